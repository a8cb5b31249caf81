"""The native interpreter of the layer program (csrc/decode_stack.cpp) against the per-op
path, on tiny random models with random Q8_0 weights: the options the default model lacks
(QKV biases, sandwich norms, soft-capped and windowed attention, the GPT family's LayerNorms,
GELUs, parallel residuals and partial rope) bit-identical too, and the architectures whose
programs hold an op it lacks refused."""
from __future__ import annotations

import pytest
import torch

from pagewire.executor.models.model_config import LlamaConfig
from pagewire.executor.models.fused_decode import FusedDecode
from pagewire.executor.models.llama import LlamaForCausalLM
from pagewire.executor.kv_blocks import allocate_kv_cache
from pagewire.kernels import quant
from pagewire.kernels.attention import AttentionBatch
from pagewire.kernels.linear import Linear
from pagewire.kernels.ops import CpuOps

SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)
BLOCK, BLOCKS, MAX_TOKENS = 8, 32, 4
PLAIN_LAYERS = {"sandwich_norms": False, "activation": "silu"}   # Gemma2 less its GELU


def model_for(lib, dtype, extra: dict, overrides: dict | None = None):
    cfg = LlamaConfig.from_hf({**SHAPE, **extra})
    for key, value in (overrides or {}).items():
        setattr(cfg, key, value)
    g = torch.Generator().manual_seed(0)
    model = LlamaForCausalLM(cfg, ops=CpuOps(lib))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.2 * torch.randn(p.shape, generator=g))
    model.to(dtype).reset_buffers()                # rope tables stay float32
    for linear in (m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head):
        linear.use_quantized(random_q8_0(linear, lib, g), MAX_TOKENS)
    return model


def random_q8_0(linear: Linear, lib, g) -> quant.QuantWeight:
    """Q8_0 blocks (an fp16 scale, 32 int8) of random values."""
    rows, blocks = linear.out_features, linear.in_features // 32
    scale = torch.full((rows, blocks, 1), 0.01, dtype=torch.float16).view(torch.uint8)
    qs = torch.randint(-127, 128, (rows, blocks, 32), generator=g, dtype=torch.int8)
    raw = torch.cat([scale, qs.view(torch.uint8)], dim=2).reshape(rows, -1)
    return quant.pack(quant.Q8_0, raw, linear.in_features, lib)


def decode_batch(caches, contexts: list[int], g):
    width = -(-max(contexts) // BLOCK)
    tables = torch.randperm(BLOCKS, generator=g)[:len(contexts) * width].view(len(contexts), -1)
    lens = torch.tensor(contexts, dtype=torch.int64)
    slots = torch.stack([tables[i, (c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK
                         for i, c in enumerate(contexts)])
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))
    return lens - 1, AttentionBatch(slots, len(contexts), tables.contiguous(), lens, [])


GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "sliding_window": 8,
          "attn_logit_softcapping": 5.0, "hidden_activation": "gelu_pytorch_tanh"}
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "sliding_window": 8,
          "layer_types": ["sliding_attention", "full_attention"]}
# The GPT family: LayerNorms, biases, plain GELU MLPs; GPT-NeoX's parallel residual (BRANCH,
# JOIN) and partial rope; GPT-2's learned positions and no rope; Phi-2's one norm.
NEOX = {"architectures": ["GPTNeoXForCausalLM"], "rotary_pct": 0.5, "hidden_act": "gelu"}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new"}
PHI2 = {"architectures": ["PhiForCausalLM"], "partial_rotary_factor": 0.5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("extra, overrides", [
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 8}, None),
    ({"architectures": ["Qwen2ForCausalLM"]}, None),                 # QKV bias
    (GEMMA2, {**PLAIN_LAYERS, "sandwich_norms": True}),      # sandwich norms, soft-cap, window
    ({"architectures": ["Qwen3ForCausalLM"]}, None),                 # QK_NORM
    (GEMMA3, PLAIN_LAYERS),                                  # QK_NORM, a rope base per layer
    (NEOX, None), (NEOX, {"parallel_residual": False}), (GPT2, None), (PHI2, None),
], ids=["mistral", "qwen2", "gemma2-silu", "qwen3", "gemma3-silu", "gpt-neox",
        "gpt-neox-sequential", "gpt2", "phi-2"])
def test_interpreter_equals_the_per_op_path(tier, native_lib, dtype, extra, overrides):
    model = model_for(native_lib, dtype, extra, overrides)
    caches = allocate_kv_cache(2, BLOCKS, BLOCK, model.num_kv_heads, 16, dtype)
    fused = FusedDecode.build(model, caches)
    assert fused is not None
    g = torch.Generator().manual_seed(1)
    for contexts in ([1], [20], [3, 30, 11]):
        positions, batch = decode_batch(caches, contexts, g)
        ids = torch.randint(0, 64, (len(contexts),), generator=g)
        before = [c.clone() for c in caches]
        with torch.inference_mode():
            expected = model(ids, positions, caches, batch)          # fused_decode unset
            written = [c.clone() for c in caches]
            for cache, old in zip(caches, before):
                cache.copy_(old)
            model.use_fused_decode(fused)
            assert fused.serves(len(contexts), batch, caches)
            got = model(ids, positions, caches, batch)
            model.use_fused_decode(None)
        assert torch.equal(got, expected), contexts
        assert all(torch.equal(c, w) for c, w in zip(caches, written))


@pytest.mark.parametrize("extra, overrides", [
    (GEMMA2, None),                                                  # GELU_MUL
], ids=["gemma2"])
def test_programs_it_cannot_run_are_refused(tier, native_lib, extra, overrides):
    model = model_for(native_lib, torch.float32, extra, overrides)
    assert FusedDecode.build(model, allocate_kv_cache(2, BLOCKS, BLOCK, 2, 16,
                                                      torch.float32)) is None


def random_adapters(model, ranks: tuple[int, ...], g, dtype):
    """A LoraBatch's adapters on every fused linear of every layer: random A and B^T blocks
    per projection (kernels/lora.py LoraWeights), the table the native kernels read."""
    from pagewire.executor.lora import PARTS, Loaded, _part_sizes
    from pagewire.executor.models.lora_slots import num_slots
    from pagewire.kernels.lora import LoraWeights
    slots, out = num_slots(model.cfg), []
    for i, rank in enumerate(ranks):
        weights = {}
        for layer in model.layers:
            for name in PARTS:
                linear, sizes = layer.get_submodule(name), _part_sizes(layer, name)
                cols = [sum(sizes[:j]) for j in range(len(sizes))]
                a = (0.3 * torch.randn(rank * len(sizes), linear.in_features, generator=g))
                blocks = [(c, 0.3 * torch.randn(rank, w, generator=g)) for c, w in zip(cols, sizes)]
                weights[linear.lora_slot] = LoraWeights(a.to(dtype), [(c, b.to(dtype))
                                                                      for c, b in blocks],
                                                        1.5 + i, linear.out_features)
        out.append(Loaded(weights, slots, generation=i))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interpreter_with_adapters_equals_the_per_op_path(tier, native_lib, dtype):
    """Each linear's product and its rows' adapter deltas in one parallel region (lora.cpp
    linear_with_lora, every split of the product's columns): the same values as the product
    and then the deltas, per op. QKV biases too (added in each thread's columns); rows of two
    adapters and of the base model mixed; a step of base rows only takes the product alone."""
    from pagewire.executor.lora import LoraBatch
    model = model_for(native_lib, dtype, {"architectures": ["Qwen2ForCausalLM"]})
    caches = allocate_kv_cache(2, BLOCKS, BLOCK, 2, 16, dtype)
    g = torch.Generator().manual_seed(2)
    adapters = random_adapters(model, (4, 8), g, dtype)      # numbers the linears' slots
    fused = FusedDecode.build(model, caches)
    for contexts, of_row in (([7], [1]), ([3, 30, 11, 5], [0, -1, 1, 0]), ([9, 2], [-1, -1])):
        positions, batch = decode_batch(caches, contexts, g)
        ids = torch.randint(0, 64, (len(contexts),), generator=g)
        lora = LoraBatch(torch.tensor(of_row), adapters)
        before = [c.clone() for c in caches]
        with torch.inference_mode():
            expected = model(ids, positions, caches, batch, lora)     # fused_decode unset
            plain = model(ids, positions, [c.clone() for c in before], batch)
            for cache, old in zip(caches, before):
                cache.copy_(old)
            model.use_fused_decode(fused)
            assert fused.serves(len(contexts), batch, caches)
            got = model(ids, positions, caches, batch, lora)
            model.use_fused_decode(None)
        assert torch.equal(got, expected), contexts
        assert torch.equal(got[torch.tensor(of_row) < 0], plain[torch.tensor(of_row) < 0])
        assert any(r >= 0 for r in of_row) == (not torch.equal(got, plain)), contexts
