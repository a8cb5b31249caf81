"""Weights from GGUF files and Hugging Face safetensors directories, into a model module.

Both sources are first mapped to Hugging Face tensor names, so each model class has one
`fuse_weights` for both. Every tensor is converted to the engine's dtype as it is read (a
GGUF tensor dequantized, a safetensors tensor cast), so the float32 source of the whole model
and its converted copy never sit in memory together. Safetensors are memory-mapped: a tensor
already in the target dtype is the file's pages, not a copy.

A Linear that keeps only its stored blocks (linear_blocks.py, placed before any float weight
is read) is not read here at all: the model then holds about its file's bytes. A GGUF model
read whole (where dense copies are kept) is cached dequantized (weight_cache.py): the next
start reads that instead of dequantizing again.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import numpy as np
import torch
from torch import nn

from pagewire.gguf_header import read_gguf_header
from pagewire.kernels.linear import Linear
from pagewire.model_files import safetensors_files
from pagewire.model_info import CLIP_ARCHITECTURES, ENCODER_ARCHITECTURES, ModelInfo
from pagewire.quant_config import read_scheme

from . import checkpoint_formats, weight_cache
from .block_embedding import BlockEmbedding, block_embedding
from .gguf_weights import read_gguf_weights, read_tensor
from .models import MODELS
from .models.clip import load_clip
from .models.encoder_weights import read_encoder
from .models.weights import embedding_source
from .load_quantization import round_linears
from .parallel import TensorParallel, shard_state

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
    if info.architecture in CLIP_ARCHITECTURES:        # pooling: models/clip.py
        return LoadedModel(load_clip(info.path, TORCH_DTYPES[dtype], ops), None)
    if info.architecture in ENCODER_ARCHITECTURES:    # pooling models: models/encoder.py
        model = read_encoder(info, TORCH_DTYPES[dtype], tp, quantization, ops, cp)
        rounded = None
        if quantization != "none":      # its Linears rounded to blocks, as a decoder's are
            linears = [n for n, m in model.named_modules() if isinstance(m, Linear)]
            weights = {f"{n}.weight": model.get_submodule(n).weight.detach() for n in linears}
            rounded = round_linears(weights, linears, quantization, info.digest)
            if place_blocks is not None:
                place_blocks(model, rounded)
        return LoadedModel(model, rounded)
    if info.architecture not in MODELS:
        raise ValueError(f"architecture {info.architecture} is not supported "
                         f"(supported: {', '.join(sorted(MODELS))})")
    model_cls = MODELS[info.architecture]
    torch_dtype = TORCH_DTYPES[dtype]
    tp, rounded = tp or TensorParallel(), None
    with one_thread():
        cfg = _read_config(info, model_cls)
        with _no_init():
            model = model_cls(cfg, tp, ops, cp)
        blocks_first = place_blocks is not None and quantization == "none"
        if blocks_first:
            place_blocks(model, None)
            embedding = block_embedding(info, cfg, tp, torch_dtype,
                                        getattr(model.lm_head, "weight", 0) is None)
            if embedding is not None:
                model.embed = embedding
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


# linear_blocks.keep_quantized bound to a model's file and options (Backend._place_blocks)
PlaceBlocks = Callable[[nn.Module, "dict | None"], int]


def _blocks_only_sources(model: nn.Module, cfg) -> frozenset[str]:
    """The Hugging Face tensors only Linears that keep no float weight read (their blocks
    serve every step) or other ranks' Linears read: the loader need not read them. The embedding is read unless it looks
    its rows up from blocks (block_embedding.py): a tied LM head that keeps blocks still
    leaves a float table's rows to look up."""
    sources = model.linear_sources(cfg)
    held = held_linear_sources(model)
    # a tensor several Linears read (gpt-oss's stack of a layer's experts) is read if any
    # Linear this rank holds needs its float weight
    needed = {src for name, names in held.items()
              if getattr(model.get_submodule(name), "weight", 0) is not None for src in names}
    skip = {src for names in sources.values() for src in names} - needed
    embed = embedding_source(cfg)
    if isinstance(model.embed, BlockEmbedding):
        return frozenset(skip | {embed})
    return frozenset(skip - {embed})


def held_linear_sources(model: nn.Module) -> dict[str, list[str]]:
    """model.linear_sources for the Linears this rank holds: with expert parallelism, the
    other ranks' experts are none of its modules (and their tensors are not read)."""
    held = {name for name, _ in model.named_modules()}
    return {name: names for name, names in model.linear_sources(model.cfg).items()
            if name in held}


def _hf_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def hf_scheme(path: str):
    cfg = _hf_config(path)
    return read_scheme(cfg.get("text_config", cfg).get("quantization_config"), path)


@functools.lru_cache(maxsize=2)
def gguf_header(path: str):
    """A GGUF file's header, read once for the weights and the quantized copies (its
    tokenizer arrays make reading it cost ~0.2 s)."""
    return read_gguf_header(path)


def _read_config(info: ModelInfo, model_cls):
    """The model's config from its GGUF metadata or config.json."""
    if info.format != "gguf":
        return model_cls.config_class.from_hf(_hf_config(info.path))
    header = gguf_header(info.path)
    if info.mmproj:                     # the language model's file and the tower's
        from .gguf_vision import vision_language_config
        cfg = vision_language_config(header.metadata, "output.weight" in header.tensors,
                                     info.mmproj)
    else:
        cfg = model_cls.config_class.from_gguf(header.metadata, "output.weight" in header.tensors)
    freqs = header.tensors.get("rope_freqs.weight")
    if freqs is not None:     # Llama 3's rope scaling as llama.cpp keeps it: a divisor per
        data = np.memmap(info.path, dtype=np.uint8, mode="r")        # rope frequency
        cfg.rope_freq_divisors = read_tensor(data, freqs).tolist()
    return cfg


def _read_weights(info: ModelInfo, cfg, dtype: torch.dtype,
                  skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """{Hugging Face name: tensor in dtype}, but the names in `skip`. A GGUF model whose
    linears are all read is cached dequantized (weight_cache.py); one that skips its
    blocks-only linears is not: what is left (embedding, norms) converts in a fraction of the
    time a cache file would cost on disk. A mmproj file's tower is read beside them, uncached."""
    if info.mmproj:
        from .gguf_vision import read_tower
        text = msgspec.structs.replace(info, mmproj="")
        return {**_read_weights(text, cfg, dtype, skip), **read_tower(info.mmproj, dtype)}
    if info.format == "gguf":
        header, heads = gguf_header(info.path), (cfg.num_heads, cfg.num_kv_heads)
        if skip - {embedding_source(cfg)}:
            return read_gguf_weights(info.path, header, *heads, dtype, skip)
        weights = weight_cache.load(info.digest, dtype)
        if weights is None:
            weights = read_gguf_weights(info.path, header, *heads, dtype)
            weight_cache.store(info.digest, dtype, weights)
        return {name: w for name, w in weights.items() if name not in skip}
    scheme = hf_scheme(info.path)
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
def one_thread():
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


# for the models whose own loaders build them (models/encoder_weights.py)
no_init = _no_init
