"""A step's image rows for a vision model (models/vision_language.py): which rows of the
flat batch are image positions, and their embeddings from the vision tower, each image
encoded once and kept in an encoder cache by its digest (least recently used out) so a
chunked prefill, a preempted and resumed sequence, or another request with the same image
reads it again for free. Qwen2.5-VL's images (each of its own size, ImageInput.grid) are
encoded together in one call too, and their rows' M-RoPE positions (mrope.py) come with
their embeddings."""
from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np
import torch

from pagewire.wire.multimodal import ImageInput
from pagewire.wire.to_scheduler import EncoderResult

from .mrope import image_row_positions


class ImageRows:
    """The executor's encoder and its cache, `capacity` images' embeddings."""

    def __init__(self, model, capacity: int = 64):
        self.model, self.capacity = model, capacity
        self.cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = self.queries = 0          # since the last take_counts()
        self.seconds = 0.0

    def step(self, rows: list[tuple[object, object, int]], device) -> tuple | None:
        """`rows` (seq id, SeqState, first row): the runner's layout. -> (rows [R], embeddings
        [R, H]) of the image positions this step computes, or None; with a third, their M-RoPE
        (t, h, w) [R, 3], where the images have grids (Qwen2.5-VL)."""
        picks, thw = [], []                         # (batch row, image, its embedding row)
        for _, seq, row in rows:
            start, end = seq.num_computed, seq.num_computed + seq.num_scheduled
            for image in seq.images:
                lo, hi = max(start, image.offset), min(end, image.offset + image.length)
                picks += [(row + p - start, image, p - image.offset) for p in range(lo, hi)]
                if image.grid and lo < hi:
                    thw.append(image_row_positions(seq.images, image,
                                                   range(lo - image.offset, hi - image.offset)))
        if not picks:
            return None
        embeds = self._encoded({im.digest: im for _, im, _ in picks}.values())
        index = torch.tensor([r for r, _, _ in picks], device=device)
        out = (index, torch.stack([embeds[im.digest][i] for _, im, i in picks]))
        return out + (torch.from_numpy(np.concatenate(thw)).to(device),) if thw else out

    def take_counts(self) -> EncoderResult:
        """The images read, the cache's hits and the seconds encoding since the last call
        (the step result's section)."""
        counts = EncoderResult(self.queries, self.hits, self.seconds)
        self.queries = self.hits = 0
        self.seconds = 0.0
        return counts

    def _encoded(self, images) -> dict[bytes, torch.Tensor]:
        """Each image's embeddings [length, H]: from the cache, the rest encoded in one call."""
        out, missing = {}, []
        for image in images:
            self.queries += 1
            if image.digest in self.cache:
                self.hits += 1
                self.cache.move_to_end(image.digest)
                out[image.digest] = self.cache[image.digest]
            else:
                missing.append(image)
        if missing:
            started = time.perf_counter()
            device = self.model.embed.weight.device
            if missing[0].grid:        # images of their own sizes: patches end to end
                pixels = torch.from_numpy(np.concatenate([image_pixels(im) for im in missing]))
                encoded = self.model.encode_images(pixels.to(device),
                                                   [im.grid for im in missing])
            else:
                pixels = torch.from_numpy(np.stack([image_pixels(im) for im in missing]))
                encoded = self.model.encode_images(pixels.to(device))
            self.seconds += time.perf_counter() - started
            for image, embeds in zip(missing, encoded):
                if embeds.shape[0] != image.length:
                    raise ValueError(f"an image of {image.length} placeholder tokens encodes "
                                     f"to {embeds.shape[0]} rows")
                out[image.digest] = self.cache[image.digest] = embeds
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        return out


def image_key_ends(images: list[ImageInput], start: int, n: int) -> torch.Tensor | None:
    """The key ends (kernels/attention.py PrefillSpan.key_ends) of a prefill chunk of
    positions [start, start + n) of a prompt whose image tokens see their whole image
    (Gemma 3): each image position's the image's end, the others' their own position + 1;
    None when no image is in the chunk. An image the chunk ends inside is an error (the
    scheduler never plans one: scheduler/encoder_budget.py)."""
    ends = None
    for image in images:
        lo, hi = max(start, image.offset), min(start + n, image.offset + image.length)
        if lo >= hi:
            continue
        if image.offset + image.length > start + n:
            raise ValueError(f"a prefill chunk of positions [{start}, {start + n}) ends inside "
                             f"the image at [{image.offset}, {image.offset + image.length})")
        if ends is None:
            ends = torch.arange(start + 1, start + n + 1)
        ends[lo - start:hi - start] = image.offset + image.length
    return ends


def image_pixels(image: ImageInput) -> np.ndarray:
    """An image's pixels as the tokenizer prepared them (read-only: the message's bytes)."""
    return np.frombuffer(image.pixels, dtype=np.float32).reshape(image.shape)
