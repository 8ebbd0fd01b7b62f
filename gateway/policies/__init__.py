"""Placement policies by name (`--scheduler`). Each module of this package defines one policy
and registers it with `@register`; importing the package imports every module, so a new
policy is one new file and nothing else.

    on_demand    P/D-Serve (default): offers by prefill work in hand, nodes accept by batch room
    round_robin  prefill and decode nodes in turn; prefill nodes queue
    jsq          the shortest prefill queue; the decode node with the fewest blocks in use
    kv_aware     Mooncake-style least estimated TTFT (queue + fetch + prefill + transfer), cost
                 model; offered to the nodes near the best estimate, which accept by batch room
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from pdserve.common.costmodel import DEFAULT_PROFILE, CostModel
from pdserve.gateway.policies.base import Need, NodeView, Policy

__all__ = ["Need", "NodeView", "Policy", "make_policy", "names", "register"]

REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"two placement policies are named {cls.name!r}")
    REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    return sorted(REGISTRY)


def make_policy(
    name: str,
    cost_profile: str = DEFAULT_PROFILE,
    decode_fit: str = "spread",
    time_scale: float = 1.0,
) -> Policy:
    if name not in REGISTRY:
        raise ValueError(f"unknown scheduler {name!r}: choose one of {names()}")
    cost = dataclasses.replace(CostModel.named(cost_profile), time_scale=time_scale)
    return REGISTRY[name](cost, decode_fit)


for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")
