"""LoRA adapters beyond the Llama family: the attention of the mixtures of experts (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss), Phi-2 and Starcoder2, and the experts (Mixtral's w1/w3/w2,
Qwen2-MoE's experts and shared expert, gpt-oss's stacks through PEFT's target_parameters): a batch mixing the base model and an adapter gives each
request transformers' greedy tokens on its merged weights, through the native MoE blocks and the
fused decode stack (attention adapters) or torch's grouping (expert adapters); a tensor an
architecture does not adapt is refused by name. The GPT family's blocks take adapters of their
attention and plain MLP under their own names (GPT-NeoX's and GPT-2's fused q/k/v one
adapter)."""
from __future__ import annotations

import os

import pytest
import torch

from pagewire import LLM, LoRARequest, SamplingParams
from pagewire.lora_files import InvalidAdapter, projection_shapes, read_adapter
from pagewire.model_info import resolve_model
from tests.actors.test_architectures import make_model
from tests.actors.test_lora import merged_oracle
from tests.helpers import assert_greedy_equal

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 45)), [100, 101, 100, 101, 7]]
# test_architectures' configs; Phi-2 names its attention's output `dense`
FAMILIES = {"mixtral-moe": ATTN, "qwen2-moe-shared": ATTN, "qwen3-moe": ATTN, "olmoe": ATTN,
            "gpt-oss": ATTN, "phi-2": ("q_proj", "k_proj", "v_proj", "dense"),
            "starcoder2": ATTN}
# the plain MLPs' (up, down), as each file names them
PLAIN_MLPS = {"phi-2": ("fc1", "fc2"), "starcoder2": ("c_fc", "c_proj")}


def attention_adapter(path: str, base: str, names, rank: int = 4, seed: int = 0,
                      extra: dict | None = None) -> str:
    """A PEFT adapter of every layer's attention projections `names` (the file's names),
    random A and B; `extra`: more tensors, {module name: (out, in)} (random too)."""
    info = resolve_model(base)
    shapes = projection_shapes(info)
    modules = {f"base_model.model.model.layers.{layer}.self_attn.{name}":
               shapes["o_proj" if name == "dense" else name]
               for layer in range(info.num_layers) for name in names}
    return write_adapter(path, {**modules, **(extra or {})}, rank, seed)


def write_adapter(path: str, modules: dict, rank: int = 4, seed: int = 0) -> str:
    """A PEFT adapter of these modules ({name: (out, in)}), A and B random (PEFT starts B at
    zero: these make every delta matter)."""
    import json

    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                   "target_modules": sorted({m.rsplit(".", 1)[1] for m in modules})}, f)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for module, (out, inp) in modules.items():
        weights[f"{module}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.3
        weights[f"{module}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.3
    save_file(weights, os.path.join(path, "adapter_model.safetensors"))
    return path


def expert_modules(base: str, mixtral: bool, layers, shared: bool = False) -> dict:
    """{module: (out, in)} of every expert's gate, up and down in `layers` (Mixtral's w1, w3,
    w2 under block_sparse_moe, else gate/up/down_proj under mlp), and the shared expert's."""
    info = resolve_model(base)
    h, i, s = info.hidden_size, info.expert_intermediate_size, info.shared_expert_size
    names = (("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj"))
    owner = "block_sparse_moe" if mixtral else "mlp"
    out = {}
    for layer in layers:
        prefix = f"base_model.model.model.layers.{layer}.{owner}."
        for e in range(info.num_experts):
            for name, shape in zip(names, ((i, h), (i, h), (h, i))):
                out[f"{prefix}experts.{e}.{name}"] = shape
        if shared:
            for name, shape in zip(MLP, ((s, h), (s, h), (h, s))):
                out[f"{prefix}shared_expert.{name}"] = shape
    return out


def _check_mixed_batch(llm, base: str, adapter: str, oracle, label: str) -> None:
    """Base and adapter requests in every step: each gets its own model's greedy tokens, and
    the adapter changes some."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    request = LoRARequest("a", 1, adapter)
    cases = [(p, lora) for p in PROMPTS for lora in (None, request)]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in cases], params,
                        lora_request=[lora for _, lora in cases])
    oracles = {None: merged_oracle(base, None), request: oracle}
    differs = 0
    for (prompt, lora), out in zip(cases, outs):
        theirs, logits = oracles[lora].greedy(prompt, 8)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits,
                            f"{label}, adapter {lora is not None}, prompt {len(prompt)}")
        differs += lora is not None and theirs != oracles[None].greedy(prompt, 8)[0]
    assert differs                                                      # the adapter matters
    assert llm.scheduler.kv.num_free == llm.scheduler.kv.num_blocks


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_attention_adapters_give_the_merged_models_tokens(tmp_path, smol_tokenizer_dir, family):
    base = make_model(str(tmp_path / "base"), smol_tokenizer_dir, family)
    adapter = attention_adapter(str(tmp_path / "adapter"), base, FAMILIES[family])
    llm = LLM(base, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=16,
              enable_lora=True, max_loras=1)
    _check_mixed_batch(llm, base, adapter, merged_oracle(base, adapter), family)


@pytest.mark.parametrize("family", sorted(PLAIN_MLPS))
def test_plain_mlp_adapters_give_the_merged_models_tokens(tmp_path, smol_tokenizer_dir, family):
    """Phi-2's fc1/fc2 and Starcoder2's c_fc/c_proj (with q and v): the up projection takes
    the slot a gated MLP's gate_up has."""
    base = make_model(str(tmp_path / "base"), smol_tokenizer_dir, family)
    info = resolve_model(base)
    h, i = info.hidden_size, info.intermediate_size
    up, down = PLAIN_MLPS[family]
    mlp = {f"base_model.model.model.layers.{layer}.mlp.{name}": shape
           for layer in range(info.num_layers)
           for name, shape in ((up, (i, h)), (down, (h, i)))}
    adapter = attention_adapter(str(tmp_path / "adapter"), base, ("q_proj", "v_proj"), extra=mlp)
    llm = LLM(base, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=16,
              enable_lora=True, max_loras=1)
    _check_mixed_batch(llm, base, adapter, merged_oracle(base, adapter), family)


@pytest.mark.parametrize("family", ["mixtral-moe", "qwen2-moe-shared"])
def test_expert_adapters_give_the_merged_models_tokens(tmp_path, smol_tokenizer_dir, family):
    """Mixtral's per-expert w1/w3/w2 with its q/v; Qwen2-MoE's experts and shared expert on
    its sparse layers (layer 1 is dense: mlp_only_layers)."""
    base = make_model(str(tmp_path / "base"), smol_tokenizer_dir, family)
    mixtral = family == "mixtral-moe"
    experts = expert_modules(base, mixtral, (0, 1, 2) if mixtral else (0, 2),
                             shared=not mixtral)
    adapter = attention_adapter(str(tmp_path / "adapter"), base, ("q_proj", "v_proj"),
                                extra=experts)
    llm = LLM(base, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=16,
              enable_lora=True, max_loras=1)
    _check_mixed_batch(llm, base, adapter, merged_oracle(base, adapter), family)


# gpt-oss's expert stacks per layer as PEFT's target_parameters names them: both (gate_up
# wrapped first, so under base_layer), down alone, gate_up alone
GPT_OSS_TARGETS = ["0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                   "1.mlp.experts.down_proj", "2.mlp.experts.gate_up_proj"]


def fused_expert_adapter(path: str, base: str, rank: int = 4) -> str:
    """A PEFT adapter of gpt-oss's q/v and GPT_OSS_TARGETS' expert stacks, as PEFT's
    ParamWrapper saves them: A [r E, in], B [out, r E] (out: gate_up's interleaved 2I rows,
    or H)."""
    import json
    info = resolve_model(base)
    h, i, count = info.hidden_size, info.expert_intermediate_size, info.num_experts
    stacks = {}
    for layer, names in ((0, ("gate_up", "down")), (1, ("down",)), (2, ("gate_up",))):
        for depth, name in enumerate(reversed(names)):
            module = f"base_model.model.model.layers.{layer}.mlp.experts" + ".base_layer" * depth
            stacks[module] = (2 * i, h) if name == "gate_up" else (h, i)
    adapter = attention_adapter(path, base, ("q_proj", "v_proj"), rank=rank)
    from safetensors.torch import load_file, save_file
    file = os.path.join(adapter, "adapter_model.safetensors")
    weights, g = load_file(file), torch.Generator().manual_seed(5)
    for module, (out, inp) in stacks.items():
        weights[f"{module}.lora_A.weight"] = torch.randn(rank * count, inp, generator=g) * 0.3
        weights[f"{module}.lora_B.weight"] = torch.randn(out, rank * count, generator=g) * 0.3
    save_file(weights, file)
    config_file = os.path.join(adapter, "adapter_config.json")
    config = {**json.load(open(config_file)), "target_parameters": GPT_OSS_TARGETS}
    json.dump(config, open(config_file, "w"))
    return adapter


def test_gpt_oss_expert_stacks_give_the_merged_models_tokens(tmp_path, smol_tokenizer_dir):
    """PEFT's target_parameters adapters of gpt-oss's stacked experts (the fine-tuning
    recipe's), a layer's two stacks nested: each expert's slice of A and B, gate_up's
    interleaved rows, merged by PEFT's own formula in the oracle."""
    base = make_model(str(tmp_path / "base"), smol_tokenizer_dir, "gpt-oss")
    adapter = fused_expert_adapter(str(tmp_path / "adapter"), base)
    file = read_adapter(adapter, resolve_model(base), 16)
    assert sorted(k for k in file.shapes if k[1].startswith("experts")) == [
        (0, "experts.down"), (0, "experts.gate_up"), (1, "experts.down"),
        (2, "experts.gate_up")]
    assert file.modules[(0, "experts.gate_up")].endswith("layers.0.mlp.experts.base_layer")
    llm = LLM(base, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=16,
              enable_lora=True, max_loras=1)
    _check_mixed_batch(llm, base, adapter, merged_oracle(base, adapter), "gpt-oss")


def test_gpt_oss_expert_stacks_of_the_wrong_shape_or_untargeted_are_refused(
        tmp_path, smol_tokenizer_dir):
    import json
    base = make_model(str(tmp_path / "base"), smol_tokenizer_dir, "gpt-oss")
    info = resolve_model(base)
    adapter = fused_expert_adapter(str(tmp_path / "adapter"), base)
    config_file = os.path.join(adapter, "adapter_config.json")
    config = json.load(open(config_file))
    json.dump({**config, "target_parameters": GPT_OSS_TARGETS[1:]}, open(config_file, "w"))
    # layer 0's down alone is targeted now: its gate_up (base_layer) names nothing
    with pytest.raises(InvalidAdapter, match=r"layers\.0\.mlp\.experts\.base_layer\.lora_A"
                                             r"\.weight: not a LoRA A or B of q/k/v/o, or the "
                                             r"experts' stacks"):
        read_adapter(adapter, info, 16)
    json.dump({**config, "target_parameters": ["2.mlp.experts.down_proj"]},
              open(config_file, "w"))
    with pytest.raises(InvalidAdapter, match=r"layers\.0\.mlp\.experts\.base_layer"):
        read_adapter(adapter, info, 16)
    json.dump({**config, "target_parameters": "mlp.experts.down_proj"}, open(config_file, "w"))
    with pytest.raises(InvalidAdapter, match="target_parameters must be a list"):
        read_adapter(adapter, info, 16)
    # a stack saved as one expert's (rank rows, not rank x experts)
    json.dump(config, open(config_file, "w"))
    from safetensors.torch import load_file, save_file
    file = os.path.join(adapter, "adapter_model.safetensors")
    weights = load_file(file)
    name = "base_model.model.model.layers.1.mlp.experts.lora_A.weight"
    weights[name] = weights[name][:4]
    save_file(weights, file)
    with pytest.raises(InvalidAdapter, match=rf"{name} has shape \[4, {info.expert_intermediate_size}\]"
                                             rf", the base model needs \[16, "):
        read_adapter(adapter, info, 16)


@pytest.mark.parametrize("family, tensor, why", [
    ("mixtral-moe", "block_sparse_moe.gate", "not a LoRA A or B of q/k/v/o or an expert's "
                                             "gate/up/down \\(w1/w3/w2\\); a router takes none"),
    ("mixtral-moe", "block_sparse_moe.experts.6.w1", "the base model has 6 experts"),
    ("mixtral-moe", "block_sparse_moe.shared_expert.gate_proj", "the base model has no shared "
                                                                "expert"),
    ("qwen2-moe-shared", "mlp.gate_proj", "not a LoRA A or B of q/k/v/o or an expert's"),
    ("gpt-oss", "mlp.experts.0.gate_proj", "not a LoRA A or B of q/k/v/o, or the experts' "
                                           "stacks named in adapter_config.json's "
                                           "target_parameters"),
    ("starcoder2", "mlp.up_proj", "not a LoRA A or B of self_attn.q_proj, self_attn.k_proj, "
                                  "self_attn.v_proj, self_attn.o_proj, mlp.c_fc, mlp.c_proj"),
    ("phi-2", "self_attn.o_proj", "not a LoRA A or B of self_attn.q_proj, self_attn.k_proj, "
                                  "self_attn.v_proj, self_attn.dense, mlp.fc1, mlp.fc2")])
def test_tensors_an_architecture_does_not_adapt_are_refused_by_name(
        tmp_path, smol_tokenizer_dir, family, tensor, why):
    base = make_model(str(tmp_path / "base"), smol_tokenizer_dir, family)
    name = f"base_model.model.model.layers.0.{tensor}"
    adapter = attention_adapter(str(tmp_path / "adapter"), base, ("q_proj",),
                                extra={name: (16, 16)})
    with pytest.raises(InvalidAdapter, match=f"tensor {name}.lora_[AB].weight: {why}"):
        read_adapter(adapter, resolve_model(base), 16)


# The GPT blocks' adapters under their own names: (attention modules, MLP modules), each
# (module, our projection); GPT-NeoX's and GPT-2's fused q/k/v take one adapter
GPT_MODULES = {
    "gpt-neox-parallel": ("gpt_neox.layers.{}", [("attention.query_key_value", "qkv_proj"),
                                                 ("attention.dense", "o_proj"),
                                                 ("mlp.dense_h_to_4h", "up_proj"),
                                                 ("mlp.dense_4h_to_h", "down_proj")]),
    "gpt2": ("transformer.h.{}", [("attn.c_attn", "qkv_proj"), ("attn.c_proj", "o_proj"),
                                  ("mlp.c_fc", "up_proj"), ("mlp.c_proj", "down_proj")]),
    "gptj": ("transformer.h.{}", [("attn.q_proj", "q_proj"), ("attn.k_proj", "k_proj"),
                                  ("attn.v_proj", "v_proj"), ("attn.out_proj", "o_proj"),
                                  ("mlp.fc_in", "up_proj"), ("mlp.fc_out", "down_proj")]),
}


@pytest.mark.parametrize("family", sorted(GPT_MODULES))
def test_gpt_blocks_adapters_give_the_merged_models_tokens(tmp_path, smol_tokenizer_dir,
                                                           family):
    """GPT-NeoX's head-by-head fused q/k/v (B's rows reordered as the weight's), GPT-2's
    Conv1D c_attn (fan_in_fan_out, as PEFT saves it), GPT-J's rotate-half q and k."""
    from pagewire.lora_names import shape
    base = make_model(str(tmp_path / "base"), smol_tokenizer_dir, family)
    info = resolve_model(base)
    prefix, modules = GPT_MODULES[family]
    adapter = write_adapter(str(tmp_path / "adapter"), {
        f"base_model.model.{prefix.format(layer)}.{module}": shape(info, proj)
        for layer in range(info.num_layers) for module, proj in modules})
    if family == "gpt2":
        import json
        config_file = os.path.join(adapter, "adapter_config.json")
        config = {**json.load(open(config_file)), "fan_in_fan_out": True}
        json.dump(config, open(config_file, "w"))
    llm = LLM(base, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=16,
              enable_lora=True, max_loras=1)
    _check_mixed_batch(llm, base, adapter, merged_oracle(base, adapter, family == "gpt2"), family)


def test_an_attention_adapter_on_gguf_experts_through_the_fused_decode(
        tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta):
    """OLMoE's GGUF (Q8_0): native MoE blocks and the fused decode stack (its LINEAR ops
    apply the adapter's delta) give the merged reference's tokens."""
    from tests.actors.test_moe_models import _gguf_and_reference
    path, ref = _gguf_and_reference(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta,
                                    "olmoe-Q8_0")
    adapter = attention_adapter(str(tmp_path / "adapter"), ref, ATTN, seed=3)
    llm = LLM(path, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=16,
              enable_lora=True, max_loras=1)
    assert llm.runner.model.fused_decode is not None
    _check_mixed_batch(llm, ref, adapter, merged_oracle(ref, adapter), "olmoe GGUF")


def test_expert_adapters_run_in_the_native_block_and_the_fused_decode(tmp_path,
                                                                       smol_tokenizer_dir):
    """Experts as tiles (--quantization int8): a step whose adapters touch experts keeps
    csrc/moe.cpp's block, in the per-op path and the fused decode stack (each row's deltas
    added there), and gives the tokens torch's grouping gives on the same tiles."""
    from pagewire.executor.models.moe import SparseMoE
    base = make_model(str(tmp_path / "base"), smol_tokenizer_dir, "mixtral-moe")
    adapter = attention_adapter(str(tmp_path / "adapter"), base, ("q_proj", "v_proj"),
                                extra=expert_modules(base, True, (0, 1, 2)))
    llm = LLM(base, dtype="float32", quantization="int8", max_model_len=256,
              num_kv_blocks=128, block_size=16, enable_lora=True, max_loras=1)
    model = llm.runner.model
    blocks = [b for b in model.modules() if isinstance(b, SparseMoE)]
    assert blocks and all(b.native_spec is not None for b in blocks) and model._fused
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    request = LoRARequest("a", 1, adapter)
    cases = [(p, lora) for p in PROMPTS for lora in (None, request)]

    def greedy():
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in cases], params,
                            lora_request=[lora for _, lora in cases])
        return [o.outputs[0].token_ids for o in outs]

    native = greedy()
    for block in blocks:                  # torch's grouping, per op, over the same tiles
        block.native_spec = None
    model._fused = None
    grouped = greedy()
    assert native == grouped
    assert native[1::2] != native[0::2]                          # the adapter matters
