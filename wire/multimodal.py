"""Images as they cross the wire: preprocessed by a tokenizer actor (decoded, resized,
normalized: actors/image_inputs.py), sent once with the request to the scheduler and with a
sequence's NewSeq to the executors, which encode them (executor/image_rows.py). Raw float32
bytes with their shape: no pickle, no tensors between actors."""
from __future__ import annotations

import msgspec


class ImageInput(msgspec.Struct, array_like=True, gc=False):
    """One image of a prompt: its placeholder tokens are prompt positions
    [offset, offset + length), each the embedding row of the same index of the image's
    encoder output. `digest`: SHA-256 of the preprocessed pixels, which keys the executors'
    encoder cache and enters the KV block hashes of the blocks the image's rows are in (the
    same image and prompt share blocks; a different image never does). `pixels`: float32,
    C order, `shape` [3, height, width] (Qwen2.5-VL: [patches, values of a patch]). `grid`:
    Qwen2.5-VL's (t, h, w) of the image in merged patches (length = t h w; its rows' M-RoPE
    positions: executor/mrope.py); empty for a model of fixed-size images."""
    digest: bytes
    offset: int
    length: int
    pixels: bytes
    shape: list[int]
    grid: list[int] = []


def image_spans(images: list[ImageInput]) -> list[tuple[int, int, bytes]]:
    """(offset, length, digest) of each image: what the KV block hashes read."""
    return [(im.offset, im.length, im.digest) for im in images]
