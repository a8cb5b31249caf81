"""Converted weights cached on disk, so a restart maps them instead of converting again:
a GGUF file's tensors dequantized to the dtype (kind "gguf"), and the blocks --quantization
rounds a float checkpoint's linears to (kinds "int8", "int4": load_quantization.py).

One safetensors file per (model digest, dtype, kind, converter version) under
$PAGEWIRE_CACHE_DIR/weights (default ~/.cache/pagewire/weights), written once, atomically
(a temporary file renamed into place), and memory-mapped on the next start. The converter
version is a hash of the module that converts (gguf_weights.py, load_quantization.py), so a
change in how weights are converted never reads a stale file. PAGEWIRE_WEIGHT_CACHE=0 turns
it off.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile

import torch

from pagewire.hf_tokenizer import cache_dir

log = logging.getLogger(__name__)


def _enabled() -> bool:
    return os.environ.get("PAGEWIRE_WEIGHT_CACHE", "1") not in ("0", "false", "no")


# kind -> the module that converts (its source's hash versions the cache files)
_CONVERTERS = {"gguf": "gguf_weights.py", "int8": "load_quantization.py",
               "int4": "load_quantization.py"}


def _converter_version(kind: str) -> str:
    with open(os.path.join(os.path.dirname(__file__), _CONVERTERS[kind]), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:8]


def cache_path(digest: str, dtype: torch.dtype, kind: str = "gguf") -> str:
    tag = "" if kind == "gguf" else f"-{kind}"
    name = (f"{digest}-{str(dtype).removeprefix('torch.')}{tag}-{_converter_version(kind)}"
            ".safetensors")
    return os.path.join(cache_dir("weights"), name)


def load(digest: str, dtype: torch.dtype, kind: str = "gguf") -> dict[str, torch.Tensor] | None:
    """The cached tensors (memory-mapped), or None when there is no usable cache file."""
    if not _enabled():
        return None
    path = cache_path(digest, dtype, kind)
    if not os.path.isfile(path):
        return None
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:   # damaged: convert again, rewrite it
        log.warning("ignoring the weight cache %s: %s", path, e)
        return None


def store(digest: str, dtype: torch.dtype, weights: dict[str, torch.Tensor],
          kind: str = "gguf") -> None:
    """Write the converted tensors for the next start; a failure (disk full, read-only
    cache) is logged and costs nothing else."""
    if not _enabled():
        return
    from safetensors.torch import save_file
    path = cache_path(digest, dtype, kind)
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in weights.items()}, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        log.warning("could not cache converted weights at %s: %s", path, e)
