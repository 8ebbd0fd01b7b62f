"""GPU x model profiles and the step-time formulas. Pure Python, no torch.

Used by the simulated engine (how long to wait), by the `kv_aware` router (estimated TTFT)
and by the planner. The model is a roofline per engine step:

    step time = max(FLOPs / (peak_flops x mfu), bytes / (mem_bw x bw_eff)) + step_overhead

    FLOPs = 2 x params x tokens                       (linear layers, every new token)
          + 4 x layers x q_dim x sum(new x ctx_avg)   (QK^T and PV, causal average context)
    bytes = weight bytes                              (read once per step)
          + kv_bytes_per_token x (context read + new tokens written)

Prefill of a long prompt is compute-bound (the FLOP term wins); a decode step of a modest
batch is bandwidth-bound (the weights dominate the bytes). KV transfer time = bytes /
link bandwidth + latency. The efficiencies are typical achieved fractions, not peaks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.common.model.config import ModelConfig


@dataclass(frozen=True)
class GpuProfile:
    name: str
    peak_flops: float  # dense BF16 tensor FLOP/s
    mem_bw: float  # HBM bytes/s
    hbm_bytes: float
    source: str
    mfu: float = 0.55  # achieved fraction of peak in prefill GEMMs
    bw_eff: float = 0.80  # achieved fraction of HBM bandwidth in decode
    step_overhead_s: float = 0.003  # scheduling, launches, sampling per engine step
    link_bw: float = 50e9  # KV transfer network, bytes/s: one 400 Gb/s RDMA NIC per GPU
    link_latency_s: float = 20e-6


@dataclass(frozen=True)
class ModelProfile:
    name: str
    params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    bytes_per_param: int
    max_context: int
    source: str

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    def layout(self) -> ModelConfig:
        """The shape a node registers (KV layout, context) for this simulated model."""
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=0,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=self.max_context,
            tie_word_embeddings=False,
        )


GPUS = {
    "h100": GpuProfile(
        "H100-SXM5-80GB",
        989e12,
        3.35e12,
        80e9,
        "NVIDIA H100 Tensor Core GPU datasheet: 989 TFLOPS dense BF16, 3.35 TB/s HBM3",
    ),
    "h200": GpuProfile(
        "H200-SXM-141GB",
        989e12,
        4.8e12,
        141e9,
        "NVIDIA H200 Tensor Core GPU datasheet: 989 TFLOPS dense BF16, 4.8 TB/s HBM3e",
    ),
    "a100": GpuProfile(
        "A100-SXM4-80GB",
        312e12,
        2.039e12,
        80e9,
        "NVIDIA A100 datasheet: 312 TFLOPS dense BF16, 2,039 GB/s HBM2e",
        link_bw=25e9,
    ),
}
MODELS = {
    "llama3.1-8b": ModelProfile(
        "Llama-3.1-8B",
        8.03e9,
        32,
        4096,
        32,
        8,
        128,
        128256,
        2,
        131072,
        "Meta Llama 3.1 model card / config.json: 8.03B params, 32 layers, 8 KV heads x 128",
    ),
    "llama3.1-70b": ModelProfile(
        "Llama-3.1-70B",
        70.6e9,
        80,
        8192,
        64,
        8,
        128,
        128256,
        2,
        131072,
        "Meta Llama 3.1 model card / config.json: 70.6B params, 80 layers, 8 KV heads x 128",
    ),
}
# the profile every command and study uses unless told otherwise
DEFAULT_PROFILE = "h100-llama3.1-8b"


@dataclass(frozen=True)
class CostModel:
    gpu: GpuProfile
    model: ModelProfile
    # every time it predicts, multiplied: 1 on the GPU modelled; S for a sim cluster whose
    # engines run at --sim-time-scale S (the gateway's rules then speak its clock)
    time_scale: float = 1.0

    @classmethod
    def named(cls, profile: str) -> CostModel:
        """'h100-llama3.1-8b' -> H100 x Llama-3.1-8B."""
        gpu, _, model = profile.lower().partition("-")
        if gpu not in GPUS or model not in MODELS:
            raise ValueError(
                f"unknown sim profile {profile!r}: use GPU-MODEL with GPU in {sorted(GPUS)} "
                f"and MODEL in {sorted(MODELS)}"
            )
        return cls(GPUS[gpu], MODELS[model])

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        free = self.gpu.hbm_bytes * memory_fraction - self.model.weight_bytes
        return max(0, int(free // self.model.kv_bytes_per_token))

    def step_seconds(
        self, prefills: Sequence[tuple[int, int]] = (), decode_contexts: Sequence[int] = ()
    ) -> float:
        """One engine step: prefills as (new tokens, tokens already cached), and the
        context length of every decoding sequence. 0 for an empty step."""
        if not prefills and not decode_contexts:
            return 0.0
        return self._roofline(
            sum(n for n, _ in prefills) + len(decode_contexts),
            sum(n * (cached + (n + 1) / 2) for n, cached in prefills) + sum(decode_contexts),
            sum(cached for _, cached in prefills) + sum(decode_contexts),
        )

    def decode_batch_seconds(self, batch: int, total_context: int) -> float:
        """A decode step of `batch` sequences whose contexts sum to `total_context`: the
        same float as `step_seconds((), contexts)` (the planner's decode runs rely on it)."""
        if batch <= 0:
            return 0.0
        return self._roofline(batch, total_context, total_context)

    def _roofline(self, new_tokens: int, attn_work: float, kv_read: int) -> float:
        m, g = self.model, self.gpu
        q_dim = m.num_heads * m.head_dim
        flops = 2 * m.params * new_tokens + 4 * m.num_layers * q_dim * attn_work
        bytes_moved = m.weight_bytes + m.kv_bytes_per_token * (kv_read + new_tokens)
        compute = flops / (g.peak_flops * g.mfu)
        memory = bytes_moved / (g.mem_bw * g.bw_eff)
        return (max(compute, memory) + g.step_overhead_s) * self.time_scale

    def prefill_compute_seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """The FLOP term alone of prefilling these tokens: what a prompt adds to any step it
        shares (a batched step lasts at least the sum of its prompts' terms)."""
        m, g = self.model, self.gpu
        q_dim = m.num_heads * m.head_dim
        attn_work = new_tokens * (cached_tokens + (new_tokens + 1) / 2)
        flops = 2 * m.params * new_tokens + 4 * m.num_layers * q_dim * attn_work
        return flops / (g.peak_flops * g.mfu) * self.time_scale

    def prefill_seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.step_seconds([(new_tokens, cached_tokens)])

    def decode_step_seconds(self, contexts: Sequence[int]) -> float:
        return self.step_seconds((), contexts)

    def transfer_seconds(self, num_tokens: int) -> float:
        link = (
            self.gpu.link_latency_s + num_tokens * self.model.kv_bytes_per_token / self.gpu.link_bw
        )
        return link * self.time_scale
