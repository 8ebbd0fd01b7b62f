"""`--config FILE` for the serving commands, the split heartbeat timeouts of `pdserve up`, and
the planner's flags sharing the serving commands' defaults."""

import dataclasses
import subprocess
import sys

import pytest

from pdserve import launch
from pdserve.cli import build_parser, parse_args
from pdserve.common.config import EngineConfig, GatewayConfig, NodeConfig
from pdserve.common.costmodel import DEFAULT_PROFILE
from pdserve.common.flags import from_args


def write(tmp_path, text):
    path = tmp_path / "pdserve.yaml"
    path.write_text(text)
    return str(path)


def parse(*argv):
    return parse_args(build_parser(), list(argv))


def test_flag_beats_file_beats_env_beats_default(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_MAX_WAITING", "100")
    monkeypatch.setenv("PDSERVE_OFFER_TIMEOUT", "7")
    path = write(tmp_path, "max-waiting: 200\nplacement_timeout: 12\n")
    cfg = from_args(GatewayConfig, parse("gateway", "--config", path))
    assert cfg.max_waiting == 200  # file beats env
    assert cfg.placement_timeout == 12.0  # file beats default, an int read as a float
    assert cfg.offer_timeout == 7.0  # env where the file says nothing
    assert cfg.heartbeat_timeout == GatewayConfig.heartbeat_timeout  # default
    flagged = from_args(GatewayConfig, parse("gateway", "--config", path, "--max-waiting", "300"))
    assert flagged.max_waiting == 300  # flag beats file


def test_both_spellings_and_yaml_on_off(tmp_path):
    path = write(tmp_path, "kv-backend: tcp\nkv_fetch: off\nlayerwise: on\nengine: sim\n")
    args = parse("prefill", "--config", path)
    cfg = from_args(NodeConfig, args)
    assert (cfg.kv_backend, cfg.kv_fetch, cfg.layerwise) == ("tcp", "off", "on")
    assert from_args(EngineConfig, args).engine == "sim"


@pytest.mark.parametrize(
    "text,message",
    [
        ("bogus: 1\n", "unknown key 'bogus'"),
        ("kv-fetch: on\n", "unknown key 'kv-fetch'"),  # a node flag, not the gateway's
        ("max-waiting: two\n", "max-waiting: 'two' is not a valid value"),
        ("max-waiting: 1.5\n", "expected an integer"),
        ("placement-timeout: [1, 2]\n", "expected one value"),
        ("scheduler: fastest\n", "choose one of"),
        ("- a list\n", "expected a mapping"),
        ("port: [unclosed\n", "not valid YAML"),
    ],
)
def test_a_bad_file_is_an_error_that_names_the_key(tmp_path, capsys, text, message):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as exc:
        parse("gateway", "--config", path)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_file_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse("up", "--config", str(tmp_path / "absent.yaml"))
    assert exc.value.code == 2
    assert "absent.yaml" in capsys.readouterr().err


def test_the_console_script_exits_2_on_a_bad_file(tmp_path):
    path = write(tmp_path, "decode: many\n")
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "up", "--config", path],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert "decode: 'many' is not a valid value" in run.stderr


def heartbeat_flags(commands):
    """The --heartbeat-timeout each child of `pdserve up` is given (gateway first)."""
    return [float(c[c.index("--heartbeat-timeout") + 1]) for c in commands]


def test_up_sets_the_gateway_and_node_heartbeat_timeouts_apart(tmp_path):
    path = write(tmp_path, "engine: sim\nnode-heartbeat-timeout: 4.5\n")
    args = parse("up", "--config", path, "--gateway-heartbeat-timeout", "3", "--decode", "2")
    gcfg, ncfg = launch.up_configs(args)
    assert (gcfg.heartbeat_timeout, ncfg.heartbeat_timeout) == (3.0, 4.5)
    assert heartbeat_flags(launch.cluster_commands(args)) == [3.0, 4.5, 4.5, 4.5]


def test_up_heartbeat_timeout_sets_both_and_one_side_overrides_it():
    both = parse("up", "--engine", "sim", "--heartbeat-timeout", "5")
    assert heartbeat_flags(launch.cluster_commands(both)) == [5.0, 5.0, 5.0]
    one = parse("up", "--engine", "sim", "--heartbeat-timeout", "5",
                "--node-heartbeat-timeout", "6")  # fmt: skip
    assert heartbeat_flags(launch.cluster_commands(one)) == [5.0, 6.0, 6.0]


def test_the_planner_takes_the_serving_commands_flags_and_defaults():
    args = parse("plan")
    engine = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    gateway = {f.name: f.default for f in dataclasses.fields(GatewayConfig)}
    for name in ("sim_profile", "max_batch", "max_batch_tokens", "prefix_caching"):
        assert getattr(args, name) == engine[name], name
    for name in ("scheduler", "admission"):
        assert getattr(args, name) == gateway[name], name
    assert engine["sim_profile"] == gateway["cost_profile"] == DEFAULT_PROFILE
