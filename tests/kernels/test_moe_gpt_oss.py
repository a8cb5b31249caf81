"""gpt-oss's mixture of experts: its routing (router bias, top k of the logits then their
softmax), expert biases and clamped SwiGLU, on the torch grouping against transformers'
GptOssMLP (its stacked tensors split by gpt_oss_weights.py), and csrc/moe.cpp against the
torch grouping over the same tiles on each tier."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from pagewire.executor.models.gpt_oss_weights import gpt_oss_layer
from pagewire.executor.models.model_config import LlamaConfig
from pagewire.executor.models.moe import SparseMoE
from pagewire.executor.parallel import TensorParallel
from pagewire.kernels import moe
from pagewire.kernels.ops import TorchOps

HIDDEN, INTER, EXPERTS = 32, 32, 6     # Q8_0 tiles: rows of 32-weight blocks


def _cfg(limit: float) -> LlamaConfig:
    return LlamaConfig(vocab_size=16, hidden_size=HIDDEN, intermediate_size=INTER, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=16, num_experts=EXPERTS,
                       experts_per_token=2, expert_intermediate_size=INTER, moe_bias=True,
                       topk_then_softmax=True, expert_activation="swiglu_oai",
                       swiglu_limit=limit, architecture="GptOssForCausalLM")


def _hf_mlp(limit: float, seed: int = 0):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                          num_experts_per_tok=2, swiglu_limit=limit, num_hidden_layers=1)
    torch.manual_seed(seed)
    mlp = GptOssMLP(config).float()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.3)
    return mlp


def _ours(mlp, limit: float) -> SparseMoE:
    """Our block holding the HF block's values, mapped as the loader maps a checkpoint's."""
    cfg = _cfg(limit)
    stored = {f"model.layers.0.mlp.{k}": v for k, v in mlp.state_dict().items()}
    stored["model.layers.0.self_attn.sinks"] = torch.zeros(2)
    state = {k.removeprefix("layers.0.mlp."): v for k, v in gpt_oss_layer(stored, cfg, 0).items()
             if k.startswith("layers.0.mlp.")}
    block = SparseMoE(cfg, TensorParallel())
    block.load_state_dict(state)
    return block


@pytest.mark.parametrize("limit", [7.0, 0.5])
def test_torch_grouping_equals_transformers_gpt_oss_mlp(limit):
    mlp = _hf_mlp(limit)
    block = _ours(mlp, limit)
    x = torch.randn(9, HIDDEN) * 2
    with torch.no_grad():
        want, _ = mlp(x[None])
        got = moe.sparse_mlp(TorchOps(), block, x)
        _, _, chosen = mlp.router(x)
        _, experts = moe.route(torch.nn.functional.linear(x, block.router.weight,
                                                          block.router.bias), 2, False, True)
    assert torch.equal(experts, chosen)          # same experts, in the same order
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)


def test_top_k_then_softmax_weights():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.0, -1.0, 5.0, 4.0]])
    weights, experts = moe.route(logits, 2, False, topk_then_softmax=True)
    assert experts.tolist() == [[1, 3], [2, 3]]                  # ties: the lower index first
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5],
                                                      [1 / (1 + np.exp(-1)), 1 / (1 + np.exp(1))]],
                                                     dtype=torch.float32))


def _tiled(lib, limit: float, dtype: torch.dtype) -> SparseMoE:
    """A gpt-oss block whose experts are Q8_0 tiles serving every step (random blocks), their
    biases kept."""
    from pagewire.kernels import quant
    from pagewire.testing.gguf_writer import random_blocks
    block = _ours(_hf_mlp(limit, seed=3), limit).to(dtype)
    rng = np.random.default_rng(0)
    for e in block.experts.values():
        for linear in (e.gate_up, e.down):
            rows = random_blocks("Q8_0", linear.out_features, linear.in_features, rng)
            linear.use_quantized(quant.pack(quant.Q8_0, rows, linear.in_features, lib),
                                 sys.maxsize)
            linear.drop_float()
    return block


@pytest.mark.parametrize("adapted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [7.0, 0.5])
def test_native_gpt_oss_block_equals_torch_grouping(native_lib, dtype, limit, adapted):
    """`adapted`: with adapters of the experts (test_moe.py's), their deltas added after
    the biases, before the clamped SwiGLU."""
    from pagewire.kernels.ops import CpuOps
    from tests.kernels.test_moe import _expert_adapters
    block = _tiled(native_lib, limit, dtype)
    block.cfg = _cfg(limit)
    ops = CpuOps(native_lib)
    block.native_spec = moe.native_spec(block, ops.capabilities.block_kinds)
    assert block.native_spec is not None
    torch.manual_seed(2)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=2e-2)
    for tokens in (1, 3, 17):
        x = (torch.randn(tokens, HIDDEN) * 2).to(dtype)
        lora = _expert_adapters(block, dtype, tokens) if adapted else None
        with torch.no_grad():
            got = ops.moe(block, x, lora)
            want = moe.sparse_mlp(TorchOps(), block, x, lora)
            logits = torch.nn.functional.linear(x.float(), block.router.weight.float(),
                                                block.router.bias.float())
            top = logits.sort(-1, descending=True).values
            clear = top[:, 1] - top[:, 2] > 1e-3             # no near-tie for the k-th expert
        assert got.dtype == dtype and clear.any()
        torch.testing.assert_close(got.float()[clear], want.float()[clear], **tol)
        if adapted:                                             # the deltas were added
            rows = lora.adapter_of_row >= 0
            assert (got[rows] != ops.moe(block, x)[rows]).any(-1).all()


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_partial_sums_are_one_ranks_output(expert_parallel):
    """gpt-oss's block on two ranks: every expert's rows split (gate_up's bias with them,
    down's bias added by rank 0 alone) or whole experts apart (each down bias its holder's):
    the ranks' float32 partials sum to the one rank's output."""
    from pagewire.executor.parallel import shard_state
    whole = _ours(_hf_mlp(0.5, seed=6), 0.5)
    cfg = _cfg(0.5)
    state = {f"layers.0.mlp.{k}": v for k, v in whole.state_dict().items()}
    x = torch.randn(5, HIDDEN) * 2
    with torch.no_grad():
        want = moe.sparse_mlp(TorchOps(), whole, x)
        total = torch.zeros(5, HIDDEN)
        for rank in range(2):
            tp = TensorParallel(rank, 2, expert_parallel=expert_parallel)
            block = SparseMoE(cfg, tp)
            block.load_state_dict({k.removeprefix("layers.0.mlp."): v
                                   for k, v in shard_state(state, cfg, tp).items()})
            assert len(block.experts) == (EXPERTS // 2 if expert_parallel else EXPERTS)
            total += moe.sparse_mlp(TorchOps(), block, x)
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)


def test_a_ranks_sinks_are_its_query_heads():
    from pagewire.executor.parallel import Shares
    cfg = LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=32, num_layers=1,
                      num_heads=8, num_kv_heads=2, head_dim=8, attention_sinks=True)
    sinks = torch.arange(8.0)
    shares = [Shares.of(cfg, TensorParallel(rank, 2)).take("layers.0.attn.sinks", sinks)
              for rank in range(2)]
    assert [s.tolist() for s in shares] == [[0, 1, 2, 3], [4, 5, 6, 7]]
