"""Image preparation for a GGUF language model with llama.cpp's mmproj file (mmproj.py): a
GGUF has no preprocessor_config.json, so the settings come from the mmproj's header and the
steps are llama.cpp's own (tools/mtmd/mtmd-image.cpp), with PIL's resampling, which
llama.cpp's resize_pillow reproduces:
- "mlp" (LLaVA): the image scaled to fit the tower's square (bicubic, each side rounded up),
  centred on a square of LLaVA's grey (122, 116, 104): llama.cpp's fixed-size preprocessor.
- "idefics3" (SmolVLM): scaled so its longest edge is clip.vision.preproc_image_size (the
  other rounded up to even), then to whole tiles of the tower's size, cut into rows x cols
  tiles, plus the whole image shrunk to one tile (all Lanczos); the prompt text around them
  is Idefics3's (TiledImagePreparer.prompt_string, llama.cpp writes the same).
Pixels then (value / 255 - mean) / std per channel, float32 [3, S, S].
The placeholder is the vocabulary's `<image>` (mmproj.IMAGE_TOKEN)."""
from __future__ import annotations

import numpy as np

from pagewire.image_inputs import ImagePreparer, TiledImagePreparer, placeholder_runs
from pagewire.mmproj import IMAGE_TOKEN, ClipSettings, read_mmproj
from pagewire.model_info import ModelInfo
from pagewire.wire.sampling_params import InvalidParam

LLAVA_PAD = (122, 116, 104)     # llama.cpp's pad colour for the "mlp" projector


def gguf_preparer(info: ModelInfo, tokenizer) -> ImagePreparer:
    """The preparer of a GGUF model with a mmproj file, by its projector type."""
    _, clip = read_mmproj(info.mmproj)
    cls = GGUFTiledImagePreparer if clip.projector == "idefics3" else GGUFImagePreparer
    return cls(clip, tokenizer, info.path)


class GGUFImagePreparer(ImagePreparer):
    """LLaVA's, from a mmproj file's settings: one encoder input an image."""

    def __init__(self, clip: ClipSettings, tokenizer, path: str = ""):
        self.clip, self.tokenizer = clip, tokenizer
        self.token_id = placeholder_id(tokenizer, path)
        grid = clip.image_size // clip.patch_size
        self.rows = grid * grid // clip.scale_factor ** 2 if clip.scale_factor else grid * grid

    def pixels(self, data: bytes, index: int) -> np.ndarray:
        return self.normalized(letterboxed(self.decoded(data, index), self.clip.image_size))

    def normalized(self, image) -> np.ndarray:
        """An RGB PIL image -> float32 [3, H, W], llama.cpp's normalization."""
        values = np.asarray(image, dtype=np.float32) / np.float32(255)
        mean = np.asarray(self.clip.image_mean, dtype=np.float32)
        std = np.asarray(self.clip.image_std, dtype=np.float32)
        return np.ascontiguousarray(((values - mean) / std).transpose(2, 0, 1))


class GGUFTiledImagePreparer(GGUFImagePreparer, TiledImagePreparer):
    """Idefics3's (SmolVLM), from a mmproj file's settings: rows x cols tiles, then the
    whole image, each one encoder input."""

    def prepared(self, data: bytes, index: int, length: int = 1
                 ) -> tuple[list[int], list[tuple]]:
        tiles, rows, cols = idefics3_tiles(self.decoded(data, index), self.clip.image_size,
                                           self.clip.longest_edge)
        pixels = [self.normalized(tile) for tile in tiles]
        segment = self.tokenizer.encode(self.prompt_string(rows, cols), add_special_tokens=False)
        starts = [start for start, _ in placeholder_runs(segment, self.token_id)]
        if len(starts) != len(pixels):
            raise InvalidParam("messages", f"image {index}: {len(pixels)} tiles but "
                                           f"{len(starts)} runs of placeholders")
        return segment, [(tile, start, []) for tile, start in zip(pixels, starts)]


def placeholder_id(tokenizer, path: str) -> int:
    """The id of `<image>` in the model's vocabulary (a single token), else a ValueError."""
    ids = tokenizer.encode(IMAGE_TOKEN, add_special_tokens=False)
    if len(ids) != 1 or tokenizer.convert_ids_to_tokens(ids[0]) != IMAGE_TOKEN:
        raise ValueError(f"{path}: the vocabulary has no {IMAGE_TOKEN} token, the placeholder "
                         f"a prompt's image rows take")
    return ids[0]


def letterboxed(image, size: int):
    """llama.cpp's fixed-size resize with padding (PAD_CEIL): scaled to fit size x size, each
    side rounded up, centred on LLAVA_PAD; an image of that size already is kept."""
    from PIL import Image
    width, height = image.size
    if (width, height) == (size, size):
        return image
    f32 = np.float32                    # llama.cpp's arithmetic, in float
    scale = min(f32(size) / f32(width), f32(size) / f32(height))
    new = (min(int(np.ceil(f32(width) * scale)), size),
           min(int(np.ceil(f32(height) * scale)), size))
    canvas = Image.new("RGB", (size, size), LLAVA_PAD)
    canvas.paste(image.resize(new, Image.Resampling.BICUBIC),
                 ((size - new[0]) // 2, (size - new[1]) // 2))
    return canvas


def idefics3_tiles(image, tile: int, longest: int) -> tuple[list, int, int]:
    """llama.cpp's Idefics3 preprocessing: (rows x cols tiles, row by row, then the whole
    image as one tile; rows; cols)."""
    from PIL import Image
    lanczos = Image.Resampling.LANCZOS
    width, height = image.size
    aspect = width / height
    if width >= height:
        size = (longest, int(longest / aspect))
        size = (size[0], size[1] + size[1] % 2)
    else:
        size = (int(longest * aspect), longest)
        size = (size[0] + size[0] % 2, size[1])
    cols, rows = -(-size[0] // tile), -(-size[1] // tile)
    resized = _resized(_resized(image, size, lanczos), (cols * tile, rows * tile), lanczos)
    tiles = [resized.crop((x * tile, y * tile, (x + 1) * tile, (y + 1) * tile))
             for y in range(rows) for x in range(cols)]
    return tiles + [_resized(resized, (tile, tile), lanczos)], rows, cols


def _resized(image, size: tuple[int, int], resample):
    """llama.cpp's resize: an image already that size is copied, not resampled."""
    return image if image.size == size else image.resize(size, resample)
