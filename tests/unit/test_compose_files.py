"""compose.yaml, its CPU variant and its monitoring profile, as `docker compose config`
resolves them (no engine needed): the services, GPU reservations, networks, IPC sharing,
healthchecks, and that every PDSERVE_* variable they set is a setting pdserve reads (a
misspelled variable would be ignored silently)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest

from pdserve.common.config import EngineConfig, GatewayConfig, NodeConfig
from tests.docker_util import compose_cli

ROOT = Path(__file__).resolve().parents[2]
# read outside the config dataclasses: pdserve/cli.py (logging), common/devices.py
EXTRA_VARIABLES = {"PDSERVE_LOG_LEVEL", "PDSERVE_LOG_FORMAT", "PDSERVE_REPLICA"}


def _config(*files: str, profile: str | None = None) -> dict:
    cmd = [*compose_cli()]
    if profile:
        cmd += ["--profile", profile]
    for f in files:
        cmd += ["-f", f]
    done = subprocess.run(
        [*cmd, "config", "--format", "json"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def gpu() -> dict:
    return _config("compose.yaml")


@pytest.fixture(scope="module")
def cpu() -> dict:
    return _config("compose.yaml", "compose.cpu.yaml")


def _gpu_devices(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_services_and_gpu_reservations(gpu, cpu):
    assert set(gpu["services"]) == {"gateway", "shm", "prefill", "decode"}  # monitoring: opt-in
    for name in ("prefill", "decode"):
        [device] = _gpu_devices(gpu["services"][name])
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert gpu["services"][name]["environment"]["PDSERVE_DEVICE"] == "cuda:auto"
        assert not _gpu_devices(cpu["services"][name])
        assert cpu["services"][name]["environment"]["PDSERVE_DEVICE"] == "cpu"
    for name in ("gateway", "shm", "prefill", "decode"):  # never the multi-GB CUDA build on CPU
        args = cpu["services"][name]["build"]["args"]
        assert args["TORCH_SPEC"] == "torch==2.13.0", name
        assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu", name


def test_only_the_gateway_is_published_and_node_traffic_is_internal(gpu):
    services = gpu["services"]
    [port] = services["gateway"]["ports"]
    assert port["target"] == 8000
    for name in ("prefill", "decode"):
        assert not services[name].get("ports")
        assert set(services[name]["networks"]) == {"nodes"}
    nodes_net = next(n for key, n in gpu["networks"].items() if key == "nodes")
    assert nodes_net.get("internal") is True


def test_same_host_kv_shares_one_ipc_namespace_with_room_for_kv(gpu, cpu):
    """The nodes share one IPC namespace, held by a container of its own: it was the first
    gateway's, and Docker refuses to start a container joining the namespace of a stopped
    one (with compose.ha.yaml, no node could restart while that gateway was down)."""
    for config in (gpu, cpu):
        services = config["services"]
        assert services["shm"]["ipc"] == "shareable" and "ipc" not in services["gateway"]
        assert services["prefill"]["ipc"] == services["decode"]["ipc"] == "service:shm"
        assert int(services["shm"]["shm_size"]) >= 512 * 2**20  # Docker's default: 64 MB
        assert services["shm"]["build"]["args"] == services["gateway"]["build"]["args"]


def test_every_service_has_a_healthcheck_on_its_own_port(gpu):
    services = gpu["services"]
    assert "8000/health" in " ".join(services["gateway"]["healthcheck"]["test"])
    for name in ("prefill", "decode"):
        assert "9100/health" in " ".join(services[name]["healthcheck"]["test"])
        assert services[name]["environment"]["PDSERVE_METRICS_PORT"] == "9100"


def test_stops_wait_for_a_drain_and_reach_a_process_still_loading(gpu):
    """Docker's default 10 s grace SIGKILLed a draining node (30 s drain: migrating streams
    cut); without an init a SIGTERM to a loading node (PID 1, no handler yet) did nothing."""
    services = gpu["services"]
    seconds = {name: _seconds(s["stop_grace_period"]) for name, s in services.items()
               if name in ("gateway", "prefill", "decode")}  # fmt: skip
    drain = NodeConfig().drain_timeout
    assert seconds["prefill"] >= drain + 10 and seconds["decode"] >= drain + 10
    assert seconds["gateway"] >= 60 + 5  # aiohttp waits up to 60 s for streams in flight
    assert all(services[name].get("init") is True for name in seconds)


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", duration))


def test_every_pdserve_variable_is_a_real_setting(gpu, cpu):
    known = set(EXTRA_VARIABLES)
    for cls in (EngineConfig, GatewayConfig, NodeConfig):
        known |= {f"PDSERVE_{f.name.upper()}" for f in dataclasses.fields(cls)}
    for config in (gpu, cpu):
        for service in config["services"].values():
            for name in service.get("environment", {}):
                if name.startswith("PDSERVE_"):
                    assert name in known, f"{name} is not read by pdserve"


def test_monitoring_profile_mounts_files_that_exist():
    config = _config("compose.yaml", profile="monitoring")
    assert {"prometheus", "grafana"} <= set(config["services"])
    for name in ("prometheus", "grafana"):
        for volume in config["services"][name]["volumes"]:
            assert Path(volume["source"]).exists(), volume["source"]
        # this host only by default: Grafana's admin/admin, Prometheus with no login at all
        assert {p["host_ip"] for p in config["services"][name]["ports"]} == {"127.0.0.1"}


def test_the_guide_documents_the_variables_compose_reads():
    """Every ${VARIABLE} compose.yaml reads is explained in the guide's GPU section."""
    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide.split("## Run on a GPU machine", 1)[1].split("\n## ", 1)[0]
    compose = (ROOT / "compose.yaml").read_text()
    for name in sorted(set(re.findall(r"\$\{(PDSERVE_[A-Z_]+)", compose))):
        assert name in section, f"{name} is not documented in docs/guide.md 'Run on a GPU machine'"


def test_the_secure_variant_gives_every_pdserve_process_the_cluster_key():
    config = _config("compose.yaml", "compose.secure.yaml")
    assert config["secrets"]["cluster_key"]["file"].endswith("cluster.key")
    for name in ("gateway", "prefill", "decode"):
        service = config["services"][name]
        assert [s["source"] for s in service["secrets"]] == ["cluster_key"]
        assert service["environment"]["PDSERVE_CLUSTER_KEY"] == "/run/secrets/cluster_key"
        assert service["environment"]["PDSERVE_GATEWAY" if name != "gateway" else "PDSERVE_PORT"]


def test_the_secure_ha_variant_gives_both_gateways_the_key_and_one_image():
    """compose.ha.yaml's second gateway is made from compose.yaml alone (`extends` reads that
    file): without compose.ha.secure.yaml it had no key (no node could register with it),
    and under compose.cpu.yaml it was built with the GPU image's arguments."""
    secure = _config("compose.yaml", "compose.secure.yaml", "compose.ha.yaml",
                     "compose.ha.secure.yaml")  # fmt: skip
    for name, service in secure["services"].items():
        if service.get("command") in (["gateway"], ["prefill"], ["decode"]):
            assert [s["source"] for s in service["secrets"]] == ["cluster_key"], name
            assert service["environment"]["PDSERVE_CLUSTER_KEY"] == "/run/secrets/cluster_key"
    ha = _config("compose.yaml", "compose.cpu.yaml", "compose.ha.yaml")["services"]
    assert "build" not in ha["gateway-b"] and ha["gateway-b"]["image"] == ha["gateway"]["image"]


def test_the_image_copies_every_package_linked_into_pdserve():
    """pdserve/ links the layer folders in; the Dockerfile copies each one by name, so a new
    one it misses would be absent from the image (the gateway's CLI imports them all)."""
    linked = {p.name for p in (ROOT / "pdserve").iterdir() if p.is_symlink()}
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) /src/\1$", dockerfile, re.M))
    assert linked and linked <= copied, sorted(linked - copied)


def test_the_ha_variant_puts_two_gateways_behind_the_balancer():
    """compose.ha.yaml: two gateways, only the balancer published, every node given both,
    and the balancer's configuration names both gateway services with a /health check."""
    ha = _config("compose.yaml", "compose.cpu.yaml", "compose.ha.yaml")
    services = ha["services"]
    assert {"gateway", "gateway-b", "lb"} <= set(services)
    published = {name for name, s in services.items() if s.get("ports")}
    assert published == {"lb"}
    for role in ("prefill", "decode"):
        gateways = services[role]["environment"]["PDSERVE_GATEWAY"].split(",")
        assert gateways == ["tcp://gateway:8001", "tcp://gateway-b:8001"]
    assert services["gateway-b"]["command"] == ["gateway"]
    assert services["lb"]["entrypoint"][0] == "haproxy"
    [mount] = services["lb"]["volumes"]
    cfg = (ROOT / "deploy/haproxy.cfg").read_text()
    assert Path(mount["source"]) == ROOT / "deploy/haproxy.cfg"
    servers = re.findall(r"^\s*server (\S+) (\S+):8000", cfg, flags=re.M)
    assert servers == [("gateway", "gateway"), ("gateway-b", "gateway-b")]
    assert "option httpchk GET /health" in cfg and "timeout server 1h" in cfg
    assert "option abortonclose" in cfg  # a client gone before its first byte frees its work


def test_the_tests_wheels_never_turn_a_later_build_offline():
    """The Dockerfile installs offline when its wheels folder has wheels: the tests' own
    downloads (cp311, CPU torch) left in docker/wheels made a later GPU `compose build`
    install offline from them and fail. The tests fill another folder, passed as an arg."""
    from tests.docker_util import TEST_WHEELS

    assert TEST_WHEELS != "docker/wheels" and (ROOT / ".gitignore").read_text().count(TEST_WHEELS)
    assert "COPY ${WHEELS}/ /wheels/" in (ROOT / "Dockerfile").read_text()
    args = _config("compose.yaml")["services"]["gateway"]["build"]["args"]
    assert args["WHEELS"] == "docker/wheels"  # a user's build: the documented folder


def test_every_gpu_scale_example_says_how_many_gpus_the_prefill_replicas_take():
    """Decode replicas take the GPUs after the prefill replicas' (PDSERVE_PREFILL_GPUS, 1 by
    default): `--scale prefill=2` without it put prefill 2 and decode 1 on one GPU."""
    for doc in ("compose.yaml", "docs/guide.md", "README.md"):
        for line in (ROOT / doc).read_text().splitlines():
            scaled = re.search(r"--scale prefill=(\d+)", line)
            if scaled and "compose.cpu.yaml" not in line and int(scaled.group(1)) > 1:
                assert f"PDSERVE_PREFILL_GPUS={scaled.group(1)}" in line, (doc, line)


def test_nodes_give_up_on_a_stopped_gateways_name_in_1_s():
    """On the internal `nodes` network a name Docker does not know can only fail, after the
    resolver's 5 s x 2 by default: a node started while a gateway was stopped waited ~40 s
    on its name before registering with the other (tests/e2e/test_compose_ha.py: 61 ->
    22-24 s with this). Every stack's nodes, and only they, give up after 1 s."""
    for files in (("compose.yaml", "compose.cpu.yaml"),
                  ("compose.yaml", "compose.cpu.yaml", "compose.ha.yaml")):  # fmt: skip
        services = _config(*files)["services"]
        for name, service in services.items():
            want = ["timeout:1", "attempts:1"] if name in ("prefill", "decode") else None
            assert service.get("dns_opt") == want, (files, name)
