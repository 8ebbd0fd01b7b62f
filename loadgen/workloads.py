"""Seeded workloads: what to send and when. Pure (numpy random generators, no clocks).

A workload is a list of `RequestSpec`s with arrival offsets in seconds. Arrivals are gamma
distributed with mean gap 1/rate and shape k (k = 1 Poisson, k < 1 bursty: same mean rate,
more clumping), or absent (fixed concurrency). Prompts are token-id lists built so that
their lengths are exact; `ignore_eos` forces output lengths. Sources:

    synthetic     input/output lengths fixed, uniform, normal or lognormal
    shared-prefix groups of requests sharing a long prefix, then a unique suffix
    sharegpt      a ShareGPT-format JSON file (conversations; first human turn is the prompt)
    mooncake      a Mooncake-format trace (JSONL: timestamp ms, input_length, output_length,
                  hash_ids of 512-token blocks; equal ids at equal positions = shared prefix)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

VOCAB_LOW, VOCAB_HIGH = 1000, 40000  # ordinary tokens of the embedded tokenizer


@dataclass
class RequestSpec:
    arrival: float  # seconds after the start
    prompt: list[int] | str
    max_tokens: int
    prompt_len: int


@dataclass(frozen=True)
class LengthDist:
    kind: str = "fixed"  # fixed | uniform | normal | lognormal
    mean: float = 128
    spread: float = 0.0  # uniform: +-spread; normal: std; lognormal: sigma of log

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """'128' (= 'fixed:128', as vllm bench reads it), 'fixed:128', 'uniform:128:64',
        'normal:512:100', 'lognormal:512:0.5'."""
        if text.strip().isdigit():
            return cls("fixed", float(text))
        parts = text.split(":")
        if parts[0] not in ("fixed", "uniform", "normal", "lognormal") or len(parts) < 2:
            raise ValueError(f"bad length distribution {text!r}")
        return cls(parts[0], float(parts[1]), float(parts[2]) if len(parts) > 2 else 0.0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            values = np.full(n, self.mean)
        elif self.kind == "uniform":
            values = rng.uniform(self.mean - self.spread, self.mean + self.spread, n)
        elif self.kind == "normal":
            values = rng.normal(self.mean, self.spread, n)
        else:
            values = rng.lognormal(np.log(self.mean), self.spread, n)
        return np.maximum(1, np.rint(values)).astype(int)


def arrivals(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> np.ndarray:
    """Offsets of n arrivals: gamma gaps with mean 1/rate and shape k; rate 0 = all at once."""
    if rate <= 0:
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def random_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(VOCAB_LOW, VOCAB_HIGH, n).tolist()


def generators(seed: int, k: int) -> list[np.random.Generator]:
    """k independent generators of one seed, one per purpose (arrivals, lengths, picks,
    tokens): from one generator, the arrivals' draws (none at rate 0, a burstiness-dependent
    number per gap) shifted every later draw, and one seed gave other prompts at each rate."""
    return [np.random.default_rng(child) for child in np.random.SeedSequence(seed).spawn(k)]


def synthetic(
    seed: int, n: int, rate: float, burstiness: float, input_len: LengthDist, output_len: LengthDist
) -> list[RequestSpec]:
    at, lengths, tokens = generators(seed, 3)
    times = arrivals(at, n, rate, burstiness)
    ins, outs = input_len.sample(lengths, n), output_len.sample(lengths, n)
    return [
        RequestSpec(float(t), random_tokens(tokens, int(i)), int(o), int(i))
        for t, i, o in zip(times, ins, outs, strict=True)
    ]


def shared_prefix(
    seed: int,
    n: int,
    rate: float,
    burstiness: float,
    groups: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
) -> list[RequestSpec]:
    at, picks, tokens = generators(seed, 3)
    prefixes = [random_tokens(tokens, prefix_len) for _ in range(groups)]
    times = arrivals(at, n, rate, burstiness)
    specs = []
    for t, g in zip(times, picks.integers(groups, size=n), strict=True):
        prompt = prefixes[int(g)] + random_tokens(tokens, suffix_len)
        specs.append(RequestSpec(float(t), prompt, output_len, len(prompt)))
    return specs


def sharegpt(
    path: Path, seed: int, n: int, rate: float, burstiness: float, max_output: int = 256
) -> list[RequestSpec]:
    data = json.loads(Path(path).read_text())
    pairs: list[tuple[str, str]] = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) >= 2 and turns[0].get("value") and turns[1].get("value"):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise ValueError(f"{path}: no conversations with a prompt and a reply")
    at, pick = generators(seed, 2)
    times = arrivals(at, n, rate, burstiness)
    picks = pick.integers(len(pairs), size=n)
    specs = []
    for t, i in zip(times, picks, strict=True):
        prompt, reply = pairs[int(i)]
        out = max(1, min(max_output, len(reply) // 4))  # ~4 characters per token
        specs.append(RequestSpec(float(t), prompt, out, len(prompt) // 4))
    return specs


def mooncake(
    path: Path,
    seed: int,
    n: int,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    block_tokens: int = 512,
) -> list[RequestSpec]:
    """Replay a Mooncake trace: arrival times x time_scale, lengths x length_scale (blocks of
    block_tokens x length_scale tokens; equal hash ids give identical token blocks)."""
    rng = np.random.default_rng(seed)
    block_len = max(1, round(block_tokens * length_scale))
    blocks: dict[int, list[int]] = {}
    specs: list[RequestSpec] = []
    with open(path) as f:
        for line in f:
            if len(specs) >= n:
                break
            if not line.strip():  # a blank line (a doubled final newline): no request
                continue
            row: dict[str, Any] = json.loads(line)
            length = max(1, round(row["input_length"] * length_scale))
            prompt: list[int] = []
            for h in row.get("hash_ids", []):
                if h not in blocks:
                    blocks[h] = random_tokens(rng, block_len)
                prompt += blocks[h]
            prompt = prompt[:length] + random_tokens(rng, max(0, length - len(prompt)))
            out = max(1, round(row["output_length"] * length_scale))
            specs.append(RequestSpec(row["timestamp"] / 1000 * time_scale, prompt, out, length))
    t0 = specs[0].arrival if specs else 0.0
    for spec in specs:
        spec.arrival -= t0
    return specs


def as_text(specs: list[RequestSpec], decode: Callable[[list[int]], str]) -> list[RequestSpec]:
    """The same workload with text prompts (for the chat endpoint): token ids decoded by the
    server's tokenizer, so a prompt re-tokenizes to about its length and equal prefixes stay
    equal text. Text prompts pass through."""
    return [
        RequestSpec(s.arrival, s.prompt if isinstance(s.prompt, str) else decode(s.prompt),
                    s.max_tokens, s.prompt_len)
        for s in specs
    ]  # fmt: skip
