"""LoRA adapters in the executor: loaded on first use (at most max_cpu_loras kept, the least
recently used unloaded first) and applied to a step's rows, each row with its sequence's
adapter, base rows untouched.

An adapter's weights are laid out as the base weights are fused (weights.py): for each Linear,
A stacks the A matrices of the projections it fuses ([R, in], R the sum of their ranks) and
B^T is block-diagonal (projection j's B^T in its own rank rows and output columns), of which
only the blocks are kept (kernels/lora.py LoraWeights). One linear's delta for a row is then
scale (x A^T) B^T, two small products per adapter however many projections the linear fuses:
the backend's lora_delta op (kernels/ops.py), in the per-op path and the fused decode alike.
"""
from __future__ import annotations

import functools
import itertools
import os
from collections import OrderedDict

import numpy as np
import torch

from pagewire.kernels.lora import ENTRY, KINDS, LoraWeights, stacked_dense
from pagewire.wire.lora import LoraRef

from .. import lora_names
from ..lora_files import WEIGHTS, AdapterFile, read_adapter
from . import huge_pages
from .models import lora_slots
from .models.gpt_weights import gpt_row_orders
from .parallel import split_range

# Each fused Linear of a layer -> the projections it holds, in its output order; the linears
# in the model's slot order (models/lora_slots.py LORA_LINEARS).
PARTS = dict(zip(lora_slots.LORA_LINEARS, (("q_proj", "k_proj", "v_proj"), ("o_proj",),
                                           ("gate_proj", "up_proj"), ("down_proj",))))
# each projection -> (the Linear holding it, its index among the Linear's parts); a fused
# q/k/v adapter (qkv_proj) is split into q, k and v parts as it loads (_projections)
_LINEAR_OF = {p: (name, j) for name, parts in PARTS.items() for j, p in enumerate(parts)}
_LINEAR_OF["qkv_proj"] = ("attn.qkv", 0)

Weights = dict[int, LoraWeights]           # linear slot -> its weights (kernels/lora.py)
Stacks = dict[int, tuple | None]           # linear slot -> stacked_dense of a step's adapters
# Steps' adapter sets (in their order) whose stacked weights are kept for the next steps with
# the same set: each holds every adapted linear's float32 A and B^T of its adapters.
KEPT_STACKS = 2


def _linear_of(proj: str, layer) -> tuple[str, int]:
    """A projection (lora_names.py's name) -> (the layer's Linear holding it, its index among
    that Linear's parts): an expert's gate and up share its gate_up, as the base weights; a
    plain MLP's up (the GPT family's) is its `up` alone."""
    owner, _, base = proj.rpartition(".")
    if proj == "up_proj" and not hasattr(layer.mlp, "gate_up"):
        return "mlp.up", 0
    if not owner:
        return _LINEAR_OF[proj]
    linear = "mlp.shared" if owner == "shared_expert" else f"mlp.{owner}"
    return (f"{linear}.down", 0) if base == "down_proj" else \
        (f"{linear}.gate_up", int(base == "up_proj"))


def _part_sizes(layer, name: str) -> list[int]:
    if name == "attn.qkv":
        return [layer.attn.q_size, layer.attn.kv_size, layer.attn.kv_size]
    out = layer.get_submodule(name).out_features
    return [out // 2] * 2 if name.endswith("gate_up") else [out]


def _rank_share(layer, cfg, proj: str) -> tuple[str, slice]:
    """The slice of a projection's LoRA this rank holds, as it holds the base weight's: B's
    rows ("out") of a column-parallel projection (its heads, its intermediate rows), A's
    columns ("in") of a row-parallel one (its partial delta joins the all-reduce that sums the
    base outputs). All of it without tensor parallelism; an expert's whole rows where its rank
    holds whole experts (expert parallelism)."""
    tp, d = layer.attn.tp, cfg.head_dim
    owner, _, base = proj.rpartition(".")
    if owner:
        shared = owner == "shared_expert"
        rows = cfg.shared_expert_size if shared else cfg.expert_intermediate_size
        sl = slice(None) if tp.expert_parallel and not shared else \
            slice(*split_range(rows, tp.size, tp.rank))
        return ("in", sl) if base == "down_proj" else ("out", sl)
    share = tp.heads(cfg.num_heads, cfg.num_kv_heads)
    q = slice(share.q_start * d, (share.q_start + share.num_q) * d)
    kv = slice(share.kv_start * d, (share.kv_start + share.num_kv) * d)
    mlp = slice(*split_range(cfg.intermediate_size, tp.size, tp.rank))
    return {"q_proj": ("out", q), "k_proj": ("out", kv), "v_proj": ("out", kv),
            "o_proj": ("in", q), "gate_proj": ("out", mlp), "up_proj": ("out", mlp),
            "down_proj": ("in", mlp)}[proj]


def load_weights(file: AdapterFile, model) -> Weights:
    """An adapter's checked tensors (lora_files.read_adapter) in the fused layout, in the
    file's dtype where every tensor of a linear shares one the kernels read, else float32;
    float32 ones in the model's dtype where that is narrower (vLLM's lora_dtype auto). An
    expert another rank holds (expert parallelism) is left out."""
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(file.path, WEIGHTS))
    linears: dict[tuple[int, str], list] = {}
    for (i, proj), (a, b) in _pairs(file, tensors, model.cfg).items():
        name, j = _linear_of(proj, model.layers[i])
        linears.setdefault((i, name), []).append((j, proj, a, b))
    orders = gpt_row_orders(model.cfg)
    out: Weights = {}
    for (i, name), present in sorted(linears.items()):
        layer = model.layers[i]
        try:
            linear = layer.get_submodule(name)
        except AttributeError:                       # another rank's expert
            continue
        parts = _projections(sorted(present, key=lambda part: part[:2]), model.cfg,
                             orders.get(f"layers.{i}.attn.qkv"))
        out[linear.lora_slot] = _fused(layer, model.cfg, name, parts, file.scale,
                                       model.embed.weight.device, model.embed.weight.dtype)
    return out


def _pairs(file: AdapterFile, tensors: dict, cfg) -> dict[tuple[int, str], tuple]:
    """(layer, projection) -> its (A, B); gpt-oss's expert stacks (lora_names.py's
    experts.gate_up / experts.down) split into each expert's gate, up and down: expert e's A
    is rows e r .. (e + 1) r of the stack's, its B columns e, e + E, ... (PEFT's layouts), and
    gate_up's rows interleave gate (even) and up (odd) as the stacked weight's columns do."""
    out = {}
    for (i, proj), module in file.modules.items():
        a, b = tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"]
        if proj not in lora_names.STACKS:
            out[(i, proj)] = (a, b)
            continue
        count = cfg.num_experts
        for e in range(count):
            a_e, b_e = a[e * file.rank:(e + 1) * file.rank], b[:, e::count].contiguous()
            if proj == "experts.down":
                out[(i, f"experts.{e}.down_proj")] = (a_e, b_e)
            else:
                out[(i, f"experts.{e}.gate_proj")] = (a_e, b_e[0::2])
                out[(i, f"experts.{e}.up_proj")] = (a_e, b_e[1::2])
    return out


def _projections(present, cfg, rows: torch.Tensor | None) -> list[tuple]:
    """(index in the linear, projection, A, B) of each projection an adapter holds in one
    Linear, B's rows in the order the base weight's take at load (`rows`, the layer's q/k/v
    order, models/gpt_weights.py: GPT-NeoX's head by head fused rows, GPT-J's rotate-half q
    and k; None: as stored), a fused q/k/v adapter's split into its q, k and v parts (each
    with the one A)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    bounds = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    out = []
    for j, p, a, b in present:
        if p == "qkv_proj":
            b = b if rows is None else b[rows]
            out += [(k, part, a, b[lo:hi]) for k, (part, (lo, hi)) in enumerate(bounds.items())]
            continue
        if rows is not None and p in bounds:            # the rows stay within their part
            lo, hi = bounds[p]
            b = b[rows[lo:hi] - lo]
        out.append((j, p, a, b))
    return out


def _fused(layer, cfg, name: str, parts, scale: float,
           dev: torch.device, model_dtype: torch.dtype) -> LoraWeights:
    """The LoraWeights of one fused linear: each present projection's A rows (this rank's
    share) and its B^T block at the projection's output columns. `parts`: _projections'."""
    sizes = _part_sizes(layer, name)
    a_parts, blocks = [], []
    for j, p, a, b in parts:
        side, sl = _rank_share(layer, cfg, p)
        a_parts.append(a[:, sl] if side == "in" else a)
        blocks.append((sum(sizes[:j]), (b[sl] if side == "out" else b).T))
    dtypes = {t.dtype for t in a_parts} | {b.dtype for _, b in blocks}
    dtype = dtypes.pop() if len(dtypes) == 1 and next(iter(dtypes)) in KINDS else torch.float32
    if dtype == torch.float32 and model_dtype != torch.float32:
        dtype = model_dtype     # as narrow as the base weights: half the bytes a step reads
    return LoraWeights(torch.cat(a_parts).to(dev, dtype),
                       [(col, b.to(dev, dtype)) for col, b in blocks], scale, sum(sizes))


class Loaded:
    """One load of an adapter: its weights and their table for the native kernels.
    `generation` is this load's alone (a reload of the same adapter gets a new one)."""

    def __init__(self, weights: Weights, num_slots: int, generation: int,
                 host_memory: bool = True, first_expert_slot: int | None = None):
        """host_memory: the weights are host memory (the backend's capabilities say so);
        `adapts_experts`: it holds weights of a slot from first_expert_slot on."""
        self.weights, self.generation = weights, generation
        self.adapts_experts = first_expert_slot is not None and \
            any(slot >= first_expert_slot for slot in weights)
        # One mapping on huge pages for the adapter's A and B^T: a decode step reads them
        # all, in short runs between the base linears' products (huge_pages.py).
        self.arena = huge_pages.move([t for lw in weights.values() for t in (lw.a, lw.bt)]) \
            if host_memory else None
        self.table = torch.zeros(num_slots, ENTRY, dtype=torch.int64)    # kernels/lora.py
        for slot, lw in weights.items():
            self.table[slot] = torch.tensor(lw.entry())


class Adapters:
    """The loaded adapters by load id, least recently used first, the stacked weights of the
    last KEPT_STACKS adapter sets steps used (by their loads' generations in order), and the
    last step's LoraBatch."""

    def __init__(self, model, info, max_rank: int, capacity: int):
        self.model, self.info, self.max_rank, self.capacity = model, info, max_rank, capacity
        self.num_slots = lora_slots.num_slots(model.cfg)
        self.loaded: OrderedDict[int, Loaded] = OrderedDict()
        self.stacks: OrderedDict[tuple[int, ...], Stacks] = OrderedDict()
        self.generations = itertools.count()
        self.last: tuple[tuple, LoraBatch] | None = None

    def batch(self, spans: list[tuple[int, int, LoraRef]], num_rows: int,
              device: torch.device) -> LoraBatch:
        """The LoraBatch of a step whose rows [row, row + n) are adapter ref's, for each
        (row, n, ref) in `spans`; the rest are the base model's. A step laid out as the last
        one, with the same loads (every step of a decode stream), gets the last one's."""
        index: dict[int, int] = {}                   # load id -> index in the step's adapters
        adapters = []
        for _, _, ref in spans:
            if ref.id not in index:
                index[ref.id] = len(adapters)
                adapters.append(self.get(ref))
        key = (num_rows, tuple((row, n, adapters[index[ref.id]].generation)
                               for row, n, ref in spans))
        if self.last is not None and self.last[0] == key:
            return self.last[1]
        of_row = np.full(num_rows, -1, dtype=np.int64)
        for row, n, ref in spans:
            of_row[row:row + n] = index[ref.id]
        batch = LoraBatch(torch.from_numpy(of_row).to(device), adapters,
                          self.stacks_for(adapters))
        self.last = (key, batch)
        return batch

    def get(self, ref: LoraRef) -> Loaded:
        """The adapter, loaded now if need be. A step uses at most max_loras <= capacity
        adapters, each touched as its rows are laid out, so none it uses is evicted."""
        adapter = self.loaded.pop(ref.id, None)
        if adapter is None:
            file = read_adapter(ref.path, self.info, self.max_rank)
            adapter = Loaded(load_weights(file, self.model),
                             self.num_slots, next(self.generations),
                             self.model.ops.capabilities.host_memory,
                             lora_slots.num_dense_slots(len(self.model.layers)))
            while len(self.loaded) >= self.capacity:
                gone = self.loaded.popitem(last=False)[1].generation
                self.last = None             # the last batch may hold it: let it go too
                self.stacks = OrderedDict((key, stacks) for key, stacks in self.stacks.items()
                                          if gone not in key)     # its memory goes with it
        self.loaded[ref.id] = adapter
        return adapter

    def stacks_for(self, adapters: list[Loaded]) -> Stacks:
        """The stacked weights (LoraBatch.dense) of a step using these loads in this order:
        those of the last step that did, else a new (empty) set, the least recent dropped."""
        key = tuple(a.generation for a in adapters)
        stacks = self.stacks.pop(key, None)
        if stacks is None:
            stacks = {}
            while len(self.stacks) >= KEPT_STACKS:
                self.stacks.popitem(last=False)
        self.stacks[key] = stacks
        return stacks


class LoraBatch:
    """A step's rows and their adapters, as every backend's lora_delta op takes them:
    adapter_of_row [T] (an index into the step's adapters, -1: the base model), their tables
    stacked [A, slots, 3], their weights, and (the torch reference's) each adapter's rows.
    `stacks`: where dense() keeps what it stacks (Adapters.stacks_for: shared with the steps
    that use the same adapters in the same order); None: this step's own."""

    def __init__(self, adapter_of_row: torch.Tensor, adapters: list[Loaded],
                 stacks: Stacks | None = None):
        self.adapter_of_row = adapter_of_row
        self.adapters = adapters                     # kept alive while the tables point at them
        self.table = torch.stack([a.table for a in adapters])
        self.weights = [a.weights for a in adapters]
        self._dense = {} if stacks is None else stacks
        # a mixture's experts are adapted: the backend's moe adds each row's delta to its
        # experts' products (csrc/moe.cpp, in the per-op path and the fused decode stack
        # alike; torch's grouping elsewhere); not in a CUDA graph, whose MoE knows none
        self.adapts_experts = any(a.adapts_experts for a in adapters)

    def subset(self, rows: torch.Tensor) -> "LoraBatch":
        """This batch for some of its rows (an expert's tokens, in `rows`' order): the same
        adapters, tables and stacked weights."""
        sub = object.__new__(LoraBatch)
        sub.__dict__.update({k: v for k, v in self.__dict__.items() if k != "rows"})
        sub.adapter_of_row = self.adapter_of_row[rows]
        return sub

    def dense(self, slot: int):
        """Linear `slot`'s weights of the step's adapters stacked for one launch
        (kernels/lora.py stacked_dense), made once for as long as `stacks` is kept."""
        if slot not in self._dense:
            self._dense[slot] = stacked_dense(self.weights, slot)
        return self._dense[slot]

    @functools.cached_property
    def rows(self) -> list[torch.Tensor]:
        """Each adapter's rows: only the paths that gather rows per adapter ask."""
        return [(self.adapter_of_row == i).nonzero().squeeze(1)
                for i in range(len(self.adapters))]
