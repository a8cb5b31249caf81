"""The image rows a step may encode (a vision model): beside the token budget, each step has
an encoder budget, so a prompt of many images is encoded over several steps and the decodes
sharing those steps are not held up by one long encode. An image is counted in the step that
computes its first row (the executor encodes it whole there and keeps it in its encoder
cache for the chunks that follow); a chunk that would start an image beyond the budget stops
just before that image. An image larger than the whole budget is encoded alone."""
from __future__ import annotations

from .request import Sequence


class EncoderBudget:
    """One step's: `left` image rows, `used` whether any image was counted yet."""

    def __init__(self, rows: int):
        self.left, self.used = rows, False

    def cut(self, seq: Sequence, n: int) -> int:
        """How many of the n tokens from seq's first pending one fit, its images counted."""
        images = seq.request.images
        if not images:
            return n
        start = seq.num_planned
        for image in sorted(images, key=lambda im: im.offset):
            if not start <= image.offset < start + n:
                continue
            if image.length > self.left and self.used:
                return image.offset - start            # up to the image; the rest next step
            self.left -= image.length
            self.used = True
        return n
