"""What a LoRA adapter's tensors are (lora_files.py reads the file): PEFT's module names, per
architecture, as the projections pagewire adapts, and each projection's shape in the base
model. No torch.

Our projection names: q_proj, k_proj, v_proj, o_proj (attention); qkv_proj (a fused q/k/v
projection's one adapter: GPT-NeoX's query_key_value, GPT-2's c_attn; the executor splits its
B by rows as the base weight's); gate_proj, up_proj, down_proj (an MLP; a plain MLP has up and
down only); experts.E.gate_proj, experts.E.up_proj, experts.E.down_proj (expert E of a
mixture: transformers 4's per-expert Linears, as PEFT names them: Mixtral's w1, w3, w2 under
block_sparse_moe, Qwen2/3-MoE's and OLMoE's gate/up/down_proj under mlp);
shared_expert.gate_proj, ... (Qwen2-MoE's shared expert); experts.gate_up, experts.down
(gpt-oss: every expert's at once, as PEFT's target_parameters adapts its stacked 3-D
parameters: A [r * E, in] expert by expert, B [out, r * E] rank by rank; see fused_experts)."""
from __future__ import annotations

import re
from typing import NamedTuple

from .architectures import GPT_ARCHITECTURES, MOE_ARCHITECTURES, VISION_ARCHITECTURES
from .model_info import ModelInfo

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
_DECODER = re.compile(r"(base_model\.model\.([\w.]+)\.(\d+)\.(\w+)\.(\w+))\.lora_([AB])\.weight")
_EXPERT = re.compile(r"(base_model\.model\.model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\."
                     r"(experts\.\d+|shared_expert)\.(\w+))\.lora_([AB])\.weight")
_FUSED = re.compile(r"(base_model\.model\.model\.layers\.(\d+)\.mlp\.experts(?:\.base_layer)?)"
                    r"\.lora_([AB])\.weight")
# gpt-oss's stacked expert parameters, in the order PEFT wraps them (their definition order),
# and our projections of them
_FUSED_PARAMS = (("gate_up_proj", "experts.gate_up"), ("down_proj", "experts.down"))
STACKS = tuple(ours for _, ours in _FUSED_PARAMS)
_LLAMA = {**{("self_attn", p): p for p in ATTENTION}, **{("mlp", p): p for p in MLP}}
_ATTENTION = {("self_attn", p): p for p in ATTENTION}
# Each architecture's (the layer's part, the file's module) -> ours, where not the Llama
# family's; a name outside its table is refused (Phi-2's o_proj is `dense`, so `o_proj` is not
# one of Phi-2's).
_NAMES = {
    **{arch: _ATTENTION for arch in MOE_ARCHITECTURES},     # experts: _EXPERT
    "PhiForCausalLM": {**{("self_attn", p): p for p in ATTENTION[:3]},
                       ("self_attn", "dense"): "o_proj", ("mlp", "fc1"): "up_proj",
                       ("mlp", "fc2"): "down_proj"},
    "Starcoder2ForCausalLM": {**_ATTENTION, ("mlp", "c_fc"): "up_proj",
                              ("mlp", "c_proj"): "down_proj"},
    "GPTNeoXForCausalLM": {("attention", "query_key_value"): "qkv_proj",
                           ("attention", "dense"): "o_proj",
                           ("mlp", "dense_h_to_4h"): "up_proj",
                           ("mlp", "dense_4h_to_h"): "down_proj"},
    "GPT2LMHeadModel": {("attn", "c_attn"): "qkv_proj", ("attn", "c_proj"): "o_proj",
                        ("mlp", "c_fc"): "up_proj", ("mlp", "c_proj"): "down_proj"},
    "GPTJForCausalLM": {**{("attn", p): p for p in ATTENTION[:3]},
                        ("attn", "out_proj"): "o_proj", ("mlp", "fc_in"): "up_proj",
                        ("mlp", "fc_out"): "down_proj"},
}
# the layers' prefixes in the file (after PEFT's base_model.model.): a model that takes images
# names its language model's layers as its transformers version saved it (LLaVA, Gemma 3,
# Qwen2.5-VL: model.language_model.layers, or language_model.model.layers before; SmolVLM:
# model.text_model.layers; Qwen2.5-VL's older top-level model.layers); its vision tower
# takes no adapter
_PREFIXES = {"GPTNeoXForCausalLM": ("gpt_neox.layers",), "GPT2LMHeadModel": ("transformer.h",),
             "GPTJForCausalLM": ("transformer.h",),
             **{arch: ("model.language_model.layers", "language_model.model.layers",
                       "model.text_model.layers", "model.layers")
                for arch in VISION_ARCHITECTURES}}
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", **{p: p for p in MLP}}


class Tensor(NamedTuple):
    module: str           # the file's module name: its tensors are MODULE.lora_{A,B}.weight
    layer: int
    proj: str             # ours (the module docstring's names)
    which: str            # "A" or "B"


def takes_experts(architecture: str) -> bool:
    """A mixture whose experts take adapters under per-expert names (gpt-oss's are fused 3-D
    parameters: fused_experts)."""
    return architecture in MOE_ARCHITECTURES and architecture != "GptOssForCausalLM"


def fused_experts(target_parameters, info: ModelInfo) -> dict[str, tuple[int, str]]:
    """gpt-oss's adapted expert stacks: {the file's module name: (layer, our projection)}.
    PEFT wraps a module's targeted parameters one inside the next in their definition order
    (gate_up_proj, then down_proj), so a layer's last targeted one is `...mlp.experts` and
    the one before it `...mlp.experts.base_layer`. A target matches a parameter as PEFT's
    does: the whole name, or a dot-separated tail of it ("7.mlp.experts.down_proj")."""
    if info.architecture != "GptOssForCausalLM" or not target_parameters:
        return {}
    out = {}
    for layer in range(info.num_layers):
        stack = f"model.layers.{layer}.mlp.experts"
        names = [ours for param, ours in _FUSED_PARAMS
                 if any(f"{stack}.{param}" == t or f"{stack}.{param}".endswith("." + t)
                        for t in target_parameters)]
        module = f"base_model.model.{stack}"
        for depth, ours in enumerate(reversed(names)):
            out[module + ".base_layer" * depth] = (layer, ours)
    return out


def parse(name: str, info: ModelInfo, fused: dict[str, tuple[int, str]] | None = None
          ) -> Tensor | str:
    """A tensor's name read for `info`'s architecture, or why it is refused; `fused`:
    fused_experts' modules."""
    arch = info.architecture
    match = _FUSED.fullmatch(name)
    if match is not None and match.group(1) in (fused or {}):
        return Tensor(match.group(1), *fused[match.group(1)], match.group(3))
    match = _DECODER.fullmatch(name)
    if match is not None and match.group(2) in _PREFIXES.get(arch, ("model.layers",)):
        ours = _NAMES.get(arch, _LLAMA).get((match.group(4), match.group(5)))
        if ours is not None:
            return Tensor(match.group(1), int(match.group(3)), ours, match.group(6))
    match = _EXPERT.fullmatch(name)
    if match is not None and takes_experts(arch) and match.group(4) in _EXPERT_NAMES:
        owner = match.group(3)
        if owner == "shared_expert" and not info.shared_expert_size:
            return "the base model has no shared expert"
        if owner != "shared_expert" and int(owner.split(".")[1]) >= info.num_experts:
            return f"the base model has {info.num_experts} experts"
        return Tensor(match.group(1), int(match.group(2)),
                      f"{owner}.{_EXPERT_NAMES[match.group(4)]}", match.group(5))
    return f"not a LoRA A or B of {_what(arch)} (embeddings, LM head, biases: not supported)"


def _what(arch: str) -> str:
    """What an adapter of `arch` may adapt, said in a refusal."""
    if takes_experts(arch):
        return "q/k/v/o or an expert's gate/up/down (w1/w3/w2); a router takes none"
    if arch in MOE_ARCHITECTURES:
        return ("q/k/v/o, or the experts' stacks named in adapter_config.json's "
                "target_parameters (mlp.experts.gate_up_proj, down_proj); a router takes none")
    if arch in GPT_ARCHITECTURES:
        return ", ".join(".".join(k) for k in _NAMES[arch])
    return "q/k/v/o or gate/up/down"


def stacked(info: ModelInfo, proj: str) -> int:
    """How many experts' ranks an adapter of `proj` stacks (gpt-oss's fused stacks: all of
    them), else 1."""
    return info.num_experts if proj in STACKS else 1


def shape(info: ModelInfo, proj: str) -> tuple[int, int]:
    """Projection `proj`'s weight shape (out, in) in the base model (one expert's, for
    gpt-oss's stacks: gate_up's rows the gate's and the up's)."""
    owner, _, base = proj.rpartition(".")
    h = info.hidden_size
    if proj in STACKS:
        i = info.expert_intermediate_size
        return (2 * i, h) if base == "gate_up" else (h, i)
    if owner:                           # an expert's: its own rows, or the shared expert's
        rows = info.shared_expert_size if owner == "shared_expert" \
            else info.expert_intermediate_size
        return (h, rows) if base == "down_proj" else (rows, h)
    q, kv, i = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim, \
        info.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "qkv_proj": (q + 2 * kv, h), "gate_proj": (i, h), "up_proj": (i, h),
            "down_proj": (h, i)}[proj]
