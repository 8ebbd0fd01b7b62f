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

MAX_TOKENS = 16
SHORT = 6  # the index of a prompt shorter than a block (16 tokens): never cached
BACKENDS = ("zmq", "tcp", "shm", "ucx")  # one per prefill node of the 4P2D cluster


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
    assert len(out[SHORT]) < 16
    return out


@pytest.fixture(scope="module")
def reference(smol_runner, tokenizer):
    ps = prompts(tokenizer)
    engine = make_engine(smol_runner, tokenizer, prefix_caching="off")
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=1234)
    outs = engine.generate(ps, greedy)
    sampled = engine.generate([ps[0], ps[SHORT]], seeded)  # ps[0] and the short prompt
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


def seeded(cluster, prompt_ids: list[int]) -> str:
    got = complete(cluster, prompt_ids, temperature=0.8, top_p=0.9, seed=1234)
    return got["choices"][0]["text"]


def check_matches(cluster, reference, backends: tuple[str, ...]) -> None:
    """The prompts in flight together, a seeded and a stop-string request, then a seeded
    request on every prefill node in turn: each equals the single process, every backend
    (prefill-i forced to backends[i]) carried KV, and the prefix caches were hit."""
    ps, expected, sampled, (stop, stopped) = reference
    n = len(backends)
    moved = ["shm_direct" if b == "auto" else b for b in backends]  # auto: the one-copy path
    kv_bytes = [cluster.metric("pdserve:kv_transfer_bytes_total", backend=b) for b in moved]
    accepts = [cluster.metric("pdserve:placement_accepts_total", node=f"prefill-{i}")
               for i in range(n)]  # fmt: skip
    hits = cluster.metric("pdserve:cluster_prefix_cache_hits_total")
    with ThreadPoolExecutor(len(ps)) as pool:  # all in flight together
        results = list(pool.map(lambda p: complete(cluster, p), ps))
    for prompt, exp, got in zip(ps, expected, results, strict=True):
        choice = got["choices"][0]
        assert choice["text"] == exp.text, f"prompt of {len(prompt)} tokens diverged"
        assert got["usage"]["completion_tokens"] == len(exp.token_ids)
        assert got["usage"]["prompt_tokens"] == len(prompt)
        assert choice["finish_reason"] == exp.finish_reason
    assert seeded(cluster, ps[0]) == sampled[0].text  # ps[0] again: where its prefix is cached
    cut = complete(cluster, ps[0], stop=[stop])  # matched by the gateway, decode aborted
    assert cut["choices"][0]["text"] == stopped.text and stop not in stopped.text
    assert cut["choices"][0]["finish_reason"] == "stop"
    # the short prompt has no full block to cache: one at a time, each goes to the idle
    # prefill node that accepted last the longest ago (on_demand's tie order), so n of them
    # take every prefill node in turn, and the seeded first token is sampled on each
    for _ in range(n):
        assert seeded(cluster, ps[SHORT]) == sampled[1].text
    for b, before in zip(moved, kv_bytes, strict=True):  # every backend really carried KV
        assert wait_for(lambda b=b, x=before: cluster.metric(
            "pdserve:kv_transfer_bytes_total", backend=b) > x), b  # fmt: skip
    for i, before in enumerate(accepts):  # and every pair served traffic
        assert cluster.metric("pdserve:placement_accepts_total", node=f"prefill-{i}") > before
    assert wait_for(lambda: cluster.metric("pdserve:cluster_prefix_cache_hits_total") > hits)


def test_1p1d_with_the_default_backend_matches_single_process(make_cluster, reference):
    """1P1D, --kv-backend auto, the decode node's cache shared: the one-copy path (shm_direct)."""
    cluster = make_cluster(prefill=1, decode=1, extra={"decode-0": ("--kv-shared-cache", "on")})
    check_matches(cluster, reference, ("auto",))


def test_4p2d_matches_single_process_on_four_backends_and_reuses_a_conversations_kv(
    make_cluster, reference, smol_runner, tokenizer
):
    """4P2D, each prefill node forced to its own KV backend (zmq, tcp, shm, ucx): one cluster
    checks the four, several prefill and several decode nodes. Then, on the same cluster, a
    conversation: each turn's prompt is the last one plus its answer plus a new question.
    The gateway's index sees the conversation on the decode node that served it, routes the
    next turn there, and only the KV after that prefix travels; the text equals the single
    process's."""
    extra = {f"prefill-{i}": ("--kv-backend", b) for i, b in enumerate(BACKENDS)}
    # decode nodes open a UCX listener only when asked to (the others they always offer)
    extra |= {f"decode-{i}": ("--kv-backend", "ucx") for i in range(2)}
    # six nodes: 100 MiB KV caches (~2,300 tokens each, plenty here) keep their memory down
    cluster = make_cluster(prefill=len(BACKENDS), decode=2, extra=extra,
                           node_flags=("--kv-cache-gb", "0.1"))  # fmt: skip
    check_matches(cluster, reference, BACKENDS)

    questions = ["Name a planet.", "Why is it red?", "How far is it from the sun?"]
    engine = make_engine(smol_runner, tokenizer, prefix_caching="off")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kv = smol_runner.kv_store
    layers = smol_runner.model_config.num_layers
    history: list[int] = []
    for turn, q in enumerate(questions):
        ask = tokenizer.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", False)
        if history:
            ask = tokenizer.encode("<|im_end|>\n", False) + ask
        prompt = history + ask
        expected = engine.generate([prompt], greedy)[0]
        before = handed_off(cluster)  # every earlier request's handoff counted
        got = complete(cluster, prompt, max_tokens=12, ignore_eos=True)
        assert got["choices"][0]["text"] == expected.text, f"turn {turn} diverged"
        sent = handed_off(cluster) - before
        full = kv.frame_bytes(len(prompt)) * layers
        if turn:  # the earlier turns' KV stayed on the decode node: only the rest travelled
            held = (len(history) - 1) // 16 * 16  # its full blocks with KV (not the last token)
            kept = kv.frame_bytes(held) * layers
            assert sent == full - kept, (sent, full, kept)
        else:
            assert sent > 0
        history = prompt + expected.token_ids


def handed_off(cluster) -> float:
    """The KV bytes handed off, read once every accepted offer's handoff is counted (the
    prefill node reports it on its own message, which may come after the answer)."""

    def settled() -> bool:
        accepted = cluster.metric("pdserve:placement_accepts_total")
        return cluster.metric("pdserve:node_messages_total", type="KvTransferred") == accepted

    assert wait_for(settled), "a handoff was not reported"
    return cluster.metric("pdserve:kv_transfer_bytes_total")


def test_colocated_node_through_the_gateway_matches_single_process(make_cluster, reference):
    ps, expected, sampled, _ = reference
    cluster = make_cluster(prefill=0, decode=0, colocated=1)
    with ThreadPoolExecutor(len(ps)) as pool:
        results = list(pool.map(lambda p: complete(cluster, p), ps))
    for prompt, exp, got in zip(ps, expected, results, strict=True):
        assert got["choices"][0]["text"] == exp.text, f"prompt of {len(prompt)} tokens diverged"
        assert got["usage"]["completion_tokens"] == len(exp.token_ids)
    assert seeded(cluster, ps[0]) == sampled[0].text
    assert wait_for(lambda: cluster.metric("pdserve:cluster_prefix_cache_hits_total") > 0)
    assert wait_for(
        lambda: cluster.metric("pdserve:kv_blocks", role="colocated", state="in_use") == 0
    )


def test_a_chunked_colocated_node_matches_single_process_and_so_do_prefixes_back_from_disk(
    make_cluster, reference, tokenizer, tmp_path
):
    """A colocated node prefilling in chunks of 64 tokens (the long prompt in 17) whose cache
    holds about one long prompt: a filler prompt pushes the others' blocks out to the disk
    tier, and sent again they load back from it (read ahead, off the node's event loop:
    common/engine/tier_reader.py) with the text unchanged."""
    ps, expected, sampled, _ = reference
    port = free_port()
    flags = ("--chunk-size", "64", "--num-kv-blocks", "96", "--kv-disk-cache-gb", "0.5",
             "--kv-disk-cache-dir", str(tmp_path))  # fmt: skip
    cluster = make_cluster(prefill=0, decode=0, colocated=1, node_flags=flags,
                           extra={"colocated-0": ("--metrics-port", str(port))})  # fmt: skip
    # ~700 tokens (44 blocks) where ~12 are free: it evicts 30-odd cached blocks, most of
    # them the prompts' own (a few hold generated tokens), every one spilled to disk
    filler = tokenizer.encode(" ".join(f"Row {i} holds the number {i * 7}." for i in range(60)))
    for round_ in range(2):  # the second time, the prefixes continue on disk
        if round_:
            complete(cluster, filler, max_tokens=1)  # its blocks are the point, not its text
        with ThreadPoolExecutor(len(ps)) as pool:
            results = list(pool.map(lambda p: complete(cluster, p), ps))
        for prompt, exp, got in zip(ps, expected, results, strict=True):
            assert got["choices"][0]["text"] == exp.text, f"{len(prompt)} tokens, round {round_}"
            assert got["usage"]["completion_tokens"] == len(exp.token_ids)
    assert seeded(cluster, ps[0]) == sampled[0].text

    def tier(event: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pdserve:kv_tier_blocks_total{")
                   and f'event="{event}"' in line)  # fmt: skip

    assert tier("spilled") > 0 and tier("disk_hits") > 0
    assert tier("corrupt") == 0
    assert wait_for(lambda: cluster.metric("pdserve:cluster_prefix_cache_hits_total") > 0)
    assert wait_for(
        lambda: cluster.metric("pdserve:kv_blocks", role="colocated", state="in_use") == 0
    )


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
