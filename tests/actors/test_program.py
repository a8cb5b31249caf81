"""The decoder layer's declared program (actors/executor/models/program.py): each
architecture's options give the expected op sequence, and the layer runs exactly it."""
from __future__ import annotations

import pytest

from pagewire.executor.models.model_config import LlamaConfig
from pagewire.executor.models.llama import LlamaForCausalLM
from pagewire.executor.models.program import Op, Step, layer_program

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)

ATTN = [Step(Op.ROPE, "attn"), Step(Op.ATTEND, "attn"), Step(Op.LINEAR, "attn.o_proj")]
LLAMA = [Step(Op.ADD_NORM, "input_norm"), Step(Op.LINEAR, "attn.qkv"), *ATTN,
         Step(Op.ADD_NORM, "post_norm"), Step(Op.LINEAR, "mlp.gate_up"), Step(Op.SILU_MUL),
         Step(Op.LINEAR, "mlp.down")]
QWEN3 = [*LLAMA[:2], Step(Op.QK_NORM, "attn"), *LLAMA[2:]]
GEMMA2 = [*LLAMA[:5], Step(Op.NORM, "post_attn_norm"), *LLAMA[5:7], Step(Op.GELU_MUL),
          LLAMA[8], Step(Op.NORM, "post_mlp_norm")]
# OLMoE: q/k norms over all heads, a mixture of experts for the MLP
OLMOE = [*LLAMA[:2], Step(Op.QK_NORM_FLAT, "attn"), *ATTN, Step(Op.ADD_NORM, "post_norm"),
         Step(Op.MOE, "mlp")]
# GPT-NeoX: the MLP off the residual the attention read, their outputs joined; GPT-2 in turn
GPT_MLP = [Step(Op.LINEAR, "mlp.up"), Step(Op.GELU), Step(Op.LINEAR, "mlp.down")]
NEOX = [Step(Op.ADD_LAYER_NORM, "input_norm"), Step(Op.LINEAR, "attn.qkv"), *ATTN,
        Step(Op.BRANCH_LAYER_NORM, "post_norm"), *GPT_MLP, Step(Op.JOIN)]
GPT2 = [*NEOX[:5], Step(Op.ADD_LAYER_NORM, "post_norm"), GPT_MLP[0], Step(Op.GELU_TANH),
        GPT_MLP[2]]


def config(arch: str, **extra) -> LlamaConfig:
    return LlamaConfig.from_hf({**SHAPE, "architectures": [arch], **extra})


@pytest.mark.parametrize("arch, extra, expected", [
    ("LlamaForCausalLM", {}, LLAMA),
    ("MistralForCausalLM", {"sliding_window": 16}, LLAMA),      # a window is ATTEND's operand
    ("Qwen2ForCausalLM", {}, LLAMA),                            # the bias is the linear's
    ("Qwen3ForCausalLM", {}, QWEN3),
    ("Gemma2ForCausalLM", {"sliding_window": 16, "attn_logit_softcapping": 50.0,
                           "hidden_activation": "gelu_pytorch_tanh"}, GEMMA2),
    ("OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}, OLMOE),
    ("GPTNeoXForCausalLM", {"hidden_act": "gelu"}, NEOX),
    ("GPT2LMHeadModel", {"activation_function": "gelu_new"}, GPT2),
], ids=["llama", "mistral", "qwen2", "qwen3", "gemma2", "olmoe", "gpt-neox", "gpt2"])
def test_program_per_architecture(arch, extra, expected):
    assert list(layer_program(config(arch, **extra))) == expected


def test_options_reach_the_operands():
    """What the program leaves to operands: Qwen2's bias on the QKV linear, Gemma2's soft-cap
    and windows on the attention."""
    qwen2 = LlamaForCausalLM(config("Qwen2ForCausalLM"))
    assert qwen2.layers[0].attn.qkv.bias is not None
    gemma2 = LlamaForCausalLM(config("Gemma2ForCausalLM", sliding_window=16,
                                     attn_logit_softcapping=50.0))
    variants = [layer.attn.variant for layer in gemma2.layers]
    assert all(v.softcap == 50.0 for v in variants)
    assert [v.window for v in variants] == [16, None]


def test_tensor_parallel_sums_each_half():
    steps = layer_program(config("LlamaForCausalLM"), tp_size=2)
    reduces = [i for i, s in enumerate(steps) if s.op == Op.ALL_REDUCE]
    assert [steps[i - 1].arg for i in reduces] == ["attn.o_proj", "mlp.down"]


def test_every_operand_names_a_submodule():
    model = LlamaForCausalLM(config("Gemma2ForCausalLM", hidden_activation="gelu_pytorch_tanh"))
    layer = model.layers[0]
    assert list(layer.program) == GEMMA2             # the layer runs the declared program
    operands = {step.arg for step in layer.program if step.arg}
    assert len(operands) == 9
    for name in operands:
        layer.get_submodule(name)                    # AttributeError when it names nothing
