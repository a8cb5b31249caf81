"""x86-64 instruction-set tiers: which ones this CPU runs, and how the native library is
built for each.

    avx2         AVX2 + FMA + F16C: the x86-64 baseline of every server CPU since 2013
    avx512       + AVX-512 F/BW/VL/DQ (Skylake-SP to Ice Lake): no bfloat16 dot product
    avx512_bf16  + AVX512-BF16 and VNNI (Cooper Lake, Zen 4, Sapphire Rapids): vdpbf16ps

Each tier runs everything the ones before it do, so a machine can build and test every tier
up to its own. There is no AMX tier: it was the avx512_bf16 build with the AMX flags and no
kernel of its own, so it was folded into avx512_bf16 (an AMX machine runs that tier);
`--kernels amx` is still accepted as another name for avx512_bf16 (ALIASES).

This module and kernels/ops.py are the backend's: the tier-dependent defaults (`--dtype
auto`, `--quantized-activations auto`) are decided here, not by the configuration. Imports
neither torch nor the project: the configuration resolves them before any actor loads torch.
"""
from __future__ import annotations

import functools

TIERS = ("avx2", "avx512", "avx512_bf16")       # lowest first
# Names --kernels still takes for a tier: amx (folded into avx512_bf16, see above).
ALIASES = {"amx": "avx512_bf16"}
# What --kernels takes (kernels/ops.py builds them): "cpu" is the best tier this CPU runs.
BACKENDS = ("auto", "torch", "cpu", *TIERS, *ALIASES, "triton")

# /proc/cpuinfo flags a tier needs, on top of the tier before it.
_NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16", "avx512_vnni"),
}
# Compiler flags that build a tier, on top of the tier before it.
_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    "avx512_bf16": ("-mavx512bf16", "-mavx512vnni"),
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
    return tier == "avx512_bf16"


def runs_on_cpu(backend: str) -> bool:
    """Whether a --kernels name is a native CPU tier ("cpu", a tier, an alias): the model
    runs on the CPU then, also on a machine with a GPU."""
    return backend == "cpu" or backend in TIERS or backend in ALIASES


def named_tier(backend: str) -> str | None:
    """The tier a --kernels name forces (an alias resolved), or None: "cpu", "auto", torch
    and triton name none."""
    backend = ALIASES.get(backend, backend)
    return backend if backend in TIERS else None


def tier_to_run(backend: str) -> str | None:
    """The CPU tier --kernels `backend` will run, checked before any actor starts: a named
    tier (or alias) this CPU runs; else the best tier here (None: none), whose dtype and
    activation defaults apply also to torch and triton. An unknown name or a named tier this
    CPU cannot run is an error."""
    if backend not in BACKENDS:
        raise ValueError(f"kernels must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return resolve(backend) if named_tier(backend) is not None else best()


def default_dtype(tier: str | None, cuda: bool) -> str:
    """--dtype auto: bfloat16 on a GPU, or where the CPU tier multiplies it in hardware; else
    float32 (emulated bfloat16 arithmetic is far slower than float32's)."""
    return "bfloat16" if cuda or has_bf16_dot(tier) else "float32"


def default_activations(tier: str | None) -> str:
    """--quantized-activations auto: int16 on tiers without a bfloat16 dot product (15 bits a
    32-column block, finer than bfloat16 activations: ~1.6x the exact kernels' single stream
    there, the same answers), exact on those with one (their exact kernels are the fast
    ones). int8 and int8-all garble the default model's answers (bench/NOTES.md): they are
    taken only by name."""
    return default_rounding(has_bf16_dot(tier))


def default_rounding(bf16_dot: bool) -> str:
    """default_activations of a tier with (`bf16_dot`) or without a bfloat16 dot product."""
    return "exact" if bf16_dot else "int16"


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
    """A tier name this CPU runs: "native" (or "cpu") is the best one; a named tier (or an
    alias of one) must be runnable here."""
    if requested in ALIASES:
        tier = ALIASES[requested]
        if tier not in runnable():
            raise ValueError(f"--kernels {requested} (now {tier}): this CPU runs "
                             f"{', '.join(runnable()) or 'no native tier'}")
        return tier
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
