"""Random-weight bfloat16 Hugging Face directories of real shapes (real_shapes.py plans the
tensors and writes the GGUF files): safetensors shards of random values, a config.json and
the default model's tokenizer."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

from .real_shapes import Planned, default_tokenizer_meta, hf_config, random_bytes, tensor_plan

SHARD_BYTES = 2 * 10**9       # safetensors files of at most this many bytes (one tensor may
                              # make a shard alone)
CHUNK_VALUES = 1 << 26        # bfloat16 values drawn at once (128 MiB)


def _bf16_table(rng) -> np.ndarray:
    """65,536 bfloat16 bit patterns of normal * 0.02 (float32 truncated): a random uint16
    index into it draws one, ~10x faster than drawing normals (8B weights in seconds)."""
    values = (rng.standard_normal(1 << 16) * 0.02).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16)


def hf_shards(plan: list[Planned], shard_bytes: int = SHARD_BYTES) -> list[list[Planned]]:
    """The plan cut into consecutive shards of at most `shard_bytes` of bfloat16 data."""
    shards, size = [[]], 0
    for t in plan:
        nbytes = 2 * int(np.prod(t.dims))
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def _safetensors_header(shard: list[Planned]) -> bytes:
    """The 8-byte length and JSON header of a bfloat16 shard, padded to 8 bytes as
    safetensors pads it."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in shard:
        end = offset + 2 * int(np.prod(t.dims))
        entries[t.hf_name] = {"dtype": "BF16", "shape": list(t.dims),
                              "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _shard_name(k: int, count: int) -> str:
    return f"model-{k + 1:05d}-of-{count:05d}.safetensors"


def write_hf_model(path: str, shape: dict, tokenizer_dir: str | None = None, seed: int = 0,
                   shard_bytes: int = SHARD_BYTES) -> str:
    """Write a bfloat16 Hugging Face directory of `shape` at `path` (via path + ".part",
    renamed when whole): sharded safetensors with their index, config.json, and the tokenizer
    files of `tokenizer_dir` (default: the default model's tokenizer)."""
    if shape.get("num_experts") or shape["architecture"] not in ("LlamaForCausalLM",
                                                                  "Qwen2ForCausalLM"):
        raise ValueError(f"{shape['architecture']} shapes are written as GGUF only")
    meta = default_tokenizer_meta()
    vocab = len(meta["tokenizer.ggml.tokens"])
    plan = tensor_plan(shape, "bf16", vocab)
    part = path + ".part"
    shutil.rmtree(part, ignore_errors=True)
    os.makedirs(part)
    rng = np.random.default_rng(seed)
    table = _bf16_table(rng)
    shards = hf_shards(plan, shard_bytes)
    weight_map = {}
    for k, shard in enumerate(shards):
        name = _shard_name(k, len(shards))
        with open(os.path.join(part, name), "wb") as f:
            f.write(_safetensors_header(shard))
            for t in shard:
                count = int(np.prod(t.dims))
                if t.hf_name.endswith("norm.weight"):
                    np.full(count, 0x3F80, dtype=np.uint16).tofile(f)     # bfloat16 1.0
                else:
                    for start in range(0, count, CHUNK_VALUES):
                        n = min(CHUNK_VALUES, count - start)
                        table[random_bytes(2 * n, rng).view(np.uint16)].tofile(f)
                weight_map[t.hf_name] = name
    total = sum(2 * int(np.prod(t.dims)) for t in plan)
    _write_json(os.path.join(part, "model.safetensors.index.json"),
                {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(os.path.join(part, "config.json"),
                hf_config(shape, vocab, int(meta["tokenizer.ggml.bos_token_id"]),
                          int(meta["tokenizer.ggml.eos_token_id"])))
    save_default_tokenizer(part, tokenizer_dir)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(part, path)
    return path


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def save_default_tokenizer(path: str, tokenizer_dir: str | None = None) -> None:
    """Into `path`: the tokenizer files of `tokenizer_dir`; else PAGEWIRE_TEST_TOKENIZER's (a
    saved copy, on a machine without the default model's package: tests/gpu_prepare.sh);
    else the default model's."""
    tokenizer_dir = tokenizer_dir or os.environ.get("PAGEWIRE_TEST_TOKENIZER")
    if tokenizer_dir is not None:
        for name in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
        return
    from pagewire.hf_tokenizer import load_tokenizer
    from pagewire.model_info import resolve_model
    load_tokenizer(resolve_model(None)).save_pretrained(path)


def hf_is_whole(path: str, shape: dict) -> bool:
    """`path` holds config.json and every shard of `shape`'s bfloat16 plan at its size."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not (os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(index)):
        return False
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    shards = hf_shards(tensor_plan(shape, "bf16", vocab))
    for k, shard in enumerate(shards):
        file = os.path.join(path, _shard_name(k, len(shards)))
        size = len(_safetensors_header(shard)) + 2 * sum(int(np.prod(t.dims)) for t in shard)
        if not os.path.isfile(file) or os.path.getsize(file) != size:
            return False
    return True
