"""sentence-transformers' Dense modules in the executor (pooler_info.DenseModule): each a
linear projection with an activation, applied in order to a step's pooled rows at once, after
pooling and before anything a request asks (Matryoshka cut, normalisation: pooling_outputs.py).
Weights are read once, at load, from each module's folder (model.safetensors, or
pytorch_model.bin in older saves), and kept in float32, as sentence-transformers runs them."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from pagewire.pooler_info import DenseModule, PoolerInfo

_APPLY = {"identity": lambda x: x, "tanh": torch.tanh, "relu": torch.relu,
          "gelu": F.gelu, "sigmoid": torch.sigmoid}


class DenseProjection:
    """The model's Dense modules: [R, in] pooled rows -> [R, out] float32."""

    def __init__(self, model_path: str, modules: list[DenseModule], device: torch.device):
        self.layers = [(*_weights(model_path, m, device), _APPLY[m.activation])
                       for m in modules]

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        x = pooled.float()
        for weight, bias, activation in self.layers:
            x = activation(F.linear(x, weight, bias))
        return x


def dense_projection(model_path: str, pooler: PoolerInfo | None,
                     device: torch.device) -> DenseProjection | None:
    """The projection a pooling model's embeddings go through; None where it has none."""
    if pooler is None or not pooler.dense:
        return None
    return DenseProjection(model_path, pooler.dense, device)


def _weights(model_path: str, module: DenseModule, device: torch.device):
    """One module's (weight [out, in], bias [out] or None) from its folder, shapes checked."""
    folder = os.path.join(model_path, module.folder)
    safe, pickled = (os.path.join(folder, n) for n in ("model.safetensors", "pytorch_model.bin"))
    if os.path.isfile(safe):
        from safetensors.torch import load_file
        file, state = safe, load_file(safe)
    elif os.path.isfile(pickled):
        file, state = pickled, torch.load(pickled, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{folder}: the Dense module's weights (model.safetensors or "
                         "pytorch_model.bin) are missing")
    weight, bias = state.get("linear.weight"), state.get("linear.bias")
    shape = (module.out_features, module.in_features)
    if weight is None or tuple(weight.shape) != shape or module.bias != (bias is not None) or \
            (bias is not None and tuple(bias.shape) != shape[:1]):
        raise ValueError(f"{file}: linear.weight of shape {list(shape)}"
                         f"{' and linear.bias' if module.bias else ''} expected (config.json), "
                         f"found {sorted((k, list(v.shape)) for k, v in state.items())}")
    to = dict(device=device, dtype=torch.float32)
    return weight.to(**to), None if bias is None else bias.to(**to)
