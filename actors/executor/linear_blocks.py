"""The Linears' weights as the native CPU kernels multiply them: a quantized model's stored
blocks (a GGUF file's, a quantized Hugging Face checkpoint's, or those --quantization rounded)
packed into kernels/quant.py's tiles, and a bfloat16 checkpoint's BF16 tiles. Backend places
them (read_model calls keep_quantized before it reads any float weight, so a Linear that keeps
only its blocks is never dequantized); a GGUF file's tiles are cached on disk (tile_cache.py),
so a restart reads them instead of packing again.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from pagewire.kernels import gguf_blocks, quant
from pagewire.kernels.linear import Linear
from pagewire.model_info import ModelInfo

from . import checkpoint_formats, huge_pages, tile_cache
from .gguf_weights import read_blocks
from .loader import gguf_header, held_linear_sources, hf_scheme, one_thread, read_safetensors
from .parallel import shard_blocks, shard_rows

log = logging.getLogger(__name__)


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
    """Give each Linear whose weight is blocks — Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS,
    MXFP4, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K: a GGUF file's, those a quantized Hugging Face
    checkpoint's codes make (checkpoint_formats.py), or those --quantization rounded (`rounded`:
    read_model()'s rounded_blocks) — a quantized copy of its weight, this rank's share of it
    (kernels/quant.py), for steps of up to `max_tokens` tokens (-1: every step, and those
    Linears drop their float copies: called before pack_linears, which then packs none of them;
    None: auto, per weight (DenseRoom): AUTO_MATMUL_TOKENS where its blocks' GEMM is the slower
    and its dense copy fits in `dense_room` bytes, else -1); returns the bytes
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
    with one_thread():
        for name, weight in _packed_weights(info, model, roundings, rounded):
            linear = model.get_submodule(name)
            tokens = max_tokens if max_tokens is not None else auto.tokens(weight)
            if ".experts." in name or ".shared." in name:
                tokens = -1     # an expert's blocks serve every step: dense copies of all a
                #                 model's experts would cost its whole size for a step's few
            linear.use_quantized(weight, tokens if tokens > 0 else sys.maxsize)
            if tokens < 0:
                linear.drop_float()
            kept += weight.nbytes
    if auto.refused:
        log.info("no dense copy of %.2f GiB of weights: beyond the %.2f GiB free for them",
                 auto.refused / 2**30, auto.room / 2**30)
    return kept


def _packed_weights(info: ModelInfo, model, roundings: dict[int, str],
                    rounded: dict | None) -> Iterator[tuple[str, quant.QuantWeight]]:
    """(Linear name, its blocks packed for model.ops' library): a GGUF file's from the tile
    cache where it holds them, else packed here (and cached); --quantization's `rounded`
    blocks or a Hugging Face checkpoint's packed here."""
    lib = model.ops.lib
    cache_kind = tile_cache.kind(lib, roundings, model.tp) if info.format == "gguf" \
        and rounded is None else None
    cached = cache_kind and tile_cache.load(info.digest, cache_kind, lib)
    if cached:
        yield from cached.items()
        return
    linears = ((name, LinearBlocks([blocks], None)) for name, blocks in rounded.items()) \
        if rounded is not None else _linear_blocks(info, model)
    if model.tp.size > 1:
        linears = _rank_shares(dict(linears), model).items()
    packed, trim = {}, huge_pages.Trimmer()   # each Linear's raw blocks: garbage once packed
    for name, (segments, order) in linears:
        linear = model.get_submodule(name)
        if not isinstance(linear, Linear) or not all(
                quant.packable(t, rows.shape[0], linear.in_features) for t, rows in segments):
            continue
        packed[name] = quant.QuantWeight.joined(
            [quant.pack(t, rows, linear.in_features, lib, roundings.get(t, "exact"))
             for t, rows in segments], lib, order)
        trim.after(packed[name].nbytes)
        yield name, packed[name]
    if cache_kind and packed:
        tile_cache.store(info.digest, cache_kind, packed)


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
    # the model's float dtype: its embedding table's, or what it names (an encoder's `embed`
    # pools: executor/models/encoder.py)
    dtype = getattr(model, "weights_dtype", None) or model.embed.weight.dtype
    lib = model.ops.lib
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


def _linear_blocks(info: ModelInfo, model) -> Iterator[tuple[str, LinearBlocks]]:
    """The Linears whose stored tensors are all blocks in one column order, fused
    (concatenated by rows) as fuse_weights fuses the float weights. A GGUF file's are read
    one Linear at a time, so loading holds one Linear's raw blocks beside the packed tiles,
    not the whole file's (an 8B file's blocks are 4.7 GB)."""
    sources = held_linear_sources(model)
    orders = model.linear_row_orders(model.cfg)
    if info.format == "gguf":
        for module_name, names in sources.items():
            stored = _gguf_blocks(info, model.cfg, names)
            if not all(n in stored for n in names):
                continue
            segments, rows = _segments(stored, names), orders.get(module_name)
            if rows is None:
                yield module_name, LinearBlocks(segments, None)
            elif len(segments) == 1:          # rows reordered as fuse_weights reorders them
                yield module_name, LinearBlocks([(segments[0][0], segments[0][1][rows])], None)
        return
    stored, orders = _hf_blocks(info.path)
    for module_name, blocks in model.expert_blocks(stored, model.cfg, sources).items():
        yield module_name, LinearBlocks([blocks], None)       # cut from a stack by the model
    stored = {name: b for name, b in stored.items() if b[1].dim() == 2}   # stacks left: float
    for module_name, names in sources.items():
        order = orders.get(names[0])
        if all(n in stored and _same(orders.get(n), order) for n in names):
            yield module_name, LinearBlocks(_segments(stored, names), order)


def _segments(stored: dict[str, Blocks], names: list[str]) -> list[Blocks]:
    """The named tensors' blocks by rows, one segment per run of one type (popped from
    `stored`)."""
    segments: list[Blocks] = []
    for ggml_type, rows in (stored.pop(n) for n in names):
        if segments and segments[-1][0] == ggml_type:
            rows = torch.cat([segments.pop()[1], rows])
        segments.append((ggml_type, rows))
    return segments


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or a is not None and b is not None and torch.equal(a, b)


_GGUF_BLOCK_TYPES = {quant.Q4_0, quant.Q4_1, quant.Q5_0, quant.Q5_1, quant.Q8_0, quant.IQ4_NL,
                     quant.MXFP4,
                     *gguf_blocks.SUPERBLOCKS}


def _gguf_blocks(info: ModelInfo, cfg, names: list[str]) -> dict[str, Blocks]:
    """{Hugging Face weight name: (GGML type, raw blocks)} of those names the file stores as
    blocks, the K-quants' 256-weight superblocks as 32-weight blocks of their superblock tile
    types (gguf_blocks.k_quant_super_blocks), which ranks can share."""
    stored = read_blocks(info.path, gguf_header(info.path), names, _GGUF_BLOCK_TYPES,
                         cfg.num_heads, cfg.num_kv_heads)
    return {name: gguf_blocks.k_quant_super_blocks(t, raw) if t in gguf_blocks.SUPERBLOCKS
            else (t, raw) for name, (t, raw) in stored.items()}


def _hf_blocks(path: str) -> tuple[dict[str, Blocks], dict[str, torch.Tensor]]:
    """A quantized Hugging Face checkpoint's blocks by weight name, and the column order
    each holds where not the weight's own (checkpoint_formats.blocks_by_name), a stack of
    experts' (MXFP4's 3-D blocks) among them too: which rows an expert's Linear takes from it
    is the model's mapping (gpt-oss interleaves gate and up rows: model.expert_blocks); a
    stack it does not map leaves its Linears their float weights, the stack's exact values."""
    scheme = hf_scheme(path)
    if scheme is None:
        return {}, {}
    return checkpoint_formats.blocks_by_name(read_safetensors(path), scheme)


def holdings(model: nn.Module) -> str:
    """What a prepared model holds, for the start-up log: its Linears' tiles (stored blocks
    or BF16), the dense weights beside them (oneDNN's packed copies, unpacked floats) and
    the other float tensors (embedding, norms)."""
    tiles = dense = linears = 0
    for m in model.modules():
        if isinstance(m, Linear):
            linears += 1
            tiles += m.quantized.nbytes if m.quantized is not None else 0
            dense += sum(t.nbytes for t in (m.weight, m.packed) if t is not None)
    others = sum(p.nbytes for name, p in model.named_parameters()
                 if not isinstance(model.get_submodule(name.rsplit(".", 1)[0]), Linear))
    others += getattr(model.embed, "blocks", torch.empty(0)).nbytes   # block_embedding.py
    return (f"weights: {tiles / 2**30:.2f} GiB of tiles, {dense / 2**30:.2f} GiB of dense "
            f"copies over {linears} Linears; {others / 2**30:.2f} GiB else (embedding, norms)")
