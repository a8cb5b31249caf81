"""Load the model's Hugging Face tokenizer. A GGUF file's tokenizer is converted once by
transformers (seconds) and cached under the cache directory, keyed by the file's digest."""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile

from .model_info import ModelInfo, cache_root


def cache_dir(*parts: str) -> str:
    """A directory under the cache root (model_info.cache_root), created if need be."""
    path = os.path.join(cache_root(), *parts)
    os.makedirs(path, exist_ok=True)
    return path


def load_tokenizer(info: ModelInfo):
    from transformers import AutoTokenizer

    if info.format == "hf":
        return AutoTokenizer.from_pretrained(info.path)
    target = os.path.join(cache_dir("tokenizers"), info.digest)
    if not os.path.isdir(target):
        # Several actors start at once; the lock makes one convert while the others wait.
        with open(target + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.isdir(target):
                _convert_gguf_tokenizer(info.path, target)
    return AutoTokenizer.from_pretrained(target)


def _convert_gguf_tokenizer(path: str, target: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tmp = tempfile.mkdtemp(dir=os.path.dirname(target))
    try:
        tok.save_pretrained(tmp)
        os.rename(tmp, target)   # atomic: readers see all of it or nothing
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
