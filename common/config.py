"""Frozen configuration dataclasses, built once from CLI flags and PDSERVE_* variables.

Each field is one concept with one flag (`--max-batch`) and one variable
(`PDSERVE_MAX_BATCH`). The default lives on the dataclass; common/flags.py turns the fields
into options, so every command that shares a concept shares its definition. Validation
happens in `__post_init__` with messages that say what to change.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass
from typing import Literal

from pdserve.common.costmodel import DEFAULT_PROFILE
from pdserve.common.errors import ConfigError
from pdserve.common.flags import flag
from pdserve.common.kv_backends import CHOICES as KV_BACKENDS
from pdserve.common.logs import cut
from pdserve.common.node_id import id_problem
from pdserve.common.numerics import choose_dtype
from pdserve.common.quant_choice import auto_quantization


@dataclass(frozen=True)
class EngineConfig:
    """What one engine (torch or sim) needs: model, numerics, KV cache and batch limits."""

    model: str | None = flag(None, "GGUF file or Hugging Face folder; unset = embedded SmolLM2")
    engine: Literal["torch", "sim"] = flag("torch", "real model (torch) or cost-model simulation")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = flag(
        "float32",
        "weights and KV dtype; auto = bfloat16 on CUDA and on CPUs with native bf16, else float32",
    )
    device: str = flag("cpu", "torch device: cpu, cuda, cuda:1, cuda:auto (one per replica)")
    block_size: int = flag(16, "tokens per KV block")
    num_kv_blocks: int = flag(0, "KV blocks in the cache; 0 = derive from --kv-cache-gb")
    kv_cache_gb: float = flag(1.0, "KV cache size in GiB when --num-kv-blocks is 0")
    max_batch: int = flag(32, "most sequences in one engine step (bp in P/D-Serve)")
    max_batch_tokens: int = flag(8192, "most prompt tokens in one batch")
    prefill_ahead: Literal["on", "off"] = flag(
        "off",
        "on-demand prefill nodes accept the next batch while a pass runs (bounded by the "
        "same limits), so an accepted prompt waits at most the rest of that pass",
    )
    prefill_pass_tokens: int = flag(
        1024,
        "on-demand prefill nodes run the prompts they hold shortest first, several in one "
        "pass only up to this many tokens (past it a pass is compute-bound); 0 = arrival "
        "order, passes up to --max-batch-tokens",
    )
    chunk_size: int = flag(0, "chunked prefill: token budget per step; 0 = off")
    max_model_len: int = flag(0, "context limit; 0 = the model's own")
    num_threads: int = flag(0, "torch CPU threads; 0 = torch's default (up: usable cores / nodes)")
    gpu_offset: int = flag(0, "cuda:auto: first GPU, +1 per replica (up: per node, all roles)")
    watermark: float = flag(0.01, "fraction of KV blocks kept free for running sequences to grow")
    prefix_caching: Literal["on", "off"] = flag(
        "on", "reuse the KV of cached prompt prefixes (full blocks, LRU among unused ones)"
    )
    kv_host_cache_gb: float = flag(
        0.0, "prefix cache tier: GiB of host memory for blocks evicted from the KV cache"
    )
    kv_disk_cache_gb: float = flag(
        0.0, "prefix cache tier: GiB on disk for what the host tier evicts"
    )
    kv_disk_cache_dir: str = flag(
        "",
        "prefix cache tier: a directory, holding a folder per node id (default: a "
        "per-process one in the pdserve cache)",
    )
    quantization: Literal["auto", "none", "int8", "int4"] = flag(
        "auto",
        "weights (CPU kernels): int4 keeps a GGUF's Q4_0/Q4_1 blocks (and a Q8_0 LM head) "
        "quantized; int8 quantizes any model's projections at load, per output channel; none "
        "dequantizes; auto = int4 where it pays: a GGUF model on CPU in bfloat16, or in "
        "float32 where the C kernel beats dense in a measurement cached per CPU",
    )
    cpu_kernels: Literal["auto", "off"] = flag(
        "auto",
        "fused C kernels for a CPU engine's small ops (norms, RoPE + KV write, decode "
        "attention, SiLU), compiled for this CPU at first start with its C compiler, and bf16 "
        "weights packed once in oneDNN's layout; auto = use them where they build (else eager "
        "torch ops, logged), off = eager torch ops and plain weights",
    )
    engine_priority: Literal["normal", "idle"] = flag(
        "normal",
        "idle: the engine thread and its OpenMP workers run under SCHED_IDLE (Linux), on CPU "
        "time the host's other processes leave; the node's event loop (tokens, KV pushes, "
        "heartbeats) keeps normal priority. pdserve up --prefill-priority idle sets it",
    )
    kv_shared_cache: Literal["auto", "on", "off"] = flag(
        "auto",
        "keep the KV cache in /dev/shm so a prefill node on this host writes KV straight into "
        "it (shm_direct: one copy); auto = on CPU when /dev/shm has room",
    )
    sim_profile: str = flag(DEFAULT_PROFILE, "sim engine: GPU x model profile (costmodel)")
    sim_kv_scale: float = flag(1 / 16, "sim engine: KV payload size relative to the real model")
    sim_time_scale: float = flag(1.0, "sim engine: stretch modelled time by this factor")

    @property
    def numerics(self) -> str:
        """What the KV depends on besides the model: dtype, and the weights' quantization
        (nodes exchanging KV or prefix hashes must agree on it)."""
        if self.engine != "torch":
            return "sim"
        return self.dtype if self.quantization == "none" else f"{self.dtype}+{self.quantization}"

    def __post_init__(self) -> None:
        _finite(self)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two, got {self.block_size}")
        if self.max_batch < 1:
            raise ConfigError(f"--max-batch must be at least 1, got {self.max_batch}")
        if self.max_batch_tokens < self.block_size:
            raise ConfigError(f"--max-batch-tokens must be >= --block-size ({self.block_size})")
        counts = ("chunk_size", "num_kv_blocks", "max_model_len", "num_threads", "gpu_offset",
                  "prefill_pass_tokens", "kv_host_cache_gb", "kv_disk_cache_gb")  # fmt: skip
        for name in (n for n in counts if getattr(self, n) < 0):  # 0: off, or the default rule
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, not {getattr(self, name)}")
        if not re.fullmatch(r"cpu|cuda(:\d+|:auto)?", self.device):  # torch's error: a traceback
            raise ConfigError(f"--device: cpu, cuda, cuda:N or cuda:auto, not {self.device!r}")
        if 0 < self.chunk_size < self.max_batch:  # as vLLM: decodes take a step's budget first
            raise ConfigError(
                f"--chunk-size must be at least --max-batch ({self.max_batch}): "
                "a smaller budget leaves running streams without a token"
            )
        if self.chunk_size == 0 and self.max_batch_tokens < self.max_batch:  # the same budget
            raise ConfigError(
                f"--max-batch-tokens must be at least --max-batch ({self.max_batch}) without "
                "--chunk-size: a smaller budget leaves running streams without a token"
            )
        if self.kv_cache_gb <= 0:
            raise ConfigError(f"--kv-cache-gb must be positive, got {self.kv_cache_gb}")
        if not 0 <= self.watermark < 0.5:
            raise ConfigError(f"--watermark must be in [0, 0.5), got {self.watermark}")
        if self.sim_kv_scale <= 0 or self.sim_time_scale <= 0:
            raise ConfigError("--sim-kv-scale and --sim-time-scale must be positive")
        if self.dtype == "auto":  # resolved once, here: every consumer sees the real dtype
            chosen, why = choose_dtype(self.device)
            logging.getLogger(__name__).info("--dtype auto: %s (%s)", chosen, why)
            object.__setattr__(self, "dtype", chosen)
        if self.quantization == "auto":  # resolved here too: nodes compare the result
            chosen = auto_quantization(self.model, self.engine, self.device, self.dtype,
                                       self.cpu_kernels)  # fmt: skip
            object.__setattr__(self, "quantization", chosen)
        if self.engine == "torch" and self.device == "cpu" and self.dtype == "float16":
            raise ConfigError("float16 on CPU is slow and inexact: use float32 or bfloat16")


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway process: HTTP front end, node registry and placement."""

    model: str | None = flag(None, "tokenizer source; must match the nodes' model")
    host: str = flag("127.0.0.1", "HTTP listen address (0.0.0.0 in containers)")
    port: int = flag(8000, "HTTP port")
    control_port: int = flag(8001, "ZeroMQ port nodes register and heartbeat on")
    tokens_port: int = flag(8002, "ZeroMQ port decode nodes push tokens to")
    advertise_host: str = flag(
        "", "host name nodes use for the tokens port; empty = the host they registered through"
    )
    scheduler: Literal["on_demand", "round_robin", "jsq", "kv_aware"] = flag(
        "on_demand", "placement policy (gateway/policies/)"
    )
    decode_placement: Literal["spread", "best_fit", "length_aware"] = flag(
        "spread",
        "decode node for a request (on_demand, kv_aware): the most free KV, the tightest fit "
        "for its final KV (prompt + max_tokens), or long requests together then best fit",
    )
    cost_profile: str = flag(DEFAULT_PROFILE, "kv_aware: GPU x model profile of its estimates")
    cost_time_scale: float = flag(
        1.0,
        "multiply the cost model's times (kv_aware, sizing, local prefill): S for sim engines "
        "at --sim-time-scale S (pdserve up sets it)",
    )
    cache_aware_routing: Literal["on", "off"] = flag(
        "on",
        "place by the cluster prefix index (cached overlap, fetch hints, the decode node "
        "holding a conversation); off: cache-blind placement, the nodes' caches still work",
    )
    admission: Literal["fifo", "spf", "deadline"] = flag(
        "spf",
        "order in which waiting requests make offers: arrival, shortest prefill first (aged), "
        "or earliest TTFT deadline first among those that can still meet it",
    )
    admission_max_wait: float = flag(
        3.0, "seconds after which a waiting request goes first whatever the order (no starving)"
    )
    admission_aging: float = flag(0.5, "spf: seconds of prefill forgiven per second waited")
    ttft_slo: float = flag(0.0, "seconds to the first token (deadline order); 0: none")
    tpot_slo: float = flag(
        0.0, "seconds per output token the decode pool's desired size keeps to; 0: KV only"
    )
    sizing_window: float = flag(
        60.0, "seconds of load the desired-replicas signal (pdserve:desired_replicas) weighs"
    )
    reject_ttft: float = flag(
        0.0,
        "answer 503 + Retry-After at once when a new request's predicted TTFT (its prefill + "
        "the prefill work waiting, per prefill node) exceeds this many seconds; 0: off",
    )
    placement_timeout: float = flag(30.0, "seconds to find a prefill node before 503")
    max_waiting: int = flag(
        4096, "requests waiting at the gateway for a prefill node at most; more get 429"
    )
    offer_timeout: float = flag(2.0, "seconds a prefill node has to answer an offer")
    heartbeat_timeout: float = flag(2.0, "seconds of silence before a node is dropped")
    progress_timeout: float = flag(
        120.0,
        "seconds a busy node may go without a token before it is dropped as hung (longer "
        "than the longest prefill pass), and a request's KV may take to reach its decode node",
    )
    max_replacements: int = flag(
        3,
        "times one request may lose its node (death, failure) before a 503; preemptions "
        "and retries for room do not count",
    )
    local_prefill: str = flag(
        "off",
        "selective disaggregation: which requests their decode node prefills itself: off "
        "(none), adaptive (by prefill time against the prefill pool's wait and the decode "
        "node's step; gateway/selective.py), always, or a number N (local when the decode "
        "node lacks at most N of the prompt's tokens in its own cache)",
    )
    role_switching: Literal["on", "off"] = flag(
        "off",
        "switch a node between prefill and decode when one pool is short and the other has "
        "one to spare (the desired-replicas rule), with hysteresis (gateway/roles.py)",
    )
    switch_hold: float = flag(5.0, "seconds an imbalance must last before a role switch")
    switch_dwell: float = flag(30.0, "seconds a node keeps a role before it may switch again")
    rebalance: float = flag(
        0.0,
        "move running sequences with their KV off a decode node whose cache is more than this "
        "share in use (0.9, say) to one at least 0.25 emptier, before it must preempt; 0: off",
    )
    stream_gap_timeout: float = flag(
        10.0, "seconds a token may wait for an earlier one before the attempt is re-placed"
    )
    api_key: str = flag("", "require 'Authorization: Bearer KEY' when set")
    allowed_origins: str = flag(
        "*",
        "origins whose web pages may call the API from a browser (CORS), comma-separated; "
        "* = any; empty = none",
    )
    cluster_key: str = flag(
        "", "key file (pdserve keygen) authenticating node traffic (CurveZMQ); empty: none"
    )
    max_body_bytes: int = flag(8 * 2**20, "largest accepted request body")
    body_timeout: float = flag(
        60.0,
        "seconds a request body may go without a byte before the gateway answers 408 "
        "(a client that stalls mid-body holds no handler: nginx's client_body_timeout)",
    )
    served_model_name: str = flag("", "model name clients use; default: the nodes' model id")
    resume_timeout: float = flag(
        5.0,
        "seconds a resumed stream (GET /v1/streams/ID) looks for the node holding it (the "
        "nodes take their --heartbeat-timeout to see that its gateway is gone)",
    )
    send_timeout: float = flag(
        60.0,
        "seconds a stream's chunk may wait to be taken by its client before the client counts "
        "as gone (a vanished peer sends no FIN: nginx's send_timeout)",
    )
    max_resuming: int = flag(
        1024, "streams looked for at once (GET /v1/streams/ID) at most; more get 429"
    )

    def __post_init__(self) -> None:
        _finite(self)
        timeouts = ("placement_timeout", "offer_timeout", "heartbeat_timeout", "send_timeout",
                    "stream_gap_timeout", "progress_timeout", "body_timeout")  # fmt: skip
        for name in timeouts:
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        if not 0 <= self.rebalance < 1:
            raise ConfigError(
                f"--rebalance is a share of the KV cache in [0, 1), got {self.rebalance}"
            )
        for name in ("max_waiting", "max_resuming"):
            if getattr(self, name) < 1:
                flag_name = f"--{name.replace('_', '-')}"
                raise ConfigError(f"{flag_name} must be at least 1, got {getattr(self, name)}")
        if not (
            self.local_prefill in ("off", "adaptive", "always")
            or (self.local_prefill.isdigit() and int(self.local_prefill) > 0)
        ):
            raise ConfigError(
                f"--local-prefill: off, adaptive, always or a token count: {self.local_prefill!r}"
            )
        if self.switch_hold < 0 or self.switch_dwell < 0:
            raise ConfigError("--switch-hold and --switch-dwell must not be negative")
        if self.cost_time_scale <= 0:
            raise ConfigError("--cost-time-scale must be positive")
        if self.sizing_window <= 0:
            raise ConfigError("--sizing-window must be positive")
        slos = ("admission_max_wait", "admission_aging", "ttft_slo", "tpot_slo", "reject_ttft")
        for name in slos:
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must not be negative")
        if len({self.port, self.control_port, self.tokens_port}) != 3:
            raise ConfigError("--port, --control-port and --tokens-port must differ")


@dataclass(frozen=True)
class NodeConfig:
    """What a prefill or decode node needs beyond its engine."""

    gateway: str = flag(
        "tcp://127.0.0.1:8001",
        "the gateway's control address; several gateways: repeat the flag or separate by "
        "commas (a host name resolving to several addresses is one gateway each)",
        repeat=True,
    )
    node_id: str = flag("", "unique node id, at most 64 of A-Za-z0-9._-; default ROLE-HOST-PID")
    advertise_host: str = flag(
        "", "host name peers use to reach this node; empty = the address facing the gateway"
    )
    metrics_port: int = flag(0, "HTTP port serving this node's /metrics and /health; 0 = off")
    metrics_host: str = flag("127.0.0.1", "listen address of --metrics-port (containers: 0.0.0.0)")
    data_port: int = flag(0, "KV data socket port (KV and prefix fetches arrive); 0 = any free")
    heartbeat_interval: float = flag(0.5, "seconds between heartbeats")
    heartbeat_timeout: float = flag(2.0, "seconds without a gateway reply before re-registering")
    kv_transfer_timeout: float = flag(
        10.0, "decode: free a transfer whose frames make no progress this long (once they flow)"
    )
    orphan_grace: float = flag(
        10.0,
        "seconds a node keeps the requests of a gateway that went silent (decoding on) for "
        "another gateway to adopt when their clients resume; then they are freed",
    )
    drain_timeout: float = flag(30.0, "seconds a draining node finishes work before handing back")
    step_timeout: float = flag(
        120.0,
        "seconds one engine step may run before the node counts itself hung: /health and "
        "/live answer 503, and a gateway that dropped it is not rejoined until the step ends",
    )
    drain_migrate: Literal["on", "off"] = flag(
        "on",
        "decode: a draining node moves its running sequences with their KV to other decode "
        "nodes (live migration); off: it finishes them, handing back at --drain-timeout",
    )
    kv_backend: str = flag(
        "auto",
        "KV transfer: auto (on one host cuda_ipc or shm_direct where both caches allow, else "
        "shm; between hosts tcp; zmq where nothing else can), or one by name: zmq, tcp, shm, "
        "shm_direct, cuda_ipc, ucx",
    )
    kv_tcp_port: int = flag(0, "decode: port of the in-place TCP KV listener; 0 = any free")
    cluster_key: str = flag(
        "", "key file (pdserve keygen) authenticating node traffic (CurveZMQ); empty: none"
    )
    kv_fetch: Literal["on", "off"] = flag(
        "on",
        "prefill: fetch prefix blocks another node's cache holds (the gateway's hint) when "
        "that is estimated faster than computing them",
    )
    layerwise: Literal["auto", "on", "off", "threshold"] = flag(
        "auto",
        "prefill: send KV layer by layer during the pass? auto = whichever this node measures "
        "ready sooner (prefill_node/layerwise.py); threshold = by --layerwise-min-tokens",
    )
    layerwise_min_tokens: int = flag(
        768, "prefill: layer-wise from this prompt length on (threshold; auto until measured)"
    )

    def __post_init__(self) -> None:
        _finite(self)
        for address in self.gateway.split(","):
            address = address.strip()
            host, _, port = address.removeprefix("tcp://").rpartition(":")
            # an IPv6 host in brackets (tcp://[::1]:8001): bare, where its port starts is a guess
            bare_ipv6 = ":" in host and not host.startswith("[")
            tcp_ok = host and not bare_ipv6 and port.isdigit() and 0 < int(port) < 65536
            if not (address.startswith("ipc://") or (address.startswith("tcp://") and tcp_ok)):
                raise ConfigError(f"--gateway must be a ZeroMQ address like tcp://HOST:PORT "
                                  f"(IPv6: tcp://[::1]:PORT), got {address!r}")  # fmt: skip
        if self.heartbeat_interval <= 0 or self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError("--heartbeat-timeout must exceed --heartbeat-interval (> 0)")
        if self.step_timeout <= 0:
            raise ConfigError("--step-timeout must be > 0")
        if self.node_id and (problem := id_problem(self.node_id)) is not None:
            raise ConfigError(f"--node-id {cut(self.node_id)!r}: {problem}")
        if self.kv_backend not in KV_BACKENDS:
            raise ConfigError(
                f"--kv-backend {self.kv_backend!r}: choose one of {list(KV_BACKENDS)}"
            )


def _finite(cfg: object) -> None:
    """NaN passes every `<= 0` check (a NaN heartbeat timeout never expires a node)."""
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
