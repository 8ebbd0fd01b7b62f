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

from typing import Annotated, Any, get_args, get_origin

import msgspec
from msgspec import Meta

MASK64 = (1 << 64) - 1
SAMPLING_EPS = 1e-5  # a temperature below this is greedy (vLLM's threshold)


class InvalidSampling(ValueError):
    """A sampling field out of its range; `field` names it (the API's error `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# Each field's range, declared once: msgspec checks it wherever a struct is decoded (the
# gateway's request body, the wire, `pdserve generate`), `__post_init__` where one is built
# in code, and the gateway's /openapi.json publishes it.
MaxTokens = Annotated[int, Meta(ge=1, description="tokens to generate at most")]
Temperature = Annotated[float, Meta(ge=0, le=2, description="0: greedy")]
TopP = Annotated[float, Meta(gt=0, le=1, description="nucleus sampling mass")]
TopK = Annotated[int, Meta(ge=-1, description="0 or -1: no top-k")]
MinP = Annotated[float, Meta(ge=0, le=1, description="drop tokens below min_p x the top one")]
Seed = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1, description="a signed 64-bit seed")]
# The gateway looks for every stop string in each token's text on its event loop, and a node
# for every stop id in each step: bounded, so one request cannot stall the others (vLLM has
# no bound; OpenAI takes 4 strings).
MAX_STOPS = 64
MAX_STOP_CHARS = 4096  # all of a request's stop strings together
StopString = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]
Stops = Annotated[tuple[StopString, ...], Meta(max_length=MAX_STOPS, description="at most 64")]
StopIds = Annotated[
    tuple[Annotated[int, Meta(ge=0)], ...], Meta(max_length=MAX_STOPS, description="at most 64")
]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: MaxTokens = 16
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    seed: Seed | None = None
    stop: Stops = ()
    stop_token_ids: StopIds = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for f in msgspec.structs.fields(self):
            value = getattr(self, f.name)
            meta = bounds(f.type)
            if meta is not None and value is not None and not in_bounds(value, meta):
                got = len(value) if isinstance(value, tuple) else value
                raise InvalidSampling(f.name, f"{f.name} must be {describe(meta)}, got {got}")
        if sum(len(s) for s in self.stop) > MAX_STOP_CHARS:
            raise InvalidSampling("stop", f"stop strings may have {MAX_STOP_CHARS} characters "
                                  "in all")  # fmt: skip

    @property
    def greedy(self) -> bool:
        # below SAMPLING_EPS, logits / temperature overflows float32 (1e-39 -> inf - inf = NaN,
        # and the draw lands on any token): such a temperature means greedy, as in vLLM
        return self.temperature < SAMPLING_EPS or self.top_k == 1

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


def bounds(annotation: Any) -> Meta | None:
    """The `Meta` of an `Annotated[...]` field type (also inside `... | None`), if any."""
    if get_origin(annotation) is Annotated:
        return next((m for m in get_args(annotation)[1:] if isinstance(m, Meta)), None)
    return next((b for a in get_args(annotation) if (b := bounds(a)) is not None), None)


def in_bounds(value: Any, meta: Meta) -> bool:
    if isinstance(value, (str, tuple, list)):
        return meta.max_length is None or len(value) <= meta.max_length
    return (
        (meta.ge is None or value >= meta.ge)
        and (meta.gt is None or value > meta.gt)
        and (meta.le is None or value <= meta.le)
        and (meta.lt is None or value < meta.lt)
    )


def describe(meta: Meta) -> str:
    parts = [
        f"{op} {bound}"
        for op, bound in ((">=", meta.ge), (">", meta.gt), ("<=", meta.le), ("<", meta.lt))
        if bound is not None
    ]
    if meta.max_length is not None:
        parts.append(f"at most {meta.max_length} long")
    return " and ".join(parts)
