"""A model's files on disk, checked without torch and without reading tensor data: which
safetensors shards a Hugging Face directory has (from model.safetensors.index.json, or every
*.safetensors), and whether every file's header is whole and its tensors lie inside it (GGUF files:
gguf_header.check_tensors).

Called by model_info.resolve_model, so a missing shard or a truncated file is a clear error
naming the file before any actor starts; the loader reads the same list."""
from __future__ import annotations

import json
import os
import struct

INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                       "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_files(path: str) -> list[str]:
    """The shard files of directory `path`, in order. With an index, exactly the files its
    weight_map names (each must exist); without, every *.safetensors file."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise ValueError(f"{path}: shard {', '.join(missing)} listed in {INDEX_FILE} is "
                             "missing")
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"no .safetensors files in {path}")
    return [os.path.join(path, n) for n in names]


def safetensors_header(file: str) -> dict:
    """The JSON header of a safetensors file, checked: whole, and every tensor's bytes inside
    the file with the size its dtype and shape need."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file}: truncated safetensors file ({size} bytes, no header)")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            raise ValueError(f"{file}: truncated or corrupt safetensors file (header of "
                             f"{length} bytes, file of {size})")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise ValueError(f"{file}: corrupt safetensors header ({e})") from None
    data_size = size - 8 - length
    for name, meta in header.items():
        if name != "__metadata__":
            _check_entry(file, name, meta, data_size)
    return header


def _check_entry(file: str, name: str, meta: dict, data_size: int) -> None:
    try:
        begin, end = meta["data_offsets"]
        count = 1
        for dim in meta["shape"]:
            count *= dim
        need = count * _SAFETENSORS_DTYPES[meta["dtype"]]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{file}: corrupt safetensors header entry for {name}") from None
    if end - begin != need:
        raise ValueError(f"{file}: tensor {name} has {end - begin} bytes, its shape "
                         f"{meta['shape']} {meta['dtype']} needs {need}")
    if end > data_size:
        raise ValueError(f"{file}: truncated: tensor {name} ends at byte {end} of the data, "
                         f"the file holds {data_size}")
