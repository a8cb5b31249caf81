"""Weights from GGUF files and Hugging Face safetensors directories, into a model module.

Both sources are first mapped to Hugging Face tensor names, so each model class has one
`fuse_weights` for both. Every tensor is converted to the engine's dtype as it is read (a
GGUF tensor dequantized, a safetensors tensor cast), so the float32 source of the whole model
and its converted copy never sit in memory together. Safetensors are memory-mapped: a tensor
already in the target dtype is the file's pages, not a copy.

A GGUF model's converted tensors are cached (weight_cache.py): the next start maps them
instead of dequantizing again.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from pagewire.gguf_header import read_gguf_header
from pagewire.kernels import gguf_blocks, quant
from pagewire.kernels.linear import Linear
from pagewire.model_files import safetensors_files
from pagewire.model_info import ModelInfo
from pagewire.quant_config import read_scheme

from . import checkpoint_formats, weight_cache
from .gguf_weights import read_blocks, read_gguf_weights, read_tensor
from .models import MODELS
from .load_quantization import round_linears
from .parallel import TensorParallel, shard_blocks, shard_rows, shard_state

log = logging.getLogger(__name__)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class LoadedModel(NamedTuple):
    """A loaded model and, with --quantization, the blocks its linears were rounded to (for
    keep_quantized; None otherwise)."""
    model: nn.Module
    rounded_blocks: dict | None


def load_model(info: ModelInfo, dtype: str, tp: TensorParallel | None = None,
               quantization: str = "none", ops=None, cp=None) -> nn.Module:
    """read_model()'s model alone."""
    return read_model(info, dtype, tp, quantization, ops, cp).model


def read_model(info: ModelInfo, dtype: str, tp: TensorParallel | None = None,
               quantization: str = "none", ops=None, cp=None,
               place_blocks: PlaceBlocks | None = None) -> LoadedModel:
    """Build the model for `info` and fill it with weights cast to `dtype` (this rank's share
    of them under tensor parallelism). `quantization` int8|int4 rounds the linears of the
    whole weights before they are shared (load_quantization.py): every rank count holds the
    same values, and the blocks come back beside the model for keep_quantized. `ops`, `cp`:
    the backend's kernel set and the context-parallel group the model is built with.
    `place_blocks(model, rounded)` gives Linears their stored blocks (keep_quantized): called
    before any float weight is read, so a Linear that keeps only its blocks never has its
    float weight read or dequantized (the model's memory is then about its file's); with
    --quantization, after rounding, which needs the float weights."""
    if info.architecture not in MODELS:
        raise ValueError(f"architecture {info.architecture} is not supported "
                         f"(supported: {', '.join(sorted(MODELS))})")
    model_cls = MODELS[info.architecture]
    torch_dtype = TORCH_DTYPES[dtype]
    tp, rounded = tp or TensorParallel(), None
    with _one_thread():
        cfg = _read_config(info, model_cls)
        with _no_init():
            model = model_cls(cfg, tp, ops, cp)
        blocks_first = place_blocks is not None and quantization == "none"
        if blocks_first:
            place_blocks(model, None)
        weights = _read_weights(info, cfg, torch_dtype, _blocks_only_sources(model, cfg))
        state = model_cls.fuse_weights(weights, cfg)
        del weights
        if quantization != "none":
            linears = [n for n, m in model.named_modules() if isinstance(m, Linear)]
            rounded = round_linears(state, linears, quantization, info.digest)
        state = {k: w.to(torch_dtype) for k, w in shard_state(state, cfg, tp).items()}
        missing = model.load_state_dict(state, strict=False, assign=True).missing_keys
        del state
        if place_blocks is not None and not blocks_first:
            place_blocks(model, rounded)
    if missing:
        raise ValueError(f"weights missing from {info.path}: {', '.join(missing[:5])}")
    model.reset_buffers()
    return LoadedModel(model.eval(), rounded)


# keep_quantized bound to a model's file and options (Backend.prepare_blocks)
PlaceBlocks = Callable[[nn.Module, "dict | None"], int]


def _blocks_only_sources(model: nn.Module, cfg) -> frozenset[str]:
    """The Hugging Face tensors only Linears that keep no float weight read (their blocks
    serve every step): the loader need not read them. The embedding is always read (its
    rows are looked up even where the tied LM head keeps blocks)."""
    sources = model.linear_sources(cfg)
    skip = {src for name, names in sources.items()
            if getattr(model.get_submodule(name), "weight", 0) is None for src in names}
    return frozenset(skip - {"model.embed_tokens.weight"})


# --quantized-matmul-tokens auto (None): steps of up to this many tokens multiply the blocks,
# larger ones oneDNN's dense copy, where the blocks' GEMM is the slower (every weight but
# those quant.blocks_serve_large_steps names: they serve every step, with no dense copy) and
# the copies fit in the room given (memory_budget.dense_budget).
AUTO_MATMUL_TOKENS = 16


class DenseRoom:
    """`auto`'s choice per weight: a dense copy for large steps where the blocks' GEMM is the
    slower, while the copies' bytes fit in `room` (None: no bound)."""

    def __init__(self, room: int | None, lib, int16_gemm: bool, dense_bytes: int,
                 int8_gemm: bool = False):
        self.room, self.lib, self.int16_gemm, self.int8_gemm = room, lib, int16_gemm, int8_gemm
        self.dense_bytes = dense_bytes        # a dense copy's bytes per weight
        self.taken = self.refused = 0

    def tokens(self, weight: quant.QuantWeight) -> int:
        """-1 (the blocks serve every step) or AUTO_MATMUL_TOKENS (a dense copy above)."""
        if quant.blocks_serve_large_steps(weight, self.lib, self.int16_gemm, self.int8_gemm):
            return -1
        need = weight.rows * weight.cols * self.dense_bytes
        if self.room is not None and self.taken + need > self.room:
            self.refused += need
            return -1
        self.taken += need
        return AUTO_MATMUL_TOKENS


def keep_quantized(model: nn.Module, info: ModelInfo, max_tokens: int | None,
                   roundings: dict[int, str] | None = None, rounded: dict | None = None,
                   dtype: torch.dtype | None = None, dense_room: int | None = None) -> int:
    """Give each Linear whose weight is blocks — Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q3_K,
    Q4_K, Q5_K or Q6_K: a GGUF file's, those a quantized Hugging Face checkpoint's codes make
    (checkpoint_formats.py), or those --quantization rounded (`rounded`: read_model()'s
    rounded_blocks) — a quantized copy of its weight, this rank's share of it
    (kernels/quant.py), for steps of up to `max_tokens` tokens (-1: every step, and those
    Linears drop their float copies: called before pack_linears, which then packs none of
    them; None: auto, per weight (DenseRoom): AUTO_MATMUL_TOKENS where its blocks' GEMM is
    the slower and its dense copy fits in `dense_room` bytes, else -1); returns the bytes
    kept. Only where the activations are bfloat16 or
    float32 (the kernels' dtypes), for the model's backend (`model.ops`: its native library
    and capabilities); `roundings`: GGML type -> how its weights meet the activations
    (kernels/quant.py ROUNDINGS; a type not named: exact). `dtype`: the activations' (None:
    the embedding's; read_model places blocks before the weights are loaded)."""
    lib, int16_gemm = model.ops.lib, model.ops.capabilities.int16_large_steps
    dtype = dtype or model.embed.weight.dtype
    if max_tokens == 0 or not quant.available(lib) or dtype not in (torch.bfloat16, torch.float32):
        return 0
    kept, roundings = 0, roundings or {}
    upcast = dtype == torch.float32 or not model.ops.capabilities.bf16_dot
    auto = DenseRoom(dense_room, lib, int16_gemm, 4 if upcast else 2,
                     model.ops.capabilities.int8_large_steps)
    with _one_thread():
        linears = {name: LinearBlocks([blocks], None) for name, blocks in rounded.items()} \
            if rounded is not None else _linear_blocks(info, model)
        if model.tp.size > 1:
            linears = _rank_shares(linears, model)
        for name, (segments, order) in linears.items():
            linear = model.get_submodule(name)
            if not isinstance(linear, Linear) or not all(
                    quant.packable(t, rows.shape[0], linear.in_features) for t, rows in segments):
                continue
            weight = quant.QuantWeight.joined(
                [quant.pack(t, rows, linear.in_features, lib, roundings.get(t, "exact"))
                 for t, rows in segments], lib, order)
            tokens = max_tokens if max_tokens is not None else auto.tokens(weight)
            linear.use_quantized(weight, tokens if tokens > 0 else sys.maxsize)
            if tokens < 0:
                linear.drop_float()
            kept += weight.nbytes
    if auto.refused:
        log.info("no dense copy of %.2f GiB of weights: beyond the %.2f GiB free for them",
                 auto.refused / 2**30, auto.room / 2**30)
    return kept


def keep_bf16_tiles(model: nn.Module, max_tokens: int | None) -> int:
    """Give each Linear that kept no blocks and whose weights are all bfloat16 values (a
    bfloat16 checkpoint's) its weight as BF16 tiles (kernels/quant.py pack_bf16); returns
    the bytes kept. Not with --quantized-matmul-tokens 0 (the float path everywhere).
    - A bfloat16 engine's tiles serve every step and its float copy goes: the native kernel
      reads them 2-2.5x faster than oneDNN's per-call path at decode sizes and is within
      0.75-0.95x of it at a prefill chunk's (bench/NOTES.md "BF16 tiles"), so the weights are
      not held twice.
    - A float32 engine (a CPU without a bfloat16 dot product runs bfloat16 checkpoints in
      float32) reads the tiles, half its float32 bytes, for steps of up to `max_tokens`
      tokens, exactly (float32 products of bfloat16 weights); larger steps keep oneDNN's
      float32 GEMMs, which the float32 arithmetic of these tiers makes faster there. With -1
      the tiles serve every step and the float copy goes.
    For the model's backend (`model.ops`), whose prepare calls it for host-memory weights."""
    dtype, lib = model.embed.weight.dtype, model.ops.lib
    max_tokens = AUTO_MATMUL_TOKENS if max_tokens is None else max_tokens
    if max_tokens == 0 or not quant.available(lib) or dtype not in (torch.bfloat16,
                                                                    torch.float32):
        return 0
    every_step = dtype == torch.bfloat16 or max_tokens < 0
    kept = 0
    for linear in model.modules():
        w = linear.weight if isinstance(linear, Linear) and linear.quantized is None else None
        if w is None or not quant.packable(quant.BF16, *w.shape):
            continue
        tiles = w.detach().bfloat16()
        if dtype == torch.float32 and not torch.equal(tiles.float(), w):
            continue                                 # not bfloat16 values: would round
        weight = quant.pack_bf16(tiles, lib)
        linear.use_quantized(weight, sys.maxsize if every_step else max_tokens)
        if every_step:
            linear.drop_float()
        kept += weight.nbytes
    return kept


Blocks = tuple[int, torch.Tensor]          # (GGML type, uint8 rows of 32-weight blocks)


class LinearBlocks(NamedTuple):
    """A Linear's weight as blocks: row runs of one type each (Q4_K_M's qkv: Q4_K q_proj and
    k_proj, then Q6_K v_proj), holding its columns in `order` (GPTQ act-order) or as they are
    (None)."""
    segments: list[Blocks]
    order: torch.Tensor | None


def _rank_shares(linears: dict[str, LinearBlocks], model) -> dict[str, LinearBlocks]:
    """This rank's share of each linear: of one type in column order by rows or whole block
    columns (parallel.shard_blocks); mixed or column-ordered ones of qkv and gate_up by rows
    (parallel.shard_rows). A row-parallel one in another column order is not shared (its
    columns would be cut across the order): its float share serves it."""
    plain = {name: segments[0] for name, (segments, order) in linears.items()
             if len(segments) == 1 and order is None}
    out = {name: LinearBlocks([blocks], None) for name, blocks in
           shard_blocks(plain, model.cfg, model.tp, quant.block_bytes).items()}
    for name, (segments, order) in linears.items():
        rows = None if name in plain else shard_rows(segments, name, model.cfg, model.tp)
        if rows:
            out[name] = LinearBlocks(rows, order)
    return out


def _linear_blocks(info: ModelInfo, model) -> dict[str, LinearBlocks]:
    """The Linears whose stored tensors are all blocks in one column order, fused
    (concatenated by rows) as fuse_weights fuses the float weights."""
    sources = model.linear_sources(model.cfg)
    stored, orders = _stored_blocks(info, model.cfg,
                                    [n for names in sources.values() for n in names])
    out = {}
    for module_name, names in sources.items():
        order = orders.get(names[0])
        if not all(n in stored and _same(orders.get(n), order) for n in names):
            continue
        segments: list[Blocks] = []
        for ggml_type, rows in (stored.pop(n) for n in names):
            if segments and segments[-1][0] == ggml_type:
                rows = torch.cat([segments.pop()[1], rows])
            segments.append((ggml_type, rows))
        out[module_name] = LinearBlocks(segments, order)
    return out


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or a is not None and b is not None and torch.equal(a, b)


def _stored_blocks(info: ModelInfo, cfg, names: list[str]) -> tuple[dict[str, Blocks],
                                                                     dict[str, torch.Tensor]]:
    """({Hugging Face weight name: (GGML type, raw blocks)} of the model's stored blocks,
    {name: the column order its blocks hold} where not the weight's own)."""
    if info.format == "gguf":
        types = {quant.Q4_0, quant.Q4_1, quant.Q5_0, quant.Q5_1, quant.Q8_0, quant.IQ4_NL,
                 *gguf_blocks.K_QUANTS}
        stored = read_blocks(info.path, _gguf_header(info.path), names, types, cfg.num_heads,
                             cfg.num_kv_heads)
        # the K-quants' 256-weight superblocks as 32-weight blocks, which ranks can share
        return {name: gguf_blocks.k_quant_blocks(t, raw) if t in gguf_blocks.K_QUANTS
                else (t, raw) for name, (t, raw) in stored.items()}, {}
    scheme = _hf_scheme(info.path)
    if scheme is None:
        return {}, {}
    return checkpoint_formats.blocks_by_name(read_safetensors(info.path), scheme)


def _hf_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _hf_scheme(path: str):
    cfg = _hf_config(path)
    return read_scheme(cfg.get("text_config", cfg).get("quantization_config"), path)


@functools.lru_cache(maxsize=2)
def _gguf_header(path: str):
    """A GGUF file's header, read once for the weights and the quantized copies (its
    tokenizer arrays make reading it cost ~0.2 s)."""
    return read_gguf_header(path)


def _read_config(info: ModelInfo, model_cls):
    """The model's config from its GGUF metadata or config.json."""
    if info.format != "gguf":
        return model_cls.config_class.from_hf(_hf_config(info.path))
    header = _gguf_header(info.path)
    cfg = model_cls.config_class.from_gguf(header.metadata, "output.weight" in header.tensors)
    freqs = header.tensors.get("rope_freqs.weight")
    if freqs is not None:     # Llama 3's rope scaling as llama.cpp keeps it: a divisor per
        data = np.memmap(info.path, dtype=np.uint8, mode="r")        # rope frequency
        cfg.rope_freq_divisors = read_tensor(data, freqs).tolist()
    return cfg


def _read_weights(info: ModelInfo, cfg, dtype: torch.dtype,
                  skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """{Hugging Face name: tensor in dtype}, but the names in `skip`. A GGUF model read whole
    is cached dequantized (weight_cache.py); one that skips its blocks-only linears is not:
    what is left (embedding, norms) converts in a fraction of the time a cache file would
    cost on disk."""
    if info.format == "gguf":
        header, heads = _gguf_header(info.path), (cfg.num_heads, cfg.num_kv_heads)
        if skip:
            return read_gguf_weights(info.path, header, *heads, dtype, skip)
        cached = weight_cache.load(info.digest, dtype)
        if cached is not None:
            return cached
        weights = read_gguf_weights(info.path, header, *heads, dtype)
        weight_cache.store(info.digest, dtype, weights)
        return weights
    scheme = _hf_scheme(info.path)
    if scheme is not None:       # packed integer linears -> float weights (their blocks' values)
        return checkpoint_formats.float_weights(read_safetensors(info.path), scheme, dtype, skip)
    return read_safetensors(info.path, dtype, skip)


def read_safetensors(path: str, dtype: torch.dtype | None = None,
                     skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory (one file or the shards its index lists) but
    those named in `skip`, memory-mapped, each cast to `dtype` (None: as stored) as it is
    read."""
    from safetensors import safe_open

    weights = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name in skip:
                    continue
                tensor = f.get_tensor(name)
                weights[name] = tensor if dtype is None else tensor.to(dtype)
    return weights


@contextlib.contextmanager
def _one_thread():
    """Load on one torch thread. Loading is many small, memory-bound ops; with a thread per
    core, every parallel region waits for the slowest core, and at start-up the other actors
    are busy on those cores: dequantizing the default model took 9 s on two threads and
    0.4 s on one, measured on the 2-core machine while the tokenizers loaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_INIT_FUNCTIONS = ("normal_", "uniform_", "zeros_", "ones_", "constant_", "kaiming_uniform_",
                   "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "trunc_normal_")


@contextlib.contextmanager
def _no_init():
    """Skip nn.init while building the model: every weight is then assigned from the
    checkpoint, so its parameters stay untouched torch.empty pages. (Not on the meta device:
    ops on meta tensors, an init or the rope table, import torch._dynamo, ~1.2 s.)"""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
