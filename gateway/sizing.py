"""The autoscaling signal: how many replicas each pool wants for the load it has now,
exported as `pdserve:desired_replicas{pool="prefill"|"decode"}` for an external autoscaler
(a Kubernetes HPA or KEDA on the Prometheus metric) to act on. Pure: `now` passed in.

The rule is the planner's capacity model in closed form (the cost model of
common/costmodel.py, the nodes' own measurements where they have them):

    prefill = ceil((lambda x s + backlog x s / W) / U)
        lambda   prompt tokens arriving per second, exponentially weighted over the window W,
                 less those their decode nodes prefilled themselves (--local-prefill: the
                 decode pool's work, whose KV its sizing counts)
        s        prefill seconds per token: the prefill nodes' measured median (their
                 `token_cost`), else the cost model's at the mean prompt length
        backlog  prompt tokens waiting at the gateway, to be drained within one window
        U        target utilisation (0.8): past it a prefill node's queue grows fast (the
                 mean wait of a node serving one batch at a time grows as U / (1 - U))
    decode  = max(ceil(blocks / (blocks per node x U)), ceil(max(running, mu x T) / B))
        blocks   KV blocks in use on the decode nodes
        B        the largest batch whose decode step, at the running sequences' mean
                 context, keeps within the TPOT SLO T (`--tpot-slo`; without one, KV only)
        mu x T   the batch the arriving load will build (Little's law: output tokens asked
                 for per second, mu, each taking T to make): the signal moves when the
                 load does, not only once the batches have grown

Each is at least 1. Scale-down is the autoscaler's to damp (an HPA's stabilisation window);
the signal itself follows the load within about one window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.common.costmodel import CostModel
from pdserve.gateway.cluster import ClusterView

PASS_TOKENS = 8192  # a prefill pass's prompt tokens with no prefill node (the nodes' default)


@dataclass
class Ewma:
    """A rate of events per second, each observation weighted by exp(-age / window)."""

    window: float
    value: float = 0.0
    at: float = 0.0

    def add(self, amount: float, now: float) -> None:
        self.value = self.rate(now) + amount / self.window
        self.at = now

    def rate(self, now: float) -> float:
        return self.value * math.exp(-max(0.0, now - self.at) / self.window)


@dataclass
class Sizing:
    cost: CostModel
    window: float = 60.0
    utilization: float = 0.8
    tpot_slo: float = 0.0
    tokens: Ewma = field(init=False)
    requests: Ewma = field(init=False)
    outputs: Ewma = field(init=False)
    local: Ewma = field(init=False)  # of `tokens`, prefilled by their decode nodes
    # this gateway's own arrivals since it started (prompt tokens, requests, output tokens,
    # and of the prompt tokens, those prefilled locally), told to the other gateways through
    # the nodes (gateway/others.py)
    own: list[int] = field(default_factory=lambda: [0, 0, 0, 0])

    def __post_init__(self) -> None:
        self.tokens, self.requests = Ewma(self.window), Ewma(self.window)
        self.outputs, self.local = Ewma(self.window), Ewma(self.window)

    def arrived(self, prompt_tokens: int, now: float, output_tokens: int = 0) -> None:
        """A request arrived here."""
        for i, amount in enumerate((prompt_tokens, 1, output_tokens)):
            self.own[i] += amount
        self.add(prompt_tokens, 1, output_tokens, now)

    def prefilled_locally(self, prompt_tokens: int, now: float) -> None:
        """A request that arrived here was prefilled by its decode node (--local-prefill)."""
        self.own[3] += prompt_tokens
        self.local.add(prompt_tokens, now)

    def add(
        self, prompt_tokens: int, requests: int, output_tokens: int, now: float, local: int = 0
    ) -> None:
        """Arrivals to size for: here, or at another gateway of the cluster."""
        self.tokens.add(prompt_tokens, now)
        self.requests.add(requests, now)
        self.outputs.add(output_tokens, now)
        if local:
            self.local.add(local, now)

    def prefill(self, cluster: ClusterView, backlog_tokens: int, now: float) -> int:
        rate = max(0.0, self.tokens.rate(now) - self.local.rate(now))  # the prefill pool's
        if rate <= 0 and backlog_tokens <= 0:
            return 1
        measured = sorted(
            n.load.token_cost for n in cluster.alive("prefill") if n.load.token_cost > 0
        )
        if measured:
            per_token = measured[len(measured) // 2]
        else:
            requests = self.requests.rate(now)
            # no arrival here yet (only other gateways' backlog): their prompts' lengths
            # are not known, so a full pass of it; a length of 1 made a step's fixed cost
            # the cost of every token (~280x: decode nodes switched away one by one)
            passes = [n.info.max_batch_tokens for n in cluster.alive("prefill")]
            passes = [p for p in passes if p > 0] or [PASS_TOKENS]
            tokens = self.tokens.rate(now)  # every prompt's: their mean length
            mean = round(tokens / requests) if requests > 0 else min(backlog_tokens, min(passes))
            per_token = self.cost.prefill_seconds(max(1, mean)) / max(1, mean)
        busy = (rate + backlog_tokens / self.window) * per_token  # node-seconds per second
        return max(1, math.ceil(busy / self.utilization - 1e-9))

    def decode(self, cluster: ClusterView, now: float = 0.0) -> int:
        nodes = cluster.alive("decode")
        if not nodes:
            return 1
        in_use = sum(n.load.blocks_in_use for n in nodes)
        per_node = max(1, nodes[0].info.num_blocks)
        want = math.ceil(in_use / (per_node * self.utilization) - 1e-9)
        running = sum(n.load.running for n in nodes)
        if self.tpot_slo > 0:
            coming = self.outputs.rate(now) * self.tpot_slo  # Little's law
            batch = max(running, coming)
            if batch > 0:
                context = self._context(in_use, nodes[0].info.block_size, running, now)
                want = max(want, math.ceil(batch / self.batch_within_slo(context) - 1e-9))
        return max(1, want)

    def _context(self, in_use: int, block: int, running: int, now: float) -> int:
        """The running sequences' mean context; with none running yet, the arriving ones'
        halfway (prompt + half the output)."""
        if running:
            return max(1, in_use * block // running)
        requests = max(self.requests.rate(now), 1e-9)
        return max(1, round((self.tokens.rate(now) + self.outputs.rate(now) / 2) / requests))

    def batch_within_slo(self, context: int) -> int:
        """The largest decode batch at this mean context whose step keeps within the TPOT
        SLO (at least 1: a lone sequence is as fast as it gets)."""
        step = self.cost.decode_step_seconds
        if step([context]) > self.tpot_slo:
            return 1
        low, high = 1, 2
        while step([context] * high) <= self.tpot_slo and high < 1 << 20:
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if step([context] * mid) <= self.tpot_slo else (low, mid)
        return low
