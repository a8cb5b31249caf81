"""A prompt's images, prepared in a tokenizer actor (CPU work that never touches the step
loop): each image file decoded with PIL (after a pixel-count check, so a small file that
claims a huge image is refused before it is decompressed), its first frame (GIF) in RGB,
resized and normalized by the model's own image processor (transformers', the PIL one), and
the prompt's placeholder for it widened to the rows the image encodes to. What leaves is an
ImageInput per image (wire/multimodal.py): raw float32 pixels, their digest and the prompt
positions they fill."""
from __future__ import annotations

import hashlib
import io
import json
import os

import numpy as np

from pagewire.model_info import VISION_ARCHITECTURES, ModelInfo, image_placeholders
from pagewire.wire.multimodal import ImageInput
from pagewire.wire.sampling_params import InvalidParam

MAX_IMAGE_PIXELS = 50_000_000     # width x height of one image, checked before decoding


class ImagePreparer:
    """The model's image placeholder, its rows an image, and its image processor."""

    def __init__(self, path: str):
        with open(os.path.join(path, "config.json")) as f:
            self.token_id, self.rows = image_placeholders(json.load(f))
        if not os.path.exists(os.path.join(path, "preprocessor_config.json")):
            raise ValueError(f"{path} holds a vision model but no preprocessor_config.json "
                             f"(its image processor's settings)")
        from transformers import AutoImageProcessor
        self.processor = AutoImageProcessor.from_pretrained(path)

    @classmethod
    def of(cls, info: ModelInfo) -> "ImagePreparer | None":
        """The preparer of a vision model; None for a text-only one."""
        return cls(info.path) if info.architecture in VISION_ARCHITECTURES else None

    def expand(self, ids: list[int], files: list[bytes]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image's placeholder run widened to its rows (a run already
        that long is kept), and the images. A 400 (InvalidParam) where the runs and the
        images differ in number, or an image cannot be read."""
        runs = _runs(ids, self.token_id)
        if len(runs) != len(files):
            raise InvalidParam("messages", f"the prompt has {len(runs)} image placeholders and "
                                         f"{len(files)} images")
        out, images, last = [], [], 0
        for index, ((start, length), data) in enumerate(zip(runs, files)):
            if length not in (1, self.rows):
                raise InvalidParam("messages", f"image {index}: a run of {length} placeholders "
                                             f"(one, or {self.rows})")
            out += ids[last:start]
            pixels = self.pixels(data, index)
            images.append(ImageInput(hashlib.sha256(pixels.tobytes()).digest(), len(out),
                                     self.rows, pixels.tobytes(), list(pixels.shape)))
            out += [self.token_id] * self.rows
            last = start + length
        return out + ids[last:], images

    def widen(self, ids: list[int]) -> list[int]:
        """The prompt with each lone placeholder widened to an image's rows, no image read:
        what /tokenize counts."""
        out, last = [], 0
        for start, length in _runs(ids, self.token_id):
            out += ids[last:start] + [self.token_id] * (self.rows if length == 1 else length)
            last = start + length
        return out + ids[last:]

    def pixels(self, data: bytes, index: int) -> np.ndarray:
        """One image file -> float32 [3, H, W], as the model's processor prepares it."""
        from PIL import Image, UnidentifiedImageError
        try:
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise InvalidParam("messages", f"image {index}: {width}x{height} pixels is over "
                                             f"the limit of {MAX_IMAGE_PIXELS}")
            image.seek(0)
            image = image.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            if isinstance(e, InvalidParam):
                raise
            raise InvalidParam("messages", f"image {index} cannot be read: {e}") from None
        values = self.processor(images=[image], return_tensors="np")["pixel_values"][0]
        return np.ascontiguousarray(values, dtype=np.float32)


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token` in ids."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs
