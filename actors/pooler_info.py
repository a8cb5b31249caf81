"""What a pooling model's output is, read without torch: its task, how a sequence's hidden
states pool to one vector, and what a request's options may do with it (ModelInfo.pooler;
None for a model that generates). Resolved once, at start, from the model's config.json,
sentence-transformers' files beside it (modules.json, the pooling module's config, a
Normalize module) and the flags --runner, --convert and --pooler-config."""
from __future__ import annotations

import msgspec

POOLING_TASKS = EMBED, CLASSIFY = ("embed", "classify")
POOLING_TYPES = CLS, MEAN, LAST = ("CLS", "MEAN", "LAST")
ACTIVATIONS = SIGMOID, SOFTMAX, NO_ACTIVATION = ("sigmoid", "softmax", "none")


class PoolerInfo(msgspec.Struct, kw_only=True, frozen=True):
    """A pooling model's output. `task` embed: the pooled hidden state (`size` values, the
    hidden size), normalised by default where `normalize` (sentence-transformers' Normalize
    module, or the runner's default), truncatable to `matryoshka_dimensions` (None: any
    `dimensions` request is refused); classify: a classifier's logits, one per label
    (`labels`, id2label's order), through `activation` by default (sigmoid for one label,
    softmax for several). `encoder_only`: attention is bidirectional, so there is no KV cache
    and a prompt runs whole in one step (executor/pooling_runner.py); else a causal model's
    prompt runs as a prefill that samples nothing (prefix cache and chunks as usual)."""
    task: str                                # POOLING_TASKS
    pooling_type: str                        # POOLING_TYPES
    size: int
    normalize: bool = False
    matryoshka_dimensions: list[int] | None = None
    labels: list[str] = []
    activation: str = NO_ACTIVATION          # ACTIVATIONS
    encoder_only: bool = False
