"""Triton's bidirectional varlen attention (encoder-only models) against per-sequence SDPA,
on CPU under the Triton interpreter; every output element poisoned with NaN first."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton

import pytest
import torch
import torch.nn.functional as F

from pagewire.kernels.encoder_attention_triton import triton_encoder_attention

pytest.importorskip("triton")
on_cpu = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                            reason="CPU tensors need TRITON_INTERPRET=1")


def _reference(q, k, v, seq_lens, scale):
    """Each sequence alone through SDPA (no mask), keys repeated for grouped heads."""
    group, outs, at = q.shape[1] // k.shape[1], [], 0
    for n in seq_lens:
        qs, ks, vs = (t[at:at + n].transpose(0, 1).float() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1))
        at += n
    return torch.cat(outs)


@on_cpu
@pytest.mark.parametrize("heads, kv_heads, head_dim, seq_lens", [
    (4, 4, 64, [5, 70, 1, 33]),      # tiles cut mid-sequence; a one-token sequence
    (4, 2, 80, [17, 40]),            # grouped heads, a head size below its power of two
])
def test_each_sequence_sees_all_and_only_its_own_keys(heads, kv_heads, head_dim, seq_lens):
    g = torch.Generator().manual_seed(0)
    t = sum(seq_lens)
    q = torch.randn(t, heads, head_dim, generator=g)
    k, v = (torch.randn(t, kv_heads, head_dim, generator=g) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    triton_encoder_attention(q, k, v, seq_lens, 0.125, out=out)
    torch.testing.assert_close(out, _reference(q, k, v, seq_lens, 0.125), atol=1e-4, rtol=1e-4)


@on_cpu
def test_bad_shapes_are_refused_by_name():
    q = torch.randn(6, 2, 16)
    with pytest.raises(ValueError, match="seq_lens"):
        triton_encoder_attention(q, q, q, [2, 3], 1.0)
    with pytest.raises(ValueError, match="does not match"):
        triton_encoder_attention(q, torch.randn(6, 3, 16), torch.randn(6, 3, 16), [6], 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_in_bfloat16():
    g = torch.Generator().manual_seed(1)
    seq_lens = [7, 300, 64]
    q = torch.randn(sum(seq_lens), 8, 64, generator=g).cuda().bfloat16()
    k, v = (torch.randn(sum(seq_lens), 8, 64, generator=g).cuda().bfloat16() for _ in range(2))
    out = triton_encoder_attention(q, k, v, seq_lens, 0.125)
    torch.testing.assert_close(out.float(), _reference(q, k, v, seq_lens, 0.125),
                               atol=2e-2, rtol=2e-2)
