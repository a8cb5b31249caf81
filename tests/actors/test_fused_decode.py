"""The fused decode stack (actors/executor/models/fused_decode.py) against the per-op path
it replaces: bit-identical hidden states and KV cache writes, on the default model."""
from __future__ import annotations

import sys

import pytest
import torch

from pagewire import LLM
from pagewire.kernels import kv_quant, quant, tiers
from pagewire.executor.models.fused_decode import FusedDecode
from pagewire.executor.models.program import Op, Step
from pagewire.kernels.attention import AttentionBatch, PrefillSpan

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[(tier, *case) for tier in tiers.TIERS
                                        for case in (("bfloat16", "exact", "auto"),
                                                     ("float32", "exact", "auto"),
                                                     ("float32", "int16", "auto"),
                                                     ("float32", "int8", "auto"),
                                                     ("float32", "int16", "int8"),
                                                     ("bfloat16", "int8-prefill", "auto"),
                                                     ("bfloat16", "exact", "fp8"))], ids=str)
def runner(request):
    """The default model on each tier this CPU runs (the stack calls that tier's kernels),
    with exact activations, int16-rounded ones for every quantized weight and int8-rounded
    ones for its Q4_1 weights (in every step, or in steps of 8+ tokens: int8-prefill); and
    with quantized KV caches."""
    tier, dtype, acts, kv_dtype = request.param
    if tier not in tiers.runnable():
        pytest.skip(f"needs the {tier} tier: this CPU runs {', '.join(tiers.runnable())}")
    llm = LLM(dtype=dtype, kernels=tier, quantized_activations=acts, max_model_len=512,
              num_kv_blocks=128, kv_cache_dtype=kv_dtype)
    model = llm.runner.model
    offset = {"exact": 0, "int16": 200, "int8": 100, "int8-prefill": 300}[acts]
    assert model.layers[0].attn.qkv.quantized.kind == quant.Q4_1 + offset
    # int8 and int8-prefill round Q4 weights' only, leaving Q8 ones at the tier's default
    int16 = acts == "int16" or acts in ("int8", "int8-prefill") and not tiers.has_bf16_dot(tier)
    assert model.lm_head.quantized.kind == quant.Q8_0 + (200 if int16 else 0)
    return llm.runner


def decode_step(runner, contexts: list[int], seed: int):
    """A decode-only batch: sequence i attends contexts[i] tokens in its own shuffled blocks,
    filled with random keys and values."""
    g = torch.Generator().manual_seed(seed)
    bs, width = runner.block_size, -(-max(contexts) // runner.block_size)
    blocks = torch.randperm(runner.config.cache.num_kv_blocks, generator=g)[:len(contexts) * width]
    tables = blocks.view(len(contexts), width).contiguous()
    lens = torch.tensor(contexts, dtype=torch.int64)
    slots = torch.stack([tables[i, (c - 1) // bs] * bs + (c - 1) % bs
                         for i, c in enumerate(contexts)])
    for cache in runner.kv_caches:
        if kv_quant.is_quantized(cache):
            shape = (*cache.shape[:-1], kv_quant.head_dim(cache))
            cache.copy_(kv_quant.quantize(torch.randn(shape, generator=g), cache.dtype))
        else:
            cache.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))
    ids = torch.randint(0, 49152, (len(contexts),), generator=g)
    return ids, lens - 1, AttentionBatch(slots, len(contexts), tables, lens, [])


def assert_fused_equals_per_op(runner, vocab: int) -> None:
    """The runner's fused decode against its per-op path over decode steps of one, three and
    nine sequences: the hidden states and the KV writes bit for bit (compared as bytes: an
    FP8 cache row's scale read as float8 codes may spell NaN)."""
    model, fused = runner.model, runner.model.fused_decode
    assert fused is not None
    for contexts in ([1], [37, 5, 200], [3 + 7 * i for i in range(9)]):
        ids, positions, batch = decode_step(runner, contexts, seed=len(contexts))
        ids = ids % vocab
        caches = [c.clone() for c in runner.kv_caches]
        with torch.inference_mode():
            model.use_fused_decode(None)
            expected = model(ids, positions, runner.kv_caches, batch)
            model.use_fused_decode(fused)
            written = [c.clone() for c in runner.kv_caches]
            for cache, before in zip(runner.kv_caches, caches):
                cache.copy_(before)
            got = model(ids, positions, runner.kv_caches, batch)
        assert torch.equal(got, expected), contexts
        assert all(torch.equal(c.view(torch.uint8), w.view(torch.uint8))
                   for c, w in zip(runner.kv_caches, written)), contexts


# 14 rows: from 12 tokens int16 linears take the GEMM (csrc/quant_gemm_avx2.h), in both paths
@pytest.mark.parametrize("contexts", [[1], [37], [300], [5, 129, 17, 64, 250],
                                      [2 + 5 * i for i in range(14)]])
def test_fused_stack_equals_the_per_op_path(runner, contexts):
    model = runner.model
    fused = model.fused_decode
    # --quantized-matmul-tokens -1 (the default): the blocks serve every step (loader.py)
    assert fused is not None and fused.max_tokens == sys.maxsize
    ids, positions, batch = decode_step(runner, contexts, seed=len(contexts))
    caches = [c.clone() for c in runner.kv_caches]
    with torch.inference_mode():
        model.use_fused_decode(None)
        try:
            expected = model(ids, positions, runner.kv_caches, batch)
        finally:
            model.use_fused_decode(fused)
        written = [c.clone() for c in runner.kv_caches]
        for cache, before in zip(runner.kv_caches, caches):
            cache.copy_(before)
        assert fused.serves(len(contexts), batch, runner.kv_caches)
        got = model(ids, positions, runner.kv_caches, batch)
    assert torch.equal(got, expected)
    # As bytes: a quantized row's scale read as float8 codes may spell NaN.
    assert all(torch.equal(c.view(torch.uint8), w.view(torch.uint8)) if c.element_size() == 1
               else torch.equal(c, w) for c, w in zip(runner.kv_caches, written))


def test_steps_the_stack_does_not_serve(runner):
    fused = runner.model.fused_decode
    if fused.max_tokens < sys.maxsize:       # (int16 blocks on avx2: every step)
        over = fused.max_tokens + 1
        _, _, batch = decode_step(runner, [10] * over, seed=9)
        assert not fused.serves(over, batch, runner.kv_caches)          # too many tokens
    _, _, small = decode_step(runner, [10, 20], seed=2)
    assert not fused.serves(2, small, list(runner.kv_caches))           # other caches
    mixed = AttentionBatch(small.slot_mapping, 1, small.decode_block_tables[:1],
                           small.decode_context_lens[:1], [PrefillSpan(1, 1, 1, small.decode_block_tables[1, :1])])
    assert not fused.serves(2, mixed, runner.kv_caches)                 # a prefill in it


def test_the_stack_runs_the_layers_programs(runner):
    """The encoded program is every layer's declared ops, in order, each opcode then its
    operands."""
    model, fused = runner.model, runner.model.fused_decode
    words, arity = fused.program.tolist(), model.ops.lib.cdll.pw_decode_stack_arity
    ops, i = [], 0
    while i < len(words):
        ops.append(words[i])
        i += 1 + arity(words[i])
    assert ops == [int(step.op) for layer in model.layers for step in layer.program]


@pytest.mark.parametrize("step", [Step(Op.GELU_MUL), Step(Op.ALL_REDUCE)],
                         ids=lambda s: s.op.name)
def test_a_program_with_an_op_it_lacks_is_refused(runner, step):
    """One layer's program with an op the native interpreter does not implement: the whole
    model takes the per-op path."""
    layer = runner.model.layers[1]
    program = layer.program
    assert runner.model.ops.lib.cdll.pw_decode_stack_arity(int(step.op)) == -1
    try:
        layer.program = (*program[:2], step, *program[2:])
        assert FusedDecode.build(runner.model, runner.kv_caches) is None
    finally:
        layer.program = program
    assert FusedDecode.build(runner.model, runner.kv_caches) is not None


def test_models_it_does_not_apply_to():
    llm = LLM(dtype="bfloat16", max_model_len=256, num_kv_blocks=16, quantized_matmul_tokens=0)
    assert llm.runner.model.fused_decode is None                        # no quantized weights
