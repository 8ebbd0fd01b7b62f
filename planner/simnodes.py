"""The planner simulation's parts: its configuration, and each node and request as it
keeps them (a node is the engine's own `Scheduler` in its role's mode, sized as the sim
engine sizes its cache)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from pdserve.common.config import EngineConfig
from pdserve.common.costmodel import DEFAULT_PROFILE, CostModel
from pdserve.common.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.common.engine.sequence import Sequence
from pdserve.common.wire.protocol import NodeInfo
from pdserve.gateway.admission import Waiting
from pdserve.gateway.requests import GatewayRequest
from pdserve.loadgen.metrics import RequestRecord
from pdserve.loadgen.workloads import RequestSpec
from pdserve.planner.decode_run import DecodeRun

FINGERPRINT = "sim"
_ENGINE = EngineConfig(engine="sim")  # defaults only


@dataclass(frozen=True)
class SimConfig:
    prefill: int
    decode: int
    profile: str = DEFAULT_PROFILE
    prefill_max_batch: int = _ENGINE.max_batch  # the serving commands' defaults
    decode_max_batch: int = 1 << 30  # a decode node runs every sequence it holds
    max_batch_tokens: int = _ENGINE.max_batch_tokens
    chunk_size: int = 0
    num_kv_blocks: int = 0  # 0: what the profile's memory holds
    prefix_caching: bool = True
    policy: str = "on_demand"
    decode_placement: str = "spread"
    admission: str = "spf"
    admission_max_wait: float = 3.0
    admission_aging: float = 0.5
    ttft_slo: float = math.inf  # deadline order: arrival + this (the gateway's --ttft-slo)
    step_overhead_s: float = 0.0  # added to every step (the real nodes' loop, if measured)
    decode_runs: bool = True  # step decode nodes in runs between events (same results)


@dataclass(eq=False)
class SimNode:
    info: NodeInfo
    sched: Scheduler
    index: int  # its place in the cluster (nodes start steps in this order)
    busy: bool = False
    out: SchedulerOutput | None = None
    run: DecodeRun | None = None
    gen: int = 0  # its current step's or run's number: a cut run's old end is stale
    peak_batch: int = 0  # the most sequences its batch ever held (prefill)


@dataclass(eq=False)
class SimRequest:
    spec: RequestSpec
    index: int
    req: GatewayRequest
    record: RequestRecord
    entry: Waiting
    prefill: str = ""  # node ids of its current attempt
    decode: str = ""
    reserved: list[int] = field(default_factory=list)  # decode blocks held for its KV
    kept: str | None = None  # the prefill node kept free for it (gateway/placement.py)
    seq: Sequence | None = None


def make_node(
    cfg: SimConfig, cost: CostModel, role: Literal["prefill", "decode"], node_id: str, index: int
) -> SimNode:
    ecfg = EngineConfig(
        engine="sim",
        sim_profile=cfg.profile,
        max_batch=cfg.prefill_max_batch if role == "prefill" else cfg.decode_max_batch,
        max_batch_tokens=cfg.max_batch_tokens if role == "prefill" else 1 << 30,
        chunk_size=cfg.chunk_size if role == "prefill" else 0,
        # a decode node's registered blocks matter only to the cluster's prefix index,
        # which the simulation has not (placement is cache-blind): nothing reads them
        prefix_caching="on" if cfg.prefix_caching and role == "prefill" else "off",
    )
    block = ecfg.block_size
    blocks = cfg.num_kv_blocks or max(1, cost.kv_capacity_tokens() // block)
    model_id = f"sim-{cfg.profile}"
    sched = Scheduler(SchedulerConfig.of(ecfg, blocks, block, role, model_id))
    info = NodeInfo(
        node_id=node_id,
        role=role,
        data_address="",
        host_id="sim",
        model_id=model_id,
        dtype="sim",
        tokenizer_fingerprint=FINGERPRINT,
        kv_layout="sim",
        block_size=block,
        num_blocks=blocks,
        max_batch=ecfg.max_batch,
        max_batch_tokens=ecfg.max_batch_tokens,
        max_model_len=sched.fit(cost.model.max_context),  # as a real node reports it
    )
    return SimNode(info, sched, index)
