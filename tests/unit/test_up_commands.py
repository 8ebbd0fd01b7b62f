"""`pdserve up`'s child commands: each node's torch thread count, per role."""

from __future__ import annotations

import json
import os
import sys

import pytest

from pdserve import launch, spawn
from pdserve.cli import build_parser
from pdserve.common.errors import ConfigError


def commands(*argv: str) -> list[list[str]]:
    """The nodes' commands (the gateway's comes first and is left out)."""
    args = build_parser().parse_args(["up", "--engine", "torch", *argv])
    return launch.cluster_commands(args)[1:]


def threads_by_node(*argv: str) -> dict[str, int]:
    out = {}
    for cmd in commands(*argv):
        out[cmd[cmd.index("--node-id") + 1]] = int(cmd[cmd.index("--num-threads") + 1])
    return out


def test_each_role_takes_its_own_thread_count_or_the_shared_one():
    got = threads_by_node("--prefill", "1", "--decode", "2", "--num-threads", "3",
                          "--decode-threads", "2")  # fmt: skip
    assert got == {"prefill-0": 3, "decode-0": 2, "decode-1": 2}
    got = threads_by_node("--prefill-threads", "2", "--decode-threads", "2")
    assert got == {"prefill-0": 2, "decode-0": 2}  # both phases may take every core


def test_without_any_the_cores_are_shared_out():

    got = threads_by_node("--prefill", "1", "--decode", "1")
    assert got == {"prefill-0": max(1, spawn.cores() // 2), "decode-0": got["decode-0"]}
    assert got["decode-0"] == got["prefill-0"]


def spawn_options(*argv: str) -> dict:
    args = build_parser().parse_args(["up", "--engine", "torch", *argv])
    return launch.node_spawn_options(args, launch.cluster_commands(args))


def test_prefill_nodes_can_give_way_and_crowded_threads_wait_passively(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(spawn.os, "sched_getaffinity", lambda pid: {0, 1})
    opts = spawn_options("--prefill-threads", "2", "--decode-threads", "2", "--prefill-nice", "10")
    assert opts["prefill-0"]["nice"] == 10 and opts["decode-0"]["nice"] == 0
    cmds = {c[c.index("--node-id") + 1]: c for c in commands("--prefill-priority", "idle")}
    assert cmds["prefill-0"][cmds["prefill-0"].index("--engine-priority") + 1] == "idle"
    assert "--engine-priority" not in cmds["decode-0"]
    # 4 threads on 2 cores: prefill waits passively, decode spins ~30 us (--decode-spin)
    assert opts["prefill-0"]["env"]["OMP_WAIT_POLICY"] == "passive"
    decode_env = opts["decode-0"]["env"]
    assert decode_env["GOMP_SPINCOUNT"] == "3000" and "OMP_WAIT_POLICY" not in decode_env
    opts = spawn_options("--prefill-threads", "2", "--decode-threads", "2", "--decode-spin", "0")
    assert all(o["env"]["OMP_WAIT_POLICY"] == "passive" for o in opts.values())
    # two decode nodes of 2 threads on 2 cores: spinning would hold a core the other needs
    opts = spawn_options("--prefill", "1", "--decode", "2", "--prefill-threads", "2",
                         "--decode-threads", "2")  # fmt: skip
    assert all(o["env"]["OMP_WAIT_POLICY"] == "passive" for o in opts.values())
    # an idle prefill node takes no core from the decode node: only the idle one waits passively
    opts = spawn_options("--prefill-threads", "2", "--decode-threads", "2",
                         "--prefill-priority", "idle")  # fmt: skip
    assert opts["decode-0"]["env"] is None
    assert opts["prefill-0"]["env"]["OMP_WAIT_POLICY"] == "passive"
    opts = spawn_options("--num-threads", "1")  # one core each: spinning costs nobody
    assert all(o["env"] is None and o["nice"] == 0 for o in opts.values())
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")  # the user's choice stands
    assert spawn_options("--num-threads", "2")["decode-0"]["env"] is None
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert all(o["env"] is None for o in spawn_options("--num-threads", "2").values())


def test_a_spawned_node_runs_at_its_niceness_with_its_environment(tmp_path):
    import sys

    from pdserve.supervisor import Child

    out = tmp_path / "seen"
    code = (
        "import os, sys; open(sys.argv[1], 'w').write("
        "f'{os.nice(0)} {os.environ[\"X\"]} {os.sched_getscheduler(0) == os.SCHED_IDLE}')"
    )
    base = os.nice(0)
    proc = launch._spawn(Child("n", [sys.executable, "-c", code, str(out)]), nice=5,
                         env={**os.environ, "X": "passive"})  # fmt: skip
    assert proc.wait(timeout=30) == 0
    # the process keeps the normal policy: only an idle engine's own thread drops it
    # (tests/unit/test_engine_threads.py)
    assert out.read_text() == f"{min(base + 5, 19)} passive False"


def test_node_counts_and_heartbeats_that_cannot_work_are_refused_at_start():
    """No node at all (a ZeroDivisionError's traceback before), a negative count (a cluster
    that never became healthy), and a gateway timeout within one heartbeat interval (every
    live node dropped between its beats)."""
    for argv in (["--prefill", "0", "--decode", "0"], ["--prefill", "-2"],
                 ["--heartbeat-interval", "3", "--node-heartbeat-timeout", "10"],
                 ["--decode-threads", "-1"],  # torch's set_num_threads(-1) in the child
                 # gateway 1's HTTP port was gateway 0's control port; past 65535
                 ["--gateways", "2", "--port", "8000", "--control-port", "8010",
                  "--tokens-port", "8020"], ["--gateways", "2", "--port", "65530"]):  # fmt: skip
        with pytest.raises(ConfigError):
            commands(*argv)
    assert len(commands("--prefill", "0", "--decode", "0", "--colocated", "1")) == 1


def test_children_do_not_inherit_the_configuration_s_variables(tmp_path, monkeypatch):
    """`up` resolves PDSERVE_* into each child's flags; inherited, a variable overrode a flag
    left out as its default (PDSERVE_MAX_BATCH=64 beat --max-batch 32) and gave every node
    one per-node port. Other variables pass."""
    monkeypatch.setenv("PDSERVE_MAX_BATCH", "64")
    monkeypatch.setenv("PDSERVE_METRICS_PORT", "9100")
    monkeypatch.setenv("PDSERVE_TEST_OTHER", "kept")
    out = tmp_path / "env.json"
    dump = f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"
    proc = launch._spawn(launch.Child("x", [sys.executable, "-c", dump]))
    assert proc.wait(30) == 0
    env = json.loads(out.read_text())
    assert "PDSERVE_MAX_BATCH" not in env and "PDSERVE_METRICS_PORT" not in env
    assert env["PDSERVE_TEST_OTHER"] == "kept"


def test_a_stop_while_the_cluster_starts_ends_the_wait():
    """SIGTERM or SIGINT to `up` while its nodes load: it stops then, not after
    --startup-timeout (300 s)."""
    with pytest.raises(RuntimeError, match="stopped"):
        launch.wait_healthy("http://127.0.0.1:9", [], 300, stop=lambda: True)


def test_the_api_key_reaches_the_gateways_in_their_environment_not_on_a_command_line(
    tmp_path, monkeypatch
):
    """`up` turned every gateway setting into a flag: the API key was in the gateway's
    command line, which any local user reads (ps, /proc/PID/cmdline)."""
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-secret")
    args = build_parser().parse_args(["up", "--engine", "sim", "--gateways", "2"])
    cmds = launch.cluster_commands(args)
    assert not any("sk-secret" in part for cmd in cmds for part in cmd)
    gcfg, _ = launch.up_configs(args)
    secrets = launch.gateway_secrets(gcfg)
    assert secrets == {"PDSERVE_API_KEY": "sk-secret"}
    out = tmp_path / "env.json"
    dump = f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"
    proc = launch._spawn(launch.Child("gateway", [sys.executable, "-c", dump]), secrets=secrets)
    assert proc.wait(30) == 0
    assert json.loads(out.read_text())["PDSERVE_API_KEY"] == "sk-secret"


def test_the_cores_up_may_use_are_its_affinity_not_the_host_s(monkeypatch):
    """`taskset -c 0,1 pdserve up` (a container's cpuset) on a 16-core host: each node got
    8 threads on 2 cores and nobody waited passively (cpu_count() is the host's)."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(spawn.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(spawn.os, "sched_getaffinity", lambda pid: {0, 1})
    assert threads_by_node("--prefill", "1", "--decode", "1") == {"prefill-0": 1, "decode-0": 1}
    opts = spawn_options("--prefill-threads", "2", "--decode-threads", "2")
    assert opts["prefill-0"]["env"]["OMP_WAIT_POLICY"] == "passive"


def test_nodes_reach_a_gateway_bound_to_one_address_there_and_take_a_gpu_each():
    """`up --host 10.1.2.3`: the gateway listened there, the nodes were told 127.0.0.1 and
    never registered; `--device cuda:auto`: every node took GPU 0 (no replica number)."""
    for cmd in commands("--host", "10.1.2.3"):
        assert cmd[cmd.index("--gateway") + 1] == "tcp://10.1.2.3:8001"
    for cmd in commands("--host", "0.0.0.0"):
        assert cmd[cmd.index("--gateway") + 1] == "tcp://127.0.0.1:8001"
    cmds = commands("--device", "cuda:auto", "--prefill", "2", "--decode", "2")
    offsets = [int(c[c.index("--gpu-offset") + 1]) if "--gpu-offset" in c else 0 for c in cmds]
    assert sorted(offsets) == [0, 1, 2, 3]


def test_a_child_runs_in_a_session_of_its_own():
    """A terminal's Ctrl-C reached every node of `up`'s process group (a drain), and `up`'s
    SIGTERM 0.2 s later was each node's second signal: stop at once, no drain."""
    proc = launch._spawn(launch.Child("x", [sys.executable, "-c", "import time; time.sleep(30)"]))
    try:
        assert os.getsid(proc.pid) == proc.pid != os.getsid(0)
    finally:
        proc.kill()
        proc.wait()


def test_a_port_in_use_is_refused_before_anything_starts():
    """A second `pdserve up` on the first's ports: its wait read the other cluster's /health
    ("is up") while its own gateway failed to bind, and its nodes joined the other one."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = build_parser().parse_args(["up", "--engine", "sim", "--port", str(port)])
        with pytest.raises(ConfigError, match=f"port {port} is in use"):
            launch.ports_free(launch.gateway_configs(launch.up_configs(args)[0], 1))


def test_a_standalone_process_names_the_flag_of_a_taken_port(capfd):
    """A gateway on a taken --port printed a bind's traceback (a ZeroMQ one for
    --control-port) naming no flag; a node found its taken --data-port or --metrics-port
    only after loading its model."""
    import socket

    from pdserve.cli import main
    from pdserve.common.wire.transport import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["gateway", "--control-port", str(free_port()), "--tokens-port", str(free_port())]
        assert main([*argv, "--port", str(port)]) == 2
        assert f"--port: port {port} is in use" in capfd.readouterr().err
        for flag in ("--data-port", "--metrics-port"):
            assert main(["decode", "--engine", "sim", flag, str(port)]) == 2
            assert f"{flag}: port {port} is in use" in capfd.readouterr().err
    assert main(["prefill", "--engine", "sim", "--data-port", "70000"]) == 2
    assert "--data-port: port 70000" in capfd.readouterr().err


def test_a_host_name_s_every_address_is_probed():
    """`--host localhost` where localhost names ::1 first (Fedora's /etc/hosts): the probe
    tried the first address alone, and missed a gateway on 127.0.0.1 (ZeroMQ binds IPv4)."""
    import socket

    from pdserve.ports import _bindable

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--control-port: port {port} is in use"):
            _bindable("localhost", port, "--control-port")


def test_a_niceness_not_permitted_is_said_and_not_restarted(monkeypatch, capfd):
    """A negative niceness without the privilege failed in preexec_fn: a traceback ("Exception
    occurred in preexec_fn") that named no flag, and at a restart the supervisor's crash.
    (os.nice refusing, as it does without CAP_SYS_NICE: the forked child runs this copy.)"""
    from pdserve.common.errors import EXIT_REFUSED

    def refused(increment: int) -> int:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(spawn.os, "nice", refused)
    proc = launch._spawn(launch.Child("decode-0", [sys.executable, "-c", "pass"]), nice=-5)
    assert proc.wait(timeout=30) == EXIT_REFUSED
    assert "decode-0: niceness -5 is not permitted" in capfd.readouterr().err


def test_readiness_reads_the_gateways_and_trusts_no_listing_of_a_dead_node(monkeypatch):
    """The supervisor counts a node's stable run from when a gateway lists it. A restarted
    node was listed at once: the gateway still listed the one that had died (until its
    heartbeat timeout), so a load and a crash counted as a stable run again. A gateway
    answering 503 serves; one answering garbage is not serving and raises nothing."""
    import http.server
    import socket
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"status": "unavailable", "nodes": {"decode-0": "decode"}})
            self.send_response(503)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    garbage = socket.socket()
    garbage.bind(("127.0.0.1", 0))
    garbage.listen()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        urls = [f"http://127.0.0.1:{server.server_port}",
                f"http://127.0.0.1:{garbage.getsockname()[1]}"]  # fmt: skip
        ready = launch.Readiness(["gateway-0", "gateway-1"], urls, stale=3.0)
        node = launch.Child("decode-0", ["x"])
        node.started = launch.time.monotonic()  # restarted just now
        assert not ready(node)  # listed, but maybe as the one that died
        assert ready(launch.Child("gateway-0", ["g"]))  # its 503 is an answer
        assert not ready(launch.Child("gateway-1", ["g"]))  # no HTTP there: not serving
        later = node.started + 4.0
        monkeypatch.setattr(launch.time, "monotonic", lambda: later)
        assert ready(node)  # listed by a read past the gateways' timeout: this one
    finally:
        server.shutdown()
        garbage.close()


def test_nodes_serve_metrics_and_health_on_consecutive_ports_when_asked():
    """Under `up` no node served /metrics, /health or /live (a node's --metrics-port is a
    per-node setting `up` left at 0): --node-metrics-port gives node k its port + k."""
    ports = {
        cmd[cmd.index("--node-id") + 1]: int(cmd[cmd.index("--metrics-port") + 1])
        for cmd in commands("--prefill", "2", "--decode", "1", "--node-metrics-port", "9300")
    }
    assert ports == {"prefill-0": 9300, "prefill-1": 9301, "decode-0": 9302}
    assert all(
        c[c.index("--metrics-host") + 1] == "127.0.0.1"
        for c in commands("--node-metrics-port", "9300")
    )  # the host its ports were probed on
    two = build_parser().parse_args(["up", "--engine", "sim", "--gateways", "2",
                                     "--node-metrics-port", "9300"])  # fmt: skip
    nodes = launch.cluster_commands(two)[2:]  # after both gateways' commands
    assert [c[c.index("--metrics-port") + 1] for c in nodes] == ["9300", "9301"]
    assert all("--metrics-port" not in c for c in commands())  # off by default
    import socket

    with socket.socket() as taken:  # a taken one is refused before anything starts
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--node-metrics-port: port {port} is in use"):
            launch.metrics_ports_free("127.0.0.1", port, 1)


def sim_commands(*argv: str) -> list[list[str]]:
    """Every command, the gateway's first, of a sim cluster."""
    return launch.cluster_commands(build_parser().parse_args(["up", "--engine", "sim", *argv]))


def flag_of(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_a_sim_cluster_s_gateway_tokenizes_as_its_nodes_and_models_their_gpus():
    """`up --engine sim --model X`: the gateway loaded X's tokenizer, the sim nodes the
    embedded one, and it refused every node; and `--sim-profile P` reached the nodes but
    not the gateway's cost rules (`--cost-profile`), which modelled the default GPU."""
    from pdserve.common.config import EngineConfig
    from pdserve.up_commands import tokenizer_model

    gateway, *nodes = sim_commands("--model", "/models/x.gguf", "--sim-profile", "h200-llama3.1-8b")
    assert "--model" not in gateway  # the embedded tokenizer, as the sim nodes load
    assert tokenizer_model(EngineConfig(engine="sim", model="/models/x.gguf")) is None
    assert tokenizer_model(EngineConfig(model="/models/x.gguf")) == "/models/x.gguf"
    assert flag_of(gateway, "--cost-profile") == "h200-llama3.1-8b"
    assert all(flag_of(n, "--sim-profile") == "h200-llama3.1-8b" for n in nodes)
    given = sim_commands("--sim-profile", "h200-llama3.1-8b", "--cost-profile", "a100-llama3.1-8b")
    assert flag_of(given[0], "--cost-profile") == "a100-llama3.1-8b"  # a given one stands
    [torch_gateway] = launch.cluster_commands(build_parser().parse_args(
        ["up", "--engine", "torch", "--model", "/models/x.gguf"]))[:1]  # fmt: skip
    assert flag_of(torch_gateway, "--model") == "/models/x.gguf"


def test_a_cluster_that_would_lack_a_phase_is_refused_at_start():
    """`up --prefill 1 --decode 0` started, then failed its health wait 300 s later: no
    node would ever decode. Role switching makes one of two nodes the other phase."""
    for argv in (["--prefill", "1", "--decode", "0"], ["--prefill", "0", "--decode", "2"],
                 ["--prefill", "1", "--decode", "0", "--role-switching", "on"]):  # fmt: skip
        with pytest.raises(ConfigError, match="other phase"):
            sim_commands(*argv)
    assert len(sim_commands("--prefill", "2", "--decode", "0", "--role-switching", "on")) == 3
    assert len(sim_commands("--prefill", "1", "--decode", "0", "--colocated", "1")) == 3


def test_an_ipv6_gateway_host_is_bracketed_in_urls_and_endpoints():
    """`up --host ::1` wrote http://::1:8000 and tcp://::1:8001."""
    from pdserve.common.wire.address import bracket
    from pdserve.up_commands import gateway_urls, up_configs

    args = build_parser().parse_args(["up", "--engine", "sim", "--host", "::1"])
    assert gateway_urls(up_configs(args)[0], 2) == ["http://[::1]:8000", "http://[::1]:8010"]
    for cmd in launch.cluster_commands(args)[1:]:
        assert flag_of(cmd, "--gateway") == "tcp://[::1]:8001"
    assert [bracket(h) for h in ("10.0.0.1", "gw", "[::1]", "fe80::1")] == [
        "10.0.0.1", "gw", "[::1]", "[fe80::1]"]  # fmt: skip
