"""KV-aware (Mooncake-style baseline): the least estimated TTFT per prefill node,

    TTFT = queue wait    (modelled prefill time of the prompts the node already has)
         + fetch time    of the tokens another node holds beyond this one's cache, when
                         fetching them is faster than computing them (else 0)
         + prefill time  of this prompt's tokens neither cached there nor fetched
         + KV transfer   time of the prompt's KV

with the cost model of `--cost-profile`. Decode: the node holding most of the prefix among
those with room for its final KV, then the most free KV blocks. Every decision is logged at
DEBUG with its numbers.

Prefill nodes do not queue (they answer offers by batch room, as on-demand's do): a request
is offered only to the nodes whose estimate is within `SLACK` of the best one. When the best
is busy (its batch is full) the request waits at the gateway for it rather than going to a
node that would compute the whole prompt cold, and the gateway's admission rounds re-plan
with fresh estimates whenever capacity frees, so a wait the estimate got wrong is corrected
at the next round instead of being locked into a node's FIFO queue. Measured against the
node-queue version on 1P1D shared prefixes (docs/results/README.md, KV reuse): a node queue
batched several cold 2,000-token prompts ahead of the cached ones; admission at the gateway
lets the cheap cached ones go first (spf on uncached tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pdserve.common.costmodel import CostModel
from pdserve.gateway.policies import register
from pdserve.gateway.policies.base import Need, NodeView, Policy

log = logging.getLogger(__name__)

# Offer a request to the nodes whose estimated TTFT is at most this many times the best's:
# equal nodes (idle, nothing cached) all get the offer and the load spreads; a node worse by
# more than the estimate's error is not worth going to while the best one is only busy.
SLACK = 1.1
MEMO_SIZE = 1 << 16


@register
class KvAware(Policy):
    name = "kv_aware"
    queueing = False
    _memo: dict[tuple[int, int], float]

    def __init__(self, cost: CostModel, decode_fit: str = "spread") -> None:
        super().__init__(cost, decode_fit)
        self._memo = {}

    def _prefill_s(self, tokens: int, cached: int = 0) -> float:
        # a placement round estimates every waiting request on every node: the same few
        # (tokens, cached) pairs again and again, so the cost model's answers are kept
        if (got := self._memo.get((tokens, cached))) is None:
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()
            got = self._memo[tokens, cached] = self.cost.prefill_seconds(tokens, cached)
        return got

    def estimate(
        self, node: NodeView, prompt_len: int, cached: int = 0, fetchable: int = 0
    ) -> dict[str, float]:
        cached = min(cached, prompt_len - 1)  # the last token is always computed
        fetched = min(fetchable, prompt_len - 1 - cached)
        wait = sum(self._prefill_s(n) for n in node.in_prefill)
        fetch = self.cost.transfer_seconds(fetched) if fetched > 0 else 0.0
        computed = self._prefill_s(prompt_len - cached, cached)
        prefill = self._prefill_s(prompt_len - cached - fetched, cached + fetched)
        if fetched <= 0 or fetch + prefill >= computed:  # the node would compute it all
            fetched, fetch, prefill = 0, 0.0, computed
        transfer = self.cost.transfer_seconds(prompt_len)
        return {
            "queue_s": wait,
            "fetch_s": fetch,
            "prefill_s": prefill,
            "transfer_s": transfer,
            "ttft_s": wait + fetch + prefill + transfer,
            "cached_tokens": cached,
            "fetched_tokens": fetched,
        }

    def prefill_order(self, nodes: Sequence[NodeView], need: Need) -> list[NodeView]:
        scored = [
            (self.estimate(n, need.prompt_len, n.cached_tokens, n.fetchable_tokens), n)
            for n in nodes
        ]
        scored.sort(key=lambda pair: (pair[0]["ttft_s"], pair[1].node_id))
        if scored and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "kv_aware %d tokens: %s",
                need.prompt_len,
                {n.node_id: {k: round(v, 4) for k, v in e.items()} for e, n in scored},
            )
        if not scored:
            return []
        bound = scored[0][0]["ttft_s"] * SLACK
        return [n for e, n in scored if e["ttft_s"] <= bound]
