"""When to send KV layer by layer: decided per batch from this node's own measurements.

Layer-wise sending hides the transfer behind the later layers' compute, but the sender then
runs during the forward pass. On a GPU it takes no compute from the pass; on a small CPU
it competes for the cores and the pass slows by about what the sender costs: on 2 cores
(benchmarks/overlap.py) a request can be ready on the decode node *later* with layer-wise
sending at every prompt length. No constant threshold is right on both.

The rule compares the predicted time until the batch's KV is ready on its decode nodes:

    at the end:   ready = N x s_plain + B x tail_end
    layer-wise:   ready = N x s_plain x slowdown + B x tail_layerwise

N the batch's prompt tokens, B its KV bytes, s_plain the pass's seconds per token without
sending (EWMA over such passes), slowdown the measured ratio of layer-wise passes to that
(>= 1 where sender and model share cores, ~1 on a GPU), tail_* the measured seconds per KV
byte from the end of the pass to the decode node's acknowledgement, per mode. Until each
mode has a few samples the static threshold (`--layerwise-min-tokens`) decides; afterwards
one batch in EXPLORE still takes the other mode, so a changed machine or load is noticed.
Pure: callers pass in what they measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALPHA = 0.2  # EWMA weight of a new sample
WARM = 3  # samples of each kind before the measurements decide
EXPLORE = 16  # afterwards, every EXPLORE-th batch tries the mode predicted to lose


@dataclass
class Ewma:
    value: float = 0.0
    count: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.count == 0 else (1 - ALPHA) * self.value + ALPHA * x
        self.count += 1


@dataclass
class Decision:
    layerwise: bool
    why: str  # "threshold", "explore" or "measured"
    predicted_layerwise_s: float | None = None
    predicted_at_end_s: float | None = None


class LayerwiseRule:
    def __init__(self, mode: str = "auto", min_tokens: int = 768) -> None:
        self.mode = mode  # auto | on | off | threshold
        self.min_tokens = min_tokens
        self.plain = Ewma()  # seconds per prompt token, passes without layer-wise sending
        self.slowdown = Ewma()  # layer-wise pass / predicted plain pass
        self.tail = {True: Ewma(), False: Ewma()}  # seconds per KV byte after the pass
        self.batches = 0

    @property
    def warm(self) -> bool:
        return min(self.plain.count, self.slowdown.count) >= WARM and all(
            t.count >= WARM for t in self.tail.values()
        )

    def predict(self, tokens: int, kv_bytes: int) -> tuple[float, float]:
        """(layer-wise, at the end) seconds until the KV is ready; warm rules only."""
        base = tokens * self.plain.value
        return (
            base * self.slowdown.value + kv_bytes * self.tail[True].value,
            base + kv_bytes * self.tail[False].value,
        )

    def decide(self, tokens: int, kv_bytes: int) -> Decision:
        """For a batch of `tokens` prompt tokens whose handed-off KV is `kv_bytes`."""
        if self.mode in ("on", "off"):
            return Decision(self.mode == "on", "forced")
        by_threshold = tokens >= self.min_tokens
        if self.mode == "threshold" or kv_bytes == 0:
            return Decision(by_threshold, "threshold")
        self.batches += 1
        if not self.warm:
            if self.plain.count < WARM or self.tail[False].count < WARM:
                return Decision(False, "explore" if by_threshold else "threshold")
            return Decision(True, "explore")  # the at-end side is known: try layer-wise
        lw, end = self.predict(tokens, kv_bytes)
        choice = lw < end
        if self.batches % EXPLORE == 0:
            return Decision(not choice, "explore", lw, end)
        return Decision(choice, "measured", lw, end)

    def observe_pass(self, tokens: int, seconds: float, layerwise: bool) -> None:
        """A forward pass of `tokens` prompt tokens took `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        if not layerwise:
            self.plain.add(seconds / tokens)
        elif self.plain.count:
            self.slowdown.add(max(1.0, seconds / (tokens * self.plain.value)))

    def observe_tail(self, kv_bytes: int, seconds: float, layerwise: bool) -> None:
        """A transfer was acknowledged `seconds` after its pass ended."""
        if kv_bytes > 0 and seconds >= 0:
            self.tail[layerwise].add(seconds / kv_bytes)


@dataclass
class _Batch:
    ended: float  # its forward pass was over
    layerwise: bool | None = None  # its transfers' mode (None: none yet)
    pending: set[str] = field(default_factory=set)
    kv_bytes: int = 0
    last: float = 0.0  # the latest acknowledgement so far
    sealed: bool = False  # every transfer of the pass added
    spoiled: bool = False  # one lost (refused, dropped) or the modes mixed: no sample


class BatchTails:
    """The tail is sampled per batch, not per transfer: a batch's transfers share the link
    after its pass, so one transfer's own time counts the others' bytes ahead of it (at the
    end, the k-th of B waits for k of them; layer-wise, all land together), and the rule
    predicts the whole batch's ready time from its total bytes. A batch gives one sample,
    its bytes over the time to its last acknowledgement, once every transfer of it is
    acknowledged."""

    def __init__(self, rule: LayerwiseRule, limit: int = 4096) -> None:
        self.rule, self.limit = rule, limit
        self.of: dict[str, _Batch] = {}  # a transfer not yet acknowledged -> its batch

    def open(self, ended: float) -> _Batch:
        return _Batch(ended)

    def add(self, batch: _Batch, rid: str, kv_bytes: int, layerwise: bool) -> None:
        """Before its KvDone goes (the acknowledgement may come at the next await)."""
        if len(self.of) >= self.limit:  # transfers never acknowledged nor lost: forget
            self.of.clear()
        if batch.layerwise is not None and batch.layerwise != layerwise:
            batch.spoiled = True  # `--layerwise threshold` mixes modes in one pass
        batch.layerwise = layerwise
        batch.pending.add(rid)
        batch.kv_bytes += kv_bytes
        self.of[rid] = batch

    def seal(self, batch: _Batch) -> None:
        batch.sealed = True
        self._maybe_sample(batch)

    def acked(self, rid: str, finished: float) -> None:
        batch = self.of.pop(rid, None)
        if batch is not None:
            batch.pending.discard(rid)
            batch.last = max(batch.last, finished)
            self._maybe_sample(batch)

    def lost(self, rid: str) -> None:
        """Refused or dropped: its batch's time says nothing of the link."""
        batch = self.of.pop(rid, None)
        if batch is not None:
            batch.pending.discard(rid)
            batch.spoiled = True

    def _maybe_sample(self, batch: _Batch) -> None:
        if batch.sealed and not batch.pending and not batch.spoiled and batch.last:
            assert batch.layerwise is not None
            self.rule.observe_tail(batch.kv_bytes, batch.last - batch.ended, batch.layerwise)
