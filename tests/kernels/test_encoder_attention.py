"""encoder_attention (kernels/encoder_attention.py): each sequence of a flat batch attends
all and only its own keys, against a plain float32 reference per sequence, on the torch
backend and each native CPU tier (the native prefill kernel serves bfloat16 with head dim 64
or 128 on AVX512-BF16; the other tiers and shapes take SDPA)."""
from __future__ import annotations

import pytest
import torch

from pagewire.kernels import tiers
from pagewire.kernels.encoder_attention import encoder_attention
from pagewire.kernels.ops import CpuOps, TorchOps

LENS = [5, 17, 1, 33]


def _reference(q, k, v, seq_lens, scale, bias=None, window=None):
    out, start = [], 0
    for n in seq_lens:
        qs, ks, vs = (x[start:start + n].float() for x in (q, k, v))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if bias is not None:
            scores = scores + bias[:, :n, :n].float()
        if window is not None:
            pos = torch.arange(n)
            scores = scores.masked_fill((pos[:, None] - pos[None, :]).abs() > window,
                                        float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
        start += n
    return torch.cat(out)


def _qkv(dtype, heads=4, head_dim=64, lens=LENS):
    g = torch.Generator().manual_seed(sum(lens))
    qkv = torch.randn(sum(lens), 3, heads, head_dim, generator=g).to(dtype)
    return qkv.unbind(1)                         # strided rows, as a fused qkv's views


def _ops(kernels):
    if kernels == "torch":
        return TorchOps()
    from pagewire.kernels import native
    lib = native.load(kernels)
    if lib is None:
        pytest.skip("no C++ compiler for the native kernels")
    return CpuOps(lib)


@pytest.fixture(params=["torch", *tiers.TIERS])
def ops(request):
    """The torch backend and each native tier this CPU runs (the others skipped, named)."""
    if request.param != "torch" and request.param not in tiers.runnable():
        pytest.skip(f"needs the {request.param} tier: this CPU runs "
                    f"{', '.join(tiers.runnable()) or 'none'}")
    return _ops(request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 3])
def test_each_sequence_attends_only_its_own_keys(ops, dtype, window):
    q, k, v = _qkv(dtype)
    out = ops.encoder_attention(q, k, v, LENS, 0.125, window=window)
    ref = _reference(q, k, v, LENS, 0.125, window=window)
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.shape == q.shape and out.dtype == dtype
    assert float((out.float() - ref).abs().max()) < bound


def test_a_bias_is_added_to_each_sequences_scores(ops):
    q, k, v = _qkv(torch.float32, head_dim=16)
    bias = torch.randn(4, 40, 40, generator=torch.Generator().manual_seed(1))
    out = ops.encoder_attention(q, k, v, LENS, 0.25, bias=bias)
    assert float((out - _reference(q, k, v, LENS, 0.25, bias)).abs().max()) < 1e-5
    assert float((out - _reference(q, k, v, LENS, 0.25)).abs().max()) > 1e-2


def test_a_bias_with_sequences_of_one_length_stacked(ops):
    """Sequences of one length share one product: each still reads only its own keys."""
    lens = [17, 5, 17, 1, 5, 17]
    q, k, v = _qkv(torch.float32, head_dim=16, lens=lens)
    bias = torch.randn(4, 20, 20, generator=torch.Generator().manual_seed(2))
    out = ops.encoder_attention(q, k, v, lens, 0.25, bias=bias)
    assert float((out - _reference(q, k, v, lens, 0.25, bias)).abs().max()) < 1e-5


def test_the_native_kernel_serves_bfloat16_where_it_can(native_lib):
    """Where prefill_attention serves (AVX512-BF16), encoder_attention runs it: the same rows
    as the SDPA path within bfloat16's rounding, padding of 33 keys to 48 never read."""
    q, k, v = _qkv(torch.bfloat16)
    if not native_lib.prefill_attention_serves(q, k.new_empty(1, 16, 4, 64)):
        pytest.skip(f"the {native_lib.tier} tier has no native prefill attention")
    for window in (None, 3):
        native = encoder_attention(q, k, v, LENS, 0.125, native_lib, window=window)
        sdpa = encoder_attention(q, k, v, LENS, 0.125, None, window=window)
        assert float((native.float() - sdpa.float()).abs().max()) < 2e-2
