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
    """The model's image placeholder, its rows an image, and its image processor. LLaVA's:
    an image is one encoder input, its placeholder widened to its rows."""

    def __init__(self, path: str, tokenizer):
        with open(os.path.join(path, "config.json")) as f:
            self.token_id, self.rows = image_placeholders(json.load(f))
        self.tokenizer = tokenizer
        if not os.path.exists(os.path.join(path, "preprocessor_config.json")):
            raise ValueError(f"{path} holds a vision model but no preprocessor_config.json "
                             f"(its image processor's settings)")
        from transformers import AutoImageProcessor
        self.processor = AutoImageProcessor.from_pretrained(path)

    @staticmethod
    def of(info: ModelInfo, tokenizer) -> "ImagePreparer | None":
        """The preparer of a vision model; None for a text-only one."""
        if info.architecture not in VISION_ARCHITECTURES:
            return None
        if info.mmproj:                 # a GGUF's tower file: its own settings and steps
            from pagewire.gguf_image_inputs import gguf_preparer
            return gguf_preparer(info, tokenizer)
        tiled = info.architecture == "Idefics3ForConditionalGeneration"
        return (TiledImagePreparer if tiled else ImagePreparer)(info.path, tokenizer)

    def expand(self, ids: list[int], files: list[bytes]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image's placeholder run widened to its rows (a run already
        that long is kept), and the images. A 400 (InvalidParam) where the runs and the
        images differ in number, or an image cannot be read."""
        runs = placeholder_runs(ids, self.token_id)
        if len(runs) != len(files):
            raise InvalidParam("messages", f"the prompt has {len(runs)} image placeholders and "
                                         f"{len(files)} images")
        out, images, last = [], [], 0
        for index, ((start, length), data) in enumerate(zip(runs, files)):
            if length not in self.run_lengths():
                raise InvalidParam("messages", f"image {index}: a run of {length} placeholders "
                                               f"(one, or {self.rows})")
            out += ids[last:start]
            segment, inputs = self.prepared(data, index)
            images += [ImageInput(hashlib.sha256(pixels.tobytes()).digest(), len(out) + at,
                                  self.rows, pixels.tobytes(), list(pixels.shape))
                       for pixels, at in inputs]
            out += segment
            last = start + length
        return out + ids[last:], images

    def run_lengths(self) -> tuple[int, ...]:
        """The placeholder runs a prompt may hold for one image."""
        return (1, self.rows)

    def prepared(self, data: bytes, index: int) -> tuple[list[int], list[tuple]]:
        """One image -> (the tokens in place of its placeholder, its encoder inputs: (pixels
        [3, S, S], where its rows start among those tokens))."""
        return [self.token_id] * self.rows, [(self.pixels(data, index), 0)]

    def widen(self, ids: list[int]) -> list[int]:
        """The prompt with each lone placeholder widened to an image's rows, no image read:
        what /tokenize counts."""
        out, last = [], 0
        for start, length in placeholder_runs(ids, self.token_id):
            out += ids[last:start] + [self.token_id] * (self.rows if length == 1 else length)
            last = start + length
        return out + ids[last:]

    def pixels(self, data: bytes, index: int) -> np.ndarray:
        """One image file -> float32 [3, H, W], as the model's processor prepares it."""
        values = self.processor(images=[self.decoded(data, index)],
                                return_tensors="np")["pixel_values"][0]
        return np.ascontiguousarray(values, dtype=np.float32)

    @staticmethod
    def decoded(data: bytes, index: int):
        """One image file -> a PIL image in RGB (a GIF's first frame); refused past
        MAX_IMAGE_PIXELS before its pixels are decompressed."""
        from PIL import Image, UnidentifiedImageError
        try:
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise InvalidParam("messages", f"image {index}: {width}x{height} pixels is over "
                                             f"the limit of {MAX_IMAGE_PIXELS}")
            image.seek(0)
            return image.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            if isinstance(e, InvalidParam):
                raise
            raise InvalidParam("messages", f"image {index} cannot be read: {e}") from None



class TiledImagePreparer(ImagePreparer):
    """Idefics3's (SmolVLM): the processor splits an image into rows x cols tiles plus the
    whole image shrunk to one tile; its placeholder becomes Idefics3's prompt string (each
    tile's marker and rows, then the global image's), every tile one encoder input. A lone
    placeholder only: how many tiles depends on the image."""

    def run_lengths(self) -> tuple[int, ...]:
        return (1,)

    def prepared(self, data: bytes, index: int) -> tuple[list[int], list[tuple]]:
        out = self.processor(images=[[self.decoded(data, index)]], return_tensors="np",
                             return_row_col_info=True)
        tiles = np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32)
        text = self.prompt_string(int(out["rows"][0][0]), int(out["cols"][0][0]))
        segment = self.tokenizer.encode(text, add_special_tokens=False)
        starts = [start for start, _ in placeholder_runs(segment, self.token_id)]
        if len(starts) != len(tiles):
            raise InvalidParam("messages", f"image {index}: {len(tiles)} tiles but "
                                           f"{len(starts)} runs of placeholders")
        return segment, list(zip(tiles, starts))

    def prompt_string(self, rows: int, cols: int) -> str:
        """Idefics3's text for an image of rows x cols tiles (0 x 0: the global image
        alone), as its processor writes it, with this tokenizer's image token."""
        image = self.tokenizer.convert_ids_to_tokens(self.token_id) * self.rows
        fake, whole = "<fake_token_around_image>", "<global-img>"
        tiles = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols))
                        + "\n" for r in range(rows))
        return f"{tiles}\n{fake}{whole}{image}{fake}" if rows or cols else \
            f"{fake}{whole}{image}{fake}"

    def widen(self, ids: list[int]) -> list[int]:
        return ids                      # the tiles are the image's: counted when it is read


def placeholder_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
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
