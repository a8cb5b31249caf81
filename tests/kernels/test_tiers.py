"""CPU tiers (kernels/tiers.py): which tiers a CPU's flags allow, how each is built, and how
--kernels and --dtype auto resolve from them."""
from __future__ import annotations

import pytest

from pagewire.config import _resolve_activations, _resolve_dtype
from pagewire.kernels import tiers

BASE = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
ZEN3 = frozenset(BASE)
SKYLAKE_SP = frozenset(BASE | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})
ZEN4 = frozenset(SKYLAKE_SP | {"avx512_bf16", "avx512_vnni", "avx512_vbmi"})
SAPPHIRE_RAPIDS = frozenset(ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"})


@pytest.mark.parametrize("flags, expected", [
    (ZEN3, ("avx2",)),
    (SKYLAKE_SP, ("avx2", "avx512")),
    (ZEN4, ("avx2", "avx512", "avx512_bf16")),
    (SAPPHIRE_RAPIDS, ("avx2", "avx512", "avx512_bf16")),   # no AMX tier: avx512_bf16's
    (frozenset({"fp", "asimd"}), ()),                       # aarch64: no tier, torch runs
    (frozenset(BASE - {"fma"}), ()),                        # AVX2 without FMA is no tier
    (frozenset(ZEN3 | {"amx_tile", "amx_bf16", "amx_int8"}), ("avx2",)),   # tiers stack
])
def test_runnable_tiers_follow_the_flags(flags, expected):
    assert tiers.runnable(flags) == expected


def test_each_tier_builds_with_the_flags_of_those_below_it():
    assert tiers.compiler_flags("avx2") == ["-mavx2", "-mfma", "-mf16c"]
    bf16 = tiers.compiler_flags("avx512_bf16")
    assert bf16[:3] == ["-mavx2", "-mfma", "-mf16c"] and "-mavx512bw" in bf16
    assert "-mavx512bf16" in bf16 and not any("amx" in flag for flag in bf16)
    assert tiers.TIERS[-1] == "avx512_bf16"                  # amx was folded into it
    with pytest.raises(ValueError, match="unknown CPU tier 'sse'"):
        tiers.compiler_flags("sse")


def test_resolve_refuses_a_tier_above_the_cpu(monkeypatch):
    monkeypatch.setattr(tiers, "cpu_flags", lambda: ZEN3)
    assert tiers.resolve("cpu") == tiers.resolve("native") == "avx2"
    assert tiers.resolve("avx2") == "avx2"
    with pytest.raises(ValueError, match="--kernels avx512_bf16: this CPU runs avx2"):
        tiers.resolve("avx512_bf16")
    monkeypatch.setattr(tiers, "cpu_flags", lambda: frozenset())
    with pytest.raises(ValueError, match="use --kernels torch"):
        tiers.resolve("cpu")


def test_amx_is_another_name_for_avx512_bf16(monkeypatch):
    """The amx tier had no kernel of its own (the avx512_bf16 build with AMX flags): it was
    folded into avx512_bf16, and `--kernels amx` still names that tier."""
    monkeypatch.setattr(tiers, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    assert tiers.resolve("amx") == tiers.best() == "avx512_bf16"
    assert "amx" in tiers.BACKENDS and tiers.runs_on_cpu("amx")
    assert tiers.named_tier("amx") == "avx512_bf16" and tiers.named_tier("cpu") is None
    monkeypatch.setattr(tiers, "cpu_flags", lambda: SKYLAKE_SP)
    with pytest.raises(ValueError, match=r"--kernels amx \(now avx512_bf16\): this CPU runs "
                                         "avx2, avx512"):
        tiers.resolve("amx")


def test_dtype_auto_is_bfloat16_only_with_a_bf16_dot_product_or_on_a_gpu():
    assert [_resolve_dtype("auto", t, False) for t in (None, *tiers.TIERS)] == \
        ["float32", "float32", "float32", "bfloat16"]
    assert [_resolve_dtype("auto", t, True) for t in (None, *tiers.TIERS)] == ["bfloat16"] * 4
    assert _resolve_dtype("bfloat16", "avx2", False) == "bfloat16"       # asked for: kept
    assert _resolve_dtype("float32", None, True) == "float32"


def test_config_checks_kernels_before_any_actor_starts(monkeypatch):
    from pagewire.config import EngineConfig
    monkeypatch.setattr(tiers, "cpu_flags", lambda: ZEN3)
    with pytest.raises(ValueError, match="kernels must be one of auto, torch, cpu, avx2"):
        EngineConfig.from_options(kernels="avx3").resolve()
    with pytest.raises(ValueError, match="this CPU runs avx2"):
        EngineConfig.from_options(kernels="amx").resolve()
    monkeypatch.setattr(tiers, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    # avx512_bf16's dtype:
    assert EngineConfig.from_options(kernels="amx").resolve().model.dtype == "bfloat16"
    assert EngineConfig.from_options(kernels="amx")._device() == "cpu"
    monkeypatch.setattr(tiers, "cpu_flags", lambda: ZEN3)
    assert EngineConfig.from_options(kernels="avx2").resolve().model.dtype == "float32"
    monkeypatch.setattr(tiers, "cpu_flags", lambda: ZEN4)
    assert EngineConfig().resolve().model.dtype == "bfloat16"
    assert EngineConfig.from_options(kernels="avx512").resolve().model.dtype == "float32"


def test_quantized_activations_int16_below_a_bf16_dot_product_and_int8_only_by_name():
    assert _resolve_activations("auto", "auto", "avx2") == "int16"
    assert _resolve_activations("auto", "float32", "avx512") == "int16"
    assert _resolve_activations("auto", "auto", "avx512_bf16") == "exact"
    assert _resolve_activations("exact", "auto", "avx2") == "exact"
    assert _resolve_activations("int8", "float32", "avx512_bf16") == "int8"
    assert _resolve_activations("int8-all", "auto", "avx2") == "int8-all"
    with pytest.raises(ValueError, match="must be one of auto, exact, int16, int8, int8-all, int8-prefill"):
        _resolve_activations("fp8", "auto", "avx2")


def test_a_cpu_tier_runs_on_the_cpu_also_where_a_gpu_is():
    """On a GPU machine `--kernels amx` put the model on cuda:0 and the native kernels
    refused its tensors (seen on an H200's host)."""
    from pagewire.config import EngineConfig
    assert EngineConfig.from_options(kernels="avx2")._device() == "cpu"
    assert EngineConfig.from_options(kernels="cpu", device="cpu")._device() == "cpu"
    assert EngineConfig.from_options(kernels="triton")._device() == "auto"
    assert EngineConfig.from_options(kernels="auto", device="cuda")._device() == "cuda"
    with pytest.raises(ValueError, match="--kernels avx2 runs on the CPU: it does not combine "
                                         "with --device cuda"):
        EngineConfig.from_options(kernels="avx2", device="cuda")._device()


def test_int8_modes_leave_the_rest_at_the_tiers_default():
    """int8 and int8-prefill round Q4 weights' activations to int8 (int8-prefill in large
    steps only); every other weight keeps the tier's default: int16 without a bfloat16 dot
    product, exact with one. exact and int8-all are what they say on every tier."""
    from pagewire.executor.backend import roundings
    from pagewire.kernels import quant
    for bf16_dot in (False, True):
        rest = None if bf16_dot else "int16"
        table = roundings("int8", bf16_dot)
        assert (table[quant.Q4_K], table.get(quant.Q6_K), table.get(quant.Q8_0)) == \
            ("int8", rest, rest)
        table = roundings("int8-prefill", bf16_dot)
        assert (table[quant.Q4_0], table.get(quant.Q6_K), table.get(quant.MXFP4)) == \
            ("int8-large", rest, rest)
        assert roundings("exact", bf16_dot) == {}
        assert set(roundings("int8-all", bf16_dot).values()) == {"int8"}
