"""Attention sinks (gpt-oss): a learned logit per query head in each row's softmax, with no
value. The paged paths (torch reference; the native CPU backend, whose decode applies them
to its kernel's rows from their log-sum-exp and whose bfloat16 prefill adds each sink to its
rows' sums) against the definition written out: softmax over [scores, sink], the sink's
column dropped."""
from __future__ import annotations

import pytest
import torch

from pagewire.kernels.attention import Variant, apply_sinks, decode_attention
from pagewire.kernels.ops import select_ops
from tests.kernels.test_attention import DECODES, PREFILLS, _build


def naive_sink_attention(q, keys, values, scale, sinks, window=None, softcap=None):
    """q [n, Hq, D] (the last n positions); keys, values [ctx, Hkv, D] -> [n, Hq, D], float64."""
    n, hq, _ = q.shape
    ctx, hkv, _ = keys.shape
    k = keys.double().repeat_interleave(hq // hkv, dim=1)
    v = values.double().repeat_interleave(hq // hkv, dim=1)
    out = torch.empty(n, hq, q.shape[2], dtype=torch.float64)
    for i in range(n):
        pos = ctx - n + i
        first = 0 if window is None else max(0, pos - window + 1)
        for h in range(hq):
            scores = (k[first:pos + 1, h] @ q[i, h].double()) * scale          # [visible]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            logits = torch.cat([scores, sinks[h].double().view(1)])
            probs = torch.softmax(logits, 0)[:-1]
            out[i, h] = probs @ v[first:pos + 1, h]
    return out


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("window, softcap", [(None, None), (6, None), (6, 2.0)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 2)])
def test_paged_attention_with_sinks_matches_the_definition(kernels, window, softcap, num_heads,
                                                           num_kv_heads):
    """Decodes and prefills (fresh prompts, chunks over cached context) in one batch; sinks
    large and small against the scores, so they take from a fifth to nearly all of the mass.
    Prefills: SDPA with the sink as a key (or, soft-capped, the explicit softmax)."""
    cache, q, k, v, batch, full_kv = _build(16, 64, num_heads, num_kv_heads, seed=7)
    sinks = torch.linspace(-3.0, 4.0, num_heads)
    scale = 64 ** -0.5
    out = select_ops(torch.device("cpu"), kernels).attention(
        q, k, v, cache, batch, scale, Variant(window=window, softcap=softcap, sinks=sinks))
    row = 0
    for (ctx, n), (keys, values) in zip(DECODES + PREFILLS, full_kv):
        expected = naive_sink_attention(q[row:row + n], keys, values, scale, sinks, window,
                                        softcap)
        torch.testing.assert_close(out[row:row + n].double(), expected, atol=2e-6, rtol=2e-6,
                                   msg=lambda m: f"ctx={ctx} n={n}: {m}")
        row += n


def test_sinks_change_the_output_by_the_mass_they_take():
    """Without a window every row's output with sinks is its plain output times
    sigmoid(lse - sink) (apply_sinks), and the log-sum-exp counts the sink."""
    cache, q, _, _, batch, _ = _build(16, 64, 4, 2, seed=8)
    nd, sinks = batch.num_decode_tokens, torch.tensor([0.5, -1.0, 2.0, 8.0])
    args = (q[:nd], cache, batch.decode_block_tables, batch.decode_context_lens, 0.125)
    plain, plain_lse = decode_attention(*args, lse=True)
    sunk, sunk_lse = decode_attention(*args, Variant(sinks=sinks), lse=True)
    scaled, lse = apply_sinks(plain, plain_lse, sinks)
    torch.testing.assert_close(sunk, scaled, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sunk_lse, lse, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sunk_lse, torch.logaddexp(plain_lse, sinks), atol=1e-6, rtol=0)
    assert (sunk[:, 3].norm(dim=-1) < 0.1 * plain[:, 3].norm(dim=-1)).all()   # sink 8 wins


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_with_sinks_matches_torch(native_lib, dtype):
    """The native kernel's rows with the sink applied after, vs the torch reference's exact
    softmax over [scores, sink] (bfloat16: one more rounding of the row)."""
    from pagewire.kernels.ops import CpuOps, TorchOps
    cache, q, _, _, batch, _ = _build(16, 64, 8, 2, seed=9)
    nd, sinks = batch.num_decode_tokens, torch.linspace(-2.0, 3.0, 8)
    args = (q[:nd].to(dtype).contiguous(), cache.to(dtype), batch.decode_block_tables,
            batch.decode_context_lens, 0.125)
    for window in (None, 20):
        variant = Variant(window=window, sinks=sinks)
        ours, ours_lse = CpuOps(native_lib).decode_lse(*args, variant)
        ref, ref_lse = TorchOps().decode_lse(*args, variant)
        tol = 1e-5 if dtype == torch.float32 else 2e-2       # bf16: torch's scores rounded
        torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(ours_lse, ref_lse, atol=tol, rtol=0)


def test_native_prefill_with_sinks_matches_the_definition(native_lib, monkeypatch):
    """The AVX512-BF16 prefill kernel (each sink's exponential on its row's running maximum
    added to the row's sum) over fresh prompts and chunks with cached context, windowed."""
    from pagewire.kernels.ops import CpuOps
    if not native_lib.bf16_dot:
        pytest.skip(f"the native prefill needs AVX512-BF16 (tier {native_lib.tier})")
    calls = []
    kernel = native_lib.prefill_attention
    monkeypatch.setattr(native_lib, "prefill_attention",
                        lambda *a, **kw: calls.append(a[-1]) or kernel(*a, **kw))
    _bf16_sinks_close_to_the_definition(CpuOps(native_lib), seed=12)
    assert len(calls) == 1 and calls[0] is not None             # the kernel took the sinks


def test_variants_compare_by_window_and_softcap():
    assert Variant(window=4, sinks=torch.zeros(2)) == Variant(window=4, sinks=torch.ones(2))
    assert not Variant(sinks=torch.zeros(2)).plain and Variant().plain


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_bfloat16_attention_with_sinks_stays_close_to_the_definition(kernels):
    _bf16_sinks_close_to_the_definition(select_ops(torch.device("cpu"), kernels), seed=10)


def _bf16_sinks_close_to_the_definition(ops, seed: int) -> None:
    """bfloat16 queries, keys, values and cache, sinks and a window of 6 through `ops`:
    within bfloat16's rounding of the output."""
    cache, q, k, v, batch, full_kv = _build(16, 64, 4, 2, seed=seed)
    sinks, bf = torch.tensor([-2.0, 0.5, 1.5, 3.0]), torch.bfloat16
    out = ops.attention(q.to(bf), k.to(bf), v.to(bf), cache.to(bf), batch, 0.125,
                        Variant(window=6, sinks=sinks))
    row = 0
    for (ctx, n), (keys, values) in zip(DECODES + PREFILLS, full_kv):
        expected = naive_sink_attention(q[row:row + n].to(bf), keys.to(bf), values.to(bf),
                                        0.125, sinks, 6)
        torch.testing.assert_close(out[row:row + n].double(), expected, atol=3e-2, rtol=3e-2)
        row += n
