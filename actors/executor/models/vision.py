"""Vision towers and their connectors: images in, language-model embeddings out (one row per
image token). Two of one shape: CLIP's ViT (LLaVA: patch embedding, a class token and learned
positions, a pre-norm, encoder layers of LayerNorm -> self-attention -> LayerNorm -> MLP, the
hidden states of one layer, LLaVA's the second last, without the class token, then a
Linear -> GELU -> Linear projector) and SigLIP's (Idefics3 / SmolVLM: a patch embedding with a
bias, no class token, the last layer's states after a post-norm, then a pixel shuffle that
folds each scale x scale square of patches into one row, and one Linear; Gemma 3: the same
SigLIP tower, then its patch grid average-pooled to mm_tokens_per_image rows, a Gemma RMSNorm
(weight + 1) and one matrix, no bias). Every patch sees every patch: no KV cache, no mask.
torch ops in the model's dtype; the runner encodes an image (a tile, for Idefics3) once and caches the result (executor/image_rows.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .llama import LayerNorm


@dataclass
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-5
    activation: str = "quick_gelu"          # CLIP's; "gelu_pytorch_tanh" SigLIP's
    feature_layer: int = -2                 # hidden_states index the language model reads
    class_token: bool = True                # CLIP: a class token first, a pre-norm
    keep_class_token: bool = False          # LLaVA's "default" strategy drops it
    patch_bias: bool = False
    post_norm: bool = False                 # SigLIP (Idefics3): the last states normalized
    scale_factor: int = 0                   # Idefics3: pixel shuffle, then one Linear
    projector_activation: str = "gelu"
    projector_bias: bool = True
    text_hidden_size: int = 0
    image_token_id: int = -1                # the prompt's placeholder, once per image row
    pooled_tokens: int = 0                  # Gemma 3: the grid pooled to this many rows

    @classmethod
    def from_hf(cls, cfg: dict) -> "VisionConfig":
        """A LLaVA or Idefics3 config.json's vision_config and connector settings."""
        v = cfg["vision_config"]
        common = dict(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                      num_layers=v["num_hidden_layers"], num_heads=v["num_attention_heads"],
                      image_size=v["image_size"], patch_size=v["patch_size"],
                      text_hidden_size=cfg["text_config"]["hidden_size"],
                      image_token_id=cfg.get("image_token_index", cfg.get("image_token_id",
                                                                          -1)))
        if "mm_tokens_per_image" in cfg:                            # Gemma 3
            return cls(**common, layer_norm_eps=v.get("layer_norm_eps", 1e-6),
                       activation=v.get("hidden_act", "gelu_pytorch_tanh"), feature_layer=-1,
                       class_token=False, patch_bias=True, post_norm=True,
                       pooled_tokens=cfg["mm_tokens_per_image"], projector_bias=False)
        if "scale_factor" in cfg:                                   # Idefics3
            return cls(**common, layer_norm_eps=v.get("layer_norm_eps", 1e-6),
                       activation=v.get("hidden_act", "gelu_pytorch_tanh"), feature_layer=-1,
                       class_token=False, patch_bias=True, post_norm=True,
                       scale_factor=cfg["scale_factor"], projector_bias=False)
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported")
        layer = cfg.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ValueError("vision_feature_layer as a list of layers is not supported yet")
        return cls(**common, layer_norm_eps=v.get("layer_norm_eps", 1e-5),
                   activation=v.get("hidden_act", "quick_gelu"), feature_layer=layer,
                   keep_class_token=strategy == "full",
                   projector_activation=cfg.get("projector_hidden_act", "gelu"),
                   projector_bias=cfg.get("multimodal_projector_bias", True))

    @property
    def tokens_per_image(self) -> int:
        patches = (self.image_size // self.patch_size) ** 2
        if self.pooled_tokens:
            return self.pooled_tokens
        if self.scale_factor:
            return patches // self.scale_factor ** 2
        return patches + int(self.class_token and self.keep_class_token)


def _activation(name: str, x: torch.Tensor, ops=None) -> torch.Tensor:
    """The tower's (or projector's) activation; GELUs through `ops` where given (the
    backend's native one: torch's tanh GELU took a tenth of a SigLIP tile's time)."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
        form = "none" if name == "gelu" else "tanh"
        return ops.gelu(x.contiguous(), form) if ops is not None else F.gelu(x, approximate=form)
    raise ValueError(f"activation {name!r} is not supported in the vision tower")


class EncoderLayer(nn.Module):
    """LayerNorm -> attention -> LayerNorm -> MLP on the backend's ops, as the GPT family's
    blocks run: a residual stream beside each sublayer's output, each norm adding the two."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, self.cfg = cfg.hidden_size, cfg
        self.norm1 = LayerNorm(d, cfg.layer_norm_eps)
        self.qkv = nn.Linear(d, 3 * d)                # q, k, v stacked by rows
        self.out = nn.Linear(d, d)
        self.norm2 = LayerNorm(d, cfg.layer_norm_eps)
        self.fc1 = nn.Linear(d, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, d)

    def forward(self, ops, x: torch.Tensor, residual: torch.Tensor | None, images: int,
                attend=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N P, D] the last sublayer's output (the embeddings, with residual None) ->
        this layer's MLP output and the stream before it (their sum: the layer's states).
        `attend(q, k, v, scale)` on [T, heads, D/h] in place of every patch seeing every patch
        of its image (CLIP's text tower: causal, sequences of their own lengths)."""
        h, residual = self.norm1.forward(ops, x, residual)
        t, d = h.shape
        heads = self.cfg.num_heads
        qkv = ops.linear(self.qkv, h)
        if attend is not None:
            attn = attend(*qkv.view(t, 3, heads, d // heads).unbind(1), (d // heads) ** -0.5)
        else:
            q, k, v = qkv.view(images, t // images, 3, heads, d // heads).unbind(2)
            attn = ops.full_attention(q, k, v, (d // heads) ** -0.5)   # [N, P, heads, D/h]
        h, residual = self.norm2.forward(ops, ops.linear(self.out, attn.reshape(t, d)),
                                         residual)
        h = _activation(self.cfg.activation, ops.linear(self.fc1, h), ops)
        return ops.linear(self.fc2, h), residual


class VisionTower(nn.Module):
    """pixel_values [N, 3, S, S] -> image embeddings [N, tokens_per_image, text hidden]."""

    def __init__(self, cfg: VisionConfig, ops):
        """ops: the backend's kernel set (kernels/ops.py), whose full_attention the layers
        call."""
        super().__init__()
        self.cfg, self.ops, d = cfg, ops, cfg.hidden_size
        grid = cfg.image_size // cfg.patch_size
        self.patch = nn.Conv2d(3, d, cfg.patch_size, stride=cfg.patch_size, bias=cfg.patch_bias)
        self.class_embedding = nn.Parameter(torch.zeros(d), requires_grad=False) \
            if cfg.class_token else None
        self.positions = nn.Embedding(grid * grid + int(cfg.class_token), d)
        self.pre_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps) if cfg.class_token else None
        # only the layers up to the one whose output is read
        depth = cfg.feature_layer % (cfg.num_layers + 1)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(depth))
        self.post_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps) if cfg.post_norm else None
        wide = d * cfg.scale_factor ** 2 if cfg.scale_factor else d
        self.proj1 = nn.Linear(wide, cfg.text_hidden_size, bias=cfg.projector_bias)
        one_linear = cfg.scale_factor or cfg.pooled_tokens
        self.proj2 = None if one_linear else nn.Linear(
            cfg.text_hidden_size, cfg.text_hidden_size, bias=cfg.projector_bias)
        # Gemma 3's mm_soft_emb_norm: RMSNorm, its weight stored less one
        self.soft_norm = nn.Parameter(torch.zeros(d), requires_grad=False) \
            if cfg.pooled_tokens else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.states(pixel_values)
        if self.class_embedding is not None and not self.cfg.keep_class_token:
            x = x[:, 1:]
        if self.cfg.scale_factor:
            return self.proj1(pixel_shuffle(x, self.cfg.scale_factor))       # [N, P/s^2, H]
        if self.soft_norm is not None:
            x = gemma_rms_norm(average_pool(x, self.cfg.pooled_tokens), self.soft_norm,
                               self.cfg.layer_norm_eps)
            return self.proj1(x)                                              # [N, rows, H]
        return self.proj2(_activation(self.cfg.projector_activation, self.proj1(x)))

    def states(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, S, S] -> the read layer's states [N, P (+1), D], through the
        post-norm where the tower has one; the class token's first where it has one."""
        dtype = self.patch.weight.dtype
        x = self.patch(pixel_values.to(dtype)).flatten(2).transpose(1, 2)   # [N, P, D]
        if self.class_embedding is not None:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)                                    # [N, P+1, D]
        x = x + self.positions.weight
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        n, p, d = x.shape
        x, residual = x.reshape(n * p, d).contiguous(), None
        for layer in self.layers:
            x, residual = layer(self.ops, x, residual, n)
        x = (x if residual is None else x + residual).view(n, p, d)
        return x if self.post_norm is None else self.post_norm(x)


def pixel_shuffle(x: torch.Tensor, s: int) -> torch.Tensor:
    """[N, P, D] patches of a square grid -> [N, P / s^2, D s^2]: each s x s square of
    patches one row (Idefics3's order: s columns of a row, then the next row's)."""
    n, p, d = x.shape
    side = int(p ** 0.5)
    x = x.view(n, side, side // s, d * s).permute(0, 2, 1, 3)
    x = x.reshape(n, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
    return x.reshape(n, p // (s * s), d * s * s)


def average_pool(x: torch.Tensor, rows: int) -> torch.Tensor:
    """[N, P, D] patches of a square grid -> [N, rows, D]: each k x k square of patches
    averaged (k = grid side / sqrt(rows)), squares in row-major order (Gemma 3's AvgPool2d)."""
    n, p, d = x.shape
    side, out = int(p ** 0.5), int(rows ** 0.5)
    grid = x.transpose(1, 2).reshape(n, d, side, side)
    return F.avg_pool2d(grid, side // out).flatten(2).transpose(1, 2)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: float32 math, scaled by (1 + weight), back in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


# the tower's own names, after its prefix: LLaVA's (vision_tower.[vision_model.]) or
# Idefics3's (model.vision_model.)
_TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.vision_model.")
_PLAIN = {"embeddings.patch_embedding.weight": "patch.weight",
          "embeddings.patch_embedding.bias": "patch.bias",
          "embeddings.class_embedding": "class_embedding",
          "embeddings.position_embedding.weight": "positions.weight",
          "pre_layrnorm.weight": "pre_norm.weight", "pre_layrnorm.bias": "pre_norm.bias",
          "post_layernorm.weight": "post_norm.weight", "post_layernorm.bias": "post_norm.bias"}
# the connector's: LLaVA's projector, Idefics3's one Linear after the pixel shuffle
_CONNECTOR = {"multi_modal_projector.linear_1.weight": "proj1.weight",
              "multi_modal_projector.linear_1.bias": "proj1.bias",
              "multi_modal_projector.linear_2.weight": "proj2.weight",
              "multi_modal_projector.linear_2.bias": "proj2.bias",
              "connector.modality_projection.proj.weight": "proj1.weight",
              "multi_modal_projector.mm_soft_emb_norm.weight": "soft_norm"}
# Gemma 3's projection, stored [vision width, text width] (a matmul's, not a Linear's)
_GEMMA3_PROJECTION = "multi_modal_projector.mm_input_projection_weight"


def vision_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's vision tower and connector names (LLaVA's, Idefics3's, Gemma 3's) -> the
    tower's state dict, q/k/v fused by rows. Takes the entries out of `weights`."""
    tower = {}
    for name in [n for n in weights if n.startswith(_TOWER_PREFIXES)]:
        short = name.split("vision_tower.", 1)[-1] if "vision_tower." in name else \
            name.split("vision_model.", 1)[1]
        tower[short.removeprefix("vision_model.")] = weights.pop(name)
    out = {ours: tower[theirs] for theirs, ours in _PLAIN.items() if theirs in tower}
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
    for name in list(weights):
        short = name.removeprefix("model.")
        if short in _CONNECTOR:
            out[_CONNECTOR[short]] = weights.pop(name)
        elif short == _GEMMA3_PROJECTION:
            out["proj1.weight"] = weights.pop(name).t().contiguous()
    return out
