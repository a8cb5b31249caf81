"""x86-64 instruction-set tiers: which ones this CPU runs, and how the native library is
built for each.

    avx2         AVX2 + FMA + F16C: the x86-64 baseline of every server CPU since 2013
    avx512       + AVX-512 F/BW/VL/DQ (Skylake-SP to Ice Lake): no bfloat16 dot product
    avx512_bf16  + AVX512-BF16 and VNNI (Cooper Lake, Zen 4): vdpbf16ps
    amx          + AMX tiles (Sapphire Rapids and later)

Each tier runs everything the ones before it do, so a machine can build and test every tier
up to its own. Imports neither torch nor the project: the configuration resolves `--dtype
auto` from here before any actor loads torch.
"""
from __future__ import annotations

import functools

TIERS = ("avx2", "avx512", "avx512_bf16", "amx")       # lowest first
# What --kernels takes (kernels/ops.py builds them): "cpu" is the best tier this CPU runs.
BACKENDS = ("auto", "torch", "cpu", *TIERS, "triton")

# /proc/cpuinfo flags a tier needs, on top of the tier before it.
_NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16", "avx512_vnni"),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}
# Compiler flags that build a tier, on top of the tier before it.
_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    "avx512_bf16": ("-mavx512bf16", "-mavx512vnni"),
    "amx": ("-mamx-tile", "-mamx-bf16", "-mamx-int8"),
}


def _upto(tier: str) -> tuple[str, ...]:
    if tier not in TIERS:
        raise ValueError(f"unknown CPU tier {tier!r} (one of {', '.join(TIERS)})")
    return TIERS[:TIERS.index(tier) + 1]


def compiler_flags(tier: str) -> list[str]:
    return [flag for t in _upto(tier) for flag in _FLAGS[t]]


def has_bf16_dot(tier: str | None) -> bool:
    """Whether the tier multiplies bfloat16 in hardware. Without it, bfloat16 arithmetic is
    emulated (torch's own bfloat16 matmul runs below 1 GFLOP/s there): float32 is faster."""
    return tier in ("avx512_bf16", "amx")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runnable(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The tiers this CPU (or one with `flags`) runs, lowest first; () off x86-64."""
    flags = cpu_flags() if flags is None else flags
    out = []
    for tier in TIERS:
        if not all(f in flags for f in _NEEDS[tier]):
            break
        out.append(tier)
    return tuple(out)


def best() -> str | None:
    tiers = runnable()
    return tiers[-1] if tiers else None


def resolve(requested: str) -> str:
    """A tier name this CPU runs: "native" (or "cpu") is the best one; a named tier must be
    runnable here."""
    if requested in ("native", "cpu"):
        tier = best()
        if tier is None:
            raise ValueError("this CPU runs none of the native tiers "
                             f"({', '.join(TIERS)}): use --kernels torch")
        return tier
    if requested not in runnable():
        raise ValueError(f"--kernels {requested}: this CPU runs "
                         f"{', '.join(runnable()) or 'no native tier'}")
    return requested
