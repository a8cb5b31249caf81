"""Models that take images: a vision tower and connector (vision.py) beside a Llama-family
language model (llama.py, unchanged): LLaVA (LlavaForConditionalGeneration) and Idefics3
(Idefics3ForConditionalGeneration: SmolVLM). The language model reads the prompt's image
tokens' rows from the tower's output instead of its embedding table; everything after the
embedding is the text model's program, so the backends, the KV cache, prefix caching and
chunked prefill treat an image's rows as any prompt's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .llama import LlamaForCausalLM
from .model_config import LlamaConfig
from .vision import VisionConfig, VisionTower, vision_weights
from .weights import fuse_weights

# the language model's names in each layout -> the text model's own
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("model.text_model.", "model."))


@dataclass
class VisionLanguageConfig(LlamaConfig):
    vision: VisionConfig | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> "VisionLanguageConfig":
        text = dict(cfg["text_config"])
        text.setdefault("architectures", ["LlamaForCausalLM"])
        if "tie_word_embeddings" in cfg:
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        base = LlamaConfig.from_hf(text)
        fields = {k: getattr(base, k) for k in LlamaConfig.__dataclass_fields__}
        return cls(**fields, vision=VisionConfig.from_hf(cfg))


class VisionLanguageModel(LlamaForCausalLM):
    config_class = VisionLanguageConfig

    def __init__(self, cfg: VisionLanguageConfig, tp=None, ops=None, cp=None):
        super().__init__(cfg, tp, ops, cp)
        self.vision = VisionTower(cfg.vision)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, S, S] -> [N, tokens_per_image, H], in the model's dtype."""
        return self.vision(pixel_values).to(self.embed.weight.dtype)

    @staticmethod
    def fuse_weights(weights: dict[str, torch.Tensor], cfg: VisionLanguageConfig) -> dict:
        """The language model's weights under the text model's names (fused as llama.py
        fuses them), the tower's under `vision.`."""
        tower = {"vision." + k: w for k, w in vision_weights(weights).items()}
        text = {}
        for name, w in weights.items():
            for theirs, ours in _TEXT_PREFIXES:
                if name.startswith(theirs):
                    name = ours + name[len(theirs):]
                    break
            text[name] = w
        return {**fuse_weights(text, cfg), **tower}
