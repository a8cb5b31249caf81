"""A quantized Hugging Face checkpoint's `quantization_config`, read into one Scheme: which
packing its linears' tensors use and how their integers become weights. What is not
supported is refused here, at start, naming the detail (executor/checkpoint_formats.py reads
the tensors). No torch: the gateway's model check imports this.

value = scale[group] * (code - zero[group]) for the integer formats (codes unsigned, 0 ..
2^bits - 1); value = float8 code * scale for FP8; value = e2m1 code * 2^(scale - 127) for
MXFP4 (gpt-oss: `<name>_blocks` and `<name>_scales` pairs, 32 weights a scale).
"""
from __future__ import annotations

import msgspec

METHODS = ("gptq", "awq", "compressed-tensors", "fp8", "mxfp4")


class Scheme(msgspec.Struct, frozen=True, kw_only=True):
    packing: str        # "gptq" | "awq" | "pack-quantized" | "int-quantized" | "fp8" | "mxfp4"
    bits: int
    group_size: int             # columns sharing a scale; -1: the whole row (per channel)
    symmetric: bool             # zero = 2^(bits-1), not stored
    desc_act: bool = False      # GPTQ act-order: g_idx gives each column's group
    zero_offset: int = 0        # GPTQ v1 stores zero - 1
    ignore: tuple[str, ...] = ()   # linears left in float (compressed-tensors "ignore")


def read_scheme(qcfg: dict | None, where: str) -> Scheme | None:
    """The scheme of a config's quantization_config (None: a float checkpoint)."""
    if not qcfg:
        return None
    method = qcfg.get("quant_method")
    read = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed, "fp8": _fp8,
            "mxfp4": _mxfp4}.get(method)
    if read is None:
        raise ValueError(f"{where}: quant_method {method!r} is not supported (supported: "
                         f"{', '.join(METHODS)})")
    return read(qcfg, where)


def _refuse(where: str, what: str) -> ValueError:
    return ValueError(f"{where}: {what} is not supported")


def _group(size, where: str) -> int:
    if size is None or size == -1:
        return -1
    if not isinstance(size, int) or size <= 0 or size % 32:
        raise _refuse(where, f"group_size {size!r} (supported: -1 or a multiple of 32)")
    return size


def _gptq(q: dict, where: str) -> Scheme:
    bits = q.get("bits")
    if bits not in (4, 8):
        raise _refuse(where, f"GPTQ with bits={bits!r} (supported: 4, 8)")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(where, f"GPTQ checkpoint_format {fmt!r} (supported: gptq, gptq_v2)")
    sym = bool(q.get("sym", True))
    if bits == 8 and not sym:
        raise _refuse(where, "GPTQ 8-bit with sym=false (the 8-bit blocks are symmetric)")
    return Scheme(packing="gptq", bits=bits, group_size=_group(q.get("group_size", 128), where),
                  symmetric=sym, desc_act=bool(q.get("desc_act", False)),
                  zero_offset=1 if fmt == "gptq" else 0)


def _awq(q: dict, where: str) -> Scheme:
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(where, f"AWQ version {version!r} (supported: gemm)")
    bits = q.get("bits", q.get("w_bit", 4))
    if bits != 4:
        raise _refuse(where, f"AWQ with bits={bits!r} (supported: 4)")
    if not q.get("zero_point", True):
        raise _refuse(where, "AWQ with zero_point=false")
    return Scheme(packing="awq", bits=4,
                  group_size=_group(q.get("group_size", q.get("q_group_size", 128)), where),
                  symmetric=False)


def _compressed(q: dict, where: str) -> Scheme:
    fmt = q.get("format")
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _refuse(where, f"compressed-tensors with {len(groups)} config groups "
                             "(supported: one)")
    w = groups[0].get("weights") or {}
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    ignore = tuple(q.get("ignore") or ())
    if fmt == "pack-quantized" and bits == 4 and kind == "int":
        if not w.get("symmetric", True):
            raise _refuse(where, "compressed-tensors pack-quantized with symmetric=false")
        size = w.get("group_size") if strategy == "group" else -1
        if strategy not in ("group", "channel"):
            raise _refuse(where, f"compressed-tensors weight strategy {strategy!r}")
        return Scheme(packing="pack-quantized", bits=4, group_size=_group(size, where),
                      symmetric=True, ignore=ignore)
    if fmt == "int-quantized" and bits == 8 and kind == "int" and strategy == "channel" \
            and w.get("symmetric", True):
        return Scheme(packing="int-quantized", bits=8, group_size=-1, symmetric=True,
                      ignore=ignore)
    if fmt == "float-quantized" and bits == 8 and kind == "float" \
            and strategy in ("tensor", "channel"):
        return Scheme(packing="fp8", bits=8, group_size=-1, symmetric=True, ignore=ignore)
    raise _refuse(where, f"compressed-tensors format {fmt!r} with {bits}-bit {kind} weights "
                         f"by {strategy} (supported: pack-quantized 4-bit int by group or "
                         "channel, int-quantized 8-bit int by channel, float-quantized 8-bit "
                         "float by tensor or channel)")


def _fp8(q: dict, where: str) -> Scheme:
    if q.get("weight_block_size"):
        raise _refuse(where, f"FP8 with weight_block_size {q['weight_block_size']} "
                             "(supported: per tensor or per channel scales)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(where, f"FP8 fmt {fmt!r} (supported: e4m3)")
    return Scheme(packing="fp8", bits=8, group_size=-1, symmetric=True)


def _mxfp4(q: dict, where: str) -> Scheme:
    """gpt-oss's: the tensors a `_blocks`/`_scales` pair names are MXFP4, the rest (its
    modules_to_not_convert) are stored as they are, so nothing else needs reading."""
    return Scheme(packing="mxfp4", bits=4, group_size=32, symmetric=True)
