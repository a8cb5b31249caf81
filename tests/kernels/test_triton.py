"""The Triton kernels against their torch references, on CPU under the Triton interpreter
(float32, tolerance ~1e-4): every output buffer is poisoned with NaN first, so an element a
kernel fails to write fails the comparison. Then a tiny Llama's forward pass with TritonOps vs
TorchOps on one mixed batch. Tests marked gpu run the launchers on CUDA tensors (compiled for
real when TRITON_INTERPRET=0) and are skipped without CUDA."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton

import math

import pytest
import torch

from pagewire.kernels.activation import silu_and_mul, triton_silu_and_mul
from pagewire.kernels.attention import (AttentionBatch, PrefillSpan, decode_attention,
                                        paged_attention, reference_attention,
                                        triton_decode_attention, triton_paged_attention,
                                        triton_prefill_attention, varlen_prefills)
from pagewire.kernels.cache import triton_write_kv, write_kv
from pagewire.kernels.norm import add_rms_norm, triton_add_rms_norm
from pagewire.kernels.ops import TorchOps, select_ops
from pagewire.kernels.rotary import apply_rope, rope_cos_sin, triton_rope, triton_rope_table_
from pagewire.kernels.token_sampling import top_k_top_p_mask, triton_top_k_top_p_mask

pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
on_cpu = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
TOL = dict(atol=1e-4, rtol=1e-4)
GQA = [(2, 2), (4, 2), (8, 2)]            # (Hq, Hkv): ratios 1, 2, 4


def nan(*shape, device="cpu", dtype=torch.float32):
    return torch.full(shape, float("nan"), device=device, dtype=dtype)


def _slots(table, positions, block_size):
    return table[positions // block_size] * block_size + positions % block_size


def _paged(seqs, block_size, hkv, d, g, device="cpu", dtype=torch.float32):
    """A cache holding sequences of the given context lengths at shuffled blocks (the
    unused blocks and slots random too). Returns cache, [block table], [(keys, values)]."""
    need = [math.ceil(ctx / block_size) for ctx in seqs]
    ids = torch.randperm(sum(need) + 2, generator=g)
    cache = torch.randn(2, sum(need) + 2, block_size, hkv, d, generator=g)
    tables, kv, at = [], [], 0
    for ctx, n in zip(seqs, need):
        table = ids[at:at + n]
        at += n
        keys, values = torch.randn(ctx, hkv, d, generator=g), torch.randn(ctx, hkv, d, generator=g)
        write_kv(cache, keys, values, _slots(table, torch.arange(ctx), block_size))
        tables.append(table)
        kv.append((keys, values))
    return (cache.to(device, dtype), [t.to(device) for t in tables],
            [(k.to(device, dtype), v.to(device, dtype)) for k, v in kv])


def _padded(tables, extra=0):
    """[len(tables), widest + extra] int64, padded with block 0."""
    width = max(len(t) for t in tables) + extra
    out = torch.zeros(len(tables), width, dtype=torch.int64, device=tables[0].device)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


# ---- cache write -------------------------------------------------------------------------

@on_cpu
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_write_kv_matches_reference(block_size):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, hkv, d, t = 5, 2, 64, 23
    cache = nan(2, num_blocks, block_size, hkv, d)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:min(t, num_blocks * block_size)]
    qkv = torch.randn(len(slots), (4 + 2 * hkv) * d, generator=g)   # k, v: strided views
    k = qkv[:, 4 * d:(4 + hkv) * d].view(-1, hkv, d)
    v = qkv[:, (4 + hkv) * d:].view(-1, hkv, d)
    expected = cache.clone()
    write_kv(expected, k, v, slots)
    triton_write_kv(cache, k, v, slots)
    assert torch.equal(cache.isnan(), expected.isnan())            # the same slots written
    assert torch.equal(cache.nan_to_num(), expected.nan_to_num())  # with the same values


@on_cpu
def test_write_kv_skips_negative_slots_and_checks_arguments():
    cache = nan(2, 2, 4, 1, 16)
    k = torch.randn(3, 1, 16)
    triton_write_kv(cache, k, k, torch.tensor([5, -1, 0]))
    assert torch.equal(cache[0, 1, 1], k[0]) and torch.equal(cache[1, 0, 0], k[2])
    assert cache.isnan().sum() == cache.numel() - 4 * 16
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_write_kv(cache, k, k, torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        triton_write_kv(cache, k.double(), k.double(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="k must be"):
        triton_write_kv(cache, k.view(3, 16), k, torch.tensor([0, 1, 2]))


# ---- decode ------------------------------------------------------------------------------

def _decode_case(block_size, d, hq, hkv, seed, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    contexts = sorted({1, 2, block_size, block_size + 1, 3 * block_size - 1, 47})
    cache, tables, _ = _paged(contexts, block_size, hkv, d, g, device, dtype)
    q = torch.randn(len(contexts), hq + 3, d, generator=g).to(device, dtype)[:, 1:hq + 1]  # strided
    return q, cache, _padded(tables), torch.tensor(contexts, device=device)


@on_cpu
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_attention(block_size, head_dim, hq, hkv):
    q, cache, tables, lens = _decode_case(block_size, head_dim, hq, hkv, seed=block_size + hq)
    scale = head_dim ** -0.5
    expected = decode_attention(q, cache, tables, lens, scale)
    for splits in (1, 4):                      # one split, and several over the long contexts
        out = triton_decode_attention(q, cache, tables, lens, scale, num_splits=splits,
                                      block_n=16, out=nan(*q.shape))
        torch.testing.assert_close(out, expected, **TOL, msg=lambda m: f"{splits} splits: {m}")


@on_cpu
def test_decode_attention_default_splits_and_wide_padded_table():
    q, cache, tables, lens = _decode_case(16, 64, 4, 2, seed=7)
    wide = torch.cat([tables, torch.zeros(len(lens), 9, dtype=torch.int64)], dim=1)
    expected = decode_attention(q, cache, tables, lens, 0.125)
    for splits in (None, 2, 1000):
        out = triton_decode_attention(q, cache, wide, lens, 0.125, num_splits=splits)
        torch.testing.assert_close(out, expected, **TOL)


@on_cpu
def test_decode_attention_checks_arguments():
    q, cache, tables, lens = _decode_case(16, 64, 4, 2, seed=8)
    with pytest.raises(ValueError, match="block_tables"):
        triton_decode_attention(q, cache, tables.int(), lens, 0.1)
    with pytest.raises(ValueError, match="context_lens"):
        triton_decode_attention(q, cache, tables, lens[:-1], 0.1)
    with pytest.raises(ValueError, match="multiple"):
        triton_decode_attention(q[:, :3], cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="dtype"):
        triton_decode_attention(q.double(), cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="last dimension"):
        triton_decode_attention(torch.randn(len(lens), 4, 128)[:, :, ::2], cache, tables,
                                lens, 0.1)
    with pytest.raises(ValueError, match="kv_cache"):
        triton_decode_attention(q, cache[0], tables, lens, 0.1)


# ---- prefill -----------------------------------------------------------------------------

# (context_len once written, query tokens): fresh prompts, chunks over cached context, ragged.
SPANS = [(19, 19), (50, 7), (33, 2), (3, 3), (70, 45), (1, 1)]


@on_cpu
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_prefill_attention_varlen(block_size, head_dim, hq, hkv):
    g = torch.Generator().manual_seed(100 + block_size + hq)
    cache, tables, kv = _paged([ctx for ctx, _ in SPANS], block_size, hkv, head_dim, g)
    lead = 3                                              # rows before the spans: untouched
    total = lead + sum(n for _, n in SPANS)
    q = torch.randn(total, hq, head_dim, generator=g)
    starts = torch.tensor([lead] + [lead + sum(n for _, n in SPANS[:i + 1])
                                    for i in range(len(SPANS))])
    scale = head_dim ** -0.5
    out = triton_prefill_attention(q, cache, starts, torch.tensor([c for c, _ in SPANS]),
                                   _padded(tables, extra=2), scale, out=nan(total, hq, head_dim),
                                   block_m=16, block_n=16)
    assert out[:lead].isnan().all()
    for i, ((ctx, n), (keys, values)) in enumerate(zip(SPANS, kv)):
        s = starts[i].item()
        torch.testing.assert_close(out[s:s + n], reference_attention(q[s:s + n], keys, values, scale),
                                   **TOL, msg=lambda m: f"span ctx={ctx} n={n}: {m}")


@on_cpu
def test_prefill_attention_default_tiles_and_checks():
    g = torch.Generator().manual_seed(9)
    cache, tables, kv = _paged([40, 5], 16, 2, 64, g)
    q = torch.randn(42, 4, 64, generator=g)
    starts, lens = torch.tensor([0, 37, 42]), torch.tensor([40, 5])
    out = triton_prefill_attention(q, cache, starts, lens, _padded(tables), 0.125,
                                   out=nan(42, 4, 64))
    torch.testing.assert_close(out[:37], reference_attention(q[:37], *kv[0], 0.125), **TOL)
    torch.testing.assert_close(out[37:], reference_attention(q[37:], *kv[1], 0.125), **TOL)
    with pytest.raises(ValueError, match="query_start"):
        triton_prefill_attention(q, cache, starts[:2], lens, _padded(tables), 0.125)
    with pytest.raises(ValueError, match="out"):
        triton_prefill_attention(q, cache, starts, lens, _padded(tables), 0.125,
                                 out=nan(42, 4, 32))


# ---- the whole batch ---------------------------------------------------------------------

def _mixed_batch(block_size, hq, hkv, d, g, device="cpu", dtype=torch.float32):
    """Decodes then prefill spans: the cache holds each sequence's earlier context; q, k, v
    are this step's tokens. Returns cache, q, k, v, AttentionBatch."""
    decodes, prefills = [1, 37, 64, 5], [(19, 19), (50, 7), (33, 2), (70, 45)]
    seqs = [(c, 1) for c in decodes] + prefills
    cache, tables, kv = _paged([c for c, _ in seqs], block_size, hkv, d, g, device, dtype)
    ks, vs, slots, spans, row = [], [], [], [], len(decodes)
    for (ctx, n), table, (keys, values) in zip(seqs, tables, kv):
        new = torch.arange(ctx - n, ctx, device=device)
        slots.append(_slots(table, new, block_size))
        ks.append(keys[ctx - n:])
        vs.append(values[ctx - n:])
        cache.view(2, -1, hkv, d)[:, slots[-1]] = float("nan")     # poisoned until written
        if n > 1:
            spans.append(PrefillSpan(row, n, ctx, table))
            row += n
    q = torch.randn(row, hq, d, generator=g).to(device, dtype)
    batch = AttentionBatch(torch.cat(slots), len(decodes), _padded(tables[:len(decodes)]),
                           torch.tensor(decodes, device=device), spans)
    return cache, q, torch.cat(ks), torch.cat(vs), batch


@on_cpu
@pytest.mark.parametrize("block_size,hq,hkv,d", [(1, 4, 4, 64), (16, 4, 2, 64), (32, 8, 2, 64),
                                                  (16, 6, 2, 80)])     # odd group and head_dim
def test_paged_attention_mixed_batch(block_size, hq, hkv, d):
    g = torch.Generator().manual_seed(block_size)
    cache, q, k, v, batch = _mixed_batch(block_size, hq, hkv, d, g)
    expected_cache = cache.clone()
    expected = paged_attention(q, k, v, expected_cache, batch, 0.125)
    out = triton_paged_attention(q, k, v, cache, batch, 0.125, out=nan(*q.shape))
    torch.testing.assert_close(out, expected, **TOL)
    assert torch.equal(cache, expected_cache)
    assert not cache.isnan().any()
    out2 = triton_paged_attention(q, k, v, cache, batch, 0.125)    # varlen tensors reused
    torch.testing.assert_close(out2, expected, **TOL)


@on_cpu
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_paged_attention_over_a_quantized_cache(dtype):
    """The write quantizes, decode and prefill read codes times scales (kv_quant.py): against
    the torch path on the same cache. Codes may differ by a rounding tie (Triton rounds ties
    away from zero, torch to even), so values agree to a step and outputs to ~1e-2."""
    from pagewire.kernels import kv_quant
    g = torch.Generator().manual_seed(3)
    plain, q, k, v, batch = _mixed_batch(16, 4, 2, 64, g)
    cache = kv_quant.quantize(torch.nan_to_num(plain), dtype)    # the step's slots: zeros
    expected_cache = cache.clone()
    expected = paged_attention(q, k, v, expected_cache, batch, 0.125)
    out = triton_paged_attention(q, k, v, cache, batch, 0.125, out=nan(*q.shape))
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    ours, theirs = kv_quant.dequantize(cache), kv_quant.dequantize(expected_cache)
    step = theirs.abs().amax(-1, keepdim=True) / kv_quant.QMAX[dtype] * (
        1 if dtype == torch.int8 else 32)                        # float8: 2^-4 .. 2^-3 of max
    assert ((ours - theirs).abs() <= step * 1.001).all()


def test_varlen_prefills_needs_consecutive_spans():
    t = torch.arange(2)
    with pytest.raises(ValueError, match="consecutive"):
        varlen_prefills([PrefillSpan(0, 3, 3, t), PrefillSpan(4, 2, 2, t)], torch.device("cpu"))
    starts, lens, tables, longest = varlen_prefills(
        [PrefillSpan(2, 3, 9, t), PrefillSpan(5, 2, 2, t[:1])], torch.device("cpu"))
    assert starts.tolist() == [2, 5, 7] and lens.tolist() == [9, 2] and longest == 3
    assert tables.tolist() == [[0, 1], [0, 0]]


# ---- norm, rope, activation ----------------------------------------------------------------

@on_cpu
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [96, 256])
def test_add_rms_norm(hidden, with_residual):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(9, hidden + 40, generator=g)[:, :hidden]      # strided rows
    res = torch.randn(9, hidden, generator=g) if with_residual else None
    w = torch.randn(hidden, generator=g)
    ref_out, ref_res = add_rms_norm(x, None if res is None else res.clone(), w, 1e-5)
    out, new_res = triton_add_rms_norm(x, res, w, 1e-5, out=nan(9, hidden))
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    assert new_res is (res if with_residual else x)                 # updated in place
    with pytest.raises(ValueError, match="weight"):
        triton_add_rms_norm(x, res, w[:-1], 1e-5)


@on_cpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    hq, hkv, t = 4, 2, 11
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, generator=g)
    table = rope_cos_sin(head_dim, 512, 10000.0)
    positions = torch.randint(0, 512, (t,), generator=g)
    q = qkv[:, :hq * head_dim].view(t, hq, head_dim)                # strided view
    expected = apply_rope(q, table[positions])
    torch.testing.assert_close(triton_rope(q, table[positions], out=nan(t, hq, head_dim)),
                               expected, **TOL)
    ref = TorchOps().split_qkv_rope(qkv.clone(), hq, hkv, head_dim, table, positions)
    got = select_ops(torch.device("cpu"), "triton").split_qkv_rope(qkv, hq, hkv, head_dim,
                                                                  table, positions)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)
    assert got[0].data_ptr() == qkv.data_ptr()                     # rotated in place
    with pytest.raises(ValueError, match="positions"):
        triton_rope_table_(q, table, positions.int())
    with pytest.raises(ValueError, match="cos_sin"):
        triton_rope(q, table[positions][:, :32])


@on_cpu
@pytest.mark.parametrize("inter", [40, 300, 1500])
def test_silu_and_mul(inter):
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(7, 2 * inter + 8, generator=g)[:, :2 * inter]   # strided rows
    out = triton_silu_and_mul(x, out=nan(7, inter))
    torch.testing.assert_close(out, silu_and_mul(x), **TOL)
    with pytest.raises(ValueError, match="gate_up"):
        triton_silu_and_mul(x[:, :-1])


@on_cpu
@pytest.mark.parametrize("tokens, n, k", [(1, 300, 200), (10, 64, 576), (5, 1000, 33)])
def test_lora_delta(tokens, n, k):
    """One launch for every row, adapters of ranks 4, 16 and 1 (zero-padded to 16) mixed
    with base rows, which stay as they were; an adapter without the linear adds nothing."""
    from pagewire.kernels.lora import lora_delta, stacked_dense, triton_lora_delta
    from tests.helpers import lora_case
    x, of_row, adapters, _ = lora_case(tokens, n, k, (4, 16, 1), seed=n)
    weights = [w for w, _ in adapters]
    base = torch.randn(tokens, n, generator=torch.Generator().manual_seed(1))
    ours, ref = base.clone(), base.clone()
    stacked = stacked_dense(weights, 0)
    assert stacked[0].shape == (3, 16, k) and stacked[2].tolist() == [4, 16, 1]
    triton_lora_delta(ours, x, of_row, stacked)
    lora_delta(ref, x, adapters, 0)
    torch.testing.assert_close(ours, ref, **TOL)
    assert torch.equal(ours[2::3], base[2::3])
    without_first = [{}, *weights[1:]]            # adapter 0 leaves this linear alone
    ours, ref = base.clone(), base.clone()
    triton_lora_delta(ours, x, of_row, stacked_dense(without_first, 0))
    lora_delta(ref, x, list(zip(without_first, (rows for _, rows in adapters))), 0)
    torch.testing.assert_close(ours, ref, **TOL)
    assert torch.equal(ours[0::3], base[0::3])
    assert stacked_dense([{}, {}], 0) is None
    with pytest.raises(ValueError, match="contiguous"):
        triton_lora_delta(ours, x.T, of_row, stacked)
    # TritonOps takes a step's LoraBatch (executor/lora.py), stacking once per linear
    from types import SimpleNamespace

    from pagewire.executor.lora import LoraBatch
    batch = LoraBatch(of_row, [SimpleNamespace(table=torch.zeros(1, 6, dtype=torch.int64),
                                               weights=w, adapts_experts=False)
                               for w in weights])
    ours, ref = base.clone(), base.clone()
    select_ops(torch.device("cpu"), "triton").lora_delta(ours, x, batch, 0)
    lora_delta(ref, x, adapters, 0)
    torch.testing.assert_close(ours, ref, **TOL)
    assert batch.dense(0) is batch.dense(0)


# ---- sampling ------------------------------------------------------------------------------

@on_cpu
@pytest.mark.parametrize("vocab,block", [(50, 64), (1000, 512), (3000, 1024)])
def test_top_k_top_p_mask(vocab, block):
    g = torch.Generator().manual_seed(vocab)
    top_k = torch.tensor([0, 1, 5, 40, vocab, 0, 20, 3, vocab + 7, 40])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.9, 0.3, 0.95, 0.01, 0.0, 1.0])
    logits = torch.randn(len(top_k), vocab, generator=g) * 3
    logits[0, :7] = float("-inf")                                  # banned tokens
    logits[9, 0] = 60.0           # the cumulative sum rounds to 1 after token 0: top_p = 1 still
    expected = top_k_top_p_mask(logits, top_k, top_p)              # keeps the tail
    out = triton_top_k_top_p_mask(logits, top_k, top_p, out=nan(len(top_k), vocab), block=block)
    assert torch.equal(out, expected)
    kept = expected.isfinite().sum(1)
    assert kept[1] == 1 and kept[2] == 5 and kept[8] == 1 and kept[0] == vocab - 7
    assert kept[9] == 40
    in_place = logits.clone()
    triton_top_k_top_p_mask(in_place, top_k, top_p, out=in_place, block=block)
    assert torch.equal(in_place, expected)
    with pytest.raises(ValueError, match="top_p"):
        triton_top_k_top_p_mask(logits, top_k, top_p.double())


# ---- a tiny model through TritonOps ----------------------------------------------------------

@on_cpu
def test_tiny_llama_forward_with_triton_ops_matches_torch_ops():
    from pagewire.executor.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=288, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64, max_position=256)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    g = torch.Generator().manual_seed(1)
    cache, q, _, _, batch = _mixed_batch(16, cfg.num_heads, cfg.num_kv_heads, 64, g)
    # One cache per layer, the same block tables: earlier context random, new slots poisoned.
    caches = [cache] + [torch.randn(cache.shape, generator=g) for _ in range(cfg.num_layers - 1)]
    for c in caches[1:]:
        c.view(2, -1, cfg.num_kv_heads, 64)[:, batch.slot_mapping] = float("nan")
    tokens = q.shape[0]
    positions = torch.cat([torch.tensor([c - 1]) for c in batch.decode_context_lens.tolist()]
                          + [torch.arange(s.context_len - s.num_tokens, s.context_len)
                             for s in batch.prefills])
    input_ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=g)
    results = {}
    for kind, ops in (("torch", TorchOps()), ("triton", select_ops(torch.device("cpu"), "triton"))):
        assert ops.name == kind
        with_ops = LlamaForCausalLM(cfg, ops=ops).eval()       # a model takes its kernels built
        with_ops.load_state_dict(model.state_dict())
        kv = [c.clone() for c in caches]
        with torch.no_grad():
            results[kind] = (with_ops(input_ids, positions, kv, batch), kv)
    hidden, kv = results["triton"]
    torch.testing.assert_close(hidden, results["torch"][0], **TOL)
    for a, b in zip(kv, results["torch"][1]):
        torch.testing.assert_close(a, b, **TOL)


# ---- on CUDA -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launchers_on_cuda(dtype):
    dev, close = "cuda", lambda a, b, **kw: torch.testing.assert_close(a, b, **(kw or tol))
    tol = TOL if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    cache, q, k, v, batch = _mixed_batch(16, 8, 2, 128, torch.Generator().manual_seed(11), dev,
                                         dtype)
    ref_cache = cache.clone()
    expected = paged_attention(q, k, v, ref_cache, batch, 0.1)
    close(triton_paged_attention(q, k, v, cache, batch, 0.1, out=torch.full_like(q, torch.nan)),
          expected)
    assert torch.equal(cache, ref_cache)
    nd, tables, lens = batch.num_decode_tokens, batch.decode_block_tables, batch.decode_context_lens
    for splits in (1, 3, None):
        close(triton_decode_attention(q[:nd], cache, tables, lens, 0.1, num_splits=splits),
              decode_attention(q[:nd], cache, tables, lens, 0.1))
    x = torch.randn(33, 500, device=dev, dtype=dtype)
    res, w = torch.randn_like(x), torch.randn(500, device=dev, dtype=dtype)
    ref, got = add_rms_norm(x, res.clone(), w, 1e-6), triton_add_rms_norm(x, res, w, 1e-6)
    close(got[0], ref[0])
    close(got[1], ref[1], atol=0, rtol=0)
    cos_sin = rope_cos_sin(128, 64, 10000.0).to(dev)[torch.randint(0, 64, (33,))].to(dtype)
    xr = torch.randn(33, 3, 128, device=dev, dtype=dtype)
    close(triton_rope(xr, cos_sin), apply_rope(xr, cos_sin))
    close(triton_silu_and_mul(x[:, :400]), silu_and_mul(x[:, :400]))
    logits = torch.randn(4, 32000, device=dev) * 4
    top_k, top_p = torch.tensor([0, 50, 1000, 7], device=dev), torch.tensor([0.9, 1.0, 0.5, 0.99],
                                                                          device=dev)
    a, b = triton_top_k_top_p_mask(logits, top_k, top_p), top_k_top_p_mask(logits, top_k, top_p)
    # the nucleus edge may move by one token where the two sums round differently
    assert ((a.isfinite() != b.isfinite()).sum(1) <= 1).all()
    assert torch.equal(a[a.isfinite() & b.isfinite()], b[a.isfinite() & b.isfinite()])


@on_cpu
@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1)])
def test_decode_lse_and_cascade(hq, hkv):
    """The decode kernel's log-sum-exp equals the torch path's, and a batch under a shared
    prefix (cascade.py: the prefix once, each suffix, merged) equals the plain decode."""
    from pagewire.kernels.cascade import SharedPrefix
    g = torch.Generator().manual_seed(11)
    shared = torch.randperm(40, generator=g)
    cache = torch.randn(2, 40, 16, hkv, 64, generator=g)
    lens = torch.tensor([49, 50, 64, 70, 51, 90])                     # 3 shared blocks + own
    tables = torch.stack([torch.cat([shared[:3], shared[3 + 3 * i:6 + 3 * i]])
                          for i in range(len(lens))])
    q = torch.randn(len(lens), hq, 64, generator=g)
    expected, expected_lse = decode_attention(q, cache, tables, lens, 0.125, lse=True)
    lse = nan(len(lens), hq)
    out = triton_decode_attention(q, cache, tables, lens, 0.125, num_splits=2, lse=lse)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(lse, expected_lse, **TOL)
    batch = AttentionBatch(slot_mapping=torch.zeros(0, dtype=torch.int64),
                           num_decode_tokens=len(lens), decode_block_tables=tables,
                           decode_context_lens=lens, prefills=[],
                           cascade=SharedPrefix(tables[0, :3], 48, tables[:, 3:].contiguous(),
                                                lens - 48))
    empty = q[:0, :hkv]
    out = triton_paged_attention(q, empty, empty, cache, batch, 0.125, out=nan(*q.shape))
    torch.testing.assert_close(out, expected, **TOL)
