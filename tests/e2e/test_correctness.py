"""The correctness invariant: in float32, greedy (or seeded) text through the cluster equals
the same engine in one process (what `pdserve generate` runs, here with the prefix cache
off), token for token, for any topology and KV backend, with concurrent requests in flight
and the nodes' prefix caches on (repeated prompts do hit them)."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.common.errors import EXIT_REFUSED
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.transport import free_port
from tests.conftest import CHAT_PROMPTS, chat_ids, make_engine
from tests.e2e.conftest import wait_for

MAX_TOKENS = 24


def prompts(tokenizer) -> list[list[int]]:
    # ~1,050 tokens: a long prompt (many KV blocks and frames, chunked under --chunk-size 64)
    # that is no longer than it needs to be: float32 prefill is the suite's slowest step
    long_text = " ".join(
        f"Item {i}: the {w} fox" for i, w in enumerate(["quick", "brown", "lazy", "red"] * 32)
    )
    chats = [chat_ids(tokenizer, p) for p in CHAT_PROMPTS]
    raw = [
        tokenizer.encode("The history of the Roman empire"),
        tokenizer.encode("Summarise: " + long_text + "\nSummary:"),
    ]
    out = [*chats, *raw]
    assert any(len(p) > 16 and len(p) % 16 for p in out)  # crosses a block boundary
    assert max(len(p) for p in out) >= 1000
    return out


@pytest.fixture(scope="module")
def reference(smol_runner, tokenizer):
    ps = prompts(tokenizer)
    engine = make_engine(smol_runner, tokenizer, prefix_caching="off")
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=1234)
    outs = engine.generate(ps, greedy)
    sampled = engine.generate([ps[0]], seeded)[0]
    stop = outs[0].text.split()[2]  # a word from the middle of the first answer
    stopped = engine.generate(
        [ps[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=(stop,))
    )[0]
    return ps, outs, sampled, (stop, stopped)


def complete(cluster, prompt_ids: list[int], **extra) -> dict:
    body = {"prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0.0, **extra}
    status, resp = cluster.post("/v1/completions", body)
    assert status == 200, resp
    return resp


@pytest.mark.parametrize(
    "backends",
    [("zmq", "tcp"), ("shm", "ucx"), ("auto",)],
    ids=["2P2D-zmq+tcp", "2P2D-shm+ucx", "1P1D-auto"],
)
def test_cluster_matches_single_process(make_cluster, reference, backends):
    """Each prefill node is forced to its own KV backend, so one cluster checks two backends
    (and both topologies are covered: 2P2D, and 1P1D with the default)."""
    ps, expected, sampled, (stop, stopped) = reference
    n = len(backends)
    extra = {f"prefill-{i}": ("--kv-backend", b) for i, b in enumerate(backends)}
    if "ucx" in backends:  # decode nodes open a UCX listener only when asked to
        extra |= {f"decode-{i}": ("--kv-backend", "ucx") for i in range(n)}
    if backends == ("auto",):
        extra |= {"decode-0": ("--kv-shared-cache", "on")}
    cluster = make_cluster(prefill=n, decode=n, extra=extra)
    with ThreadPoolExecutor(len(ps)) as pool:  # all in flight together
        results = list(pool.map(lambda p: complete(cluster, p), ps))
    for prompt, exp, got in zip(ps, expected, results, strict=True):
        choice = got["choices"][0]
        assert choice["text"] == exp.text, f"prompt of {len(prompt)} tokens diverged"
        assert got["usage"]["completion_tokens"] == len(exp.token_ids)
        assert got["usage"]["prompt_tokens"] == len(prompt)
        assert choice["finish_reason"] == exp.finish_reason
    for _ in range(n):  # seeded and stop-string requests land on every prefill node
        seeded = complete(cluster, ps[0], temperature=0.8, top_p=0.9, seed=1234)
        assert seeded["choices"][0]["text"] == sampled.text
        cut = complete(cluster, ps[0], stop=[stop])  # matched by the gateway, decode aborted
        assert cut["choices"][0]["text"] == stopped.text and stop not in stopped.text
        assert cut["choices"][0]["finish_reason"] == "stop"
    for backend in backends:  # every backend really carried KV (auto: the one-copy path,
        moved = "shm_direct" if backend == "auto" else backend  # the decode cache is shared)
        assert cluster.metric("pdserve:kv_transfer_bytes_total", backend=moved) > 0, moved
    for i in range(n):  # and every pair served traffic
        assert cluster.metric("pdserve:placement_accepts_total", node=f"prefill-{i}") > 0
    assert wait_for(lambda: cluster.metric("pdserve:cluster_prefix_cache_hits_total") > 0)


@pytest.mark.parametrize("chunk", [0, 64], ids=["colocated", "colocated-chunked"])
def test_colocated_node_through_the_gateway_matches_single_process(make_cluster, reference, chunk):
    ps, expected, sampled, _ = reference
    flags = ("--chunk-size", str(chunk)) if chunk else ()
    cluster = make_cluster(prefill=0, decode=0, colocated=1, node_flags=flags)
    with ThreadPoolExecutor(len(ps)) as pool:
        results = list(pool.map(lambda p: complete(cluster, p), ps))
    for prompt, exp, got in zip(ps, expected, results, strict=True):
        assert got["choices"][0]["text"] == exp.text, f"prompt of {len(prompt)} tokens diverged"
        assert got["usage"]["completion_tokens"] == len(exp.token_ids)
    seeded = complete(cluster, ps[0], temperature=0.8, top_p=0.9, seed=1234)
    assert seeded["choices"][0]["text"] == sampled.text
    assert wait_for(lambda: cluster.metric("pdserve:cluster_prefix_cache_hits_total") > 0)
    assert wait_for(
        lambda: cluster.metric("pdserve:kv_blocks", role="colocated", state="in_use") == 0
    )


def test_prefixes_evicted_to_the_disk_tier_load_back_and_match_single_process(
    make_cluster, reference, tokenizer, tmp_path
):
    """A colocated node whose cache holds about one long prompt: a filler prompt pushes the
    others' blocks out to the disk tier, and sent again they load back from it (read ahead,
    off the node's event loop: common/engine/tier_reader.py) with the text unchanged."""
    ps, expected, _, _ = reference
    port = free_port()
    flags = ("--num-kv-blocks", "96", "--kv-disk-cache-gb", "0.5",
             "--kv-disk-cache-dir", str(tmp_path))  # fmt: skip
    cluster = make_cluster(prefill=0, decode=0, colocated=1, node_flags=flags,
                           extra={"colocated-0": ("--metrics-port", str(port))})  # fmt: skip
    filler = tokenizer.encode(" ".join(f"Row {i} holds the number {i * 7}." for i in range(115)))
    for round_ in range(2):  # the second time, the prefixes continue on disk
        with ThreadPoolExecutor(len(ps)) as pool:
            results = list(pool.map(lambda p: complete(cluster, p), ps))
        for prompt, exp, got in zip(ps, expected, results, strict=True):
            assert got["choices"][0]["text"] == exp.text, f"{len(prompt)} tokens, round {round_}"
        complete(cluster, filler)

    def tier(event: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pdserve:kv_tier_blocks_total{")
                   and f'event="{event}"' in line)  # fmt: skip

    assert tier("spilled") > 0 and tier("disk_hits") > 0
    assert tier("corrupt") == 0


def test_a_conversation_reuses_its_kv_on_the_decode_node_and_matches_single_process(
    make_cluster, smol_runner, tokenizer
):
    """Each turn's prompt is the last one plus its answer plus a new question. The gateway's
    index sees the conversation on the decode node that served it, routes the next turn there,
    and only the KV after that prefix travels; the text equals the single process's."""
    questions = ["Name a planet.", "Why is it red?", "How far is it from the sun?"]
    engine = make_engine(smol_runner, tokenizer, prefix_caching="off")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cluster = make_cluster(prefill=1, decode=2)
    history: list[int] = []
    for turn, q in enumerate(questions):
        ask = tokenizer.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", False)
        if history:
            ask = tokenizer.encode("<|im_end|>\n", False) + ask
        prompt = history + ask
        expected = engine.generate([prompt], greedy)[0]
        before = cluster.metric("pdserve:kv_transfer_bytes_total")
        got = complete(cluster, prompt, max_tokens=12, ignore_eos=True)
        assert got["choices"][0]["text"] == expected.text, f"turn {turn} diverged"
        assert wait_for(lambda b=before: cluster.metric("pdserve:kv_transfer_bytes_total") > b)
        sent = cluster.metric("pdserve:kv_transfer_bytes_total") - before
        full = smol_runner.kv_store.frame_bytes(len(prompt)) * smol_runner.model_config.num_layers
        if turn:  # the earlier turns' KV stayed on the decode node: only the rest travelled
            held = (len(history) - 1) // 16 * 16  # its full blocks with KV (not the last token)
            kept = smol_runner.kv_store.frame_bytes(held) * smol_runner.model_config.num_layers
            assert sent == full - kept, (sent, full, kept)
        history = prompt + expected.token_ids


def test_cluster_with_4_bit_weights_matches_the_single_process_with_them(make_cluster, tokenizer):
    """--quantization int4 (the GGUF's blocks kept: in float32 gguf_matmul.c's kernel for the
    generated tokens, dense for the prompt's) on both nodes: the cluster's greedy text equals
    one process with the same weights with requests in flight together, and a node whose
    weights or dtype differ is refused (the KV would not match)."""
    from pdserve.common.config import EngineConfig
    from pdserve.common.engine.runner import ModelRunner

    runner = ModelRunner(EngineConfig(quantization="int4", num_kv_blocks=512))
    assert runner.kernels == "fused+gguf"  # the C kernels, as the nodes on this CPU run them
    engine = make_engine(runner, tokenizer, prefix_caching="off")
    ps = [chat_ids(tokenizer, p) for p in CHAT_PROMPTS[:4]]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = engine.generate(ps, greedy)
    cluster = make_cluster(prefill=1, decode=1, node_flags=("--quantization", "int4"))
    with ThreadPoolExecutor(len(ps)) as pool:  # all in flight together: batched decode rows
        results = list(pool.map(lambda p: complete(cluster, p), ps))
    for exp, got in zip(expected, results, strict=True):
        assert got["choices"][0]["text"] == exp.text
    assert cluster.metric("pdserve:kv_transfer_bytes_total") > 0
    # nodes whose KV would differ are refused: other weights (dequantized), another dtype
    # (the same refusal as for any dtype: the numerics, dtype and quantization, must match),
    # while their weights load (common/node/precheck.py), not once they are loaded
    plain = cluster.add_node("decode", "decode-plain", "--quantization", "none")
    bf16 = cluster.add_node("decode", "decode-bf16", "--dtype", "bfloat16")
    for proc, theirs in ((plain, "float32"), (bf16, "bfloat16+int4")):
        out, _ = proc.communicate(timeout=180)
        said = f"has dtype {theirs!r} but the cluster runs 'float32+int4'"
        assert proc.returncode == EXIT_REFUSED and said in out, out[-500:]
        assert "refused before its weights loaded" in out, out[-500:]
    # the same numerics computed by other code (torch's ops, not the C kernels): its last
    # bits differ, so it is refused too, at its registration (the Probe names no code path),
    # and leaves as refused (EXIT_REFUSED: `pdserve up` does not restart it)
    eager = cluster.add_node("decode", "decode-eager", "--quantization", "int4",
                             "--cpu-kernels", "off")  # fmt: skip
    out, _ = eager.communicate(timeout=180)
    assert eager.returncode == EXIT_REFUSED and "kernels 'eager', not 'fused'" in out, out[-500:]
    health = str(cluster.get("/health")[1])
    assert "decode-plain" not in health and "decode-bf16" not in health
    assert "decode-eager" not in health
