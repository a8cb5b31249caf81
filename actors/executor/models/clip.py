"""CLIP (CLIPModel) as a pooling model: a text and an image embedded into one space, for
/v1/embeddings of either. The text tower is CLIP's pre-norm transformer with a causal mask,
read after its final norm at the text's last token (its end-of-text token: the tokenizer
ends every text with it) and projected; the image tower is vision.py's CLIP ViT (class token,
pre-norm), its class token's state after the post-norm, projected. Both on the backend's ops;
no KV cache (PoolingRunner runs it whole, as the encoders)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagewire.kernels.linear import Linear

from .llama import LayerNorm
from .vision import EncoderLayer, VisionConfig, VisionTower, vision_weights


@dataclass
class ClipConfig:
    text: VisionConfig               # the text tower's widths (its image fields unused)
    vision: VisionConfig
    vocab_size: int
    max_positions: int
    projection_dim: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "ClipConfig":
        t, v = cfg["text_config"], cfg["vision_config"]

        def tower(c: dict, **extra) -> VisionConfig:
            return VisionConfig(
                hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
                layer_norm_eps=c.get("layer_norm_eps", 1e-5),
                activation=c.get("hidden_act", "quick_gelu"), feature_layer=-1, **extra)
        return cls(text=tower(t, image_size=1, patch_size=1, class_token=False),
                   vision=tower(v, image_size=v["image_size"], patch_size=v["patch_size"],
                                keep_class_token=True, post_norm=True,
                                text_hidden_size=cfg.get("projection_dim", 512)),
                   vocab_size=t["vocab_size"], max_positions=t["max_position_embeddings"],
                   projection_dim=cfg.get("projection_dim", 512))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int],
                     scale: float) -> torch.Tensor:
    """[T, H, D] each: every sequence's queries over its own keys up to their own position."""
    out, at = torch.empty_like(q), 0
    for n in seq_lens:
        qs, ks, vs = (x[at:at + n].transpose(0, 1) for x in (q, k, v))       # [H, n, D]
        out[at:at + n] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                        scale=scale).transpose(0, 1)
        at += n
    return out


class ClipModel(nn.Module):
    """The PoolingRunner's encoder contract (forward / embed) for texts, and embed_images."""

    def __init__(self, cfg: ClipConfig, ops):
        super().__init__()
        self.cfg, self.ops, d = cfg, ops, cfg.text.hidden_size
        self.words = nn.Embedding(cfg.vocab_size, d)
        self.positions = nn.Embedding(cfg.max_positions, d)
        self.layers = nn.ModuleList(EncoderLayer(cfg.text) for _ in range(cfg.text.num_layers))
        self.final_norm = LayerNorm(d, cfg.text.layer_norm_eps)
        self.text_projection = Linear(d, cfg.projection_dim, bias=False)
        self.tower = VisionTower(cfg.vision, ops)
        self.tower.proj1 = Linear(cfg.vision.hidden_size, cfg.projection_dim, bias=False)
        self.tower.proj2 = None                    # CLIP projects the class token alone

    @property
    def weights_dtype(self) -> torch.dtype:
        return self.words.weight.dtype

    def forward(self, input_ids: torch.Tensor, token_types, seq_lens: list[int]) -> torch.Tensor:
        """Texts, flat [T] -> their states after the final norm [T, D]."""
        offsets = torch.cat([torch.arange(n, device=input_ids.device) for n in seq_lens])
        x, residual = self.words(input_ids) + self.positions(offsets), None
        attend = lambda q, k, v, scale: causal_attention(q, k, v, seq_lens, scale)  # noqa: E731
        for layer in self.layers:
            x, residual = layer(self.ops, x, residual, 1, attend)
        x, _ = self.final_norm.forward(self.ops, x, residual)
        return x

    def embed(self, hidden: torch.Tensor, seq_lens: list[int], pooling_type: str) -> torch.Tensor:
        """Each text's end-of-text state, projected -> [B, projection_dim] float32."""
        ends = torch.tensor(seq_lens, device=hidden.device).cumsum(0) - 1
        return self.ops.linear(self.text_projection, hidden[ends]).float()

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] -> each image's class token state, projected: [N, projection_dim]."""
        states = self.tower.states(pixel_values)                      # [N, P + 1, D]
        return self.ops.linear(self.tower.proj1, states[:, 0].contiguous()).float()


def clip_state(weights: dict[str, torch.Tensor], cfg: ClipConfig) -> dict[str, torch.Tensor]:
    """Hugging Face's CLIPModel names -> ClipModel's state dict."""
    text = {k.removeprefix("text_model."): weights.pop(k) for k in list(weights)
            if k.startswith("text_model.")}
    out = {"words.weight": text.pop("embeddings.token_embedding.weight"),
           "positions.weight": text.pop("embeddings.position_embedding.weight"),
           "final_norm.weight": text.pop("final_layer_norm.weight"),
           "final_norm.bias": text.pop("final_layer_norm.bias"),
           "text_projection.weight": weights.pop("text_projection.weight"),
           "tower.proj1.weight": weights.pop("visual_projection.weight")}
    # the layers' names are the vision tower's: read both through vision_weights
    as_tower = {f"model.vision_model.{k}": w for k, w in text.items()}
    out.update((k, w) for k, w in vision_weights(as_tower).items() if k.startswith("layers."))
    tower = vision_weights({f"model.vision_model.{k.removeprefix('vision_model.')}": w
                            for k, w in weights.items() if k.startswith("vision_model.")})
    out.update((f"tower.{k}", w) for k, w in tower.items())
    return out


def load_clip(path: str, dtype: torch.dtype, ops) -> ClipModel:
    """A CLIPModel directory's weights in `dtype`, on the CPU (Backend.load moves and lays
    them out)."""
    from ..loader import no_init, one_thread, read_safetensors    # (it imports this module)
    with open(os.path.join(path, "config.json")) as f:
        cfg = ClipConfig.from_hf(json.load(f))
    with one_thread():
        with no_init():
            model = ClipModel(cfg, ops)
        state = clip_state(read_safetensors(path, dtype), cfg)
        missing = model.load_state_dict(state, strict=False, assign=True).missing_keys
    if missing:
        raise ValueError(f"weights missing from {path}: {', '.join(missing[:5])}")
    return model.eval()
