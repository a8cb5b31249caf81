"""The token embedding looked up from a GGUF file's blocks (executor/block_embedding.py): the
rows gguf-py's dequantization gives, in the activations' dtype, holding the blocks' bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire.executor.block_embedding import BlockEmbedding

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_rows_are_the_dequantized_blocks(qtype):
    from pagewire.testing.gguf_writer import random_blocks
    from tests.kernels.test_gguf_blocks import dequantized
    rows = random_blocks(qtype, 40, 512, np.random.default_rng(3))
    table = torch.from_numpy(dequantized(rows, qtype))
    embedding = BlockEmbedding(int(gguf.GGMLQuantizationType[qtype]), rows, 512, torch.bfloat16)
    ids = torch.tensor([7, 0, 39, 7])
    assert torch.equal(embedding.lookup(ids), table[ids].bfloat16())
    assert embedding.weight.dtype == torch.bfloat16 and embedding.weight.numel() == 0
    assert embedding.blocks.nbytes == rows.numel() < table.numel() * 2
