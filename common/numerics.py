"""`--dtype auto`: which dtype this device runs best. Torch-free (the config imports it, and
the gateway imports the config)."""

from __future__ import annotations

# CPU features that run bfloat16 matmuls natively (x86: AVX512-BF16 or AMX; arm64: BF16).
# Without them torch emulates bf16 and runs ~10x slower than float32 (measured on a 2-core
# AMD EPYC without AVX512-BF16: prefill 71 tok/s in bf16 against several hundred in fp32).
NATIVE_BF16 = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags() -> set[str]:
    """This CPU's feature flags, from /proc/cpuinfo (x86 `flags`, arm64 `Features`)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def choose_dtype(device: str, flags: set[str] | None = None) -> tuple[str, str]:
    """`--dtype auto`: (dtype, why). CUDA: bfloat16; CPU: bfloat16 only with native bf16
    instructions, else float32."""
    if device.startswith("cuda"):
        return "bfloat16", f"{device}: GPUs run bfloat16 natively"
    have = (cpu_flags() if flags is None else flags) & set(NATIVE_BF16)
    if have:
        return "bfloat16", f"this CPU has native bfloat16 ({', '.join(sorted(have))})"
    return (
        "float32",
        "this CPU lacks native bfloat16 (no avx512_bf16/amx_bf16): bf16 is ~10x slower",
    )
