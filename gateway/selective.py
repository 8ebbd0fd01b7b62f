"""Selective disaggregation (`--local-prefill`): which requests their decode node prefills
itself, with no prefill node and no KV transfer. Pure: the placer passes what it knows.

Disaggregating a request buys decode streams freedom from its prefill, and costs a hop and
a KV transfer; when the prefill pool is backed up it also costs the wait there. A decode
node prefilling a prompt itself stalls its running streams for as long as that prefill
takes, and for as long as the prompts queued there before it take. So, with P the prompt's
prefill time (the prefill nodes' measured cost per token, else the cost model) and Q that of
the local prefills the node has not done yet (every gateway's, at the same cost per token),
the adaptive rule prefills locally when

    Q + P <= min(stall budget, max(one decode step, prefill-pool wait + KV transfer))

Q is what keeps one placement round (or several gateways) from piling prompts that each
fit alone onto one node: the node prefills its waiting prompts together, up to its step
budget (common/engine/scheduler.py, decode mode).

  one decode step    S, that node's step time now (the cost model at its running batch and
                     their mean context): a prefill no longer than a step costs its streams
                     no more than one step more, so short prompts stay local at any load
  prefill-pool wait  W, how long the request would wait for a prefill node: the prefill
                     work queued at the gateway per node, plus what the least busy prefill
                     node still has in prefill (0 when nothing is queued and a node is idle);
                     with the KV transfer X it is what disaggregating adds to TTFT, so past
                     that, local is faster for this request
  stall budget       how late the node's running streams may see one token: twice the TPOT
                     SLO (`--tpot-slo`), or four decode steps without one

The threshold therefore moves with the measured load: it grows while the prefill pool is
backed up and shrinks as the decode node fills (S grows, and with an SLO, the budget stays).
Other modes: `off` (always disaggregate), `always` (every prompt on its decode node: the
never-disaggregate baseline, on the same nodes) and a number N (local iff the decode node
lacks at most N of the prompt's tokens in its own cache: the fixed threshold of llm-d's and
Dynamo's rules, counted as they count it, on what would have to be computed).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.costmodel import CostModel
from pdserve.gateway.policies import NodeView

MODES = ("off", "adaptive", "always")
STALL_STEPS = 4  # without a TPOT SLO: the stall budget in decode steps
STALL_SLOS = 2.0  # with one: the budget in TPOT SLOs


def parse_mode(text: str) -> str | int:
    """'off' | 'adaptive' | 'always' | a token count."""
    if text in MODES:
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ValueError(f"--local-prefill: {MODES} or a number of tokens, not {text!r}")


@dataclass(frozen=True)
class Decision:
    local: bool
    prefill_s: float  # P
    threshold_s: float  # what Q + P was held against (adaptive), else 0
    wait_s: float  # W
    step_s: float  # S
    queued_s: float = 0.0  # Q

    def fields(self) -> dict[str, float | bool]:
        ms = 1000.0
        return {
            "local": self.local,
            "prefill_ms": round(self.prefill_s * ms, 3),
            "threshold_ms": round(self.threshold_s * ms, 3),
            "wait_ms": round(self.wait_s * ms, 3),
            "step_ms": round(self.step_s * ms, 3),
            "queued_ms": round(self.queued_s * ms, 3),
        }


@dataclass(frozen=True)
class LocalPrefill:
    mode: str | int
    cost: CostModel
    tpot_slo: float = 0.0

    def decide(
        self,
        tokens: int,
        prefill_s: float,
        decode: NodeView,
        prefill: list[NodeView],
        queued_s: float,
    ) -> Decision:
        """`tokens`: the prompt's tokens the decode node lacks in its own cache, `prefill_s`
        their prefill time (measured or modelled); `queued_s`: prefill work waiting at the
        gateway, per prefill node. `decode.in_prefill`: the prompts that node has to prefill
        itself still (gateway/plan.py)."""
        p = prefill_s
        if self.mode in ("off", "always") or isinstance(self.mode, int):
            local = self.mode == "always" or (isinstance(self.mode, int) and tokens <= self.mode)
            return Decision(local, p, 0.0, 0.0, 0.0)
        load = decode.node.load
        running = max(1, load.running)
        context = max(1, load.blocks_in_use * decode.block_size // running)
        step = self.cost.decode_step_seconds([context] * running)
        unit = p / max(1, tokens)
        busy = min((sum(v.in_prefill) for v in prefill), default=None)
        wait = queued_s + (busy or 0) * unit if busy is not None else float("inf")
        budget = STALL_SLOS * self.tpot_slo if self.tpot_slo > 0 else STALL_STEPS * step
        threshold = min(budget, max(step, wait + self.cost.transfer_seconds(tokens)))
        queued = sum(decode.in_prefill) * unit
        return Decision(queued + p <= threshold, p, threshold, wait, step, queued)
