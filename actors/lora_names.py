"""What a LoRA adapter's tensors are (lora_files.py reads the file): PEFT's module names, per
architecture, as the projections pagewire adapts, and each projection's shape in the base
model. No torch.

Our projection names: q_proj, k_proj, v_proj, o_proj (attention); gate_proj, up_proj,
down_proj (a dense MLP); experts.E.gate_proj, experts.E.up_proj, experts.E.down_proj (expert
E of a mixture: transformers 4's per-expert Linears, as PEFT names them: Mixtral's w1, w3, w2
under block_sparse_moe, Qwen2/3-MoE's and OLMoE's gate/up/down_proj under mlp);
shared_expert.gate_proj, ... (Qwen2-MoE's shared expert)."""
from __future__ import annotations

import re
from typing import NamedTuple

from .architectures import LORA_ATTENTION_ONLY, MOE_ARCHITECTURES, PLAIN_MLP_LORA
from .model_info import ModelInfo

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
_LAYER = r"base_model\.model\.model\.layers\.(\d+)\."
_DECODER = re.compile(rf"({_LAYER}(self_attn|mlp)\.(\w+))\.lora_([AB])\.weight")
_EXPERT = re.compile(rf"({_LAYER}(?:block_sparse_moe|mlp)\.(experts\.\d+|shared_expert)\.(\w+))"
                     r"\.lora_([AB])\.weight")
# the file's name of a projection where it is not ours (Phi-2 names its attention's output
# `dense`, its plain MLP's fc1 and fc2; Starcoder2 its c_fc and c_proj; Mixtral its experts'
# gate, up and down w1, w3, w2). A plain MLP's up projection is our up_proj, alone.
_THEIR_NAMES = {"PhiForCausalLM": {"dense": "o_proj", "fc1": "up_proj", "fc2": "down_proj"},
                "Starcoder2ForCausalLM": {"c_fc": "up_proj", "c_proj": "down_proj"}}
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", **{p: p for p in MLP}}


class Tensor(NamedTuple):
    module: str           # the file's module name: its tensors are MODULE.lora_{A,B}.weight
    layer: int
    proj: str             # ours (the module docstring's names)
    which: str            # "A" or "B"


def takes_experts(architecture: str) -> bool:
    """A mixture whose experts take adapters (gpt-oss's are fused 3-D tensors PEFT does not
    name one by one)."""
    return architecture in MOE_ARCHITECTURES and architecture not in LORA_ATTENTION_ONLY


def parse(name: str, info: ModelInfo) -> Tensor | str:
    """A tensor's name read for `info`'s architecture, or why it is refused."""
    arch = info.architecture
    match = _DECODER.fullmatch(name)
    if match is not None:
        renamed, raw = _THEIR_NAMES.get(arch, {}), match.group(4)
        theirs = renamed.get(raw, None if raw in renamed.values() else raw)   # theirs only
        if match.group(3) == "self_attn" and theirs in ATTENTION or \
                match.group(3) == "mlp" and theirs in _mlp(arch):
            return Tensor(match.group(1), int(match.group(2)), theirs, match.group(5))
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


def _mlp(arch: str) -> tuple[str, ...]:
    """The dense MLP projections an adapter of `arch` may hold: a gated MLP's three, a plain
    one's up and down (Phi-2, Starcoder2), none where the MLP is a mixture or takes none."""
    if arch in PLAIN_MLP_LORA:
        return ("up_proj", "down_proj")
    return () if arch in MOE_ARCHITECTURES else MLP


def _what(arch: str) -> str:
    """What an adapter of `arch` may adapt, said in a refusal."""
    if takes_experts(arch):
        return "q/k/v/o or an expert's gate/up/down (w1/w3/w2); a router takes none"
    if arch in MOE_ARCHITECTURES:
        return "q/k/v/o; gpt-oss's fused experts and its router take none"
    if arch in PLAIN_MLP_LORA:
        return "q/k/v/o or the MLP's two (" + \
            " and ".join(k for k in _THEIR_NAMES[arch] if k != "dense") + ")"
    return "q/k/v/o or gate/up/down"


def shape(info: ModelInfo, proj: str) -> tuple[int, int]:
    """Projection `proj`'s weight shape (out, in) in the base model."""
    owner, _, base = proj.rpartition(".")
    h = info.hidden_size
    if owner:                           # an expert's: its own rows, or the shared expert's
        rows = info.shared_expert_size if owner == "shared_expert" \
            else info.expert_intermediate_size
        return (h, rows) if base == "down_proj" else (rows, h)
    q, kv, i = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim, \
        info.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}[proj]
