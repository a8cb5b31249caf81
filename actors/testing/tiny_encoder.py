"""Tiny random-weight encoder checkpoints (model_info.ENCODER_ARCHITECTURES) for tests and
benchmarks: transformers' own model of the architecture saved as safetensors, with no
tokenizer (prompts are token ids)."""
from __future__ import annotations

import torch

# width 128 in 2 heads: head dim 64, which the native prefill attention takes in bfloat16;
# every Linear a whole number of BF16 tiles (16 rows, 32 columns)
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=256, vocab_size=160, max_position_embeddings=64)
NUM_LABELS = 3


def tiny_encoder_config(architecture: str, **overrides):
    """transformers' config of `architecture` at the TINY shape (3 labels). ModernBERT: a
    local window of 8 (4 each way) and every second layer global, so 2 layers have one of
    each and a 17-token sequence is longer than the window."""
    import transformers

    options = {**TINY, "num_labels": NUM_LABELS, **overrides}
    if architecture.startswith("ModernBert"):
        options = {"local_attention": 8, "global_attn_every_n_layers": 2, "pad_token_id": 0,
                   "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2,
                   **options}
    family = architecture.removesuffix("ForSequenceClassification").removesuffix(
        "ForTokenClassification").removesuffix("Model")
    return getattr(transformers, f"{family}Config")(**options)


def make_tiny_encoder(path: str, architecture: str, seed: int = 0, **overrides) -> str:
    """Save a random `architecture` (e.g. "BertForSequenceClassification") at `path`;
    returns path. Weights scaled up (x4) from transformers' init (std 0.02) so that errors
    in any op show in the hidden states."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(tiny_encoder_config(architecture, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name.lower():
                p.mul_(4)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path
