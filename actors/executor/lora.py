"""LoRA adapters in the executor: loaded on first use (at most max_cpu_loras kept, the least
recently used unloaded first) and applied to a step's rows, each row with its sequence's
adapter, base rows untouched.

An adapter's weights are laid out as the base weights are fused (weights.py): for each Linear,
A stacks the A matrices of the projections it fuses ([R, in], R the sum of their ranks) and B
is block-diagonal ([out, R]: projection j's B in its output rows and its own rank columns,
zeros elsewhere), the scale folded in. One linear's delta for a row is then x A^T B^T, two
small matmuls per adapter however many projections the linear fuses.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch

from pagewire.wire.lora import LoraRef

from ..lora_files import WEIGHTS, read_adapter

# Each fused Linear of a layer -> the projections it holds, in its output order.
PARTS = {"attn.qkv": ("q_proj", "k_proj", "v_proj"), "attn.o_proj": ("o_proj",),
         "mlp.gate_up": ("gate_proj", "up_proj"), "mlp.down": ("down_proj",)}

Weights = dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]   # Linear -> (A, B)


def _part_sizes(layer, name: str) -> list[int]:
    if name == "attn.qkv":
        return [layer.attn.q_size, layer.attn.kv_size, layer.attn.kv_size]
    out = layer.get_submodule(name).out_features
    return [out // 2] * 2 if name == "mlp.gate_up" else [out]


def load_weights(path: str, shapes: dict, scale: float, model) -> Weights:
    """An adapter's checked tensors (lora_files.read_adapter) in the fused layout, float32."""
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(path, WEIGHTS))
    out: Weights = {}
    for i, layer in enumerate(model.layers):
        for name, parts in PARTS.items():
            present = [(j, p) for j, p in enumerate(parts) if (i, p) in shapes]
            if not present:
                continue
            sizes = _part_sizes(layer, name)
            key = f"base_model.model.model.layers.{i}.%s.{{}}.lora_%s.weight"
            kind = "self_attn" if name.startswith("attn") else "mlp"
            a = [tensors[(key % (kind, "A")).format(p)].float() for _, p in present]
            b = torch.zeros(sum(sizes), sum(t.shape[0] for t in a))              # [out, R]
            col = 0
            for (j, p), a_j in zip(present, a):
                row = sum(sizes[:j])
                b[row:row + sizes[j], col:col + a_j.shape[0]] = \
                    tensors[(key % (kind, "B")).format(p)].float() * scale
                col += a_j.shape[0]
            dev = model.embed.weight.device
            out[layer.get_submodule(name)] = (torch.cat(a).to(dev), b.to(dev))   # [R, in]
    return out


class Adapters:
    """The loaded adapters by load id, least recently used first."""

    def __init__(self, model, info, max_rank: int, capacity: int):
        self.model, self.info, self.max_rank, self.capacity = model, info, max_rank, capacity
        self.loaded: OrderedDict[int, Weights] = OrderedDict()

    def get(self, ref: LoraRef) -> Weights:
        """The adapter's weights, loaded now if need be. A step uses at most max_loras <=
        capacity adapters, each touched as its rows are laid out, so none it uses is evicted."""
        weights = self.loaded.pop(ref.id, None)
        if weights is None:
            file = read_adapter(ref.path, self.info, self.max_rank)
            weights = load_weights(ref.path, file.shapes, file.scale, self.model)
            while len(self.loaded) >= self.capacity:
                self.loaded.popitem(last=False)
        self.loaded[ref.id] = weights
        return weights


class LoraBatch:
    """A step's rows grouped by adapter: (weights, row indices) each. The program's LINEAR op
    adds every group's delta to the rows it owns."""

    def __init__(self, groups: list[tuple[Weights, torch.Tensor]]):
        self.groups = groups

    def apply(self, linear, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, out] += the delta of x [T, in] through `linear`'s adapters, row by row."""
        for weights, rows in self.groups:
            ab = weights.get(linear)
            if ab is None:
                continue
            a, b = ab
            delta = (x.index_select(0, rows).float() @ a.T) @ b.T      # [n, R] -> [n, out]
            y.index_add_(0, rows, delta.to(y.dtype))
