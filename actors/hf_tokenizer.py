"""Load the model's Hugging Face tokenizer. A GGUF file's tokenizer is converted once by
transformers (seconds) and cached under the cache directory, keyed by what the conversion reads
(the file's tokenizer keys, architecture and name): the quantizations of one model share it."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile

from .model_info import ModelInfo, cache_root, file_digest


def cache_dir(*parts: str) -> str:
    """A directory under the cache root (model_info.cache_root), created if need be."""
    path = os.path.join(cache_root(), *parts)
    os.makedirs(path, exist_ok=True)
    return path


def load_tokenizer(info: ModelInfo):
    return _from_directory(tokenizer_directory(info))


def load_backend_tokenizer(info: ModelInfo):
    """The model's `tokenizers.Tokenizer` alone (what the detokenizer decodes with). Where
    transformers would load it unchanged (its generic class, no tokens added beside
    tokenizer.json) it is read without importing transformers, which is most of a
    detokenizer's start: a restarted one serves again sooner."""
    path = tokenizer_directory(info)
    if _is_generic(path) and not _added_beside(path):
        from tokenizers import Tokenizer
        return Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    return _from_directory(path).backend_tokenizer


def tokenizer_directory(info: ModelInfo) -> str:
    """Where the model's tokenizer files are: its directory, or a GGUF file's tokenizer as
    transformers converted it (once, cached)."""
    if info.format == "hf":
        return info.path
    # with a mmproj file, the digest is the pair's; the tokenizer is the text file's alone
    key = file_digest(info.path) if info.mmproj else info.digest
    memo = os.path.join(cache_dir("tokenizers"), key)     # a link: the file's digest -> target
    if os.path.isdir(memo):
        return memo
    target = os.path.join(cache_dir("tokenizers"), "t" + gguf_tokenizer_digest(info.path))
    if not os.path.isdir(target):
        # Several actors start at once; the lock makes one convert while the others wait.
        with open(target + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.isdir(target):
                _convert_gguf_tokenizer(info.path, target)
    tmp = f"{memo}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(os.path.basename(target), tmp)
    os.replace(tmp, memo)                                  # atomic, as the conversion's rename
    return memo


def gguf_tokenizer_digest(path: str) -> str:
    """32 hex digits of everything a GGUF tokenizer's conversion reads: the tokenizer.* keys,
    the architecture and name (transformers picks the tokenizer class from them) and the
    converting transformers' version. Files of one model in several formats share it."""
    from importlib.metadata import version

    import numpy as np

    from .gguf_header import read_gguf_header
    meta = read_gguf_header(path).metadata
    digest = hashlib.sha256(version("transformers").encode())
    for key in sorted(k for k in meta if k.startswith("tokenizer.")
                      or k in ("general.architecture", "general.name")):
        value = meta[key]
        if isinstance(value, np.ndarray):
            part = value.dtype.str.encode() + value.tobytes()
        elif isinstance(value, (list, tuple)):
            part = "\0".join(map(str, value)).encode()
        else:
            part = f"{type(value).__name__}:{value}".encode()
        digest.update(f"\0{key}\0{len(part)}\0".encode())
        digest.update(part)
    return digest.hexdigest()[:32]


def _from_directory(path: str):
    """A tokenizer saved as tokenizer.json with transformers' generic class is loaded by that
    class directly: AutoTokenizer would resolve the model config first, importing torch
    (~1.4 s of every tokenizer and detokenizer start, on cores the executor is loading on)."""
    if _is_generic(path):
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _tokenizer_config(path: str) -> dict | None:
    import json

    config_path = os.path.join(path, "tokenizer_config.json")
    if not (os.path.isfile(config_path) and os.path.isfile(os.path.join(path, "tokenizer.json"))):
        return None
    with open(config_path) as f:
        return json.load(f)


def _is_generic(path: str) -> bool:
    config = _tokenizer_config(path)
    return config is not None and config.get("tokenizer_class") in _GENERIC_CLASSES


def _added_beside(path: str) -> bool:
    """Tokens that tokenizer_config.json or added_tokens.json add to tokenizer.json's."""
    import json

    with open(os.path.join(path, "tokenizer.json")) as f:
        known = {t["content"] for t in json.load(f).get("added_tokens", [])}
    extra = {t["content"] for t in (_tokenizer_config(path) or {})
             .get("added_tokens_decoder", {}).values()}
    if os.path.isfile(os.path.join(path, "added_tokens.json")):
        with open(os.path.join(path, "added_tokens.json")) as f:
            extra |= set(json.load(f))
    return not extra <= known


_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _convert_gguf_tokenizer(path: str, target: str) -> None:
    from transformers import AutoTokenizer

    from .gguf_header import read_gguf_header
    from .gguf_unigram import is_unigram, save_unigram
    from .gguf_wordpiece import is_wordpiece, save_wordpiece

    tmp = tempfile.mkdtemp(dir=os.path.dirname(target))
    try:
        meta = read_gguf_header(path).metadata
        # BERT's WordPiece and XLM-R's Unigram: transformers converts BPE and SPM-BPE only
        for matches, save in ((is_wordpiece, save_wordpiece), (is_unigram, save_unigram)):
            if matches(meta):
                save(meta, tmp)
                os.rename(tmp, target)
                return
        try:
            tok = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                gguf_file=os.path.basename(path))
        except (ValueError, TypeError):   # an architecture transformers has no model for
            #                                 (olmoe, ...), or whose keys it misreads (gpt-oss)
            copy = _tokenizer_alone(path, os.path.join(tmp, "tokenizer.gguf"))
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=os.path.basename(copy))
            os.unlink(copy)
        tok.save_pretrained(tmp)
        os.rename(tmp, target)   # atomic: readers see all of it or nothing
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tokenizer_alone(path: str, out: str) -> str:
    """A GGUF file of `path`'s tokenizer metadata alone, labelled arch llama: transformers'
    GGUF reader refuses architectures it has no model for, though it builds their BPE
    tokenizers from the tokenizer keys only (a sentencepiece one takes llama's builder)."""
    import gguf
    import numpy as np

    from .gguf_header import read_gguf_header
    writer = gguf.GGUFWriter(out, "llama")
    for key, value in read_gguf_header(path).metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, (list, np.ndarray)):
            writer.add_array(key, list(value.tolist() if isinstance(value, np.ndarray) else value))
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, int(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return out
