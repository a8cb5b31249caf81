"""The native CPU kernels against their torch references, in float32 and bfloat16, and the
model's greedy tokens with the native kernel set against the torch reference set."""
from __future__ import annotations

import random

import pytest
import torch

from pagewire import LLM, SamplingParams
from pagewire.kernels import native
from pagewire.kernels.activation import silu_and_mul
from pagewire.kernels.norm import add_rms_norm
from pagewire.kernels.rotary import apply_rope, rope_cos_sin

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C++ compiler")
DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 200, generator=g).to(dtype)[:, :96]        # strided rows
    res = torch.randn(37, 96, generator=g).to(dtype) if with_residual else None
    w = torch.randn(96, generator=g).to(dtype)
    ref_out, ref_res = add_rms_norm(x, None if res is None else res.clone(), w, 1e-5)
    out, new_res = native.add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(out, ref_out, **tol(dtype))
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)    # the add rounds the same
    if with_residual:
        assert new_res.data_ptr() == res.data_ptr()                 # updated in place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_in_place_on_fused_qkv(dtype, head_dim):
    g = torch.Generator().manual_seed(1)
    hq, hkv, t = 4, 2, 19
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, generator=g).to(dtype)
    table = rope_cos_sin(head_dim, 512, 10000.0)
    positions = torch.randint(0, 512, (t,), generator=g)
    cos_sin = table[positions].to(dtype)
    q_ref = apply_rope(qkv[:, :hq * head_dim].reshape(t, hq, head_dim), cos_sin)
    k_ref = apply_rope(qkv[:, hq * head_dim:(hq + hkv) * head_dim].reshape(t, hkv, head_dim), cos_sin)
    v_before = qkv[:, (hq + hkv) * head_dim:].clone()
    native.rope_(qkv, hq + hkv, head_dim, table, positions)
    torch.testing.assert_close(qkv[:, :hq * head_dim].view(t, hq, head_dim), q_ref, **tol(dtype))
    torch.testing.assert_close(qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(t, hkv, head_dim),
                               k_ref, **tol(dtype))
    assert torch.equal(qkv[:, (hq + hkv) * head_dim:], v_before)    # values untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(23, 2 * 300, generator=torch.Generator().manual_seed(2)).to(dtype)
    torch.testing.assert_close(native.silu_and_mul(x), silu_and_mul(x), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (16, None), (20, 3.0),
                                             (None, 1.5)])
def test_decode_attention_handles_every_context_length(dtype, window, softcap):
    """Context lengths 1 .. 3 blocks + 1, against the torch path, small and large batches
    (a small batch is split by kv head); sliding windows (shorter than, equal to and across
    a block) and soft-capping."""
    from pagewire.kernels.attention import Variant, decode_attention
    g = torch.Generator().manual_seed(3)
    bs, hkv, hq, d = 16, 2, 6, 64
    lens = list(range(1, 3 * bs + 2))
    width = -(-max(lens) // bs)
    cache = torch.randn(2, len(lens) * width + 1, bs, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(cache.shape[1], generator=g)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    ctx = torch.tensor(lens)
    for rows in (slice(0, 2), slice(None)):
        out = native.decode_attention(q[rows], cache[0], cache[1], tables[rows].contiguous(),
                                      ctx[rows].contiguous(), 0.125, window, softcap)
        ref = decode_attention(q[rows].float(), cache.float(), tables[rows], ctx[rows], 0.125,
                               Variant(window, softcap))
        torch.testing.assert_close(out.float(), ref, **tol(dtype))


def test_native_and_torch_kernel_sets_give_the_same_greedy_tokens(tiny_llama):
    path = tiny_llama("gqa3-odd")
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 33, 70)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for kernels in ("torch", "cpu"):
        llm = LLM(path, dtype="float32", kernels=kernels, block_size=16, num_kv_blocks=128,
                  max_num_batched_tokens=32)
        assert llm.runner.model.ops.name == kernels
        outs[kernels] = [o.outputs[0].token_ids for o in
                         llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert outs["cpu"] == outs["torch"]
