"""The Triton fused mixture-of-experts (kernels/moe_triton.py) against kernels/moe.py's
grouping (sparse_mlp), on CPU under the Triton interpreter with tiny tiles (16 rows, 32
columns, 32 deep): float32 within 1e-5 absolute + 1e-4 relative (the same products, summed
in another order); bfloat16 within one bfloat16 rounding of the output. The alignment is
checked element by element on a hand example. The test marked gpu runs TritonOps.moe on
CUDA in bfloat16 and is skipped without CUDA."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton

import pytest
import torch

from pagewire.executor.models.model_config import LlamaConfig
from pagewire.executor.models.moe import SparseMoE
from pagewire.executor.parallel import TensorParallel
from pagewire.kernels import moe
from pagewire.kernels.moe_triton import (MoeBlocks, StackedExperts, align_by_expert, fused_moe,
                                         stacked_experts, triton_moe_block)
from pagewire.kernels.ops import TorchOps

pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
on_cpu = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
TINY = MoeBlocks(m=16, n=32, k=32)
TOL = dict(atol=1e-5, rtol=1e-4)
E, K, H, I = 8, 2, 64, 32


def _block(shared: bool = False, tp: TensorParallel | None = None, seed: int = 0) -> SparseMoE:
    """E experts, top-2 renormalised, H 64, I 32; random weights (the router's tenfold, so
    routing is decisive)."""
    cfg = LlamaConfig(vocab_size=16, hidden_size=H, intermediate_size=48, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32, num_experts=E,
                      experts_per_token=K, expert_intermediate_size=I, normalize_top_k=True,
                      shared_expert_size=48 if shared else 0)
    torch.manual_seed(seed)
    block = SparseMoE(cfg, tp or TensorParallel())
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
        block.router.weight.mul_(10)
    return block


def _fused(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    experts = stacked_experts(block)
    weights, ids = moe.block_route(block, x)
    return fused_moe(x, experts.w13, experts.w2, weights, ids, blocks=TINY)


# ---- alignment ---------------------------------------------------------------------------

def test_align_by_expert_hand_example():
    """Pairs (token * 2 + slot): expert 0 <- 1, 2; expert 3 <- 0, 3, 5; expert 5 <- 4; runs
    padded to blocks of 2 with the pair count (6); the capacity (12) bounds any routing."""
    ids = torch.tensor([[3, 0], [0, 3], [5, 3]])
    a = align_by_expert(ids, block_m=2, num_experts=6)
    assert a.sorted_ids.tolist() == [1, 2, 0, 3, 5, 6, 4, 6, 6, 6, 6, 6]
    assert a.expert_ids.tolist() == [0, 3, 3, 5, -1, -1]
    assert a.used.tolist() == [8] and a.num_pairs == 6
    # expert parallel: this rank holds experts 3 and 5 (stacked 0 and 1); expert 0's pairs
    # are left out
    held = torch.tensor([-1, -1, -1, 0, -1, 1])
    a = align_by_expert(ids, block_m=2, num_experts=2, expert_map=held)
    assert a.sorted_ids.tolist() == [0, 3, 5, 6, 4, 6, 6, 6]
    assert a.expert_ids.tolist() == [0, 0, 1, -1]
    assert a.used.tolist() == [6]


def test_align_by_expert_places_every_pair_once_in_its_experts_blocks():
    g = torch.Generator().manual_seed(3)
    for tokens, k, experts, block_m in [(1, 2, 8, 16), (33, 4, 8, 4), (7, 3, 64, 2)]:
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
        a = align_by_expert(ids, block_m, experts)
        used = a.used.item()
        placed = a.sorted_ids[:used]
        real = placed[placed < tokens * k]
        assert sorted(real.tolist()) == list(range(tokens * k))
        assert (a.sorted_ids[used:] == tokens * k).all() and (a.expert_ids[used // block_m:]
                                                              == -1).all()
        block_of = a.expert_ids.repeat_interleave(block_m)[:used]
        real_at = placed < tokens * k
        assert torch.equal(block_of[real_at], ids.flatten()[real])
        assert used == sum(-(-int((ids == e).sum()) // block_m) * block_m
                           for e in range(experts))


# ---- the fused kernels against torch's grouping ------------------------------------------

@on_cpu
@pytest.mark.parametrize("tokens", [1, 5, 17])
def test_fused_moe_equals_sparse_mlp(tokens):
    block = _block(seed=tokens)
    x = torch.randn(tokens, H)
    with torch.no_grad():
        want = moe.sparse_mlp(TorchOps(), block, x)
        got = _fused(block, x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL)


@on_cpu
def test_fused_moe_ragged_shapes_and_weights():
    """H 40 and I 24, multiples of no tile (masked columns and depths), k 3 of 5 experts,
    weights not summing to one: each pair's expert MLP times its weight, in float64."""
    g = torch.Generator().manual_seed(2)
    w13, w2 = torch.randn(5, 48, 40, generator=g), torch.randn(5, 40, 24, generator=g)
    x, weights = torch.randn(6, 40, generator=g), torch.rand(6, 3, generator=g)
    ids = torch.stack([torch.randperm(5, generator=g)[:3] for _ in range(6)])
    want = torch.zeros(6, 40, dtype=torch.float64)
    for t, j in ((t, j) for t in range(6) for j in range(3)):
        gate, up = (w13[ids[t, j]].double() @ x[t].double()).chunk(2)
        want[t] += weights[t, j] * (w2[ids[t, j]].double() @ (torch.nn.functional.silu(gate) * up))
    got = fused_moe(x, w13, w2, weights, ids, blocks=TINY)
    torch.testing.assert_close(got.double(), want, **TOL)


@on_cpu
def test_fused_moe_lone_unchosen_and_tied_experts():
    """The router reads x's first E features (logits = 10 x[:, :E]): token 0 alone chooses
    expert 7, experts 5 and 6 go unchosen, and tokens 2-3 tie three ways (route: the lower
    experts)."""
    block = _block(seed=9)
    logits = torch.tensor([[0.0, 0, 0, 0, 0, 0, 0, 3],   # experts 7, then 0 (a tie below)
                           [2.0, 1, 0, 0, 0, 0, 0, 0],   # 0, 1
                           [1.0, 1, 1, 0, 0, 0, 0, 0],   # tie: 0, 1
                           [0.0, 0, 3, 3, 3, 0, 0, 0],   # tie: 2, 3
                           [0.0, 0, 0, 1, 2, 0, 0, 0]])  # 4, 3
    x = torch.randn(5, H)
    x[:, :E] = logits
    with torch.no_grad():
        block.router.weight.zero_()
        block.router.weight[:, :E] = 10 * torch.eye(E)
        _, ids = moe.block_route(block, x)
        assert ids.tolist() == [[7, 0], [0, 1], [0, 1], [2, 3], [4, 3]]
        want = moe.sparse_mlp(TorchOps(), block, x)
        got = _fused(block, x)
    torch.testing.assert_close(got, want, **TOL)


@on_cpu
@pytest.mark.parametrize("tokens", [3, 17])
def test_fused_moe_bfloat16_rounds_as_the_linears_do(tokens):
    """Each expert's gate_up and down outputs rounded to bfloat16, as the Linears' are; the
    weighted sum in float32, rounded once. The interpreter rounds float32 to bfloat16 toward
    zero (torch and a GPU: to nearest), so its roundings drift further than torch's (1.6% of
    the largest output, where torch's bfloat16 is 0.5-0.8% from float32): within 1/32 of it.
    The gpu test below bounds the compiled kernel's."""
    block = _block(seed=tokens + 1).to(torch.bfloat16)
    x = torch.randn(tokens, H).to(torch.bfloat16)
    with torch.no_grad():
        want = moe.sparse_mlp(TorchOps(), block, x)
        got = _fused(block, x)
    assert got.dtype == torch.bfloat16
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=scale / 32, rtol=0)


@on_cpu
@pytest.mark.parametrize("shared", [False, True])
def test_block_with_shared_expert_and_expert_parallel_partials(shared):
    """triton_moe_block (as TritonOps.moe runs it on CUDA): the shared expert added in
    float32; on an expert-parallel rank (experts 4-7 held) the float32 partial, pairs of
    another rank's experts left out."""
    whole = _block(shared, seed=4)
    x = torch.randn(9, H)
    with torch.no_grad():
        got = triton_moe_block(TorchOps(), whole, x, stacked_experts(whole))
        torch.testing.assert_close(got, moe.sparse_mlp(TorchOps(), whole, x), **TOL)
        rank = _block(shared, TensorParallel(1, 2, expert_parallel=True), seed=5)
        experts = stacked_experts(rank)
        assert experts.expert_map.tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
        got = triton_moe_block(TorchOps(), rank, x, experts)
        want = moe.sparse_mlp(TorchOps(), rank, x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL)


@on_cpu
def test_the_fused_block_counts_the_experts_chosen():
    """SparseMoE.reads on the Triton path: the distinct experts the tokens chose (all of
    them, whichever rank holds them), as the torch grouping counts, added on the device."""
    block = _block(seed=7)
    block.reads = torch.zeros(1, dtype=torch.int64)
    for tokens in (1, 9):
        x = torch.randn(tokens, H)
        with torch.no_grad():
            chosen = len(set(moe.block_route(block, x)[1].flatten().tolist()))
            triton_moe_block(TorchOps(), block, x, stacked_experts(block))
            assert int(block.reads) == chosen
            moe.sparse_mlp(TorchOps(), block, x)
            assert int(block.reads) == 2 * chosen
        block.reads.zero_()


def test_stacked_experts_are_the_experts_weights_once():
    block = _block(seed=6)
    before = block.experts["3"].down.weight.detach().clone()
    experts = stacked_experts(block)
    assert experts.w13.shape == (E, 2 * I, H) and experts.w2.shape == (E, H, I)
    assert experts.expert_map is None
    for e in range(E):          # the Linears' weights are views of the stacks: held once
        assert block.experts[str(e)].gate_up.weight.data_ptr() == experts.w13[e].data_ptr()
        assert block.experts[str(e)].down.weight.data_ptr() == experts.w2[e].data_ptr()
    assert torch.equal(experts.w2[3], before)
    assert stacked_experts(block) is experts                     # built once
    packed = _block(seed=6)
    packed.experts["2"].down.pack()                              # not a plain dense weight
    if packed.experts["2"].down.packed is not None:
        assert stacked_experts(packed) is None and stacked_experts(packed) is None


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton runs CPU tensors only interpreted")
def test_triton_ops_moe_on_cpu_tensors_is_torchs_grouping():
    from pagewire.kernels.triton_ops import TritonOps
    block = _block(seed=7)
    x = torch.randn(4, H)
    with torch.no_grad():      # TritonOps' silu_and_mul (interpreted) beside torch's F.silu
        torch.testing.assert_close(TritonOps().moe(block, x),
                                   moe.sparse_mlp(TorchOps(), block, x), **TOL)
    assert getattr(block, "triton_experts", None) is None        # nothing stacked on CPU


# ---- on CUDA -----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
def test_triton_ops_moe_on_cuda(shared, dtype):
    """Compiled: float32 within TOL; bfloat16 within 1/64 of the largest output (a product
    summed in another order may round the other way, and so move its expert's output)."""
    from pagewire.kernels.triton_ops import TritonOps
    block = _block(shared, seed=8).to("cuda", dtype)
    for tokens in (1, 7, 300):            # decode (16-row blocks) and prefill (64-row blocks)
        x = torch.randn(tokens, H, device="cuda").to(dtype)
        with torch.no_grad():
            got = TritonOps(torch.device("cuda")).moe(block, x)
            want = moe.sparse_mlp(TorchOps(), block, x)
        assert isinstance(block.triton_experts, StackedExperts) and got.dtype == dtype
        tol = TOL if dtype == torch.float32 else dict(atol=want.float().abs().max().item() / 64,
                                                        rtol=0)
        torch.testing.assert_close(got.float(), want.float(), **tol)
