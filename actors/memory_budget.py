"""How much memory a server may take, decided once where its configuration is resolved (the
supervisor, or the offline LLM): the KV pool of `--kv-cache-memory auto` and, with
`--quantized-matmul-tokens auto`, the room the executor leaves its dense weight copies.

The memory free to this process is the least of the kernel's MemAvailable and, under a
cgroup limit (systemd's MemoryMax, a container's), the limit less the group's usage. The
model's weights are estimated from its file: blocks kept as stored cost about their bytes
(the tiles of kernels/quant.py run 1.0-1.5x the file's K-quant blocks, ~1.1x Q4_0), a float
checkpoint its bytes, a dense copy per weight on top where one is asked for.
"""
from __future__ import annotations

import logging
import math
import os
from typing import NamedTuple

from pagewire.kernels import tiers

log = logging.getLogger(__name__)

GiB = 2**30
# What the engine holds beside weights and KV: torch, oneDNN and the kernels, the
# tokenizers and the other actors' Python (~0.6 GiB measured for the default model), the
# step's activations and logits, and room for the OS page cache the weights are read through.
RESERVE = 1 * GiB
# The share of what is left after weights and RESERVE that `auto` gives the KV pool: the rest
# stays free for the machine (the page cache, a second engine, a client).
KV_SHARE = 0.5
# Bytes the executor holds per byte of a quantized checkpoint's blocks where its tensors'
# types are not read (a Hugging Face checkpoint's; a GGUF file's come from TILE_BYTES).
TILE_OVERHEAD = 1.35
# An MXFP4 checkpoint's (gpt-oss: nearly all its bytes are MXFP4 experts) is its file's 17
# bytes a 32 weights held as its tiles' (tile_bytes: Q8_0's 34, or level tiles' 18).
MXFP4, MXFP4_BLOCK_BYTES = 39, 17
# Bytes of tiles a row's 32 weights of each GGML type become (kernels/quant.py; the K-quants
# and IQ4_XS as superblock tiles, csrc/quant_tiles.h): Q4_0 as Q4_1 (20 against the file's
# 18), Q5_0, IQ4_NL and MXFP4 as Q8_0 (MXFP4 with exponents beyond fp16's range as Q6_K, 40),
# Q5_1 as Q5_K, Q4_K 18.5 against 18, Q6_K 34.25 against 26.25.
# tests/actors/test_memory_budget.py holds it to what pack() makes.
TILE_BYTES = {2: 20, 3: 20, 6: 34, 7: 40, 8: 34, 20: 34, 10: 36.5, 11: 34.25, 12: 18.5,
              13: 34.5, 14: 34.25, 23: 34.25, 39: 34}
FLOAT_BYTES = 2        # a dequantized tensor's (embedding, norms) element in bfloat16
# IQ4_NL, MXFP4 and IQ4_XS where a native tier keeps them as level tiles (every one does,
# csrc/quant_tiles.h Levels): 256 bytes of nibbles and 16 fp16 d a 16 x 32 tile, the file's 4.5 bits a
# weight; IQ4_XS's superblock tiles its 8 blocks' scale bytes beside one fp16 d.
LEVEL_TILE_BYTES = {20: 18, 39: 18, 23: 17.25}
# Types whose embedding stays blocks (executor/block_embedding.py: gguf_weights dequantizes
# them with torch; one rank)
BLOCK_EMBEDDINGS = {2, 3, 8, 10, 11, 12, 13, 14, 39}


def available_bytes() -> int:
    """Memory this process may still take: /proc/meminfo's MemAvailable, or less under a
    cgroup v2 limit."""
    free = _meminfo_available()
    limit = _cgroup_room()
    return free if limit is None else min(free, limit)


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2); None without a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))
        base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            return max(0, int(limit) - int(f.read()))
    except (OSError, StopIteration, ValueError):
        return None


def file_bytes(path: str) -> int:
    """Bytes of a model's weights on disk: the GGUF file, or a directory's safetensors."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    from .model_files import safetensors_files
    return sum(os.path.getsize(f) for f in safetensors_files(path))


def weights_estimate(info, quantized_matmul_tokens: int | None) -> int:
    """The executor's bytes of weights for `info` (a ModelInfo): a quantized model's blocks,
    plus a dense bfloat16 copy of them where steps above some size use one (a positive
    --quantized-matmul-tokens; `auto` is bounded by dense_budget instead); a float
    checkpoint's file as it is."""
    size = file_bytes(info.path)
    quantized = info.format == "gguf" or bool(info.stored_quantization)
    if not quantized:
        return size
    dense = 2 * _parameters(info) if quantized_matmul_tokens and quantized_matmul_tokens > 0 \
        else 0
    held = _gguf_held(info.path) if info.format == "gguf" else None
    overhead = tile_bytes(_level_tiles())[MXFP4] / MXFP4_BLOCK_BYTES \
        if info.stored_quantization == "mxfp4" else TILE_OVERHEAD
    return (held if held is not None else int(size * overhead)) + dense


def _level_tiles() -> bool:
    """Whether the executor keeps IQ4_NL, MXFP4 and IQ4_XS as level tiles: where a native
    tier runs (--kernels auto's), every one of which has them."""
    return tiers.best() is not None


def tile_bytes(level_tiles: bool) -> dict[int, float]:
    """Bytes of tiles a row's 32 weights of each GGML type become (TILE_BYTES), with
    LEVEL_TILE_BYTES where the tier has level tiles."""
    return {**TILE_BYTES, **LEVEL_TILE_BYTES} if level_tiles else TILE_BYTES


def _gguf_held(path: str) -> int | None:
    """A GGUF file's weights as the executor holds them: each 2-D tensor (or 3-D stack of
    experts) of a type the tiles take as TILE_BYTES says, the embedding as its blocks where
    it can stay so (its file bytes), the rest dequantized; None where the header cannot be
    read."""
    from .gguf_header import GGML_TYPES, read_gguf_header
    try:
        tensors = read_gguf_header(path).tensors.values()
    except (OSError, ValueError):
        return None
    held, sizes = 0, tile_bytes(_level_tiles())
    for t in tensors:
        count, embedding = math.prod(t.shape), "token_embd" in t.name
        if embedding and t.ggml_type in BLOCK_EMBEDDINGS:
            _, block, size = GGML_TYPES[t.ggml_type]
            held += count // block * size
        elif len(t.shape) in (2, 3) and t.ggml_type in sizes and not embedding:
            held += count // 32 * sizes[t.ggml_type]
        else:
            held += count * FLOAT_BYTES
    return int(held)


def _parameters(info) -> int:
    """The linears' weights of a Llama-shaped model (what a dense copy holds)."""
    h, layers = info.hidden_size, info.num_layers
    q = info.num_heads * info.head_dim
    kv = 2 * info.num_kv_heads * info.head_dim
    return layers * (h * (q + kv) + q * h + 3 * h * info.intermediate_size) \
        + h * info.vocab_size


class KvPlan(NamedTuple):
    bytes: int          # the pool's size
    max_len: int        # max_model_len, lowered to what the pool holds where it was not set
    reason: str         # the start-up log's account of both


def kv_auto(info, per_token: int, max_len: int, len_given: bool, max_seqs: int,
            quantized_matmul_tokens: int | None, free: int | None = None) -> KvPlan:
    """`--kv-cache-memory auto`: KV_SHARE of the memory left after the weights and RESERVE,
    no more than max_seqs sequences of max_len tokens fill, no less than one. Where even one
    does not fit and --max-model-len was not given, the context is lowered to what fits."""
    free = available_bytes() if free is None else free
    weights = weights_estimate(info, quantized_matmul_tokens)
    left = free - weights - RESERVE
    share = int(max(0, left) * KV_SHARE)
    size = min(share, max_seqs * max_len * per_token)
    account = (f"{free / GiB:.1f} GiB free, ~{weights / GiB:.1f} GiB of weights, "
               f"{RESERVE / GiB:.0f} GiB reserved: {KV_SHARE:.0%} of the rest")
    if size >= max_len * per_token:
        return KvPlan(size, max_len, account)
    fits = share // per_token
    if not len_given and fits >= 1024:
        return KvPlan(share, fits, account + f"; the context lowered to {fits} tokens to fit "
                      f"(the model's is {max_len}: pass --max-model-len and "
                      "--kv-cache-memory for more)")
    return KvPlan(max_len * per_token, max_len, account + f"; less than one sequence of "
                  f"{max_len} tokens fits, so the pool holds exactly one")


def dense_budget(kv_bytes: int) -> int:
    """With --quantized-matmul-tokens auto, the bytes of dense weight copies the executor may
    add beside the blocks: half the memory free as it loads them, less the KV pool of
    `kv_bytes` it allocates after."""
    return max(0, available_bytes() - kv_bytes) // 2
