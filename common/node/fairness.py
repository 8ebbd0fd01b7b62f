"""Room across gateways: a node's freed room goes to the oldest request it is offered, not to
the gateway that asks most often (docs/architecture.md, "Several gateways").

Each gateway re-offers its waiting requests in rounds; one whose own requests just finished
a pass offers again at once and would take every freed slot before a quieter gateway's next
round. So a node that refuses a gateway's request for lack of room remembers it as that
gateway's claim (its age: how long it has waited at its gateway, `PrefillOffer.waited_ms`, a
duration, so no clocks need agree; a gateway's claim is its last refused offer). While the
claim is fresh (its gateway offered it within `HOLD_S`), an offer of a younger request from
another gateway gives way when taking it would leave too little room for the claim: the
claimant's next offer finds the room. A claim ends when its request is accepted, when its
gateway offers another, or when it stops offering (placed elsewhere, gone).
"""

from __future__ import annotations

from dataclasses import dataclass

# a claim lives this long unrenewed: three of a waiting gateway's rounds (20 ms apart). A
# claim whose request was placed on another node is no longer offered here: held longer,
# it would keep this node's room idle for nobody (measured: 8 gateways, TTFT p50 x5 at 250 ms)
HOLD_S = 0.06
STALE = "stale view"


@dataclass
class Claim:
    rid: str
    since: float  # the request's arrival at its gateway, in this node's clock
    tokens: int  # its prompt
    seen: float  # last offered


@dataclass(frozen=True)
class Room:
    """What the node would take now: the longest prompt, and free batch slots."""

    tokens: int
    slots: int


class Fairness:
    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self.claims: dict[object, Claim] = {}  # by gateway (its link): its oldest refused

    def gives_way(
        self, gateway: object, since: float, tokens: int, room: Room, now: float
    ) -> Claim | None:
        """The claim an offer (arrived `since`, `tokens` long, from `gateway`) gives way to:
        another gateway's older request that fits the room now but would not after this."""
        for key, c in self.claims.items():
            if key is gateway or now - c.seen > self.hold_s or c.since >= since:
                continue
            fits_now = c.tokens <= room.tokens and room.slots >= 1
            fits_after = c.tokens <= room.tokens - tokens and room.slots >= 2
            if fits_now and not fits_after:
                return c
        return None

    def refusal(
        self, gateway: object, since: float, tokens: int, room: Room, now: float,
        believed: int, actual: int,
    ) -> tuple[str, int] | None:  # fmt: skip
        """Why the node refuses an offer before its role sees it, and the room to say, or
        None. A stale view: its gateway believed the node had less of the other gateways'
        prefill work (`believed` prompt tokens, -1: no belief) than it has (`actual`). Their
        acceptances are not broadcast: the offering gateway learns them from the Reject's
        `foreign` and plans again, rather than the node taking a request that would wait for
        a pass its gateway did not know of. Else: room kept for an older claim."""
        if 0 <= believed < actual:
            return STALE, room.tokens
        if self.gives_way(gateway, since, tokens, room, now) is not None:
            return "room kept for an older request of another gateway", 0
        return None

    def answered(
        self, gateway: object, rid: str, since: float, tokens: int, accepted: bool, now: float
    ) -> None:
        """A node's answer to `gateway`'s offer: an acceptance ends that request's claim; a
        refusal makes it the gateway's claim. A gateway's round offers a node its waiting
        requests in its admission order and stops at the first refusal, so its last refused
        offer is the one it wants here most (the one before was placed, or comes later)."""
        c = self.claims.get(gateway)
        if accepted:
            if c is not None and c.rid == rid:
                del self.claims[gateway]
            return
        self.claims[gateway] = Claim(rid, since, tokens, now)

    def forget(self, gateway: object) -> None:
        self.claims.pop(gateway, None)
