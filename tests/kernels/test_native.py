"""The native CPU kernels against their torch references, in float32 and bfloat16, and the
model's greedy tokens with the native kernel set against the torch reference set."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pagewire import LLM, SamplingParams
from pagewire.kernels.activation import silu_and_mul
from pagewire.kernels.norm import add_rms_norm
from pagewire.kernels.rotary import apply_rope, rope_cos_sin

DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def test_loading_a_tier_leaves_the_process_denormals_alone(native_lib):
    """The library is linked without -ffast-math's crtfastmath, whose constructor would set
    flush-to-zero for every thread of the process that loads it (a user's, offline)."""
    code = ("import threading, torch; from pagewire.kernels import native; "
            f"assert native.load({native_lib.tier!r}) is not None; "
            "out = []; t = threading.Thread(target=lambda: out.append(torch.tensor([1e-40]) * 1)); "
            "t.start(); t.join(); print(float(torch.tensor([1e-40]) * 1), float(out[0][0]))")
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout.split()
    assert [float(v) for v in printed] == [pytest.approx(1e-40, rel=1e-3)] * 2


def test_without_a_compiler_the_torch_reference_runs_with_one_warning(tmp_path):
    """No compiler (CXX names none) and nothing built yet: the CPU backend is the torch
    reference, one warning says why, and nothing half-built is left in the cache."""
    code = ("import logging, torch; logging.basicConfig(); "
            "from pagewire.kernels.ops import select_ops; "
            "print(select_ops(torch.device('cpu')).name)")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"),
           "PAGEWIRE_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, check=True)
    assert done.stdout.split() == ["torch"]
    assert done.stderr.count("native CPU kernels unavailable, using the torch reference") == 1
    assert [p.name for p in (tmp_path / "cache" / "kernels").iterdir()
            if not p.name.endswith(".lock")] == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(native_lib, dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 200, generator=g).to(dtype)[:, :96]        # strided rows
    res = torch.randn(37, 96, generator=g).to(dtype) if with_residual else None
    w = torch.randn(96, generator=g).to(dtype)
    ref_out, ref_res = add_rms_norm(x, None if res is None else res.clone(), w, 1e-5)
    out, new_res = native_lib.add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(out, ref_out, **tol(dtype))
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)    # the add rounds the same
    if with_residual:
        assert new_res.data_ptr() == res.data_ptr()                 # updated in place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_in_place_on_fused_qkv(native_lib, dtype, head_dim):
    g = torch.Generator().manual_seed(1)
    hq, hkv, t = 4, 2, 19
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, generator=g).to(dtype)
    table = rope_cos_sin(head_dim, 512, 10000.0)
    positions = torch.randint(0, 512, (t,), generator=g)
    cos_sin = table[positions].to(dtype)
    q_ref = apply_rope(qkv[:, :hq * head_dim].reshape(t, hq, head_dim), cos_sin)
    k_ref = apply_rope(qkv[:, hq * head_dim:(hq + hkv) * head_dim].reshape(t, hkv, head_dim), cos_sin)
    v_before = qkv[:, (hq + hkv) * head_dim:].clone()
    native_lib.rope_(qkv, hq + hkv, head_dim, table, positions)
    torch.testing.assert_close(qkv[:, :hq * head_dim].view(t, hq, head_dim), q_ref, **tol(dtype))
    torch.testing.assert_close(qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(t, hkv, head_dim),
                               k_ref, **tol(dtype))
    assert torch.equal(qkv[:, (hq + hkv) * head_dim:], v_before)    # values untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_layer_norm(native_lib, dtype, with_residual):
    """The GPT family's LayerNorm against torch's (kernels/norm.py), the residual's add
    rounded the same and updated in place."""
    from pagewire.kernels.norm import add_layer_norm
    g = torch.Generator().manual_seed(5)
    x = (3 + torch.randn(37, 96, generator=g)).to(dtype)          # a mean far from zero
    res = torch.randn(37, 96, generator=g).to(dtype) if with_residual else None
    w, b = torch.randn(96, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    ref_out, ref_res = add_layer_norm(x, None if res is None else res.clone(), w, b, 1e-5)
    out, new_res = native_lib.add_layer_norm(x, res, w, b, 1e-5)
    torch.testing.assert_close(out, ref_out, **tol(dtype))
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    if with_residual:
        assert new_res.data_ptr() == res.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(native_lib, dtype, approximate):
    x = (4 * torch.randn(23, 300, generator=torch.Generator().manual_seed(6))).to(dtype)
    torch.testing.assert_close(native_lib.gelu(x, approximate == "tanh"),
                               torch.nn.functional.gelu(x, approximate=approximate), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rope_rotates_the_first_columns_of_each_head(native_lib, dtype):
    """GPT-NeoX's rope on a quarter of each head (kernels/rotary.py partial_rope): the other
    columns and v untouched."""
    from pagewire.kernels.rotary import partial_rope
    g = torch.Generator().manual_seed(7)
    hq, hkv, d, r, t = 4, 2, 64, 16, 19
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    table = rope_cos_sin(r, 512, 10000.0)
    positions = torch.randint(0, 512, (t,), generator=g)
    want = partial_rope(qkv.clone(), hq, hkv, d, r, table, positions)
    native_lib.rope_(qkv, hq + hkv, d, table, positions, r)
    got = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    for g_part, w_part in zip(got, want):
        torch.testing.assert_close(g_part.reshape(w_part.shape), w_part, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(native_lib, dtype):
    x = torch.randn(23, 2 * 300, generator=torch.Generator().manual_seed(2)).to(dtype)
    torch.testing.assert_close(native_lib.silu_and_mul(x), silu_and_mul(x), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (16, None), (20, 3.0),
                                             (None, 1.5)])
@pytest.mark.parametrize("hq, hkv, d, bs", [(6, 2, 64, 16), (8, 1, 128, 16), (4, 4, 64, 16),
                                            (6, 2, 64, 12), (9, 3, 96, 16)])
def test_decode_attention_handles_every_context_length(native_lib, dtype, window, softcap, hq,
                                                       hkv, d, bs):
    """Context lengths 1 .. 3 blocks + 1, against the torch path, small and large batches
    (a small batch is split by kv head); sliding windows (shorter than, equal to and across
    a block) and soft-capping; 3, 8 (three passes of query heads) and 1 query head per kv
    head; blocks of 16 (the AVX2 row kernels, eight tokens at a time) and 12 tokens, head
    dims the kernels unroll (64, 128) and one they do not (96). The rows past each context
    hold 1e4: the row kernels score them in lanes of their own, never read."""
    from pagewire.kernels.attention import Variant, decode_attention
    g = torch.Generator().manual_seed(3)
    lens = list(range(1, 3 * bs + 2))
    width = -(-max(lens) // bs)
    cache = torch.randn(2, len(lens) * width + 1, bs, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(cache.shape[1], generator=g)[:len(lens) * width].view(len(lens), width)
    for table, n in zip(tables, lens):
        cache[:, table[(n - 1) // bs], (n - 1) % bs + 1:] = 1e4
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    ctx = torch.tensor(lens)
    for rows in (slice(0, 2), slice(None)):
        out = native_lib.decode_attention(q[rows], cache[0], cache[1], tables[rows].contiguous(),
                                      ctx[rows].contiguous(), 0.125, window, softcap)
        ref = decode_attention(q[rows].float(), cache.float(), tables[rows], ctx[rows], 0.125,
                               Variant(window, softcap))
        torch.testing.assert_close(out.float(), ref, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens, window, softcap", [([700], None, None), ([300, 517], None, 2.0),
                                                   ([900], 333, None), ([130], None, None)])
def test_decode_attention_splits_long_contexts_of_small_batches(native_lib, dtype, lens, window,
                                                                softcap):
    """One or two sequences leave a thread short of work even split by kv head: contexts of
    8 blocks or more are split into parts whose softmax states are merged (a window's range
    too); the result is the torch path's."""
    from pagewire.kernels.attention import Variant, decode_attention
    g = torch.Generator().manual_seed(8)
    bs, hq, hkv, d = 16, 6, 2, 64
    width = -(-max(lens) // bs)
    cache = torch.randn(2, len(lens) * width + 1, bs, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(cache.shape[1], generator=g)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    ctx = torch.tensor(lens)
    out = native_lib.decode_attention(q, cache[0], cache[1], tables.contiguous(), ctx, 0.125,
                                      window, softcap)
    ref = decode_attention(q.float(), cache.float(), tables, ctx, 0.125, Variant(window, softcap))
    torch.testing.assert_close(out.float(), ref, **tol(dtype))


PREFILL_CHUNKS = [(1, 1), (15, 15), (16, 16), (17, 17), (100, 100), (40, 7), (70, 33), (33, 1),
                  (130, 64)]          # (context once written, queries): fresh and continued


def _prefill_case(heads, kv_heads, head_dim, block_size, seed=5):
    """Chunks at shuffled blocks of a random bf16 cache; q as strided rows of a fused qkv."""
    from pagewire.kernels.attention import AttentionBatch, PrefillSpan
    g = torch.Generator().manual_seed(seed)
    need = [-(-ctx // block_size) for ctx, _ in PREFILL_CHUNKS]
    cache = torch.randn(2, sum(need) + 2, block_size, kv_heads, head_dim,
                        generator=g).bfloat16()
    ids = torch.randperm(cache.shape[1], generator=g)
    spans, start, used = [], 0, 0
    for (ctx, n), blocks in zip(PREFILL_CHUNKS, need):
        spans.append(PrefillSpan(start, n, ctx, ids[used:used + blocks]))
        start, used = start + n, used + blocks
    width = (heads + 2 * kv_heads) * head_dim
    q = torch.randn(start, width, generator=g).bfloat16()[:, :heads * head_dim]
    batch = AttentionBatch(torch.zeros(start, dtype=torch.int64), 0, None, None, spans)
    return cache, q.view(start, heads, head_dim), batch


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(6, 2, 64), (4, 4, 128), (8, 1, 64),
                                                       (9, 3, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 5, 20, 40])
def test_prefill_attention_matches_the_float32_reference(native_lib, heads, kv_heads, head_dim,
                                                         block_size, window):
    """Every chunk of one call (fresh prompts of 1 .. 100 tokens, around the 16-key tile, and
    chunks over cached context) against causal attention in float32 of the same bf16
    inputs, sliding windows included: within bfloat16's rounding, and no worse than torch's
    own bf16 SDPA on the same inputs."""
    from pagewire.kernels.attention import Variant, prefill_attention
    if not native_lib.bf16_dot:
        pytest.skip(f"the native prefill kernel needs a bfloat16 dot product ({native_lib.tier} "
                    "prefills on torch)")
    cache, q, batch = _prefill_case(heads, kv_heads, head_dim, block_size)
    chunks, tables = batch.packed_prefills
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    native_lib.prefill_attention(q, cache[0], cache[1], chunks, tables, 0.125, window, out)
    for span in batch.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        new = [c[span.block_table].flatten(0, 1)[span.context_len - span.num_tokens:
                                                 span.context_len] for c in cache]
        ref = prefill_attention(q[rows].float(), new[0].float(), new[1].float(), cache.float(),
                                span, 0.125, Variant(window))
        torch.testing.assert_close(out[rows].float(), ref, **tol(torch.bfloat16))
        if window is None and span.context_len > span.num_tokens:
            sdpa = prefill_attention(q[rows], *new, cache, span, 0.125)
            ours, theirs = ((x.float() - ref).abs().mean() for x in (out[rows], sdpa))
            assert ours <= 1.1 * theirs


@pytest.mark.parametrize("window", [None, 20])
def test_prefill_key_ends_let_a_query_see_keys_past_its_own(native_lib, window):
    """key_ends: each chunk's rows 3..9 see up to its row 9 (an image seen whole, Gemma 3's
    way), the others causally: the float32 reference under that mask; a key end past a chunk's
    context or before its query's own key is refused."""
    from pagewire.kernels.attention import attend
    if not native_lib.bf16_dot:
        pytest.skip(f"the native prefill kernel needs a bfloat16 dot product ({native_lib.tier})")
    cache, q, batch = _prefill_case(6, 2, 64, 16)
    chunks, tables = batch.packed_prefills
    ends, masks = [], []
    for span in batch.prefills:
        past = span.context_len - span.num_tokens
        end = torch.arange(past + 1, span.context_len + 1)
        if span.num_tokens >= 10:
            end[3:10] = past + 10
        ends.append(end)
        masks.append(torch.arange(span.context_len)[None] < end[:, None])
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    native_lib.prefill_attention(q, cache[0], cache[1], chunks, tables, 0.125, window, out,
                                 key_ends=torch.cat(ends))
    for span, mask in zip(batch.prefills, masks):
        rows = slice(span.start, span.start + span.num_tokens)
        if window is not None:
            own = torch.arange(span.context_len - span.num_tokens, span.context_len)
            mask &= torch.arange(span.context_len)[None] > own[:, None] - window
        k, v = (c[span.block_table].flatten(0, 1)[:span.context_len].float() for c in cache)
        ref = attend(q[rows].float(), k, v, mask, False, 0.125)
        torch.testing.assert_close(out[rows].float(), ref, **tol(torch.bfloat16))
    for bad in (torch.cat(ends) + 1, torch.cat(ends) - 1):
        with pytest.raises(ValueError, match="key end"):
            native_lib.prefill_attention(q, cache[0], cache[1], chunks, tables, 0.125, window,
                                         out, key_ends=bad)


@pytest.mark.parametrize("patches", [64, 37])
def test_full_attention_of_images_matches_torch(native_lib, patches):
    """A vision tower's attention (every patch sees every patch of its image, none of the
    next's) on the native kernel, 37 patches padded to blocks of 16: equal to SDPA in float32
    within bfloat16's rounding."""
    from pagewire.kernels.attention import full_attention
    g = torch.Generator().manual_seed(patches)
    qkv = torch.randn(3, patches, 3, 4, 64, generator=g).bfloat16()    # [N, P, 3, H, D]
    q, k, v = qkv.unbind(2)
    out = full_attention(q, k, v, 0.125, native_lib)
    ref = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)),
                                         scale=0.125).transpose(1, 2)
    torch.testing.assert_close(out.float(), ref, **tol(torch.bfloat16))


def test_native_and_torch_kernel_sets_give_the_same_greedy_tokens(tiny_llama, tier):
    path = tiny_llama("gqa3-odd")
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 33, 70)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for kernels in ("torch", tier):
        llm = LLM(path, dtype="float32", kernels=kernels, block_size=16, num_kv_blocks=128,
                  max_num_batched_tokens=32)
        assert llm.runner.model.ops.backend == ("torch" if kernels == "torch" else f"cpu-{tier}")
        outs[kernels] = [o.outputs[0].token_ids for o in
                         llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert outs[tier] == outs["torch"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 64, 301])
def test_lora_delta(native_lib, dtype, weights, tokens):
    """Adapter weights as stored (float32, bfloat16, float16) and B^T kept as its blocks; rows
    of an adapter in tiles of 1-4 (interleaved with other adapters' and base rows), K and the
    blocks' widths not multiples of a vector."""
    from pagewire.kernels.lora import lora_delta
    from tests.helpers import lora_case
    x, of_row, adapters, table = lora_case(tokens, 300, 203, (4, 16), seed=tokens,
                                           dtype=weights)
    x = x.to(dtype)
    base = torch.randn(tokens, 300).to(dtype)
    ours, ref = base.clone(), base.clone()
    native_lib.lora_delta(ours, x, of_row, table, 0)
    lora_delta(ref, x, adapters, 0)
    torch.testing.assert_close(ours, ref, **tol(dtype))
    assert torch.equal(ours[2::3], base[2::3])            # base rows untouched
