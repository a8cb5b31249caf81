"""POST /update_weights (and LLM.update_weights): which checkpoints may replace the served
weights. Checked by the gateway before anything reaches the engine, and again by each
executor before it reads a byte (the offline LLM has no gateway). Imports no torch.

A new checkpoint must be the served model's own kind (a GGUF file for a GGUF model, a Hugging
Face directory for a directory) with the same architecture and shapes: every field of
ModelInfo the KV pool, the scheduler's tables, the tokenizer's vocabulary or a LoRA slot was
sized by. What it may change is the weights' values (and their stored quantization's blocks,
where the packing is the same).
"""
from __future__ import annotations

import os

from .model_info import ModelInfo, ModelNotFound, resolve_model

# ModelInfo fields that must match: shapes, and what the engine was laid out for.
SAME_FIELDS = ("format", "architecture", "vocab_size", "num_layers", "num_kv_heads", "head_dim",
               "hidden_size", "num_heads", "intermediate_size", "stored_quantization",
               "sliding_window", "rope_scaling")


class WeightsRefused(ValueError):
    """The path cannot replace the served weights: why, for a 400."""


def resolve_update(current: ModelInfo, path: str) -> ModelInfo:
    """The checkpoint at `path` as the served model's new weights: `current` with the new
    path and digest (its name, pooler, vision tower and context length kept). Raises
    WeightsRefused naming the problem."""
    if not isinstance(path, str) or not path:
        raise WeightsRefused("give the new weights' path (a GGUF file or a Hugging Face "
                             "directory)")
    real = os.path.realpath(os.path.expanduser(path))
    try:
        new = resolve_model(real)
    except (ModelNotFound, ValueError, OSError) as e:
        raise WeightsRefused(f"cannot read weights at {path}: {e}") from None
    differ = [f"{f} {getattr(new, f)!r} (served: {getattr(current, f)!r})"
              for f in SAME_FIELDS if getattr(new, f) != getattr(current, f)]
    if differ:
        raise WeightsRefused(f"{path} is not the served model's architecture and shapes: "
                             + "; ".join(differ))
    return ModelInfo(**{**{f: getattr(current, f) for f in current.__struct_fields__},
                        "path": new.path, "digest": new.digest})

