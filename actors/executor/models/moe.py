"""A mixture-of-experts MLP: a router picks `experts_per_token` of `num_experts` expert MLPs
per token and sums their outputs weighted by its probabilities (Mixtral, Qwen2/3-MoE, OLMoE).
Each expert is a gated MLP with Linears of its own, so every weight layout the dense MLP has
(stored blocks, BF16 tiles, packed dense) serves experts unchanged; the layer program's MOE
op (program.py) runs the routing and the chosen experts through the backend (ops.moe).

Under tensor parallelism every rank holds every expert's slice of the intermediate rows, as
the dense MLP's (plain TP); with expert parallelism (`expert_parallel`) each rank holds whole
experts, a contiguous range of them. Either way each rank's output is a float32 partial and
the layer program's ALL_REDUCE sums it.
"""
from __future__ import annotations

from torch import nn

from pagewire.kernels.linear import Linear

from ..parallel import TensorParallel, local_experts, split_range
from .lora_slots import expert_lora_slots


class Expert(nn.Module):
    """One gated MLP: gate/up column-parallel, down row-parallel over `inter` rows; with
    biases (gpt-oss) on both."""

    def __init__(self, hidden: int, inter: int, float_partial: bool, bias: bool = False,
                 lora_slots: tuple[int, int] = (-1, -1)):
        super().__init__()
        self.gate_up = Linear(hidden, 2 * inter, bias=bias, lora_slot=lora_slots[0])
        self.down = Linear(inter, hidden, bias=bias, float_partial=float_partial,
                           lora_slot=lora_slots[1])


class SparseMoE(nn.Module):
    """The router (replicated on every rank), this rank's experts by global index
    (`experts["5"]`), and Qwen2-MoE's gated shared expert. `top_k`, `normalize` and
    `num_experts` are the routing's settings (kernels/moe.py route). The router and the
    shared expert's gate are plain torch Linears, never packed or quantized: their float32
    products (kernels/moe.py) read the weights as loaded. `native_spec`: the native kernels'
    description of the block (kernels/moe.py native_spec), which the backend's prepare sets
    where they run it. `reads`: an int64 [1] counter (a view of the model's expert_reads)
    every path adds the experts a call's tokens chose to, each once (all of them, whichever
    rank holds them), or None. gpt-oss's options (model_config.py): biases on the router and
    the experts, `topk_then_softmax` routing, the experts' `activation` (name, alpha, limit)."""

    native_spec = None
    reads = None

    def __init__(self, cfg, tp: TensorParallel, layer: int = 0):
        super().__init__()
        partial = tp.size > 1
        self.num_experts, self.top_k = cfg.num_experts, cfg.experts_per_token
        self.normalize, self.float_partial = cfg.normalize_top_k, partial
        self.topk_then_softmax = cfg.topk_then_softmax
        self.activation = (cfg.expert_activation, cfg.swiglu_alpha, cfg.swiglu_limit)
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.moe_bias)
        inter = cfg.expert_intermediate_size if tp.expert_parallel else \
            _share(cfg.expert_intermediate_size, tp)
        self.experts = nn.ModuleDict({str(e): Expert(cfg.hidden_size, inter, partial,
                                                     cfg.moe_bias, expert_lora_slots(cfg, layer, e))
                                      for e in local_experts(cfg.num_experts, tp)})
        self.shared = self.shared_gate = None
        if cfg.shared_expert_size:
            self.shared = Expert(cfg.hidden_size, _share(cfg.shared_expert_size, tp), partial,
                                 lora_slots=expert_lora_slots(cfg, layer, cfg.num_experts))
            self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False)


def _share(rows: int, tp: TensorParallel) -> int:
    start, end = split_range(rows, tp.size, tp.rank)
    return end - start


def describe_experts(model) -> str:
    """The start-up log's account of a mixture: its experts, how many a token reads, and the
    bytes of experts' tiles a decode token streams of those held (this rank's)."""
    cfg = model.cfg
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    held = sum(linear.quantized.nbytes for b in blocks for e in b.experts.values()
               for linear in (e.gate_up, e.down) if linear.quantized is not None)
    per_token = held * cfg.experts_per_token / cfg.num_experts
    native = sum(b.native_spec is not None for b in blocks)
    return (f"mixture of experts: {cfg.num_experts} experts, {cfg.experts_per_token} a token, "
            f"in {len(blocks)} of {cfg.num_layers} layers; a token reads ~{per_token / 2**30:.2f} "
            f"GiB of the experts' {held / 2**30:.2f} GiB of tiles; {native} blocks native")
