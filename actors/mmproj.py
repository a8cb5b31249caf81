"""A llama.cpp mmproj file: the vision tower and projector of a GGUF language model, kept in
a GGUF file of its own (general.architecture "clip"), as `llama-server --mmproj FILE` takes
it. Read without torch: the supervisor checks the pair and names the Hugging Face
architecture they make; the executor builds the tower from the same settings
(executor/gguf_vision.py), the tokenizer actors preprocess images from them
(gguf_image_inputs.py).

Two projector types, the towers pagewire runs from Hugging Face directories:
- "mlp" (LLaVA: CLIP, Linear -> GELU -> Linear). llama.cpp's converter
  (tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py) keeps only the layers up to the
  one LLaVA reads (the second last) and drops the post-norm; clip.cpp runs the layers up to
  the deepest `clip.vision.feature_layer` (the hidden state after that many blocks), or
  without that key all but the last stored one. Its `projection_dim` is CLIP's own, not the
  text width: the width is the projector's output rows.
- "idefics3" (SmolVLM: SigLIP, post-norm, pixel shuffle, one Linear): every layer runs, the
  text width is `mm.model.fc.weight`'s rows.
"""
from __future__ import annotations

from dataclasses import dataclass

from .gguf_header import GGUFHeader, check_tensors, read_gguf_header

# clip.projector_type -> the Hugging Face architecture whose tower it is
PROJECTORS = {"mlp": "LlavaForConditionalGeneration",
              "idefics3": "Idefics3ForConditionalGeneration"}
IMAGE_TOKEN = "<image>"     # the placeholder converted LLaVA / SmolVLM vocabularies keep


@dataclass
class ClipSettings:
    """What a mmproj file's metadata and tensor shapes say about its tower."""
    projector: str                  # PROJECTORS
    image_size: int
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    depth: int                      # encoder layers run (the state after them is read)
    layer_norm_eps: float
    activation: str                 # the tower MLP's (vision.py's names)
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    text_hidden_size: int           # the projector's output width
    scale_factor: int = 0           # idefics3's pixel shuffle
    longest_edge: int = 0           # idefics3: an image's longest edge before tiling


def read_mmproj(path: str) -> tuple[GGUFHeader, ClipSettings]:
    """The file's header (tensors checked whole) and its tower's settings; a ValueError naming
    the file where it is not a vision mmproj pagewire runs."""
    header = read_gguf_header(path)
    meta = header.metadata
    if meta.get("general.architecture") != "clip":
        raise ValueError(f"{path}: not a mmproj file (general.architecture is "
                         f"{meta.get('general.architecture')!r}, not 'clip')")
    projector = meta.get("clip.vision.projector_type", meta.get("clip.projector_type"))
    if projector not in PROJECTORS:
        raise ValueError(f"{path}: mmproj projector type {projector!r} is not supported "
                         f"(supported: {', '.join(PROJECTORS)})")
    if not meta.get("clip.has_vision_encoder", False):
        raise ValueError(f"{path}: the mmproj file holds no vision encoder")
    check_tensors(path, header)
    try:
        return header, _settings(meta, header, projector)
    except KeyError as e:
        raise ValueError(f"{path}: mmproj metadata or tensor {e} is missing") from None


def _settings(meta: dict, header: GGUFHeader, projector: str) -> ClipSettings:
    def v(key: str):
        return meta[f"clip.vision.{key}"]
    layers = int(v("block_count"))
    out = "mm.model.fc.weight" if projector == "idefics3" else "mm.2.weight"
    gelu = "gelu_pytorch_tanh" if projector == "idefics3" else "gelu"
    if meta.get("clip.use_silu", False):
        raise ValueError("a SiLU vision MLP (clip.use_silu) is not supported")
    common = dict(
        projector=projector, image_size=int(v("image_size")), patch_size=int(v("patch_size")),
        hidden_size=int(v("embedding_length")), intermediate_size=int(v("feed_forward_length")),
        num_heads=int(v("attention.head_count")),
        layer_norm_eps=float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        activation=gelu if meta.get("clip.use_gelu", False) else "quick_gelu",
        image_mean=tuple(float(x) for x in v("image_mean"))[:3],
        image_std=tuple(float(x) for x in v("image_std"))[:3],
        text_hidden_size=int(header.tensors[out].shape[0]))
    if projector == "idefics3":
        return ClipSettings(**common, depth=layers,
                            scale_factor=int(meta.get("clip.vision.projector.scale_factor", 2)),
                            longest_edge=int(meta.get("clip.vision.preproc_image_size",
                                                      common["image_size"])))
    features = [int(x) for x in meta.get("clip.vision.feature_layer", [])]
    if len(features) > 1:
        raise ValueError(f"several vision feature layers {features} are not supported")
    depth = features[0] if features else layers - 1
    if not 0 < depth <= layers:
        raise ValueError(f"vision feature layer {depth} is outside the {layers} stored layers")
    return ClipSettings(**common, depth=depth)


def image_token_id(text_meta: dict, path: str) -> int:
    """The id of IMAGE_TOKEN in a GGUF language model's vocabulary: the placeholder a prompt
    holds where an image's rows go."""
    tokens = text_meta.get("tokenizer.ggml.tokens", [])
    for i, token in enumerate(tokens):
        if token == IMAGE_TOKEN:
            return i
    raise ValueError(f"{path}: the vocabulary has no {IMAGE_TOKEN} token, the placeholder "
                     f"a prompt's image rows take (a GGUF converted from the vision model's "
                     f"own tokenizer keeps it)")


def check_pair(text_path: str, text_meta: dict, mmproj_path: str) -> tuple[str, int]:
    """A GGUF language model and its mmproj file -> (the Hugging Face architecture they make,
    the image placeholder's id); a ValueError where they do not fit together."""
    _, clip = read_mmproj(mmproj_path)
    arch = text_meta.get("general.architecture")
    width = int(text_meta.get(f"{arch}.embedding_length", 0))
    if arch != "llama":
        raise ValueError(f"{text_path}: a {arch!r} language model with a mmproj file is not "
                         f"supported (LLaVA's and SmolVLM's are 'llama')")
    if width != clip.text_hidden_size:
        raise ValueError(f"{mmproj_path}: its projector gives rows of width "
                         f"{clip.text_hidden_size}, the language model {text_path} takes "
                         f"{width}: not this model's mmproj")
    return PROJECTORS[clip.projector], image_token_id(text_meta, text_path)
