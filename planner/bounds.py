"""Upper bounds on what a split can score, from the cost model alone: the planner skips a
split whose bound is below the best goodput per node already simulated.

Each bound holds for any placement and batching, because it is built from lower bounds on
work that every schedule must do:
- a prompt's prefill adds at least its FLOP term (`prefill_compute_seconds`) to the steps
  that compute it, counting as cached every leading block an earlier prompt shares (a
  prefix cache can do no better; a collision of the 64-bit block keys only loosens it);
- a request's KV stays on a decode node for at least its prompt's tokens times its decode
  steps, each at least a batch-1 step;
- a request alone takes at least those times (TTFT, TPOT, end to end): one that misses an
  SLO even alone misses it in every split;
- a request past the cluster's context limit (prompt + max_tokens > max_model_len) is
  refused at its arrival, as the gateway answers it: it does no work and ends there.

From these, for P prefill and D decode nodes: the run lasts at least as long as the work
arriving after any moment needs on P nodes (prefill) or in D nodes' KV (decode); and of the
requests whose whole TTFT window lies in one window of time, at most as many meet their TTFT
as the cheapest of them fit in P nodes' time in that window (the others, straddling windows,
count as met). Goodput per node is then at most (requests that can meet) / (least duration)
/ (P + D).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdserve.common.costmodel import CostModel
from pdserve.loadgen.workloads import RequestSpec
from pdserve.planner.decode_run import prompt_tokens

WINDOWS = (2, 4, 8, 16, 32, 64)  # window lengths tried, in TTFT SLOs (each gives a bound)


@dataclass
class Bounds:
    arrivals: np.ndarray  # seconds from the first, sorted as the requests
    prefill_work: np.ndarray  # per request: least prefill seconds it adds
    kv_work: np.ndarray  # per request: least token-seconds of decode KV
    able: np.ndarray  # per request: can meet every SLO when alone
    least_end: float  # the run's least duration (the last request alone)
    ttft: float | None
    kv_tokens: int  # a decode node's KV capacity (tokens)
    fastest: dict[str, float] = field(default_factory=dict)  # per SLO: least of any alone
    _met: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    _ends: dict[tuple[str, float], float] = field(default_factory=dict)  # _drain's, kept

    def __post_init__(self) -> None:
        # what every split's bound reads, sorted once: a large budget has O(budget^2) splits
        order = np.argsort(self.arrivals, kind="stable")
        self._sorted = self.arrivals[order]
        self._after = {  # work arriving at or after each request (in arrival order)
            name: np.cumsum(work[order][::-1])[::-1]
            for name, work in (("prefill", self.prefill_work), ("kv", self.kv_work))
        }

    @classmethod
    def of(
        cls,
        specs: list[RequestSpec],
        slo: dict[str, float],
        cost: CostModel,
        block_size: int,
        kv_tokens: int,
        step_overhead_s: float = 0.0,
        max_model_len: int | None = None,
    ) -> Bounds:
        """`max_model_len`: the cluster's context limit, as the simulation refuses past it
        (default: the model's context or a decode node's cache, whichever is less)."""
        n = len(specs)
        arrivals = np.array([s.arrival for s in specs], dtype=float)
        if n:
            arrivals -= arrivals.min()
        limit = min(cost.model.max_context, kv_tokens) if max_model_len is None else max_model_len
        prompts = [prompt_tokens(s.prompt, s.prompt_len) for s in specs]
        need = [len(p) + s.max_tokens for p, s in zip(prompts, specs, strict=True)]
        refused = np.array(need, dtype=np.int64) > limit
        cached = _shared_blocks(specs, prompts, refused, block_size) * block_size
        prefill = np.zeros(n)
        kv = np.zeros(n)
        able = np.zeros(n, dtype=bool)
        least_end = 0.0
        fastest: dict[str, float] = {}
        for i, spec in enumerate(specs):
            if refused[i]:  # ended at its arrival, never placed: no work, no good
                least_end = max(least_end, arrivals[i])
                continue
            length = len(prompts[i])
            hit = min(int(cached[i]), length - 1)
            new = length - hit
            prefill[i] = cost.prefill_compute_seconds(new, hit)
            step = cost.decode_batch_seconds(1, length) + step_overhead_s
            steps = max(0, spec.max_tokens - 1)
            kv[i] = length * steps * step
            ttft = cost.prefill_seconds(new, hit) + step_overhead_s
            # one token ends at the prefill node: no KV is handed off
            e2e = ttft + (cost.transfer_seconds(length) if steps else 0.0) + steps * step
            least_end = max(least_end, arrivals[i] + e2e)
            alone = {"ttft": ttft, "tpot": step if steps else 0.0, "e2e": e2e}
            able[i] = all(alone[k] <= v for k, v in slo.items() if k in alone)
            for k, v in alone.items():
                fastest[k] = min(fastest.get(k, v), v)
        return cls(arrivals, prefill, kv, able, least_end, slo.get("ttft"), kv_tokens, fastest)

    def goodput_per_node(self, prefill: int, decode: int) -> float:
        """At most this goodput per node for `prefill` P + `decode` D nodes."""
        if len(self.arrivals) == 0:
            return 0.0
        duration = max(
            self.least_end,
            self._drain("prefill", prefill),
            self._drain("kv", decode * self.kv_tokens),
            1e-9,
        )
        return self.meetable(prefill) / duration / (prefill + decode)

    def _drain(self, work: str, servers: float) -> float:
        """The least time until `work` (each arriving at its time) is done at rate `servers`:
        what arrives after any moment needs at least its sum / servers from then."""
        end = self._ends.get((work, servers))
        if end is None:  # once per node count: the splits with as many share it
            end = float("inf") if servers <= 0 else 0.0
            if servers > 0 and len(self._sorted):
                end = float(np.max(self._sorted + self._after[work] / servers))
            self._ends[work, servers] = end
        return end

    def meetable(self, prefill: int) -> int:
        """At most this many requests meet every SLO with `prefill` prefill nodes."""
        if prefill >= len(self._met):
            self._met = self._meetable_upto(max(2 * prefill, 16))
        return int(self._met[prefill])

    def _meetable_upto(self, most: int) -> np.ndarray:
        nodes = np.arange(most + 1)
        able = int(self.able.sum())
        best = np.full(most + 1, able)
        if self.ttft is None or self.ttft <= 0:
            return best
        for k in WINDOWS:
            width = k * self.ttft
            window = np.floor(self.arrivals / width)
            inside = self.able & (np.floor((self.arrivals + self.ttft) / width) == window)
            met = np.full(most + 1, int((self.able & ~inside).sum()))  # straddlers: met
            for w in np.unique(window[inside]):
                cums = np.cumsum(np.sort(self.prefill_work[inside & (window == w)]))
                met += np.searchsorted(cums, nodes * width, side="right")
            best = np.minimum(best, met)
        return best


def _shared_blocks(
    specs: list[RequestSpec], prompts: list[list[int]], refused: np.ndarray, block_size: int
) -> np.ndarray:
    """Per request: its leading full blocks that some earlier prompt also began with (a
    refused prompt is never prefilled: it caches nothing)."""
    seen: set[int] = set()
    out = np.zeros(len(specs), dtype=np.int64)
    for i in sorted(range(len(specs)), key=lambda i: specs[i].arrival):
        if refused[i]:
            continue
        tokens = np.asarray(prompts[i], dtype=np.int64)
        full = len(tokens) // block_size
        key, shared, leading = 0, 0, True
        for row in tokens[: full * block_size].reshape(full, block_size):
            key = hash((key, row.tobytes()))
            if leading and key in seen:
                shared += 1
            else:
                leading = False
            seen.add(key)
        out[i] = shared
    return out
