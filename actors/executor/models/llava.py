"""LLaVA (LlavaForConditionalGeneration): a vision tower and projector (vision.py) beside a
Llama-family language model (llama.py, unchanged). The language model reads the prompt's
image tokens' rows from the tower's output instead of its embedding table; everything after
the embedding is the text model's program, so the backends, the KV cache, prefix caching and
chunked prefill treat an image's rows as any prompt's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .llama import LlamaForCausalLM
from .model_config import LlamaConfig
from .vision import VisionConfig, VisionTower, vision_weights
from .weights import fuse_weights


@dataclass
class LlavaConfig(LlamaConfig):
    vision: VisionConfig | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlavaConfig":
        text = dict(cfg["text_config"])
        text.setdefault("architectures", ["LlamaForCausalLM"])
        base = LlamaConfig.from_hf(text)
        fields = {k: getattr(base, k) for k in LlamaConfig.__dataclass_fields__}
        return cls(**fields, vision=VisionConfig.from_hf(cfg))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    config_class = LlavaConfig

    def __init__(self, cfg: LlavaConfig, tp=None, ops=None, cp=None):
        super().__init__(cfg, tp, ops, cp)
        self.vision = VisionTower(cfg.vision)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, S, S] -> [N, tokens_per_image, H], in the model's dtype."""
        return self.vision(pixel_values).to(self.embed.weight.dtype)

    @staticmethod
    def fuse_weights(weights: dict[str, torch.Tensor], cfg: LlavaConfig) -> dict:
        """The language model's weights under the text model's names (fused as llama.py
        fuses them), the tower's under `vision.`."""
        tower = {"vision." + k: w for k, w in vision_weights(weights).items()}
        text = {}
        for name, w in weights.items():
            for theirs, ours in (("model.language_model.", "model."),
                                 ("language_model.model.", "model."),
                                 ("language_model.lm_head.", "lm_head.")):
                if name.startswith(theirs):
                    name = ours + name[len(theirs):]
                    break
            text[name] = w
        return {**fuse_weights(text, cfg), **tower}
