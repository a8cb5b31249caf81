"""A GGUF language model and llama.cpp's mmproj file (pagewire/mmproj.py) as one vision model:
its config from both headers, the tower's tensors under Hugging Face's names, so that
VisionLanguageModel.fuse_weights (vision.vision_weights) maps them as it maps a directory's.

llama.cpp's names (tools/mtmd/clip-impl.h) -> Hugging Face's: v.patch_embd, v.class_embd,
v.position_embd, v.pre_ln, v.post_ln, v.blk.N.{attn_q,attn_k,attn_v,attn_out,ln1,ln2,ffn_up,
ffn_down}, mm.0 / mm.2 (LLaVA's projector), mm.model.fc (Idefics3's). Files from the legacy
LLaVA converter store fc1 as ffn_down and fc2 as ffn_up; as clip.cpp does, a layer whose
ffn_down takes the tower's width is read the other way round."""
from __future__ import annotations

import numpy as np
import torch

from pagewire.gguf_header import GGUFHeader
from pagewire.mmproj import ClipSettings, read_mmproj

from .gguf_weights import read_tensor
from .models.model_config import LlamaConfig
from .models.vision import VisionConfig
from .models.vision_language import VisionLanguageConfig

_TOWER = "model.vision_model."
_TOP = {"v.patch_embd": "embeddings.patch_embedding", "v.class_embd": "embeddings.class_embedding",
        "v.position_embd": "embeddings.position_embedding", "v.pre_ln": "pre_layrnorm",
        "v.post_ln": "post_layernorm"}
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj", "ln1": "layer_norm1",
          "ln2": "layer_norm2", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_CONNECTOR = {"mm.0": "multi_modal_projector.linear_1", "mm.2": "multi_modal_projector.linear_2",
              "mm.model.fc": "model.connector.modality_projection.proj"}


def vision_language_config(meta: dict, has_output: bool, mmproj: str) -> VisionLanguageConfig:
    """The language model's config from its GGUF metadata, the tower's from the mmproj's."""
    base = LlamaConfig.from_gguf(meta, has_output)
    fields = {k: getattr(base, k) for k in LlamaConfig.__dataclass_fields__}
    header, clip = read_mmproj(mmproj)
    return VisionLanguageConfig(**fields, vision=vision_config(clip, header))


def vision_config(clip: ClipSettings, header: GGUFHeader) -> VisionConfig:
    """The tower vision.py builds for these settings: the layers clip.cpp runs, the norms and
    biases the file holds."""
    has = header.tensors.__contains__
    common = dict(hidden_size=clip.hidden_size, intermediate_size=clip.intermediate_size,
                  num_layers=int(header.metadata["clip.vision.block_count"]),
                  num_heads=clip.num_heads, image_size=clip.image_size,
                  patch_size=clip.patch_size, layer_norm_eps=clip.layer_norm_eps,
                  activation=clip.activation, feature_layer=clip.depth,
                  patch_bias=has("v.patch_embd.bias"), post_norm=has("v.post_ln.weight"),
                  text_hidden_size=clip.text_hidden_size)
    if clip.projector == "idefics3":
        return VisionConfig(**common, class_token=False, scale_factor=clip.scale_factor,
                            projector_bias=False)
    if not has("v.class_embd") or not has("v.pre_ln.weight"):
        raise ValueError("a LLaVA mmproj without a class embedding and pre-norm (CLIP's) is "
                         "not supported")
    return VisionConfig(**common, class_token=True, projector_activation="gelu",
                        projector_bias=has("mm.0.bias"))


def read_tower(mmproj: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of the layers the tower runs and of its projector, under Hugging Face's
    names, in `dtype`."""
    header, clip = read_mmproj(mmproj)
    data = np.memmap(mmproj, dtype=np.uint8, mode="r")
    out = {}
    for info in header.tensors.values():
        name = hf_tower_name(info.name, clip.depth)
        if name is not None:
            tensor = read_tensor(data, info, dtype)
            out[name] = tensor.reshape(-1) if name.endswith("class_embedding") else tensor
    return _unswap_ffn(out, clip.hidden_size)


def hf_tower_name(name: str, depth: int) -> str | None:
    """v.blk.2.attn_q.weight -> model.vision_model.encoder.layers.2.self_attn.q_proj.weight;
    None for a layer past `depth` and for tensors the tower does not use."""
    parts = name.split(".")
    if parts[0] == "v" and len(parts) == 5 and parts[1] == "blk":
        if int(parts[2]) >= depth or parts[3] not in _LAYER:
            return None
        return f"{_TOWER}encoder.layers.{parts[2]}.{_LAYER[parts[3]]}.{parts[4]}"
    stem, _, kind = name.rpartition(".")
    if name == "v.class_embd":
        return _TOWER + _TOP[name]
    if stem in _TOP:
        return f"{_TOWER}{_TOP[stem]}.{kind}"
    if stem in _CONNECTOR:
        return f"{_CONNECTOR[stem]}.{kind}"
    return None


def _unswap_ffn(weights: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """fc1 takes the tower's width, fc2 gives it: a layer stored the other way round (the
    legacy converter's ffn_up / ffn_down) has its pair of weights and biases swapped back."""
    for name in [n for n in weights if n.endswith("mlp.fc2.weight")]:
        if weights[name].shape[-1] == width and weights[name].shape[0] != width:
            stem = name[:-len("fc2.weight")]
            for kind in ("weight", "bias"):
                one, two = f"{stem}fc1.{kind}", f"{stem}fc2.{kind}"
                if one in weights and two in weights:
                    weights[one], weights[two] = weights[two], weights[one]
    return weights
