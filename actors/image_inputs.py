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
            self.config = json.load(f)
        self.token_id, self.rows = image_placeholders(self.config)
        self.tokenizer = tokenizer
        if not os.path.exists(os.path.join(path, "preprocessor_config.json")):
            raise ValueError(f"{path} holds a vision model but no preprocessor_config.json "
                             f"(its image processor's settings)")
        from transformers import AutoImageProcessor
        self.processor = AutoImageProcessor.from_pretrained(path)

    @staticmethod
    def of(info: ModelInfo, tokenizer) -> "ImagePreparer | None":
        """The preparer of a vision model; None for a text-only one."""
        if info.architecture not in VISION_ARCHITECTURES + ("CLIPModel",):
            return None
        if info.architecture == "CLIPModel":        # images to embed, not to read
            return PooledImagePreparer(info.path, tokenizer)
        if info.mmproj:                 # a GGUF's tower file: its own settings and steps
            from pagewire.gguf_image_inputs import gguf_preparer
            return gguf_preparer(info, tokenizer)
        kind = {"Idefics3ForConditionalGeneration": TiledImagePreparer,
                "Qwen2_5_VLForConditionalGeneration": GridImagePreparer,
                "Gemma3ForConditionalGeneration": Gemma3ImagePreparer}
        return kind.get(info.architecture, ImagePreparer)(info.path, tokenizer)

    def expand(self, ids: list[int], files: list[bytes]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image's placeholder run widened to its rows (a run already
        that long is kept), and the images. A 400 (InvalidParam) where the runs and the
        images differ in number, or an image cannot be read."""
        runs = self.placeholders(ids)
        if len(runs) != len(files):
            raise InvalidParam("messages", f"the prompt has {len(runs)} image placeholders and "
                                         f"{len(files)} images")
        out, images, last = [], [], 0
        for index, ((start, length), data) in enumerate(zip(runs, files)):
            if length not in self.run_lengths():
                raise InvalidParam("messages", f"image {index}: a run of {length} placeholders "
                                               f"(one, or {self.rows})" if self.rows else
                                   f"image {index}: a run of {length} placeholders (one)")
            out += ids[last:start]
            segment, inputs = self.prepared(data, index, length)
            images += [_input(pixels, len(out) + at, self.rows, grid)
                       for pixels, at, grid in inputs]
            out += segment
            last = start + length
        return out + ids[last:], images

    def mark(self) -> str:
        """The text a chat message's image part becomes (then rendered by the chat template):
        the placeholder token."""
        return self.tokenizer.convert_ids_to_tokens(self.token_id)

    def run_lengths(self) -> tuple[int, ...]:
        """The placeholder runs a prompt may hold for one image."""
        return (1, self.rows)

    def placeholders(self, ids: list[int]) -> list[tuple[int, int]]:
        """(start, length) of each image's placeholder run in the prompt."""
        return placeholder_runs(ids, self.token_id)

    def prepared(self, data: bytes, index: int, length: int = 1
                 ) -> tuple[list[int], list[tuple]]:
        """One image, its placeholder run `length` long -> (the tokens in place of the run,
        its encoder inputs: (pixels [3, S, S], where its rows start among those tokens, its
        grid: ImageInput.grid))."""
        return [self.token_id] * self.rows, [(self.pixels(data, index), 0, [])]

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

    def prepared(self, data: bytes, index: int, length: int = 1
                 ) -> tuple[list[int], list[tuple]]:
        out = self.processor(images=[[self.decoded(data, index)]], return_tensors="np",
                             return_row_col_info=True)
        tiles = np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32)
        text = self.prompt_string(int(out["rows"][0][0]), int(out["cols"][0][0]))
        segment = self.tokenizer.encode(text, add_special_tokens=False)
        starts = [start for start, _ in placeholder_runs(segment, self.token_id)]
        if len(starts) != len(tiles):
            raise InvalidParam("messages", f"image {index}: {len(tiles)} tiles but "
                                           f"{len(starts)} runs of placeholders")
        return segment, [(tile, at, []) for tile, at in zip(tiles, starts)]

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


class GridImagePreparer(ImagePreparer):
    """Qwen2.5-VL's: dynamic resolution. The processor resizes an image to whole 28-pixel
    merge squares (its pixel bounds kept) and flattens its 14-pixel patches ([patches, 1176]);
    the image is one encoder input of t x h x w merged patches, its placeholder (the chat
    template's <|vision_start|><|image_pad|><|vision_end|>: the pad) widened to that many
    rows. A lone placeholder only, and /tokenize does not widen it: the rows depend on the
    image's size, known once it is read."""

    def mark(self) -> str:
        """<|vision_start|><|image_pad|><|vision_end|>, as Qwen's chat template writes an
        image part (the pad is the placeholder)."""
        ids = [self.config.get("vision_start_token_id"), self.token_id,
               self.config.get("vision_end_token_id")]
        return "".join(self.tokenizer.convert_ids_to_tokens(i) for i in ids if i is not None)

    def run_lengths(self) -> tuple[int, ...]:
        return (1,)

    def prepared(self, data: bytes, index: int, length: int = 1
                 ) -> tuple[list[int], list[tuple]]:
        out = self.processor(images=[self.decoded(data, index)], return_tensors="np")
        patches = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        m = self.processor.merge_size
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        grid = [t, h // m, w // m]
        return [self.token_id] * (t * grid[1] * grid[2]), [(patches, 0, grid)]

    def widen(self, ids: list[int]) -> list[int]:
        return ids                      # the rows are the image's: counted when it is read


class Gemma3ImagePreparer(ImagePreparer):
    """Gemma 3's: the chat template writes <start_of_image> (boi) where an image goes, which
    its processor turns into "\\n\\n" boi, mm_tokens_per_image image tokens, eoi "\\n\\n"
    (processing_gemma3.py full_image_sequence); so does a lone image token here. A run of
    mm_tokens_per_image image tokens is kept as it is (a prompt already widened). With
    pan-and-scan (do_pan_and_scan in its preprocessor config) an image whose aspect is
    stretched enough is also cut into crops: its placeholder becomes the processor's text
    ("Here is the original image ... and here are some crops ..."), the original and each
    crop an encoder input of its own sequence."""

    def __init__(self, path: str, tokenizer):
        super().__init__(path, tokenizer)
        self.boi = self.config.get("boi_token_index", self.config.get("boi_token_id"))
        self.eoi = self.config.get("eoi_token_index", self.config.get("eoi_token_id"))
        self.pan_and_scan = bool(getattr(self.processor, "do_pan_and_scan", False))
        newlines = tokenizer.encode("\n\n", add_special_tokens=False)
        self.sequence = newlines + [self.boi] + [self.token_id] * self.rows + [self.eoi] + \
            newlines
        self.first_row = len(newlines) + 1        # where the rows start in the sequence

    def placeholders(self, ids: list[int]) -> list[tuple[int, int]]:
        """Image token runs, and each boi that no image token follows (as a run of one)."""
        lone = [(i, 1) for i, t in enumerate(ids)
                if t == self.boi and (i + 1 == len(ids) or ids[i + 1] != self.token_id)]
        return sorted(placeholder_runs(ids, self.token_id) + lone)

    def prepared(self, data: bytes, index: int, length: int = 1
                 ) -> tuple[list[int], list[tuple]]:
        out = self.processor(images=[self.decoded(data, index)], return_tensors="np")
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)  # original, crops
        crops = int(out["num_crops"][0]) if "num_crops" in out else 0
        if length == self.rows:
            if crops:
                raise InvalidParam("messages", f"image {index}: a run of {length} image tokens "
                                               f"cannot take pan-and-scan crops (one boi)")
            return [self.token_id] * self.rows, [(pixels[0], 0, [])]
        if not crops:
            return list(self.sequence), [(pixels[0], self.first_row, [])]
        segment = self.tokenizer.encode(self.crops_string(crops), add_special_tokens=False)
        starts = [start for start, _ in placeholder_runs(segment, self.token_id)]
        if len(starts) != len(pixels):
            raise InvalidParam("messages", f"image {index}: {len(pixels)} crops but "
                                           f"{len(starts)} runs of image tokens")
        return segment, [(crop, start, []) for crop, start in zip(pixels, starts)]

    def crops_string(self, crops: int) -> str:
        """Gemma 3's processor's text for an image and its `crops` pan-and-scan crops
        (replace_image_token), with this tokenizer's boi, image and eoi tokens."""
        name = self.tokenizer.convert_ids_to_tokens
        full = f"\n\n{name(self.boi)}{name(self.token_id) * self.rows}{name(self.eoi)}\n\n"
        return (f"Here is the original image {full} and here are some crops to help you see "
                f"better " + " ".join([full] * crops))

    def widen(self, ids: list[int]) -> list[int]:
        if self.pan_and_scan:
            return ids                  # crops depend on the image: counted when it is read
        out, last = [], 0
        for start, length in self.placeholders(ids):
            out += ids[last:start] + (ids[start:start + length] if length == self.rows
                                      else self.sequence)
            last = start + length
        return out + ids[last:]


class PooledImagePreparer(ImagePreparer):
    """A pooling model's images (CLIP's): an image is a request of its own, embedded whole
    by the image tower; its prompt is one token (the tokenizer's BOS) that only carries it
    through the scheduler. Texts have no image placeholder."""

    def __init__(self, path: str, tokenizer):
        self.token_id, self.rows, self.tokenizer = None, 1, tokenizer
        from transformers import AutoImageProcessor
        self.processor = AutoImageProcessor.from_pretrained(path)

    def pooled(self, files: list[bytes]) -> tuple[list[int], list[ImageInput]]:
        """One image -> its one-token prompt and the image."""
        if len(files) != 1:
            raise InvalidParam("input", f"an image embedding takes one image, got {len(files)}")
        token = self.tokenizer.bos_token_id or 0
        return [token], [_input(self.pixels(files[0], 0), 0, 1, [])]


def _input(pixels: np.ndarray, offset: int, rows: int, grid: list[int]) -> ImageInput:
    """An encoder input at prompt position `offset`: `rows` long, or its grid's t h w. The
    digest covers the grid too: the same patches in another grid are another image (other
    M-RoPE positions for the tokens after it)."""
    data = pixels.tobytes()
    digest = hashlib.sha256(data + (np.asarray(grid, np.int64).tobytes() if grid else b""))
    length = int(np.prod(grid)) if grid else rows
    return ImageInput(digest.digest(), offset, length, data, list(pixels.shape), grid)


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
