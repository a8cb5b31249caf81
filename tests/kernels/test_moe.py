"""Mixture-of-experts routing and expert grouping (kernels/moe.py): ties, a token's choices,
experts several tokens chose and experts none chose, against a dense reference that runs
every expert on every token."""
from __future__ import annotations

import pytest
import torch

from pagewire.executor.models.model_config import LlamaConfig
from pagewire.executor.models.moe import SparseMoE
from pagewire.executor.parallel import TensorParallel
from pagewire.kernels import moe
from pagewire.kernels.ops import TorchOps


def test_route_breaks_ties_toward_the_lower_expert_and_renormalises():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0],      # three-way tie for the top
                           [2.0, 2.0, -1.0, 5.0, 2.0]])
    weights, experts = moe.route(logits, 2, normalize=False)
    assert experts.tolist() == [[1, 2], [3, 0]]
    probs = torch.softmax(logits, -1)
    assert torch.equal(weights, torch.stack([probs[0, [1, 2]], probs[1, [3, 0]]]))
    weights, _ = moe.route(logits, 2, normalize=True)
    assert torch.allclose(weights[0], torch.tensor([0.5, 0.5]))
    assert torch.allclose(weights.sum(-1), torch.ones(2))


def test_route_softmax_is_float32_whatever_the_logits():
    logits = torch.randn(4, 8).bfloat16()
    weights, experts = moe.route(logits, 3, normalize=False)
    ref_w, ref_e = torch.topk(torch.softmax(logits.float(), -1), 3)
    assert weights.dtype == torch.float32 and torch.equal(weights, ref_w)
    assert torch.equal(experts, ref_e)


def test_by_expert_groups_tokens_in_order():
    experts = torch.tensor([[3, 0], [0, 3], [5, 3]])
    groups = [(e, t.tolist(), s.tolist()) for e, t, s in moe.by_expert(experts)]
    assert groups == [(0, [0, 1], [1, 0]), (3, [0, 1, 2], [0, 1, 1]), (5, [2], [0])]


def _moe(shared: bool, seed: int = 0) -> SparseMoE:
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, num_experts=6,
                      experts_per_token=2, expert_intermediate_size=32, normalize_top_k=True,
                      shared_expert_size=64 if shared else 0)
    torch.manual_seed(seed)
    block = SparseMoE(cfg, TensorParallel())
    block.cfg = cfg
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block


def _dense_reference(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the route's weights (zero where unchosen)."""
    weights, experts = moe.route(block.router(x), block.top_k, block.normalize)
    dense = torch.zeros(x.shape[0], block.num_experts).scatter(1, experts, weights)
    out = torch.zeros_like(x)
    for e in range(block.num_experts):
        gate, up = block.experts[str(e)].gate_up(x).chunk(2, -1)
        out += dense[:, e:e + 1] * block.experts[str(e)].down(torch.nn.functional.silu(gate) * up)
    if block.shared is not None:
        gate, up = block.shared.gate_up(x).chunk(2, -1)
        shared = block.shared.down(torch.nn.functional.silu(gate) * up)
        out += torch.sigmoid(block.shared_gate(x)) * shared
    return out


class _CountingOps(TorchOps):
    """Counts the rows each Linear multiplies."""

    def __init__(self):
        super().__init__()
        self.rows: dict[int, list[int]] = {}

    def linear(self, linear, x):
        self.rows.setdefault(id(linear), []).append(x.shape[0])
        return super().linear(linear, x)


@pytest.mark.parametrize("shared", [False, True])
def test_sparse_mlp_equals_every_expert_weighted(shared):
    block = _moe(shared)
    x = torch.randn(7, 32)
    ops = _CountingOps()
    with torch.no_grad():
        out = moe.sparse_mlp(ops, block, x)
        ref = _dense_reference(block, x)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)
    _, experts = moe.route(block.router(x).detach(), 2, True)
    for e in range(6):         # each chosen expert once, over all its tokens; the rest unread
        chose = int((experts == e).any(-1).sum())
        calls = ops.rows.get(id(block.experts[str(e)].gate_up), [])
        assert calls == ([chose] if chose else [])


def test_a_token_alone_reads_only_its_experts():
    block = _moe(False, seed=3)
    ops = _CountingOps()
    with torch.no_grad():
        moe.sparse_mlp(ops, block, torch.randn(1, 32))
    read = [e for e in range(6) if id(block.experts[str(e)].down) in ops.rows]
    assert len(read) == 2


def _quantized_moe(lib, shared: bool, dtype: torch.dtype) -> SparseMoE:
    """_moe's block, its experts' weights Q8_0 tiles serving every step (random blocks)."""
    import sys

    import numpy as np

    from pagewire.kernels import quant
    from pagewire.testing.gguf_writer import random_blocks
    block = _moe(shared, seed=5).to(dtype)
    rng = np.random.default_rng(0)
    experts = [*block.experts.values(), *([block.shared] if shared else [])]
    for linear in (lin for e in experts for lin in (e.gate_up, e.down)):
        rows = random_blocks("Q8_0", linear.out_features, linear.in_features, rng)
        linear.use_quantized(quant.pack(quant.Q8_0, rows, linear.in_features, lib), sys.maxsize)
        linear.drop_float()
    return block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
def test_native_block_equals_torch_grouping(native_lib, dtype, shared):
    """csrc/moe.cpp (CpuOps.moe) against kernels/moe.py's grouping over the same tiles, on
    each tier: a token alone, a few, and more tokens than experts (every expert chosen)."""
    from pagewire.kernels.ops import CpuOps
    block = _quantized_moe(native_lib, shared, dtype)
    ops = CpuOps(native_lib)
    block.native_spec = moe.native_spec(block, ops.capabilities.block_kinds)
    assert block.native_spec is not None
    torch.manual_seed(2)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.15, rtol=2e-2)
    for tokens in (1, 3, 17):
        x = torch.randn(tokens, 32).to(dtype)
        with torch.no_grad():
            got = ops.moe(block, x)
            want = moe.sparse_mlp(TorchOps(), block, x)
            # tokens whose k-th and next expert nearly tie may choose either (the router's
            # float32 sums are added in another order)
            probs = torch.softmax(x.float() @ block.router.weight.float().T, -1)
            top = probs.sort(-1, descending=True).values
            clear = top[:, 1] - top[:, 2] > 1e-4
        assert got.dtype == dtype
        assert torch.allclose(got.float()[clear], want.float()[clear], **tol), tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_block_is_the_same_whichever_thread_runs_an_expert(native_lib, dtype):
    """csrc/moe.cpp hands its experts out largest first to whichever thread is free
    (each_task): the outputs are the same bits on one thread as on two or three, for steps
    whose experts hold different counts of tokens (a decode step's) and for one token (its
    experts' rows split into tasks)."""
    from pagewire.kernels.ops import CpuOps
    block = _quantized_moe(native_lib, True, dtype)
    ops = CpuOps(native_lib)
    block.native_spec = moe.native_spec(block, ops.capabilities.block_kinds)
    torch.manual_seed(7)
    threads = torch.get_num_threads()
    try:
        for tokens in (1, 5, 16, 33):
            x = torch.randn(tokens, 32).to(dtype)
            outs = []
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                with torch.no_grad():
                    outs.append(ops.moe(block, x))
            counts = torch.bincount(moe.block_route(block, x)[1].flatten(), minlength=6)
            assert tokens == 1 or len(set(counts[counts > 0].tolist())) > 1, counts
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), tokens
    finally:
        torch.set_num_threads(threads)


def test_the_counts_follow_the_model_wherever_it_moves():
    """LlamaForCausalLM.expert_reads: each sparse layer's block counts into its row, on the
    model's device, the links kept when the model is moved or converted."""
    from pagewire.executor.models.llama import LlamaForCausalLM
    from pagewire.executor.models.model_config import LlamaConfig
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4,
                      experts_per_token=2, expert_intermediate_size=16)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    assert model.expert_reads.dtype == torch.int64
    for i, layer in enumerate(model.layers):
        layer.mlp.reads += i + 3
    assert model.expert_reads.tolist() == [3, 4] and model.take_expert_reads() == 7
    assert model.expert_reads.tolist() == [0, 0]


def test_both_paths_count_the_experts_a_call_chose(native_lib):
    """SparseMoE.reads: csrc/moe.cpp and kernels/moe.py each add the distinct experts the
    call's tokens chose (the metric pagewire:moe_experts_read sums them)."""
    from pagewire.kernels.ops import CpuOps
    block = _quantized_moe(native_lib, False, torch.float32)
    block.reads = torch.zeros(1, dtype=torch.int64)
    ops = CpuOps(native_lib)
    block.native_spec = moe.native_spec(block, ops.capabilities.block_kinds)
    torch.manual_seed(4)
    for tokens in (1, 2, 17):
        block.reads.zero_()
        x = torch.randn(tokens, 32)
        with torch.no_grad():
            chosen = len(set(moe.block_route(block, x)[1].flatten().tolist()))
            ops.moe(block, x)
            assert int(block.reads) == chosen, tokens
            moe.sparse_mlp(TorchOps(), block, x)
            assert int(block.reads) == 2 * chosen, tokens
        assert chosen == (block.top_k if tokens == 1 else chosen)


def test_native_spec_refuses_what_the_kernels_cannot_run(native_lib):
    from pagewire.kernels.ops import CpuOps
    kinds = CpuOps(native_lib).capabilities.block_kinds
    assert moe.native_spec(_moe(False), kinds) is None        # float experts: torch's path
    block = _quantized_moe(native_lib, False, torch.bfloat16)
    assert not moe.native_spec(block, kinds).partial
    block.float_partial = True                   # a rank's share: a float32 partial
    assert moe.native_spec(block, kinds).partial


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_partial_sums_are_one_ranks_output(expert_parallel):
    """Tensor parallel (every expert's rows split) and expert parallel (experts 0-2 on rank
    0, 3-5 on rank 1; the shared expert split either way): the ranks' float32 partials, as
    the layer's all-reduce sums them, are the whole block's output."""
    from pagewire.executor.parallel import shard_state
    whole = _moe(shared=True, seed=4)
    cfg = whole.cfg
    state = {f"layers.0.mlp.{k}": v for k, v in whole.state_dict().items()}
    x = torch.randn(5, 32)
    with torch.no_grad():
        want = moe.sparse_mlp(TorchOps(), whole, x)
        total = torch.zeros(5, 32)
        for rank in range(2):
            tp = TensorParallel(rank, 2, expert_parallel=expert_parallel)
            block = SparseMoE(cfg, tp)
            mine = {k.removeprefix("layers.0.mlp."): v
                    for k, v in shard_state(state, cfg, tp).items()}
            block.load_state_dict(mine)
            held = sorted(map(int, block.experts))
            assert held == ([0, 1, 2] if rank == 0 else [3, 4, 5]) if expert_parallel \
                else list(range(6))
            out = moe.sparse_mlp(TorchOps(), block, x)
            assert out.dtype == torch.float32
            total += out
    assert torch.allclose(total, want.float(), atol=1e-5, rtol=1e-4)


def _expert_adapters(block: SparseMoE, dtype: torch.dtype, tokens: int):
    """A LoraBatch (executor/lora.py) of two random adapters over `tokens` rows (some rows
    none): the first adapts every routed expert's gate/up and the odd ones' down, the second
    the even experts' down and the shared expert's gate/up."""
    from pagewire.executor.lora import LoraBatch, Loaded
    from pagewire.executor.models.lora_slots import num_dense_slots, num_slots
    from pagewire.kernels.lora import LoraWeights
    g = torch.Generator().manual_seed(7)

    def weights(linear, rank):
        a = torch.randn(rank, linear.in_features, generator=g) * 0.3
        bt = torch.randn(rank, linear.out_features, generator=g) * 0.3
        return LoraWeights(a.to(dtype), [(0, bt.to(dtype))], 0.5, linear.out_features)

    experts = [block.experts[str(e)] for e in range(block.num_experts)]
    first = {e.gate_up.lora_slot: weights(e.gate_up, 4) for e in experts}
    first.update({e.down.lora_slot: weights(e.down, 4) for e in experts[1::2]})
    second = {e.down.lora_slot: weights(e.down, 2) for e in experts[0::2]}
    if block.shared is not None:
        second[block.shared.gate_up.lora_slot] = weights(block.shared.gate_up, 2)
    loads = [Loaded(w, num_slots(block.cfg), i, host_memory=False,
                    first_expert_slot=num_dense_slots(1)) for i, w in enumerate((first, second))]
    rows = torch.randint(-1, 2, (tokens,), generator=g)
    return LoraBatch(rows, loads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
def test_native_block_adds_expert_adapters_as_torch_grouping_does(native_lib, dtype, shared):
    """csrc/moe.cpp with adapters of the experts (csrc/lora.cpp's deltas after each
    product's bias) against kernels/moe.py's grouping with the same adapters."""
    from pagewire.kernels.ops import CpuOps
    block = _quantized_moe(native_lib, shared, dtype)
    block.cfg = _moe(shared).cfg
    ops = CpuOps(native_lib)
    block.native_spec = moe.native_spec(block, ops.capabilities.block_kinds)
    torch.manual_seed(4)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.2, rtol=3e-2)
    for tokens in (1, 5, 17):
        x = torch.randn(tokens, 32).to(dtype)
        lora = _expert_adapters(block, dtype, tokens)
        assert lora.adapts_experts
        with torch.no_grad():
            got = ops.moe(block, x, lora)
            want = moe.sparse_mlp(TorchOps(), block, x, lora)
            base = ops.moe(block, x)
            probs = torch.softmax(x.float() @ block.router.weight.float().T, -1)
            top = probs.sort(-1, descending=True).values
            clear = top[:, 1] - top[:, 2] > 1e-4
        assert torch.allclose(got.float()[clear], want.float()[clear], **tol), tokens
        adapted = lora.adapter_of_row >= 0
        assert torch.equal(got[~adapted], base[~adapted])        # rows of no adapter: as is
        assert (got[adapted] != base[adapted]).any(-1).all()     # each adapted row moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_native_partials_sum_to_one_ranks_native_output(native_lib, expert_parallel,
                                                                  dtype):
    """csrc/moe.cpp on each rank's share (every expert's rows split, or whole experts a
    rank), the experts Q8_0 tiles: each rank's float32 partial is the grouping's on that rank
    (bfloat16: down products of float32 activations, as a float partial Linear's), and the
    ranks' partials sum to one rank's whole block, as the layer's all-reduce sums them."""
    import sys

    import gguf

    from pagewire.executor.parallel import shard_state
    from pagewire.kernels import quant
    from pagewire.kernels.ops import CpuOps
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, num_experts=6,
                      experts_per_token=2, expert_intermediate_size=64, normalize_top_k=True)
    torch.manual_seed(6)
    whole = SparseMoE(cfg, TensorParallel())
    with torch.no_grad():
        for p in whole.parameters():
            p.normal_(0, 0.2)
    state = {f"layers.0.mlp.{k}": v for k, v in whole.state_dict().items()}
    ops = CpuOps(native_lib)

    def native(block):
        """Its experts as Q8_0 tiles: each 32-column block of a row rounded alike whichever
        rank holds it (a rank's share starts at a block's edge)."""
        for e in block.experts.values():
            for linear in (e.gate_up, e.down):
                blocks = gguf.quants.quantize(linear.weight.detach().float().numpy(),
                                              gguf.GGMLQuantizationType.Q8_0)
                linear.use_quantized(quant.pack(quant.Q8_0, torch.from_numpy(blocks),
                                                linear.in_features, native_lib), sys.maxsize)
                linear.drop_float()
        block.native_spec = moe.native_spec(block, ops.capabilities.block_kinds)
        assert block.native_spec is not None
        return block

    x = torch.randn(9, 32).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=2e-2)
    with torch.no_grad():
        want = ops.moe(native(whole.to(dtype)), x).float()
        total = torch.zeros(9, 32)
        for rank in range(2):
            tp = TensorParallel(rank, 2, expert_parallel=expert_parallel)
            block = SparseMoE(cfg, tp).to(dtype)
            block.load_state_dict({k.removeprefix("layers.0.mlp."): v.to(dtype)
                                   for k, v in shard_state(state, cfg, tp).items()})
            out = ops.moe(native(block), x)
            assert out.dtype == torch.float32
            torch.testing.assert_close(out, moe.sparse_mlp(TorchOps(), block, x),
                                       atol=1e-5 if dtype == torch.float32 else 1e-3,
                                       rtol=1e-4 if dtype == torch.float32 else 1e-3)
            total += out
    torch.testing.assert_close(total, want, **tol)

