"""A vision tower and its projector: images in, language-model embeddings out (one row per
image token). CLIP's ViT (LLaVA): patch embedding, a class token and learned positions, a
pre-norm, encoder layers of LayerNorm -> self-attention (every patch sees every patch: no KV
cache, no mask) -> LayerNorm -> MLP; the hidden states of one layer (LLaVA: the second last)
without the class token, then the projector's Linear -> GELU -> Linear into the language
model's width. torch ops, float32 or the model's dtype; the step loop never runs it while a
decode waits on it (the runner encodes an image once and caches the result).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-5
    activation: str = "quick_gelu"          # CLIP's; "gelu" elsewhere
    feature_layer: int = -2                 # hidden_states index the language model reads
    keep_class_token: bool = False          # LLaVA's "default" strategy drops it
    projector_activation: str = "gelu"
    projector_bias: bool = True
    text_hidden_size: int = 0
    image_token_id: int = -1                # the prompt's placeholder, once per image row

    @classmethod
    def from_hf(cls, cfg: dict) -> "VisionConfig":
        """A LLaVA config.json's vision_config and projector settings."""
        v = cfg["vision_config"]
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported")
        layer = cfg.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ValueError("vision_feature_layer as a list of layers is not supported yet")
        return cls(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                   num_layers=v["num_hidden_layers"], num_heads=v["num_attention_heads"],
                   image_size=v["image_size"], patch_size=v["patch_size"],
                   layer_norm_eps=v.get("layer_norm_eps", 1e-5),
                   activation=v.get("hidden_act", "quick_gelu"), feature_layer=layer,
                   keep_class_token=strategy == "full",
                   projector_activation=cfg.get("projector_hidden_act", "gelu"),
                   projector_bias=cfg.get("multimodal_projector_bias", True),
                   text_hidden_size=cfg["text_config"]["hidden_size"],
                   image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", -1)))

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + int(self.keep_class_token)


def _activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu(x)
    raise ValueError(f"activation {name!r} is not supported in the vision tower")


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, self.cfg = cfg.hidden_size, cfg
        self.norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.qkv = nn.Linear(d, 3 * d)                # q, k, v stacked by rows
        self.out = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(d, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, p, d = x.shape                                               # [N, P, D]
        heads = self.cfg.num_heads
        q, k, v = self.qkv(self.norm1(x)).view(n, p, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)                  # [N, heads, P, D/h]
        x = x + self.out(attn.transpose(1, 2).reshape(n, p, d))
        return x + self.fc2(_activation(self.cfg.activation, self.fc1(self.norm2(x))))


class VisionTower(nn.Module):
    """pixel_values [N, 3, S, S] -> image embeddings [N, tokens_per_image, text hidden]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg, d = cfg, cfg.hidden_size
        grid = cfg.image_size // cfg.patch_size
        self.patch = nn.Conv2d(3, d, cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(d), requires_grad=False)
        self.positions = nn.Embedding(grid * grid + 1, d)
        self.pre_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        # only the layers up to the one whose output is read
        depth = cfg.feature_layer % (cfg.num_layers + 1)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(depth))
        self.proj1 = nn.Linear(d, cfg.text_hidden_size, bias=cfg.projector_bias)
        self.proj2 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size,
                               bias=cfg.projector_bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = self.patch.weight.dtype
        x = self.patch(pixel_values.to(dtype)).flatten(2).transpose(1, 2)   # [N, P, D]
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.positions.weight                # [N, P+1, D]
        x = self.pre_norm(x)
        for layer in self.layers:
            x = layer(x)
        if not self.cfg.keep_class_token:
            x = x[:, 1:]
        x = _activation(self.cfg.projector_activation, self.proj1(x))
        return self.proj2(x)                                                  # [N, P, H]


def vision_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's vision tower and projector names (either LLaVA layout) -> the tower's
    state dict, q/k/v fused by rows. Takes the entries out of `weights`."""
    out, prefixes = {}, ("model.vision_tower.", "vision_tower.")
    plain = {"embeddings.patch_embedding.weight": "patch.weight",
             "embeddings.class_embedding": "class_embedding",
             "embeddings.position_embedding.weight": "positions.weight",
             "pre_layrnorm.weight": "pre_norm.weight", "pre_layrnorm.bias": "pre_norm.bias"}
    tower = {}
    for name in [n for n in weights if n.startswith(prefixes)]:
        short = name.split("vision_tower.", 1)[1].removeprefix("vision_model.")
        tower[short] = weights.pop(name)
    for theirs, ours in plain.items():
        out[ours] = tower[theirs]
    i = 0
    while f"encoder.layers.{i}.layer_norm1.weight" in tower:
        src, dst = f"encoder.layers.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            out[dst + "qkv." + kind] = torch.cat([tower[f"{src}self_attn.{x}_proj.{kind}"]
                                                  for x in "qkv"])
            out[dst + "out." + kind] = tower[f"{src}self_attn.out_proj.{kind}"]
            for theirs, ours in (("layer_norm1", "norm1"), ("layer_norm2", "norm2"),
                                 ("mlp.fc1", "fc1"), ("mlp.fc2", "fc2")):
                out[f"{dst}{ours}.{kind}"] = tower[f"{src}{theirs}.{kind}"]
        i += 1
    for name in [n for n in weights if "multi_modal_projector." in n]:
        linear, kind = name.split("multi_modal_projector.", 1)[1].split(".")
        out[("proj1." if linear == "linear_1" else "proj2.") + kind] = weights.pop(name)
    return out
