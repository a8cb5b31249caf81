"""A Hugging Face LLaVA or Idefics3 directory written the way llama.cpp ships such models
(tests only): the language model as a GGUF (gguf_writer.write_gguf, arch llama) and the
vision tower and projector as a mmproj GGUF (arch "clip"), named and cut as llama.cpp's
converters do: LLaVA's by the legacy script (tools/mtmd/legacy-models/
convert_image_encoder_to_gguf.py: the layers after the one LLaVA reads and the post-norm left
out, clip.vision.feature_layer, projector mm.0 / mm.2, fc1 stored as ffn_down), Idefics3's by
convert_hf_to_gguf.py's SmolVLMModel (every layer, mm.model.fc, the pixel shuffle's scale)."""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from .gguf_writer import write_gguf

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out",
          "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
_TOP = {"embeddings.patch_embedding": "v.patch_embd", "embeddings.class_embedding": "v.class_embd",
        "embeddings.position_embedding": "v.position_embd", "pre_layrnorm": "v.pre_ln",
        "post_layernorm": "v.post_ln"}
_CONNECTOR = {"multi_modal_projector.linear_1": "mm.0", "multi_modal_projector.linear_2": "mm.2",
              "model.connector.modality_projection.proj": "mm.model.fc"}
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."), ("model.text_model.", "model."))


def write_llama_cpp_pair(hf_dir: str, text_path: str, mmproj_path: str, tokenizer_meta: dict,
                         image_token: int | None = None, **mmproj_options) -> tuple[str, str]:
    """(text GGUF, mmproj GGUF) of the directory's float32 weights. `image_token`: the
    vocabulary entry renamed `<image>` (a converted LLaVA / SmolVLM vocabulary has one; the
    borrowed test tokenizer has not)."""
    from safetensors.torch import load_file
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    text = {}
    for name, w in state.items():
        for theirs, ours in _TEXT_PREFIXES:
            if name.startswith(theirs):
                text[ours + name[len(theirs):]] = w
        if name == "lm_head.weight":
            text[name] = w
    meta = dict(tokenizer_meta)
    if image_token is not None:
        tokens = list(meta["tokenizer.ggml.tokens"])
        tokens[image_token] = "<image>"
        meta["tokenizer.ggml.tokens"] = tokens
    write_gguf(text_path, "llama", text, cfg["text_config"], meta)
    write_mmproj(mmproj_path, hf_dir, cfg, state, **mmproj_options)
    return text_path, mmproj_path


def write_mmproj(path: str, hf_dir: str, cfg: dict, state: dict[str, torch.Tensor],
                 projector: str | None = None, drop: tuple[str, ...] = (),
                 f16: bool = False) -> str:
    """The tower of `state` as llama.cpp's mmproj file. `projector` overrides the type
    written, `drop` leaves tensors out (tests of bad files); `f16` stores the weights of two
    or more dimensions as float16 (the files llama.cpp ships), the rest float32."""
    import gguf
    with open(os.path.join(hf_dir, "preprocessor_config.json")) as f:
        processor = json.load(f)
    vision = cfg["vision_config"]
    idefics3 = "scale_factor" in cfg
    layers = vision["num_hidden_layers"]
    feature = cfg.get("vision_feature_layer", -2)         # LLaVA's: hidden_states[feature]
    depth = layers if idefics3 else feature % (layers + 1)
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_string("clip.projector_type", projector or ("idefics3" if idefics3 else "mlp"))
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_uint32("clip.vision.image_size", vision["image_size"])
    writer.add_uint32("clip.vision.patch_size", vision["patch_size"])
    writer.add_uint32("clip.vision.embedding_length", vision["hidden_size"])
    writer.add_uint32("clip.vision.feed_forward_length", vision["intermediate_size"])
    writer.add_uint32("clip.vision.block_count", depth)
    writer.add_uint32("clip.vision.attention.head_count", vision["num_attention_heads"])
    writer.add_float32("clip.vision.attention.layer_norm_epsilon",
                       vision.get("layer_norm_eps", 1e-6 if idefics3 else 1e-5))
    writer.add_array("clip.vision.image_mean", list(processor["image_mean"]))
    writer.add_array("clip.vision.image_std", list(processor["image_std"]))
    writer.add_bool("clip.use_gelu", idefics3 or vision.get("hidden_act") == "gelu")
    if idefics3:
        writer.add_uint32("clip.vision.projector.scale_factor", cfg["scale_factor"])
        writer.add_uint32("clip.vision.preproc_image_size", processor["size"]["longest_edge"])
        writer.add_uint32("clip.vision.projection_dim", cfg["text_config"]["hidden_size"])
    else:
        writer.add_array("clip.vision.feature_layer", [depth])
        writer.add_uint32("clip.vision.projection_dim", vision.get("projection_dim", 0))
    for name, w in state.items():
        clip = clip_name(name, depth, legacy=not idefics3)
        if clip is not None and clip not in drop:
            a = np.ascontiguousarray(w.float().numpy())
            writer.add_tensor(clip, a.astype(np.float16) if f16 and a.ndim >= 2 else a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def clip_name(name: str, depth: int, legacy: bool) -> str | None:
    """A Hugging Face tower or connector tensor's mmproj name; None for one the converter
    leaves out (layers past `depth`; the legacy LLaVA script's post-norm)."""
    stem, _, kind = name.rpartition(".")
    if name.endswith("class_embedding"):
        return "v.class_embd"
    connector = stem if stem in _CONNECTOR else stem.removeprefix("model.")
    if connector in _CONNECTOR:
        return f"{_CONNECTOR[connector]}.{kind}"
    short = stem.split("vision_tower.", 1)[-1].split("vision_model.", 1)[-1]
    if short.startswith("encoder.layers."):
        _, _, index, part = short.split(".", 3)
        if int(index) >= depth:
            return None
        kind_name = _LAYER[part]
        if legacy and kind_name in ("ffn_up", "ffn_down"):      # the legacy script's swap
            kind_name = "ffn_down" if kind_name == "ffn_up" else "ffn_up"
        return f"v.blk.{index}.{kind_name}.{kind}"
    if short in _TOP and not (legacy and short == "post_layernorm"):
        return f"{_TOP[short]}.{kind}"
    return None
