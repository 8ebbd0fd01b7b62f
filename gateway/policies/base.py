"""What a placement policy sees and decides. Pure: policies read `NodeView`s and return an
order; no sockets, no clocks.

A policy answers two questions for a request that needs `Need.prompt_len` tokens prefilled:
in which order to offer it to prefill nodes (`prefill_order`), and which decode node takes its
KV (`pick_decode`). The gateway turns the answers into a plan (gateway/plan.py) and runs the
offer protocol over it. `queueing` says whether the policy's prefill nodes keep a local queue
(the baselines) or answer offers by batch room (on-demand); the gateway tells every prefill
node at registration.

A new policy is one module in this package: subclass `Policy`, decorate it with `@register`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from pdserve.common.costmodel import CostModel
from pdserve.gateway.cluster import NodeState


@dataclass(frozen=True)
class NodeView:
    """One node as a policy sees it, derived at decision time from its last load report and
    the gateway's request table."""

    node: NodeState
    in_prefill: tuple[int, ...] = ()  # prompt tokens of each request the gateway has in
    # prefill here (what it sent since the node's report counts too)
    decoding: int = 0  # requests whose KV is on, or headed to, this node
    free_blocks: int = 0  # reported free + cached, minus what was promised and not shown
    cached: int = 0  # of this request's leading blocks, how many its cache holds (the index)
    # prefill: another node holding more of them (`holder_blocks`), which this node may fetch
    holder: NodeState | None = None
    holder_blocks: int = 0
    long_decoding: int = 0  # decode: of `decoding`, requests whose final KV is long here

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def block_size(self) -> int:
        return self.node.info.block_size

    @property
    def cached_tokens(self) -> int:
        return self.cached * self.block_size

    @property
    def holder_tokens(self) -> int:
        """The prompt's tokens `holder` caches. The index counts blocks of the hashes' block
        size (the cluster's reference, the holder's own): not this node's, if it differs."""
        return self.holder_blocks * self.holder.info.block_size if self.holder else 0

    @property
    def fetchable_tokens(self) -> int:
        """Tokens beyond its own cached prefix this node could fetch from `holder`."""
        return max(0, self.holder_tokens - self.cached_tokens)

    @property
    def queued(self) -> int:
        """Requests waiting or running at a prefill node: its last report, or what the gateway
        sent it since if more (reports lag by up to a heartbeat)."""
        return max(self.node.load.waiting + self.node.load.running, len(self.in_prefill))

    @property
    def blocks_in_use(self) -> int:
        """Its report's, plus what was promised since (`free_blocks` counts cached blocks as
        free: they are not in use; after a refusal it is 0, and every block counts)."""
        load = self.node.load
        return load.blocks_in_use + (load.blocks_free + load.blocks_cached - self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def capacity_tokens(self) -> int:
        return self.node.info.num_blocks * self.block_size

    def is_long(self, final_tokens: int) -> bool:
        """A request whose KV will take an eighth of this node's cache or more."""
        return final_tokens * LONG_SHARE >= self.capacity_tokens


@dataclass(frozen=True)
class Need:
    prompt_len: int  # tokens to prefill (prompt, or prompt + output kept when re-placed)
    exclude_decode: frozenset[str] = field(default_factory=frozenset)  # refused the KV
    hashes: tuple[bytes, ...] = ()  # chained hashes of its full blocks (common/prefix.py)
    output_len: int = 0  # tokens it may still generate (its max_tokens, less what it has)

    @property
    def final_len(self) -> int:
        """Its KV size once done, at most: what memory-aware decode placement plans for."""
        return self.prompt_len + self.output_len


DECODE_FITS = ("spread", "best_fit", "length_aware")
LONG_SHARE = 8  # a request is long on a node when its final KV takes 1/8 of the cache


class Policy:
    name: ClassVar[str]
    queueing: ClassVar[bool] = False  # do its prefill nodes queue locally?

    def __init__(self, cost: CostModel, decode_fit: str = "spread") -> None:
        if decode_fit not in DECODE_FITS:
            raise ValueError(f"unknown decode placement {decode_fit!r}: one of {DECODE_FITS}")
        self.cost = cost  # the cost model of --cost-profile, for policies that estimate
        self.decode_fit = decode_fit  # --decode-placement, for policies using pick_decode

    def prefill_order(self, nodes: Sequence[NodeView], need: Need) -> list[NodeView]:
        raise NotImplementedError

    def pick_decode(self, nodes: Sequence[NodeView], need: Need) -> NodeView | None:
        """Default: among nodes that can hold the request, those with room for its final KV
        first (`holds_whole`), then the one whose cache holds the most of its prefix (a
        conversation's earlier turns: their KV need not travel again), then by `decode_fit`.
        Room first: else a nearly full node holding one shared block (a system prompt) takes
        every request sharing it, to preempt them as they grow, while an empty node waits."""
        return max(fits(nodes, need), key=lambda n: self._decode_rank(n, need), default=None)

    def _decode_rank(self, n: NodeView, need: Need) -> tuple[int | str, ...]:
        # no node with room for it all (a chat request's max_tokens left at the context's
        # rest): the cache still leads, as it always did
        whole = holds_whole(n, need)
        return (int(whole), n.cached, *decode_key(self.decode_fit, n, need), n.node_id)


def decode_key(fit: str, n: NodeView, need: Need) -> tuple[int, ...]:
    """Larger is better. `spread`: the most free KV blocks (then the fewest requests).
    `best_fit` (LoongServe's memory-aware placement): a node with room for the request's
    final KV (prompt + its remaining max_tokens), the tightest such fit, so large free
    regions stay whole for long requests and a long output is not preempted half way; when
    none has room for it all, spread. `length_aware`: long requests (final KV >= 1/8 of a
    node's cache) go with other long ones, short ones away from them, then best fit: a node
    with few long requests stays able to take many short ones."""
    spread = (n.free_blocks, -n.decoding)
    if fit == "spread":
        return spread
    whole = holds_whole(n, need)
    tight = (int(whole), -n.free_blocks if whole else n.free_blocks, -n.decoding)
    if fit == "best_fit":
        return tight
    together = n.long_decoding if n.is_long(need.final_len) else -n.long_decoding
    return (int(whole), together, *tight[1:])


def holds_whole(n: NodeView, need: Need) -> bool:
    """Room for the request's final KV (prompt + its remaining max_tokens) in the node's free
    blocks, its cached ones included (the request's own prefix may be among them)."""
    return n.free_blocks >= n.blocks_for(need.final_len)


def fits(nodes: Iterable[NodeView], need: Need) -> list[NodeView]:
    """Decode nodes not excluded with room for the prompt's KV and the first token."""
    return [
        n
        for n in nodes
        if n.node_id not in need.exclude_decode
        and n.free_blocks >= n.blocks_for(need.prompt_len + 1)
    ]
