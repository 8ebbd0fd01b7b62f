import argparse

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.errors import ConfigError
from pdserve.common.flags import add_flags, from_args


def parse(argv):
    p = argparse.ArgumentParser()
    add_flags(p, EngineConfig)
    return from_args(EngineConfig, p.parse_args(argv))


def test_flags_env_and_defaults(monkeypatch):
    monkeypatch.setenv("PDSERVE_MAX_BATCH", "7")
    monkeypatch.setenv("PDSERVE_DTYPE", "bfloat16")
    cfg = parse(["--block-size", "32", "--max-batch", "3"])
    assert cfg.block_size == 32 and cfg.max_batch == 3  # flag beats env
    assert cfg.dtype == "bfloat16"  # env beats default
    assert cfg.chunk_size == 0  # default


@pytest.mark.parametrize(
    "env,value,match",
    [
        ("PDSERVE_BLOCK_SIZE", "12", "power of two"),
        ("PDSERVE_BLOCK_SIZE", "abc", "not a valid int"),
        ("PDSERVE_DTYPE", "int8", "choose one of"),
        ("PDSERVE_MAX_BATCH", "0", "at least 1"),
    ],
)
def test_bad_values_name_the_setting(monkeypatch, env, value, match):
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError, match=match):
        parse([])


def test_a_chunk_budget_below_the_batch_is_refused():
    """As vLLM's check: each running stream decodes a token of the step's budget first."""
    with pytest.raises(ConfigError, match="--chunk-size must be at least --max-batch"):
        EngineConfig(chunk_size=16, max_batch=32)
    assert EngineConfig(chunk_size=32, max_batch=32).chunk_size == 32
    # without chunking the step's budget is --max-batch-tokens: 24 streams and a budget of 16
    # gave 8 of them their first token and then none while the others ran
    with pytest.raises(ConfigError, match="--max-batch-tokens must be at least --max-batch"):
        EngineConfig(max_batch=24, max_batch_tokens=16, block_size=16)
    assert EngineConfig(max_batch=16, max_batch_tokens=16, block_size=16).max_batch == 16


def test_not_a_number_and_unusable_gateway_addresses_are_refused():
    """NaN passed every `<= 0` check (a NaN heartbeat timeout never expires a node); a
    --gateway without a port failed after the weights loaded, one past 65535 never
    registered."""
    from pdserve.common.config import GatewayConfig, NodeConfig

    with pytest.raises(ConfigError, match="finite"):
        GatewayConfig(heartbeat_timeout=float("nan"))
    with pytest.raises(ConfigError, match="finite"):
        NodeConfig(heartbeat_timeout=float("inf"))
    for address in ("tcp://127.0.0.1", "tcp://127.0.0.1:99999", "tcp://:5", "udp://h:1"):
        with pytest.raises(ConfigError, match="--gateway"):
            NodeConfig(gateway=address)
    assert NodeConfig(gateway="tcp://gw:8001, ipc:///tmp/g").gateway


def test_an_empty_model_resolves_quantization_as_the_embedded_gguf_does():
    # compose passes PDSERVE_MODEL="" for the embedded model: it loaded the GGUF but
    # `--quantization auto` took "" for a Hugging Face folder and chose none (compose nodes
    # ran dequantized; a node given no model at all, int4: the gateway refused the mix)
    for dtype in ("bfloat16", "float32"):
        kw = dict(engine="torch", device="cpu", dtype=dtype, quantization="auto", cpu_kernels="off")
        cfgs = [EngineConfig(model=m, **kw) for m in (None, "")]  # type: ignore[arg-type]
        assert cfgs[0].quantization == cfgs[1].quantization
    assert (
        EngineConfig(model="", device="cpu", dtype="bfloat16", quantization="auto").quantization
        == "int4"
    )


def test_negative_counts_and_unknown_devices_are_refused_naming_the_flag():
    """--num-threads -1 and --device foo were torch's RuntimeError (a traceback) when the
    engine loaded; a negative --gpu-offset or --prefill-pass-tokens passed unchecked."""
    for field in ("num_threads", "gpu_offset", "prefill_pass_tokens", "chunk_size",
                  "kv_host_cache_gb"):  # fmt: skip
        flag = "--" + field.replace("_", "-")
        with pytest.raises(ConfigError, match=f"{flag} must be >= 0, not -1"):
            EngineConfig(engine="sim", **{field: -1})
    for device in ("foo", "gpu", "cuda:", "cuda:x", " cpu"):
        with pytest.raises(ConfigError, match="--device: cpu, cuda, cuda:N or cuda:auto"):
            EngineConfig(engine="sim", device=device)
    for device in ("cpu", "cuda", "cuda:1", "cuda:auto"):
        assert EngineConfig(engine="sim", device=device).device == device
