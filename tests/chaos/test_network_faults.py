"""Network faults between "hosts": a decode node in its own network namespace, joined to this
one by a veth pair, while streams run. The link first turns slow and lossy (a token-bucket
qdisc whose small queue drops what overflows, and 3 % random loss: TCP sees loss and delay),
then is cut for 3 s (the node is dropped, its requests re-placed), then comes back (the node
registers again and frees what the gateway forgot). No request hangs, every text is exact,
no KV is left.

Needs root, `ip`/`tc` (iproute2) and iptables; addresses are ones this test creates, nothing
else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.e2e.conftest import wait_for
from tests.e2e.streams import SteadyLoad, seeded_bodies, sim_text


def _netns_permitted() -> bool:
    """Root with iproute2, and allowed to make a namespace (a container may not be)."""
    tools = ("ip", "tc", "iptables")
    if os.geteuid() != 0 or any(shutil.which(t) is None for t in tools):
        return False
    probe = f"pdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=30)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return made.returncode == 0


pytestmark = pytest.mark.skipif(
    not _netns_permitted(), reason="network namespaces need root, iproute2 and CAP_NET_ADMIN"
)
NS = f"pdchaos{os.getpid()}"
HOST_IF, NS_IF = f"pdh{os.getpid() % 100000}", f"pdn{os.getpid() % 100000}"
HOST_IP, NS_IP = "10.213.7.1", "10.213.7.2"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespace():
    sh("ip", "netns", "add", NS)
    try:
        sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        sh("ip", "link", "set", NS_IF, "netns", NS)
        sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
        sh("ip", "link", "set", HOST_IF, "up")
        for cmd in (
            ("ip", "addr", "add", f"{NS_IP}/30", "dev", NS_IF),
            ("ip", "link", "set", NS_IF, "up"),
            ("ip", "link", "set", "lo", "up"),
        ):
            sh("ip", "netns", "exec", NS, *cmd)
        yield
    finally:
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True, timeout=30)


def _lossy(on: bool) -> None:
    """A 4 Mbit/s link whose 16 KiB queue drops what overflows (queueing delay up to 32 ms),
    both directions, and 3 % of the namespace's packets dropped at random either way (an
    iptables `statistic` rule inside the namespace: this kernel has no netem qdisc)."""
    for prefix in ((), ("ip", "netns", "exec", NS)):
        dev = NS_IF if prefix else HOST_IF
        if on:
            sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", "4mbit",
               "burst", "16kb", "limit", "16kb")  # fmt: skip
        else:
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], timeout=30)
    ns = ("ip", "netns", "exec", NS, "iptables")
    if on:
        for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
            sh(*ns, "-A", chain, flag, NS_IF, "-m", "statistic", "--mode", "random",
               "--probability", "0.03", "-j", "DROP")  # fmt: skip
    else:
        subprocess.run([*ns, "-F"], timeout=30)


def _dropped() -> int:
    """Packets the namespace's random-loss rules have dropped so far."""
    out = subprocess.run(
        ["ip", "netns", "exec", NS, "iptables", "-L", "-v", "-n", "-x"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    return sum(int(line.split()[0]) for line in out.splitlines() if "statistic" in line)


def test_a_slow_lossy_then_cut_link_to_a_decode_node_changes_no_text(
    namespace, make_cluster, tokenizer
):
    cluster = make_cluster(
        prefill=1,
        decode=1,
        engine="sim",
        gateway_flags=("--host", "0.0.0.0", "--heartbeat-timeout", "1.0"),
        node_flags=("--sim-time-scale", "0.1", "--kv-backend", "tcp"),
        extra={"prefill-0": ("--advertise-host", HOST_IP)},
    )
    control_port = cluster.control.rsplit(":", 1)[1]
    remote = subprocess.Popen(
        ["ip", "netns", "exec", NS, sys.executable, "-m", "pdserve.cli", "--log-level",
         "WARNING", "decode", "--gateway", f"tcp://{HOST_IP}:{control_port}", "--node-id",
         "decode-remote", "--advertise-host", NS_IP, *cluster.node_flags]
    )  # fmt: skip
    cluster.procs.append(remote)
    from tests.chaos.test_node_faults import _nodes

    deadline = time.monotonic() + 60
    while "decode-remote" not in _nodes(cluster):
        assert time.monotonic() < deadline and remote.poll() is None, "the remote node never came"
        time.sleep(0.2)
    # the load of 160 streams (one every 50 ms), now open-ended: it runs until the link has
    # been shaped, cut and restored, however slow this machine, and is at least 160 long
    n, spacing = 160, 0.05
    pool = seeded_bodies(n, 40)
    load = SteadyLoad(cluster.url, lambda i: {**pool[i % n], "seed": i}, spacing).start()

    def held() -> float:  # requests on the remote node, decoding or their KV arriving
        states = ("running", "waiting")
        return sum(
            cluster.metric(f"pdserve:num_requests_{s}", node="decode-remote") for s in states
        )

    # each fault once the remote node holds work (the gateway's view), not after a sleep
    assert wait_for(lambda: held() > 0, timeout=60), "the remote node never took work"
    _lossy(True)
    time.sleep(3.0)  # the slow, lossy spell
    assert wait_for(lambda: held() > 0, timeout=60), "the remote node held nothing to cut"
    cut = time.monotonic()
    sh("ip", "link", "set", HOST_IF, "down")  # the cable is pulled
    # for 3 s, and until the gateway has dropped the node (its requests re-placed)
    assert wait_for(lambda: "decode-remote" not in _nodes(cluster), timeout=30)
    time.sleep(max(0.0, cut + 3.0 - time.monotonic()))
    sh("ip", "link", "set", HOST_IF, "up")
    lost = _dropped()
    _lossy(False)
    assert wait_for(lambda: len(load.bodies) >= n, timeout=n * spacing + 30)
    load.stop()
    assert load.join(), "the load generator itself hung"
    bodies, results = load.bodies, load.results
    hung = [r for r in results if "TimeoutError" in r.error]
    assert not hung, [r.error for r in hung[:3]]
    failed = [r for r in results if not r.ok]
    assert not failed, [r.error for r in failed[:3]]
    for body, r in zip(bodies, results, strict=True):
        assert r.text == sim_text(tokenizer, body["prompt"], body["seed"], 40)
    print(
        f"\nnetwork faults: {len(results)} streams, "
        f"{cluster.metric('pdserve:request_replacements_total'):.0f} re-placed, "
        f"remote decode accepted KV: {cluster.metric('pdserve:kv_transfer_bytes_total') > 0}, "
        f"{lost} packets dropped at random"
    )
    assert lost > 0  # the loss did bite
    assert cluster.metric("pdserve:request_replacements_total") > 0  # the cut did bite
    deadline = time.monotonic() + 30  # the remote node is back and holds nothing
    while "decode-remote" not in _nodes(cluster) or cluster.metric(
        "pdserve:kv_blocks", state="in_use"
    ):
        assert time.monotonic() < deadline, "KV left in use or the remote node never came back"
        time.sleep(0.2)
