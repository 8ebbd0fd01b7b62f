"""Room across gateways: a node's freed room goes to the oldest request it is offered, not to
the gateway that asks most often (docs/architecture.md, "Several gateways").

Each gateway re-offers its waiting requests in rounds; one whose own requests just finished
a pass offers again at once and would take every freed slot before a quieter gateway's next
round. So a node that refuses a gateway's request for lack of room remembers it as that
gateway's claim (its age: how long it has waited at its gateway, `PrefillOffer.waited_ms`, a
duration, so no clocks need agree). While the claim is fresh (its gateway offered it within
`HOLD_S`), an offer of a younger request from another gateway gives way when taking it would
leave too little room for the claim: the claimant's next offer finds the room. A claim ends
when its request is accepted, or when its gateway stops offering it (placed elsewhere, gone).
"""

from __future__ import annotations

from dataclasses import dataclass

HOLD_S = 0.25  # a claim lives this long unrenewed: several of a waiting gateway's rounds


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

    def answered(
        self, gateway: object, rid: str, since: float, tokens: int, accepted: bool, now: float
    ) -> None:
        """A node's answer to `gateway`'s offer: an acceptance ends that request's claim; a
        refusal makes it the gateway's claim if it is older than the one it has."""
        c = self.claims.get(gateway)
        if accepted:
            if c is not None and c.rid == rid:
                del self.claims[gateway]
            return
        if c is not None and c.rid == rid:
            c.seen = now
        elif c is None or since < c.since or now - c.seen > self.hold_s:
            self.claims[gateway] = Claim(rid, since, tokens, now)

    def forget(self, gateway: object) -> None:
        self.claims.pop(gateway, None)
