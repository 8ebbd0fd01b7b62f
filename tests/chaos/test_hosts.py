"""Hosts in network namespaces: the gateway, a prefill node and two decode nodes each on a
"host" of its own, and streams running through them while one host's link turns slow and
lossy and is then cut.

A host here is what a separate machine is to pdserve: its own network namespace with its own
address (10.214.N.x/24; the hosts and this test's own namespace hang off a bridge that lives
in a further namespace, so nothing but one veth end and one address is added here), its own
IPC namespace and its own tmpfs on /dev/shm (`unshare --ipc --mount`). host_identity() is the
kernel's boot id and the IPC namespace, so the nodes' identities differ and the `auto` KV
backend must not pick shm between them: KV crosses hosts over tcp. A fifth node, a decode
node entered into the prefill host's namespaces (`nsenter`), is the control: to it the same
prefill node, under the same `auto`, sends KV through shared memory.

What is checked: every text exact (the sim engine's tokens are known, tests/e2e/test_stress);
the decode nodes on other hosts received KV over tcp only, the co-hosted one over shm only;
each node's /dev/shm and host identity are its host's; the prefill node reached each decode
node, and every node the gateway, at its own host's address (decode-0 advertised with
--advertise-host, decode-1 found by the address facing the gateway: the gateway's /health
shows node ids and roles only, so the established connections in the prefill host are what
is looked at); and decode-0's link, shaped then cut for 3 s, is detected within the cut, its
requests re-placed, none hangs or fails, and once the link is back the node registers again
and no KV block is in use anywhere.

The shaping is a token-bucket qdisc (`tc tbf`: 4 Mbit/s, a 16 KiB queue that drops what
overflows) on both ends of the link and a 3 % random-drop iptables rule (`statistic --mode
random`) in the host, rather than `tc netem`, which CI kernels may lack; tbf plus
random drop gives TCP both delay and loss. The same network as tests/chaos/
test_network_faults.py, with every process on a host of its own.

Needs root, iproute2 (ip, tc, ss), iptables, util-linux (unshare, nsenter) and the right to
make namespaces, bridges and tmpfs mounts; skipped otherwise. Every address, link and
namespace is one this test creates, and all of them are removed when it ends."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from pdserve.launch import stop_all, wait_healthy
from tests.chaos.test_node_faults import _nodes
from tests.e2e.conftest import Cluster, wait_for
from tests.e2e.streams import SteadyLoad, seeded_bodies, sim_text

PID = os.getpid()
NET = f"10.214.{PID % 250 + 1}"  # this test's /24; this process's host is .1
HUB = f"pdhub{PID}"  # the namespace holding the bridge ("the switch")
ROOT_IF = f"pdr{PID % 100000}"  # this namespace's end of its link to the switch
HOSTS = {"gw": 2, "p0": 3, "d0": 4, "d1": 5}  # host -> last octet of its address
SHM = 'mount -t tmpfs -o size=256m pdshm /dev/shm && exec "$@"'  # a host's own /dev/shm
TOKENS = 50  # ~1 s of decode each at --sim-time-scale 0.2: decode-0 holds some when cut
STATES = ("running", "waiting")  # a decode node's requests: decoding, or their KV arriving
TOOLS = ("ip", "tc", "ss", "iptables", "unshare", "nsenter")


def _hosts_permitted() -> bool:
    """Root with the tools, and allowed to make a namespace, a bridge in it, and a process
    with its own IPC namespace and /dev/shm (a container may not be)."""
    if os.geteuid() != 0 or any(shutil.which(t) is None for t in TOOLS):
        return False
    probe = f"pdhprobe{PID}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=30)
    try:
        checks = (
            ("ip", "link", "add", "pdbr", "type", "bridge"),
            ("unshare", "--ipc", "--mount", "--propagation", "private", "sh", "-c", SHM, "sh",
             "true"),
        )  # fmt: skip
        return made.returncode == 0 and all(
            subprocess.run(["ip", "netns", "exec", probe, *c], capture_output=True, timeout=30)
            .returncode == 0
            for c in checks
        )  # fmt: skip
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)


pytestmark = pytest.mark.skipif(
    not _hosts_permitted(),
    reason="hosts in namespaces need root, iproute2, iptables, unshare/nsenter and CAP_SYS_ADMIN",
)


def ns(host: str) -> str:
    return f"pd{host}{PID}"


def addr(host: str) -> str:
    return f"{NET}.{HOSTS[host]}"


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout


def on_host(host: str, argv: list[str]) -> list[str]:
    """`argv` as a process of `host`: in its network namespace, with an IPC namespace and a
    /dev/shm of its own (`ip netns exec`, `unshare` and `sh` each exec the next: the process
    started is the one that runs argv, the pid that SIGTERM reaches)."""
    return ["ip", "netns", "exec", ns(host), "unshare", "--ipc", "--mount", "--propagation",
            "private", "sh", "-c", SHM, "sh", *argv]  # fmt: skip


@pytest.fixture
def hosts():
    """The network: the switch namespace with a bridge, each host's namespace and this one
    joined to it by a veth pair. Yields the list of processes to stop before it is removed."""
    procs: list[subprocess.Popen] = []
    made: list[str] = []
    hub = ("ip", "netns", "exec", HUB)
    try:
        for name in (HUB, *map(ns, HOSTS)):
            sh("ip", "netns", "add", name)
            made.append(name)
        sh(*hub, "ip", "link", "add", "br0", "type", "bridge")
        sh(*hub, "ip", "link", "set", "br0", "up")
        sh("ip", "link", "add", "name", ROOT_IF, "type", "veth", "peer", "name", "root",
           "netns", HUB)  # fmt: skip
        sh("ip", "addr", "add", f"{NET}.1/24", "dev", ROOT_IF)
        sh("ip", "link", "set", ROOT_IF, "up")
        sh(*hub, "ip", "link", "set", "root", "master", "br0", "up")
        for host in HOSTS:
            sh("ip", "link", "add", "name", "eth0", "netns", ns(host), "type", "veth",
               "peer", "name", host, "netns", HUB)  # fmt: skip
            sh(*hub, "ip", "link", "set", host, "master", "br0", "up")
            for cmd in (
                ("ip", "addr", "add", f"{addr(host)}/24", "dev", "eth0"),
                ("ip", "link", "set", "eth0", "up"),
                ("ip", "link", "set", "lo", "up"),
            ):
                sh("ip", "netns", "exec", ns(host), *cmd)
        yield procs
    finally:
        stop_all(procs, grace=10)
        subprocess.run(["ip", "link", "del", ROOT_IF], capture_output=True, timeout=30)
        for name in reversed(made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _link(host: str, up: bool) -> None:
    """Plug or pull `host`'s cable (its port on the switch)."""
    sh("ip", "netns", "exec", HUB, "ip", "link", "set", host, "up" if up else "down")


def _lossy(host: str, on: bool) -> None:
    """`host`'s link at 4 Mbit/s with a 16 KiB queue that drops what overflows (queueing
    delay up to 32 ms), both directions, and 3 % of its packets dropped at random either way
    (an iptables `statistic` rule in the host: CI kernels may have no netem qdisc)."""
    ends = ((("ip", "netns", "exec", HUB), host), (("ip", "netns", "exec", ns(host)), "eth0"))
    for prefix, dev in ends:
        if on:
            sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", "4mbit",
               "burst", "16kb", "limit", "16kb")  # fmt: skip
        else:
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], timeout=30)
    iptables = ("ip", "netns", "exec", ns(host), "iptables")
    if on:
        for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
            sh(*iptables, "-A", chain, flag, "eth0", "-m", "statistic", "--mode", "random",
               "--probability", "0.03", "-j", "DROP")  # fmt: skip
    else:
        subprocess.run([*iptables, "-F"], timeout=30)


def _dropped(host: str) -> int:
    """Packets the host's random-loss rules have dropped so far."""
    out = sh("ip", "netns", "exec", ns(host), "iptables", "-L", "-v", "-n", "-x")
    return sum(int(line.split()[0]) for line in out.splitlines() if "statistic" in line)


def _peers(host: str) -> set[int]:
    """Last octets of this network's addresses in `host`'s established TCP connections."""
    out = sh("ip", "netns", "exec", ns(host), "ss", "-tnH", "state", "established")
    return {int(o) for o in re.findall(rf"{re.escape(NET)}\.(\d+):\d+", out)}


def _is_node(pid: int) -> bool:
    """The process has exec'd the node's Python (its namespaces and /dev/shm are made by then:
    the `ip`, `unshare` and `sh` before it have the node's command line among their arguments
    too, so it is the first argument that tells)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0", 1)[0] == os.fsencode(sys.executable)
    except OSError:
        return False


def _host_of(pid: int | str) -> tuple[str, int]:
    """A process's host identity as host_identity() computes it in that process (boot id and
    IPC namespace), and the device of the /dev/shm it sees."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    ipc = os.readlink(f"/proc/{pid}/ns/ipc")
    return f"{boot}/{ipc}", os.stat(f"/proc/{pid}/root/dev/shm").st_dev


def _received(node: Cluster) -> dict[str, float]:
    """KV bytes a node has received, by backend (its own /metrics)."""
    _, text = node.get("/metrics")
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve:kv_transfer_bytes_total{") and 'direction="in"' in line:
            backend = re.search(r'backend="([^"]*)"', line)
            assert backend is not None, line
            found[backend[1]] = found.get(backend[1], 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _kinds(received: dict[str, float]) -> str:
    return ", ".join(f"{_mib(n)} over {b}" for b, n in sorted(received.items()) if n) or "none"


def test_nodes_on_separate_hosts_move_kv_over_tcp_and_survive_a_cut_link(hosts, tokenizer):
    procs = hosts
    base = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING"]
    control = f"tcp://{addr('gw')}:8001"
    p0, d0 = addr("p0"), addr("d0")
    flags = ["--engine", "sim", "--heartbeat-interval", "0.2", "--sim-time-scale", "0.2",
             "--kv-backend", "auto"]  # fmt: skip

    def node(role: str, node_id: str, host: str, port: int, *extra: str) -> list[str]:
        return [*base, role, "--gateway", control, "--node-id", node_id, *flags,
                "--metrics-port", str(port), "--metrics-host", addr(host), *extra]  # fmt: skip

    # each on its own host; the ports are fixed: nothing else lives in these namespaces
    gateway = [*base, "gateway", "--host", "0.0.0.0", "--port", "8000", "--control-port",
               "8001", "--tokens-port", "8002", "--heartbeat-timeout", "1.0"]  # fmt: skip
    procs.append(subprocess.Popen(on_host("gw", gateway)))
    started = {  # decode-1 advertises the address facing the gateway (no --advertise-host)
        "prefill-0": ("p0", node("prefill", "prefill-0", "p0", 9100, "--advertise-host", p0)),
        "decode-0": ("d0", node("decode", "decode-0", "d0", 9100, "--advertise-host", d0)),
        "decode-1": ("d1", node("decode", "decode-1", "d1", 9100)),
    }
    pids = {}
    for node_id, (host, argv) in started.items():
        procs.append(subprocess.Popen(on_host(host, argv)))
        pids[node_id] = procs[-1].pid
    # the control: a decode node on the prefill node's host (its network, IPC and mounts)
    assert wait_for(lambda: _is_node(pids["prefill-0"]), timeout=30), "prefill-0 never started"
    local = node("decode", "decode-local", "p0", 9101, "--advertise-host", p0)
    procs.append(
        subprocess.Popen(
            ["nsenter", "--target", str(pids["prefill-0"]), "--net", "--ipc", "--mount", *local]
        )
    )
    pids["decode-local"] = procs[-1].pid
    cluster = Cluster(url=f"http://{addr('gw')}:8000", control=control, procs=procs)
    wait_healthy(cluster.url, procs, timeout=120, nodes=4)
    node_metrics = {
        node_id: Cluster(url=f"http://{addr(host)}:{9101 if node_id == 'decode-local' else 9100}",
                         control=control)
        for node_id, host in (("prefill-0", "p0"), ("decode-0", "d0"), ("decode-1", "d1"),
                              ("decode-local", "p0"))
    }  # fmt: skip

    # each node is its host's: a host identity and /dev/shm of its own, shared on p0 only
    assert all(_is_node(pid) for pid in pids.values())  # the execs kept each node's pid
    where = {node_id: _host_of(pid) for node_id, pid in pids.items()}
    here = _host_of("self")
    remote = ("prefill-0", "decode-0", "decode-1")
    assert len({where[n][0] for n in remote} | {here[0]}) == 4, where
    assert len({where[n][1] for n in remote} | {here[1]}) == 4, where
    assert where["decode-local"] == where["prefill-0"]

    # the load of 160 streams (one every 50 ms), now open-ended: it runs until decode-0's
    # link has been shaped, cut and restored, however slow this machine, and is at least 160
    # long; each fault waits for the state it needs instead of a sleep
    n, spacing = 160, 0.05
    pool = seeded_bodies(n, TOKENS)
    start = time.monotonic()
    load = SteadyLoad(cluster.url, lambda i: {**pool[i % n], "seed": i}, spacing).start()

    def flowing() -> bool:  # KV has reached both decode hosts (their own /metrics)
        return all(_received(node_metrics[d]).get("tcp", 0) > 0 for d in ("decode-0", "decode-1"))

    assert wait_for(flowing, timeout=60), "KV never reached both decode hosts"
    peers = _peers("p0")
    _lossy("d0", True)
    time.sleep(3.0)  # the slow, lossy spell

    held = 0.0

    def holding() -> bool:  # the cut hits requests in flight on decode-0
        nonlocal held
        held = sum(cluster.metric(f"pdserve:num_requests_{s}", node="decode-0") for s in STATES)
        return held > 0

    assert wait_for(holding, timeout=60), "decode-0 held nothing to cut"
    stalled = cluster.metric("pdserve:gateway_stall_seconds_total")
    cut = time.monotonic()
    _link("d0", up=False)  # the cable is pulled
    detected = wait_for(lambda: "decode-0" not in _nodes(cluster), timeout=10, interval=0.05)
    detection_s = time.monotonic() - cut
    assert detected, "the gateway never noticed decode-0's link was cut"
    # the 1 s lease and the gateway's 0.25 s checks; later by what the gateway could not run
    stalled = cluster.metric("pdserve:gateway_stall_seconds_total") - stalled
    assert detection_s <= 2.0 + stalled, (detection_s, stalled)
    time.sleep(max(0.0, 3.0 - detection_s))
    _link("d0", up=True)
    back = time.monotonic()
    lost = _dropped("d0")
    _lossy("d0", False)
    assert wait_for(lambda: len(load.bodies) >= n, timeout=n * spacing + 30)
    load.stop()
    assert wait_for(lambda: "decode-0" in _nodes(cluster), timeout=30), "decode-0 never returned"
    back_s = time.monotonic() - back
    assert load.join(), "the load generator itself hung"
    elapsed = time.monotonic() - start
    bodies, results = load.bodies, load.results

    hung = [r for r in results if "TimeoutError" in r.error]
    assert not hung, [r.error for r in hung[:3]]
    failed = [r for r in results if not r.ok]
    assert not failed, [r.error for r in failed[:3]]
    for body, r in zip(bodies, results, strict=True):
        assert r.text == sim_text(tokenizer, body["prompt"], body["seed"], TOKENS)
    peers |= _peers("p0")

    kv = {n: _received(node_metrics[n]) for n in ("decode-0", "decode-1", "decode-local")}
    across = sum(b for n in ("decode-0", "decode-1") for k, b in kv[n].items() if k != "tcp")
    sent = {
        b: cluster.metric("pdserve:kv_transfer_bytes_total", node="prefill-0", backend=b)
        for b in ("tcp", "shm", "zmq")
    }
    replaced = cluster.metric("pdserve:request_replacements_total", kind="lost")
    print(
        f"\nhosts: {len(results)} streams over 4 hosts in {elapsed:.1f} s, KV over tcp to "
        f"decode-0 {_mib(kv['decode-0'].get('tcp', 0))} and decode-1 "
        f"{_mib(kv['decode-1'].get('tcp', 0))}, across hosts by any other backend {across:.0f} "
        f"B, on prefill-0's own host {_kinds(kv['decode-local'])} (zmq {sent['zmq']:.0f} B "
        f"sent), decode-0 held {held:.0f} when cut, cut detected in "
        f"{detection_s:.2f} s, {replaced:.0f} re-placed as lost, back in {back_s:.1f} s, "
        f"{lost} packets dropped at random"
    )
    # KV crossed hosts over tcp and nothing else (no shm, nor any other same-host backend);
    # on one host the same `auto` took shm
    assert kv["decode-0"].get("tcp", 0) > 0 and kv["decode-1"].get("tcp", 0) > 0, kv
    assert across == 0, kv
    assert kv["decode-local"].get("shm", 0) > 0 and not kv["decode-local"].get("tcp"), kv
    assert sent["tcp"] > 0 and sent["shm"] > 0, sent
    # the prefill host reached the gateway and both decode hosts at their own addresses
    assert {HOSTS["gw"], HOSTS["d0"], HOSTS["d1"]} <= peers, peers
    assert lost > 0  # the loss did bite
    assert replaced > 0  # the cut did bite: decode-0's requests were re-placed

    # decode-0 is back and nothing holds KV anywhere: in the gateway's view, nor in any node's
    def in_use() -> float:
        views = (cluster, *node_metrics.values())
        return sum(v.metric("pdserve:kv_blocks", state="in_use") for v in views)

    assert wait_for(lambda: in_use() == 0, timeout=30), f"{in_use()} KV blocks left in use"
    assert all(p.poll() is None for p in procs), "a process died"
