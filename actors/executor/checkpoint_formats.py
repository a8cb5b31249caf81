"""The linears of a quantized Hugging Face checkpoint (GPTQ, AWQ, compressed-tensors, FP8,
MXFP4; actors/quant_config.py reads which), unpacked to their integer codes and then:

- to GGML blocks the quantized kernels multiply (kernels/quant.py), the codes kept as they
  are: 4-bit -> Q4_1 (nibble = code, d = scale, m = -scale * zero), symmetric 8-bit -> Q8_0
  (code - zero, d = scale). A block's d and m are float16: a scale is kept exactly where
  float16 holds it (GPTQ and AWQ store float16), m = -scale * zero is rounded to it.
- to float weights equal to those blocks' values, so a prefill (the float GEMMs) and a decode
  step (the blocks) compute with the same weights, as for a GGUF file.

A GPTQ act-order linear (desc_act: a g_idx that is not k // group_size) has its columns
sorted by group first, stably, when that makes every 32 columns one group: the blocks hold
the columns in that order, and the kernels take the activations' columns in it too
(QuantWeight.order). FP8 (e4m3, a scale per tensor or per output row) keeps its codes as
they are, in blocks of 32 after their row's float32 scale (kernels/quant.py FP8). A linear
the blocks cannot hold — groups of other sizes, a row length not a multiple of 32, a code of
-128 after the zero, another FP8 encoding — keeps only its float weights, exact; the float
GEMMs multiply it.

MXFP4 (gpt-oss's experts) names no linear: each `<name>_blocks` (uint8 [..., N, K / 32, 16])
and `<name>_scales` (uint8 [..., N, K / 32]) pair becomes `<name>`: a stack of experts as
transformers' dequantization lays it out ([E, K, N], x @ W, as gpt-oss's bfloat16 experts),
a 2-D pair (which transformers never writes) as a Linear's weight [N, K]; or its GGML MXFP4
blocks [..., N, K / 32 * 17] (the same bytes, nibbles reordered), which the kernels take as
Q8_0 blocks of the same values (kernels/gguf_blocks.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagewire.kernels import quant
from pagewire.quant_config import Scheme

from .gguf_weights import dequantize_rows

_BLOCKS, _SCALES = "_blocks", "_scales"     # an MXFP4 tensor's pair of suffixes

_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]     # AWQ's nibble i holds column _AWQ_ORDER[i] of 8


@dataclass
class IntLinear:
    """One linear as integers: value[n, k] = scales[n, g] * (codes[n, k] - zeros[n, g]) with
    g = groups[k]."""
    codes: torch.Tensor      # [N, K] int16, 0 .. 2^bits - 1
    scales: torch.Tensor     # [N, G] float32
    zeros: torch.Tensor      # [N, G] int16
    groups: torch.Tensor     # [K] int64
    bits: int

    def values(self) -> torch.Tensor:
        g = self.groups
        return self.scales[:, g] * (self.codes - self.zeros[:, g]).float()

    def in_group_order(self) -> tuple["IntLinear", torch.Tensor | None]:
        """This linear with its columns sorted by group (stably), and that order; (itself,
        None) where the groups are in column order already."""
        if (self.groups.diff() >= 0).all():
            return self, None
        order = torch.sort(self.groups, stable=True).indices
        return IntLinear(self.codes[:, order], self.scales, self.zeros, self.groups[order],
                         self.bits), order

    def contiguous_groups(self) -> bool:
        """Each 32 columns in one group, groups in column order."""
        k = self.codes.shape[1]
        if k % 32:
            return False
        return bool((self.groups.view(-1, 32) == self.groups.view(-1, 32)[:, :1]).all()
                    and (self.groups.diff() >= 0).all())


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of 32 / bits codes (the first in the low bits), spread along `dim`."""
    per = 32 // bits
    parts = [(packed >> (bits * i)) & ((1 << bits) - 1) for i in range(per)]
    out = torch.stack(parts, dim + 1)
    shape = list(packed.shape)
    shape[dim] *= per
    return out.reshape(shape).to(torch.int16)


def _groups(k: int, size: int) -> torch.Tensor:
    return torch.arange(k) // (k if size == -1 else size)


def _gptq(t: dict, s: Scheme) -> IntLinear:
    codes = _unpack(t["qweight"].int(), s.bits, 0).T.contiguous()                 # [N, K]
    zeros = _unpack(t["qzeros"].int(), s.bits, 1) + s.zero_offset                 # [G, N]
    k = codes.shape[1]
    groups = t["g_idx"].long() if "g_idx" in t else _groups(k, s.group_size)
    return IntLinear(codes, t["scales"].float().T.contiguous(), zeros.T.contiguous(), groups,
                     s.bits)


def _awq(t: dict, s: Scheme) -> IntLinear:
    undo = torch.tensor(_AWQ_ORDER).argsort()

    def columns(packed):                       # [R, N / 8] -> [R, N] in column order
        nib = _unpack(packed.int(), 4, 1).view(packed.shape[0], -1, 8)
        return nib[..., undo].reshape(packed.shape[0], -1)

    codes = columns(t["qweight"]).T.contiguous()                                  # [N, K]
    return IntLinear(codes, t["scales"].float().T.contiguous(),
                     columns(t["qzeros"]).T.contiguous(), _groups(codes.shape[1], s.group_size),
                     4)


def _pack_quantized(t: dict, s: Scheme) -> IntLinear:
    n, k = (int(x) for x in t["weight_shape"].tolist())
    codes = _unpack(t["weight_packed"].int(), 4, 1)[:, :k].contiguous()          # [N, K]
    scales = t["weight_scale"].float().reshape(n, -1)
    return IntLinear(codes, scales, torch.full(scales.shape, 8, dtype=torch.int16),
                     _groups(k, s.group_size), 4)


def _int_quantized(t: dict, s: Scheme) -> IntLinear:
    w = t["weight"]
    scales = t["weight_scale"].float().reshape(w.shape[0], 1)
    return IntLinear(w.to(torch.int16) + 128, scales,
                     torch.full(scales.shape, 128, dtype=torch.int16),
                     torch.zeros(w.shape[1], dtype=torch.int64), 8)


def _fp8_scale(t: dict) -> torch.Tensor:
    """Per output row [N, 1] or per tensor [], float32."""
    scale = t.get("weight_scale", t.get("weight_scale_inv"))
    return scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(())


def _fp8_values(t: dict) -> torch.Tensor:
    return t["weight"].float() * _fp8_scale(t)


def _fp8_blocks(t: dict) -> tuple[int, torch.Tensor] | None:
    """e4m3 codes per row in blocks of 32 after their row's scale (kernels/quant.py FP8),
    which the kernels decode exactly: the same values as _fp8_values. None for other FP8
    encodings or rows not a multiple of 32."""
    w = t["weight"]
    n, k = w.shape
    if w.dtype != torch.float8_e4m3fn or k % 32:
        return None
    scales = _fp8_scale(t).expand(n, k // 32).contiguous().view(torch.uint8)   # [N, K/32 x 4]
    codes = w.contiguous().view(torch.uint8).view(n, k // 32, 32)
    return quant.FP8, torch.cat([scales.view(n, k // 32, 4), codes], -1).reshape(n, -1)


# packing -> (the tensor that marks a quantized linear, the reader of its tensors)
_READERS = {"gptq": ("qweight", _gptq), "awq": ("qweight", _awq),
            "pack-quantized": ("weight_packed", _pack_quantized),
            "int-quantized": ("weight_scale", _int_quantized)}
_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
             "weight_shape", "weight_zero_point", "weight_scale_inv", "input_scale", "weight")


def quantized_linears(weights: dict, s: Scheme) -> dict[str, dict[str, torch.Tensor]]:
    """{linear prefix: {tensor suffix: tensor}} for each linear the checkpoint quantized."""
    marker = "weight_scale" if s.packing == "fp8" else _READERS[s.packing][0]
    prefixes = [name[: -len(marker) - 1] for name in weights if name.endswith("." + marker)]
    if s.packing == "fp8" and not prefixes:
        prefixes = [n[: -len(".weight_scale_inv")] for n in weights
                    if n.endswith(".weight_scale_inv")]
    out = {}
    for p in prefixes:
        if any(p == ign or p.endswith("." + ign) for ign in s.ignore):
            continue
        out[p] = {sfx: weights[f"{p}.{sfx}"] for sfx in _SUFFIXES if f"{p}.{sfx}" in weights}
    return out


def blocks_of(linear: IntLinear) -> tuple[int, torch.Tensor] | None:
    """(GGML type, raw blocks [N, K / 32 * bytes]) holding exactly these codes, or None."""
    if not linear.contiguous_groups():
        return None
    n, k = linear.codes.shape
    g = linear.groups[::32]                                                        # [K/32]
    d = linear.scales[:, g].to(torch.float16)                                      # [N, K/32]
    zero = linear.zeros[:, g]
    codes = linear.codes.view(n, k // 32, 32)
    if linear.bits == 4:
        m = (-linear.scales[:, g] * zero.float()).to(torch.float16)
        q = codes.to(torch.uint8)
        nibbles = q[..., :16] | (q[..., 16:] << 4)
        raw = torch.cat([d[..., None].view(torch.uint8), m[..., None].view(torch.uint8),
                         nibbles], -1)
        return quant.Q4_1, raw.reshape(n, -1)
    signed = codes - zero[..., None]
    if int(signed.min()) < -127 or int(signed.max()) > 127:
        return None
    raw = torch.cat([d[..., None].view(torch.uint8), signed.to(torch.int8).view(torch.uint8)], -1)
    return quant.Q8_0, raw.reshape(n, -1)


def convert(tensors: dict, s: Scheme) -> tuple[torch.Tensor, tuple[int, torch.Tensor] | None,
                                               torch.Tensor | None]:
    """One quantized linear's (float32 weight [N, K], its blocks or None, the column order
    the blocks hold or None); the weight is the blocks' values where there are blocks."""
    if s.packing == "fp8":
        return _fp8_values(tensors), _fp8_blocks(tensors), None
    linear = _READERS[s.packing][1](tensors, s)
    ordered, order = linear.in_group_order()
    blocks = blocks_of(ordered)
    if blocks is None:
        return linear.values(), None, None
    values = dequantize_rows(*blocks)
    if order is not None:                        # back to the checkpoint's column order
        values = torch.empty_like(values).index_copy_(1, order, values)
    return values, blocks, order


def mxfp4_pairs(weights: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{`<name>`: (its `_blocks`, its `_scales`)} of every MXFP4 pair in a checkpoint."""
    names = [n[: -len(_BLOCKS)] for n in weights if n.endswith(_BLOCKS)]
    return {n: (weights[n + _BLOCKS], weights[n + _SCALES]) for n in names
            if n + _SCALES in weights}


def mxfp4_as_gguf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A Hugging Face MXFP4 pair -> GGML MXFP4 blocks uint8 [..., N, K / 32 * 17], the same
    values: the scale byte as it is (2^(s - 127) * e2m1 is ggml's 2^(s - 128) * its doubled
    levels, the same 16 codes in the same order); the nibbles reordered, as Hugging Face's
    byte j holds weights 2j (low) and 2j + 1 (high), ggml's weights j and j + 16."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != 16 or blocks.shape[:-1] != \
            scales.shape or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks must be uint8 [..., N, K / 32, 16] and scales uint8 "
                         f"[..., N, K / 32], got {blocks.dtype} {tuple(blocks.shape)} and "
                         f"{scales.dtype} {tuple(scales.shape)}")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], -1).flatten(-2)       # [..., G, 32]
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    raw = torch.cat([scales[..., None], nibbles], -1)                        # [..., G, 17]
    return raw.flatten(-2)


def mxfp4_values(blocks: torch.Tensor, scales: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A Hugging Face MXFP4 pair's weights in `dtype` (float32 values exact; rounded once to
    `dtype`): a stack [E, K, N] as transformers' convert_moe_packed_tensors gives it, a 2-D
    pair [N, K]."""
    raw = mxfp4_as_gguf(blocks, scales)
    values = dequantize_rows(quant.MXFP4, raw.reshape(-1, raw.shape[-1]))
    values = values.reshape(*raw.shape[:-1], -1)
    return (values.transpose(-1, -2) if values.dim() > 2 else values).to(dtype).contiguous()


def _mxfp4_float_weights(weights: dict, dtype: torch.dtype,
                         skip: frozenset[str]) -> dict[str, torch.Tensor]:
    pairs = mxfp4_pairs(weights)
    out = {n: mxfp4_values(b, s, dtype) for n, (b, s) in pairs.items() if n not in skip}
    taken = {n + sfx for n in pairs for sfx in (_BLOCKS, _SCALES)}
    out.update((n, t.to(dtype)) for n, t in weights.items() if n not in taken and n not in skip)
    return out


def float_weights(weights: dict, s: Scheme, dtype: torch.dtype,
                  skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The checkpoint with each quantized linear's tensors replaced by `prefix.weight` (its
    values in `dtype`; none for a name in `skip`), every other tensor cast to `dtype`. MXFP4:
    each pair replaced by `<name>` (mxfp4_values)."""
    if s.packing == "mxfp4":
        return _mxfp4_float_weights(weights, dtype, skip)
    linears = quantized_linears(weights, s)
    out = {}
    for prefix, tensors in linears.items():
        if f"{prefix}.weight" not in skip:
            out[f"{prefix}.weight"] = convert(tensors, s)[0].to(dtype)
    taken = {f"{p}.{sfx}" for p, t in linears.items() for sfx in t}
    for name, tensor in weights.items():
        if name not in taken:
            out[name] = tensor.to(dtype)
    return out


def blocks_by_name(weights: dict, s: Scheme) -> tuple[dict[str, tuple[int, torch.Tensor]],
                                                        dict[str, torch.Tensor]]:
    """({`prefix.weight`: (GGML type, raw blocks)} for each linear the blocks hold, {the same
    name: the column order its blocks hold} for those not in column order). MXFP4: {`<name>`:
    (MXFP4, its GGML blocks [..., N, K / 32 * 17])}, a stack of experts' blocks 3-D."""
    if s.packing == "mxfp4":
        return {n: (quant.MXFP4, mxfp4_as_gguf(b, sc)) for n, (b, sc) in
                mxfp4_pairs(weights).items()}, {}
    blocks, orders = {}, {}
    for prefix, tensors in quantized_linears(weights, s).items():
        _, linear_blocks, order = convert(tensors, s)
        if linear_blocks is not None:
            blocks[f"{prefix}.weight"] = linear_blocks
        if linear_blocks is not None and order is not None:
            orders[f"{prefix}.weight"] = order
    return blocks, orders
