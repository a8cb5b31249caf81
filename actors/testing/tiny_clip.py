"""A tiny random-weight CLIPModel directory for tests: transformers' model, a CLIP BPE
tokenizer over a few characters and words, and an image processor of 32-pixel crops."""
from __future__ import annotations

import json
import os
import string


def make_tiny_clip(path: str, seed: int = 0) -> str:
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizerFast
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, image_size=32, patch_size=8),
        projection_dim=48)
    CLIPModel(config).eval().save_pretrained(path, safe_serialization=True)
    CLIPImageProcessor(size={"shortest_edge": 32},
                       crop_size={"height": 32, "width": 32}).save_pretrained(path)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in string.ascii_lowercase + string.digits + ".,!?'":
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    merges = ["t h", "th e</w>", "c a", "ca t</w>"]
    vocab.update((w, len(vocab) + i) for i, w in enumerate(["th", "the</w>", "ca", "cat</w>"]))
    with open(os.path.join(path, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(path, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    CLIPTokenizerFast(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"),
                      bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                      pad_token="<|endoftext|>", unk_token="<|endoftext|>").save_pretrained(path)
    return path
