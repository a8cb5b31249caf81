"""Qwen2.5-VL's M-RoPE positions, from a sequence's images alone (ImageInput.grid: each
image's (t, h, w) in merged patches): a pure function of (token index, the sequence's
images), so chunked prefill (an image split across chunks), prefix caching and preemption
see the same positions whatever the step.

M-RoPE gives every token three positions (t, h, w), each rotating its own section of the
rotary frequencies (mrope_section). A text token has t = h = w: ordinary rope at one
position, which is its index shifted by the rope delta of the images before it. An image's
rows start at base = its first index + the delta before it: row (ti, r, c) of its grid is
at (base + ti, base + r, base + c), and the text after it resumes at base + max(h, w), so
each image adds max(h, w) - its rows to the delta (transformers' get_rope_index for still
images, whose t is 1). The KV-cache slot of a token stays its index; only rope reads these.
"""
from __future__ import annotations

import numpy as np
import torch


def image_delta(image) -> int:
    """How far the positions after `image` shift from their indices because of it."""
    _, h, w = image.grid
    return max(h, w) - image.length


def rope_positions(images, index: np.ndarray) -> np.ndarray:
    """Token indices [n] (ascending) -> their 1D rope positions: index + the deltas of the
    images before; an image's own rows get its base (their real positions are 3D:
    image_row_positions). Unchanged without a gridded image (every other model)."""
    gridded = [im for im in images if im.grid]
    if not gridded:
        return index
    out = index.copy()
    for image in gridded:
        end = image.offset + image.length
        out[index >= end] += image_delta(image)
        inside = (index >= image.offset) & (index < end)
        out[inside] -= index[inside] - image.offset
    return out


def image_row_positions(images, image, rows: list[int]) -> np.ndarray:
    """(t, h, w) [len(rows), 3] of rows (indices within `image`, one of `images`)."""
    base = image.offset + sum(image_delta(im) for im in images
                              if im.grid and im.offset < image.offset)
    _, h, w = image.grid
    j = np.asarray(rows, dtype=np.int64)
    return base + np.stack([j // (h * w), (j % (h * w)) // w, j % w], axis=1)


def mrope_table(table: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                thw: torch.Tensor, sections: list[int]) -> torch.Tensor:
    """A step's own (cos | sin) table [T, D], one row per batch row: table's row at each
    position, but image rows' columns each from the row of their section's position
    (t, h or w), the cos and sin halves alike. thw: [R, 3] of batch rows `rows`."""
    step = table[positions]
    half = table.shape[1] // 2
    which = torch.repeat_interleave(torch.arange(3), torch.tensor(sections))[:half]
    which = torch.cat([which, which]).to(table.device)                     # [D]
    cols = torch.arange(table.shape[1], device=table.device)
    step[rows] = table[thw.to(table.device)[:, which], cols]
    return step
