"""Tensor parallelism, Megatron style: which share of each weight a rank holds, and the
collectives that put the shares back together.

- QKV and gate/up are column-parallel: a rank holds some attention heads (its KV heads and the
  query heads that read them) and a slice of the MLP's intermediate rows.
- o_proj and down are row-parallel: each rank's partial output is summed by an all-reduce.
- The embedding and the LM head are vocab-parallel: a rank holds a range of vocabulary rows;
  embedding rows outside the range read as zero before the all-reduce, and the logits are
  gathered.

Shares need not be equal (SmolLM2 has 9 query and 3 KV heads): a rank's KV heads are a
contiguous range, the first `n % size` ranks taking one more, and its query heads are exactly
the groups of those KV heads. With fewer KV heads than ranks, each KV head is replicated over
`size / num_kv_heads` ranks, which split its query group between them.
"""
from __future__ import annotations

import datetime
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pagewire.kernels.ops import collective_library


def split_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's share of n items; the first n % size ranks get one more."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def local_experts(num_experts: int, tp: "TensorParallel") -> range:
    """The experts of a mixture a rank holds: all of them (tensor parallel: a slice of each)
    or, with expert parallelism, its contiguous share of them, whole."""
    return range(*split_range(num_experts, tp.size, tp.rank)) if tp.expert_parallel \
        else range(num_experts)


@dataclass(frozen=True)
class HeadShare:
    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


@dataclass
class TensorParallel:
    """This rank's place in the group. size 1 (the default) makes every collective a no-op."""
    rank: int = 0
    size: int = 1
    group: Any = None
    expert_parallel: bool = False     # ranks hold whole experts (models/moe.py), not slices

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShare:
        """The query and KV heads this rank holds (see the module docstring)."""
        group = num_heads // num_kv_heads
        if num_kv_heads >= self.size:
            kv_start, kv_end = split_range(num_kv_heads, self.size, self.rank)
            return HeadShare(kv_start * group, (kv_end - kv_start) * group, kv_start,
                             kv_end - kv_start)
        replicas = self.size // num_kv_heads
        if self.size % num_kv_heads or group % replicas:
            raise ValueError(f"{num_heads} query / {num_kv_heads} KV heads cannot be split over "
                             f"{self.size} ranks: with fewer KV heads than ranks, the rank count "
                             "must be a multiple of the KV heads and divide each query group")
        kv = self.rank // replicas
        per = group // replicas
        return HeadShare(kv * group + (self.rank % replicas) * per, per, kv, 1)

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        return split_range(vocab_size, self.size, self.rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def smallest(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise minimum of every rank's x, in place."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        return x

    def embed(self, embedding, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Vocab-parallel lookup: embedding.weight [V_local, H] (or, one rank, an embedding
        that looks its rows up itself: block_embedding.py), ids [T] -> [T, H] on every rank."""
        weight = embedding.weight
        if self.size == 1:
            lookup = getattr(embedding, "lookup", None)
            return lookup(ids) if lookup is not None else F.embedding(ids, weight)
        start, end = self.vocab(vocab_size)
        local = ids - start
        inside = (local >= 0) & (local < end - start)
        x = F.embedding(local.clamp(0, end - start - 1), weight) * inside[:, None].to(weight.dtype)
        return self.all_reduce(x)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[S, V_local] on each rank -> [S, V] on every rank."""
        if self.size == 1:
            return logits
        width = -(-vocab_size // self.size)           # all_gather wants equal shapes: pad
        padded = F.pad(logits, (0, width - logits.shape[1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        sizes = [e - s for s, e in (split_range(vocab_size, self.size, r) for r in range(self.size))]
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, 0, group=self.group)
        return x


@dataclass
class ContextParallel:
    """This rank's place among the ranks that split a KV head's tokens (context parallelism:
    kernels/context_parallel.py)."""
    rank: int
    size: int
    group: Any = None

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[S, *x.shape]: every rank's x, by rank (float32 on the wire)."""
        parts = [torch.empty(x.shape, dtype=torch.float32, device=x.device)
                 for _ in range(self.size)]
        dist.all_gather(parts, x.float().contiguous(), group=self.group)
        return torch.stack(parts)


def context_groups(tp: TensorParallel, size: int) -> ContextParallel:
    """This rank's context-parallel group: `size` consecutive ranks, which hold one KV head
    (its replicas under tensor parallelism are consecutive ranks) and consecutive query heads.
    Every rank creates every group, in one order, as torch.distributed requires."""
    mine = None
    for start in range(0, tp.size, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if tp.rank in ranks:
            mine = ContextParallel(tp.rank - start, size, group)
    return mine


def init_group(address: str, rank: int, size: int, timeout: float,
               device: torch.device) -> TensorParallel:
    """Join the gloo (CPU) or NCCL (CUDA) group at tcp://host:port (rank 0 hosts its store),
    as the executors' `device` decides. A collective that waits longer than `timeout`
    seconds raises instead of hanging."""
    host = address.removeprefix("tcp://").rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(collective_library(device), init_method=address, rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=timeout))
    return TensorParallel(rank, size, dist.group.WORLD)


@dataclass(frozen=True)
class Shares:
    """The slices of each fused weight (names as LlamaForCausalLM.fuse_weights makes them)
    that one rank holds: the one place that decides a rank's rows and columns, for float
    weights and for quantized blocks alike."""
    q: slice           # query rows of qkv, and columns of o_proj
    kv: slice          # rows of k and of v in qkv
    sizes: tuple[int, int, int]     # qkv's q, k, v rows
    inter: slice       # rows of gate and of up, columns of down
    vocab: slice       # rows of the embedding and the LM head
    experts: range     # the experts a rank holds (all but with expert parallel)
    expert_inter: slice  # an expert's rows it holds (all of them with expert parallel)
    shared_inter: slice  # the shared expert's rows it holds
    first: bool        # rank 0: the one that adds a row-parallel linear's bias
    heads: slice       # its query heads (gpt-oss's attention sinks)
    whole_experts: bool  # expert parallel: each expert's down bias is its one holder's
    flat_qk_norms: bool  # q/k norm weights span every head (OLMoE): sliced as q and kv rows

    @classmethod
    def of(cls, cfg, tp: TensorParallel) -> "Shares":
        heads = tp.heads(cfg.num_heads, cfg.num_kv_heads)
        d = cfg.head_dim
        inter = cfg.expert_intermediate_size
        return cls(slice(heads.q_start * d, (heads.q_start + heads.num_q) * d),
                   slice(heads.kv_start * d, (heads.kv_start + heads.num_kv) * d),
                   (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d),
                   slice(*split_range(cfg.intermediate_size, tp.size, tp.rank)),
                   slice(*tp.vocab(cfg.vocab_size)),
                   local_experts(cfg.num_experts, tp),
                   slice(0, inter) if tp.expert_parallel else
                   slice(*split_range(inter, tp.size, tp.rank)),
                   slice(*split_range(cfg.shared_expert_size, tp.size, tp.rank)),
                   tp.rank == 0, slice(heads.q_start, heads.q_start + heads.num_q),
                   tp.expert_parallel, cfg.qk_norm_flat)

    def take(self, name: str, w: torch.Tensor, columns=None) -> torch.Tensor | None:
        """w's share: rows sliced here, columns (row-parallel weights) by `columns(w, cols)`
        (default w[:, cols]), which may answer None: w cannot be cut there (or, an expert
        another rank holds, is none of this rank's)."""
        if ".experts." in name or ".shared." in name:
            return self._expert_share(name, w, columns)
        if name.endswith("attn.sinks"):
            return w[self.heads]
        if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
            qw, kw, vw = w.split(list(self.sizes))
            return torch.cat([qw[self.q], kw[self.kv], vw[self.kv]])
        if name.endswith("mlp.gate_up.weight"):
            gate, up = w.chunk(2)
            return torch.cat([gate[self.inter], up[self.inter]])
        if name.endswith(("mlp.up.weight", "mlp.up.bias")):         # the GPT family's plain MLP
            return w[self.inter]
        if self.flat_qk_norms and name.endswith(("attn.q_norm.weight", "attn.k_norm.weight")):
            return w[self.q if ".q_norm." in name else self.kv]     # OLMoE's: every head's
        if name.endswith(("attn.o_proj.bias", "mlp.down.bias")):   # the GPT family's: added
            return w if self.first else torch.zeros_like(w)          # once, by rank 0
        row_parallel = {"attn.o_proj.weight": self.q, "mlp.down.weight": self.inter}
        for suffix, cols in row_parallel.items():
            if name.endswith(suffix):
                return w[:, cols] if columns is None else columns(w, cols)
        if name in ("embed.weight", "lm_head.weight", "lm_head.bias"):
            return w[self.vocab]
        return w

    def _expert_share(self, name: str, w: torch.Tensor, columns) -> torch.Tensor | None:
        """An expert's gate_up rows and down columns of this rank's intermediate slice (the
        shared expert's likewise); None for an expert another rank holds. gpt-oss's biases:
        gate_up's rows alike; down's added once, by its expert's one holder (expert
        parallel) or rank 0."""
        inter = self.shared_inter
        if ".experts." in name:
            if int(name.split(".experts.")[1].split(".")[0]) not in self.experts:
                return None
            inter = self.expert_inter
        if name.endswith(("gate_up.weight", "gate_up.bias")):
            gate, up = w.chunk(2)
            return torch.cat([gate[inter], up[inter]])
        if name.endswith("down.bias"):
            return w if self.whole_experts or self.first else torch.zeros_like(w)
        return w[:, inter] if columns is None else columns(w, inter)


def shard_state(state: dict[str, torch.Tensor], cfg, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's share of a fused state dict. Shares are copies, so the full tensors can be
    freed."""
    if tp.size == 1:
        return state
    shares = Shares.of(cfg, tp)
    out = {name: share.clone() for name, w in state.items()
           if (share := shares.take(name, w)) is not None}
    if "embed.weight" in state and state.get("lm_head.weight") is state["embed.weight"]:
        out["lm_head.weight"] = out["embed.weight"]          # tied: one copy
    return out


def shard_blocks(blocks: dict[str, tuple[int, torch.Tensor]], cfg, tp: TensorParallel,
                 block_bytes) -> dict[str, tuple[int, torch.Tensor]]:
    """This rank's share of each Linear's GGML blocks ({module name: (type, uint8 rows of
    32-weight blocks)}; `block_bytes(type)`: a block's size). Rows split as the float
    weights do; a row-parallel weight's columns only on block boundaries: one whose share
    starts or ends inside a block is left out (its float share serves it)."""
    if tp.size == 1:
        return blocks
    shares, out = Shares.of(cfg, tp), {}
    for name, (ggml_type, raw) in blocks.items():
        cut = functools.partial(_whole_blocks, block_bytes(ggml_type))
        share = shares.take(name + ".weight", raw, cut)
        if share is not None:
            out[name] = (ggml_type, share.contiguous())
    return out


def shard_rows(segments: list[tuple[int, torch.Tensor]], name: str, cfg,
               tp: TensorParallel) -> list[tuple[int, torch.Tensor]] | None:
    """This rank's rows of a column-parallel Linear (qkv, gate_up) held as row segments of
    blocks of one type each (Q4_K_M's qkv: Q4_K q and k rows, Q6_K v rows): the rows its
    float share takes, each from its segment, in order, runs of one type joined. Columns
    are not cut, so a column order (GPTQ act-order) holds for the share too. None for a
    row-parallel Linear (its columns would be cut)."""
    if not name.endswith(("attn.qkv", "gate_up")):
        return None
    total = sum(raw.shape[0] for _, raw in segments)
    rows = Shares.of(cfg, tp).take(name + ".weight", torch.arange(total)[:, None])
    if rows is None:                                     # an expert another rank holds
        return None
    rows = rows[:, 0]
    out: list[tuple[int, torch.Tensor]] = []
    start = 0
    for ggml_type, raw in segments:
        mine = rows[(rows >= start) & (rows < start + raw.shape[0])] - start
        start += raw.shape[0]
        if not mine.numel():
            continue
        share = raw[mine]
        if out and out[-1][0] == ggml_type:
            share = torch.cat([out.pop()[1], share])
        out.append((ggml_type, share.contiguous()))
    return out


def _whole_blocks(size: int, raw: torch.Tensor, cols: slice) -> torch.Tensor | None:
    """Columns [cols) of rows of `size`-byte 32-weight blocks, or None off block bounds."""
    if cols.start % 32 or cols.stop % 32:
        return None
    return raw[:, cols.start // 32 * size:cols.stop // 32 * size]
