"""Qwen2.5-VL's vision tower: dynamic resolution (an image is a grid of 14-pixel patches of
its own size, no resize to a square), a ViT with 2D rotary positions, RMSNorms, gated SiLU MLPs
with biases, window attention in most layers (full attention in `fullatt_block_indexes`), and
a patch merger (RMSNorm, each 2 x 2 square of patches one row, Linear -> GELU -> Linear).

The processor's patches arrive flattened ([patches, 3 x temporal_patch x 14 x 14], a still
image its frame repeated) in its order: merge squares row-major, the four patches of a
square together. Conv3d with stride = kernel over one such patch is a Linear over the
flattened values. Window attention regroups the merge squares window by window (the
window_index transformers computes) so each window's patches are contiguous; the merger's
rows go back to the processor's order after it. Each image attends within itself only.
torch ops in the model's dtype (attention and rotary math as transformers': float32 rope).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class QwenVisionConfig:
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    out_hidden_size: int                      # the language model's width
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112                    # pixels a window spans
    fullatt_block_indexes: list[int] = field(default_factory=list)
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    image_token_id: int = -1

    @classmethod
    def from_hf(cls, cfg: dict) -> "QwenVisionConfig":
        v = cfg["vision_config"]
        rope = v.get("rope_parameters") or {}
        return cls(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                   depth=v["depth"], num_heads=v["num_heads"],
                   out_hidden_size=v["out_hidden_size"], patch_size=v.get("patch_size", 14),
                   temporal_patch_size=v.get("temporal_patch_size", 2),
                   spatial_merge_size=v.get("spatial_merge_size", 2),
                   window_size=v.get("window_size", 112),
                   fullatt_block_indexes=list(v.get("fullatt_block_indexes") or []),
                   rope_theta=rope.get("rope_theta", 10000.0),
                   hidden_act=v.get("hidden_act", "silu"),
                   image_token_id=cfg.get("image_token_id", 151655))

    @property
    def patch_values(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size ** 2


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = x.float()
        return self.weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [P, heads, D] rotated (rotate-half pairs) by cos_sin [P, D] (cos | sin), in float32."""
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        d, self.heads = cfg.hidden_size, cfg.num_heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.gate = nn.Linear(d, cfg.intermediate_size)
        self.up = nn.Linear(d, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, d)
        if cfg.hidden_act != "silu":
            raise ValueError(f"vision hidden_act {cfg.hidden_act!r} is not supported")

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, windows) -> torch.Tensor:
        """x [P, D]; windows: None (every patch sees every patch) or (index [W, S] into the
        rows, valid [W, S]): each window's rows, padded to the widest."""
        p, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(p, 3, self.heads, d // self.heads).unbind(1)
        q, k = _rotate(q, cos_sin), _rotate(k, cos_sin)
        if windows is None:
            out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))
            out = out[0].transpose(0, 1).reshape(p, d)
        else:
            index, valid = windows
            q, k, v = (t[index].transpose(1, 2) for t in (q, k, v))     # [W, heads, S, D/h]
            mask = valid[:, None, None, :]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
            out = out[valid].reshape(p, d)            # windows' rows in order: the rows' order
        x = x + self.proj(out)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class QwenVisionTower(nn.Module):
    """patches [sum of P, patch_values] of images of grids (t, h, w) in patches -> each
    image's rows [t h w / merge^2, out_hidden_size]."""

    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.cfg, d = cfg, cfg.hidden_size
        self.patch = nn.Linear(cfg.patch_values, d, bias=False)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        unit = d * cfg.spatial_merge_size ** 2
        self.merge_norm = RMSNorm(d)
        self.merge1, self.merge2 = nn.Linear(unit, unit), nn.Linear(unit, cfg.out_hidden_size)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
                ) -> list[torch.Tensor]:
        x = self.patch(patches.to(self.patch.weight.dtype))
        out, start = [], 0
        for t, h, w in grids:
            out.append(self.image(x[start:start + t * h * w], t, h, w))
            start += t * h * w
        return out

    def image(self, x: torch.Tensor, t: int, h: int, w: int) -> torch.Tensor:
        cfg, unit = self.cfg, self.cfg.spatial_merge_size ** 2
        order, sizes = window_order(t, h, w, cfg.spatial_merge_size,
                                    cfg.window_size // cfg.spatial_merge_size // cfg.patch_size)
        order = order.to(x.device)
        rows = (order[:, None] * unit + torch.arange(unit, device=x.device)).reshape(-1)
        x = x[rows]                                   # merge squares window by window
        cos_sin = self.rope(t, h, w).to(x.device)[rows]
        windows = _padded(sizes, unit, x.device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos_sin, None if i in cfg.fullatt_block_indexes else windows)
        merged = self.merge2(F.gelu(self.merge1(self.merge_norm(x).view(-1, x.shape[1] * unit))))
        return merged[torch.argsort(order)]

    def rope(self, t: int, h: int, w: int) -> torch.Tensor:
        """(cos | sin) [t h w, head] of each patch in the processor's order: the first half of
        the frequencies rotate by its row, the second by its column."""
        m = self.cfg.spatial_merge_size
        hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        hpos = hpos.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t)
        wpos = wpos.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t)
        half = self.cfg.hidden_size // self.cfg.num_heads // 2       # (built here: no buffer
        inv = 1.0 / self.cfg.rope_theta ** (                          # for a meta-device load)
            torch.arange(0, half, 2, dtype=torch.float32) / half)
        freqs = torch.cat([hpos[:, None] * inv, wpos[:, None] * inv], dim=-1)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def window_order(t: int, h: int, w: int, merge: int, side: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """Merge squares (t, h / merge, w / merge, row-major) listed window by window (side x side
    squares a window, windows row-major, the last ones cut at the edge), and each window's
    number of squares: transformers' get_vision_window_index for one image."""
    gh, gw = h // merge, w // merge
    nh, nw = -(-gh // side), -(-gw // side)
    index = torch.arange(t * gh * gw).reshape(t, gh, gw)
    padded = F.pad(index, (0, nw * side - gw, 0, nh * side - gh), value=-1)
    padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
    sizes = (padded >= 0).sum(1).tolist()
    flat = padded.reshape(-1)
    return flat[flat >= 0], [s for s in sizes if s]


def _padded(sizes: list[int], unit: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [W, S], valid [W, S]) of windows of sizes[i] squares (unit patches each)."""
    lengths = torch.tensor(sizes) * unit
    widest = int(lengths.max())
    valid = torch.arange(widest)[None, :] < lengths[:, None]
    starts = torch.cumsum(lengths, 0) - lengths
    index = torch.where(valid, starts[:, None] + torch.arange(widest)[None, :], 0)
    return index.to(device), valid.to(device)


_BLOCK = {"norm1.weight": "norm1.weight", "norm2.weight": "norm2.weight",
          "attn.qkv.weight": "qkv.weight", "attn.qkv.bias": "qkv.bias",
          "attn.proj.weight": "proj.weight", "attn.proj.bias": "proj.bias",
          **{f"mlp.{x}_proj.{k}": f"{x}.{k}" for x in ("gate", "up", "down")
             for k in ("weight", "bias")}}
_MERGER = {"merger.ln_q.weight": "merge_norm.weight", "merger.mlp.0.weight": "merge1.weight",
           "merger.mlp.0.bias": "merge1.bias", "merger.mlp.2.weight": "merge2.weight",
           "merger.mlp.2.bias": "merge2.bias"}


def qwen_vision_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's tower names (model.visual.* in transformers 5's layout, visual.* in the
    released checkpoints') -> the tower's state dict; the Conv3d patch embedding as the
    Linear over a flattened patch. Takes the entries out of `weights`."""
    tower = {}
    for name in [n for n in weights if n.startswith(("model.visual.", "visual."))]:
        tower[name.split("visual.", 1)[1]] = weights.pop(name)
    conv = tower.pop("patch_embed.proj.weight")
    out = {"patch.weight": conv.reshape(conv.shape[0], -1)}
    out.update((ours, tower.pop(theirs)) for theirs, ours in _MERGER.items())
    i = 0
    while f"blocks.{i}.norm1.weight" in tower:
        out.update((f"blocks.{i}.{ours}", tower.pop(f"blocks.{i}.{theirs}"))
                   for theirs, ours in _BLOCK.items())
        i += 1
    if tower:
        raise ValueError(f"unexpected vision weights: {sorted(tower)[:5]}")
    return out
