"""Models that take images: a vision tower and connector (vision.py, qwen_vision.py) beside a
Llama-family language model (llama.py, unchanged): LLaVA (LlavaForConditionalGeneration),
Idefics3 (Idefics3ForConditionalGeneration: SmolVLM), Qwen2.5-VL
(Qwen2_5_VLForConditionalGeneration: a Qwen2 text model with M-RoPE) and Gemma 3
(Gemma3ForConditionalGeneration: a Gemma 3 text model). The language model reads the
prompt's image tokens' rows from the tower's output instead of its embedding table;
everything after the embedding is the text model's program, so the backends, the KV cache,
prefix caching and chunked prefill treat an image's rows as any prompt's.

M-RoPE (Qwen2.5-VL): the runner's positions are already each text row's shifted position
(executor/mrope.py); a step with image rows also brings their (t, h, w), and the model
builds that step's own rope table (one row per batch row) so the layers' rope op is the
same (table, positions) gather as every model's.

Gemma 3's image tokens see their whole image during prefill (`bidirectional_images`), which
the runner turns into per-query key ends (kernels/attention.py PrefillSpan.key_ends).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagewire.model_info import hf_text_config

from ..mrope import mrope_table
from .llama import LlamaForCausalLM
from .model_config import LlamaConfig
from .qwen_vision import QwenVisionConfig, QwenVisionTower, qwen_vision_weights
from .vision import VisionConfig, VisionTower, vision_weights
from .weights import fuse_weights

# the language model's names in each layout -> the text model's own
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("model.text_model.", "model."))


# the language model's architecture where its text_config names none
_TEXT_ARCHITECTURES = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}


@dataclass
class VisionLanguageConfig(LlamaConfig):
    vision: VisionConfig | QwenVisionConfig | None = None
    mrope_section: list[int] | None = None      # Qwen2.5-VL: rotary frequencies per t, h, w

    @classmethod
    def from_hf(cls, cfg: dict) -> "VisionLanguageConfig":
        qwen = (cfg.get("architectures") or [""])[0] == "Qwen2_5_VLForConditionalGeneration"
        text = _qwen_text(cfg) if qwen else dict(cfg["text_config"])
        text.setdefault("architectures", [_TEXT_ARCHITECTURES.get(
            (cfg.get("architectures") or [""])[0], "LlamaForCausalLM")])
        if "tie_word_embeddings" in cfg:
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        base = LlamaConfig.from_hf(text)
        fields = {k: getattr(base, k) for k in LlamaConfig.__dataclass_fields__}
        if not qwen:
            return cls(**fields, vision=VisionConfig.from_hf(cfg))
        sections = text["mrope_section"]
        if sum(sections) != base.head_dim // 2:
            raise ValueError(f"mrope_section {sections} does not sum to head_dim / 2")
        return cls(**fields, vision=QwenVisionConfig.from_hf(cfg), mrope_section=sections)


def _qwen_text(cfg: dict) -> dict:
    """Qwen2.5-VL's text model as a Qwen2 config: text_config (transformers 5's layout) or
    the top level (the released checkpoints'), its "mrope" rope plain rope of the same theta
    (the sections kept apart)."""
    text = hf_text_config(cfg)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    theta = rope.get("rope_theta", text.get("rope_theta", 1000000.0))
    text.pop("rope_scaling", None)
    text.update(architectures=["Qwen2ForCausalLM"], mrope_section=rope["mrope_section"],
                rope_parameters={"rope_type": "default", "rope_theta": theta})
    return text


class VisionLanguageModel(LlamaForCausalLM):
    config_class = VisionLanguageConfig

    def __init__(self, cfg: VisionLanguageConfig, tp=None, ops=None, cp=None):
        super().__init__(cfg, tp, ops, cp)
        self.vision = QwenVisionTower(cfg.vision) if cfg.mrope_section else \
            VisionTower(cfg.vision, self.ops)
        # an image's tokens attend each other both ways in prefill (Gemma 3's token_type_ids)
        self.bidirectional_images = getattr(cfg.vision, "pooled_tokens", 0) > 0

    def encode_images(self, pixel_values: torch.Tensor, grids=None):
        """pixel_values [N, 3, S, S] -> [N, tokens_per_image, H], in the model's dtype.
        Qwen2.5-VL: every image's patches [sum of P, values] and `grids`, each image's (t, h,
        w) in merged patches -> a list of [t h w, H]."""
        dtype = self.embed.weight.dtype
        if grids is None:
            return self.vision(pixel_values).to(dtype)
        m = self.cfg.vision.spatial_merge_size
        return [x.to(dtype) for x in self.vision(pixel_values,
                                                  [(t, h * m, w * m) for t, h, w in grids])]

    def rope_inputs(self, positions: torch.Tensor, images=None) -> list:
        """M-RoPE: a step with image rows (images = rows, embeddings, their (t, h, w))
        rotates by its own table, row i of it batch row i's."""
        if images is None or len(images) < 3:
            return super().rope_inputs(positions, images)
        rows, _, thw = images
        table = mrope_table(self.rope_tables[0], positions, rows, thw, self.cfg.mrope_section)
        return [(table, torch.arange(len(positions), device=positions.device))]

    @staticmethod
    def fuse_weights(weights: dict[str, torch.Tensor], cfg: VisionLanguageConfig) -> dict:
        """The language model's weights under the text model's names (fused as llama.py
        fuses them), the tower's under `vision.`."""
        read = qwen_vision_weights if cfg.mrope_section else vision_weights
        tower = {"vision." + k: w for k, w in read(weights).items()}
        text = {}
        for name, w in weights.items():
            for theirs, ours in _TEXT_PREFIXES:
                if name.startswith(theirs):
                    name = ours + name[len(theirs):]
                    break
            text[name] = w
        return {**fuse_weights(text, cfg), **tower}
