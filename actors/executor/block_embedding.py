"""A GGUF model's token embedding kept as the file's blocks: each step dequantizes only the
rows its tokens look up (executor/gguf_weights.py's dequantization, exact), so the
embedding holds its file's bytes instead of a bfloat16 table (Llama 3's 128,256 x 4,096
rows: 0.3 GB of Q4_K against 1.05 GB). A tied LM head multiplies the same blocks as tiles
(linear_blocks.py), so the float table is never needed.

One rank only (tensor parallelism splits the vocabulary of a float table); types that
gguf_weights dequantizes with torch (Q4_0, Q4_1, Q8_0, Q2_K-Q6_K).
"""
from __future__ import annotations

import torch
from torch import nn

from pagewire.gguf_header import GGML_TYPES

from .gguf_weights import DEQUANTIZED, dequantize_rows, read_blocks
from .models.weights import embedding_source


class BlockEmbedding(nn.Module):
    """Rows uint8 [vocab, row bytes] of `ggml_type` blocks; lookup(ids [T]) -> [T, H] in
    `dtype`. `weight`: an empty [0, H] tensor of the activations' dtype, which the model's
    other parts read for their dtype and device (it holds no rows)."""

    def __init__(self, ggml_type: int, rows: torch.Tensor, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.ggml_type = ggml_type
        self.register_buffer("blocks", rows, persistent=False)
        self.weight = torch.empty(0, hidden, dtype=dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.ggml_type, self.blocks[ids]).to(self.weight.dtype)


def block_embedding(info, cfg, tp, dtype: torch.dtype,
                    tied_head_blocks_only: bool) -> BlockEmbedding | None:
    """The embedding of a GGUF model as its blocks where it can be (one rank; a type
    dequantized here; a tied LM head that keeps only its blocks, else the float table must
    exist for it), or None."""
    from .loader import gguf_header
    if info.format != "gguf" or tp.size > 1 or (cfg.tie_word_embeddings
                                                 and not tied_head_blocks_only):
        return None
    name = embedding_source(cfg)
    stored = read_blocks(info.path, gguf_header(info.path), [name], set(DEQUANTIZED),
                         cfg.num_heads, cfg.num_kv_heads)
    if name not in stored:
        return None
    ggml_type, rows = stored[name]
    _, block, size = GGML_TYPES[ggml_type]
    if rows.shape != (cfg.vocab_size, cfg.hidden_size // block * size):
        return None
    return BlockEmbedding(ggml_type, rows.contiguous(), cfg.hidden_size, dtype)
