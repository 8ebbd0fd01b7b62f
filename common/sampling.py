"""Per-request sampling parameters and the counter-based random source (no torch).

Every random draw is a pure function of (seed, token position): `counter_uniform` hashes
the pair with SplitMix64. Nothing depends on generator state, batch composition or which
process produced the previous token, so a seeded request yields the same text in one
process or split across a prefill node and a decode node.

`SamplingParams` is the one definition of a sampling field: the gateway reads each field from
a request body by its name and type (gateway/openai_api.py), nodes receive the struct whole,
`pdserve generate` makes a flag of each, and the checks below are the only ones. A new field
is declared here and applied where the engine samples (common/engine/sampler.py).
"""

from __future__ import annotations

import msgspec

MASK64 = (1 << 64) - 1


class InvalidSampling(ValueError):
    """A sampling field out of its range; `field` names it (the API's error `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest one's probability
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = (
            ("max_tokens", self.max_tokens >= 1, "at least 1"),
            ("temperature", 0 <= self.temperature <= 2, "in [0, 2]"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= -1, "-1, 0 or positive"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("seed", self.seed is None or -(1 << 63) <= self.seed < (1 << 64), "a 64-bit integer"),
        )
        for name, ok, what in checks:
            if not ok:
                raise InvalidSampling(name, f"{name} must be {what}, got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def with_seed(self, seed: int) -> SamplingParams:
        return msgspec.structs.replace(self, seed=seed)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def counter_uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, position)."""
    mixed = _splitmix64(_splitmix64(seed & MASK64) ^ (position & MASK64))
    return (mixed >> 11) * (1.0 / (1 << 53))


def counter_int(seed: int, position: int, modulo: int) -> int:
    """An integer in [0, modulo) that depends only on (seed, position)."""
    return int(counter_uniform(seed, position) * modulo)
