"""The image rows a step may encode (a vision model): beside the token budget, each step has
an encoder budget, so a prompt of many images is encoded over several steps and the decodes
sharing those steps are not held up by one long encode. An image is counted in the step that
computes its first row (the executor encodes it whole there and keeps it in its encoder
cache for the chunks that follow); a chunk that would start an image beyond the budget stops
just before that image. An image larger than the whole budget is encoded alone.

A model whose image tokens attend their whole image (Gemma 3: model_info
WHOLE_IMAGE_ARCHITECTURES) also never has a chunk end inside an image: the chunk stops before
an image it cannot take whole (none then starts inside one, except after a cached prefix,
whose image rows were computed whole), and the image waits for a step with room; an image
longer than the step's token budget is refused at admission (live_requests.py)."""
from __future__ import annotations

from .request import Sequence


class EncoderBudget:
    """One step's: `left` image rows, `used` whether any image was counted yet."""

    def __init__(self, rows: int, whole_images: bool = False):
        self.left, self.used, self.whole = rows, False, whole_images

    def cut(self, seq: Sequence, n: int) -> int:
        """How many of the n tokens from seq's first pending one fit, its images counted (and,
        `whole_images`, none cut)."""
        images = seq.request.images
        if not images:
            return n
        start = seq.num_planned
        for image in sorted(images, key=lambda im: im.offset):
            if self.whole and image.offset < start + n < image.offset + image.length:
                return max(0, image.offset - start)    # before the image it would split
            if not start <= image.offset < start + n:
                continue
            if image.length > self.left and self.used:
                return image.offset - start            # up to the image; the rest next step
            self.left -= image.length
            self.used = True
        return n
