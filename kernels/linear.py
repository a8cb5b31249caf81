"""Linear layers: the weight path every projection goes through.

`Linear` is the model's projection. On CPU, pack() reorders its weight once into oneDNN's
blocked layout (bf16 runs on AMX/AVX512-BF16), so each call skips the per-call reorder
torch.nn.functional.linear pays: 1.5-2.5x faster at decode batch sizes on this machine.

A quantized weight plugs in beside it: use_quantized() gives the Linear a QuantWeight
(kernels/quant.py), which serves steps of up to `max_tokens` tokens; larger ones keep using
the float weight, where arithmetic rather than bytes read bounds the matmul.

On a CPU without a bfloat16 dot product (AVX2, AVX-512 before BF16) oneDNN packs no bfloat16
weight and torch's bfloat16 matmul is emulated (below 1 GFLOP/s): pack(upcast=True) keeps a
bfloat16 model's dense weight in float32 and multiplies in float32, rounding the output back.

A row-parallel projection under tensor parallelism (`float_partial=True`) returns its partial
sum in float32, unrounded, whatever the activations' dtype: the ranks' partials are summed in
float32 and rounded once (parallel.TensorParallel.all_reduce), as one rank's output is. Summing
bfloat16 partials rounded each rank's share and then their sum, and changed greedy answers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import quant


class Linear(nn.Linear):
    """nn.Linear that can be packed for the CPU. Its parameters keep nn.Linear's names, so
    state dicts load unchanged; after pack() the float weight is dropped."""

    packed: torch.Tensor | None = None
    packed_bias: torch.Tensor | None = None
    quantized: quant.QuantWeight | None = None
    quantized_max_tokens: int = 0
    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 float_partial: bool = False, lora_slot: int = -1):
        super().__init__(in_features, out_features, bias=bias)
        self.float_partial = float_partial    # forward returns float32 (see the module doc)
        # Its row in a step's LoRA table (executor/lora.py), given by the model; -1: none.
        self.lora_slot = lora_slot

    def pack(self, batch_hint: int = 64, upcast: bool = False) -> None:
        """upcast: multiply in float32 whatever the weight's dtype. Nothing to pack after
        drop_float(). A host-memory weight's: only the native CPU backend's prepare packs
        (its Capabilities.native_weights)."""
        if self.weight is None or not torch.backends.mkldnn.is_available():
            return
        weight = self.weight.detach()
        bias = None if self.bias is None else self.bias.detach()    # a tensor, not a Parameter
        if (upcast or self.float_partial) and weight.dtype != torch.float32:
            weight, bias = weight.float(), None if bias is None else bias.float()
        self.packed_bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.weight = None   # the packed copy is the only one kept

    def use_quantized(self, weight: quant.QuantWeight, max_tokens: int) -> None:
        if (weight.rows, weight.cols) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight [{weight.rows}, {weight.cols}] does not fit "
                             f"Linear({self.in_features}, {self.out_features})")
        self.quantized, self.quantized_max_tokens = weight, max_tokens

    def drop_float(self) -> None:
        """Keep only the quantized weight: every step multiplies it (use_quantized's
        max_tokens must cover them all)."""
        self.weight, self.packed, self.packed_bias = None, None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and x.shape[0] <= self.quantized_max_tokens:
            # float32 activations give float32 sums: a float partial stays unrounded
            out = quant.matmul(x.float() if self.float_partial else x, self.quantized)
            return out if self.bias is None else out.add_(self.bias)
        if self.packed is not None:       # packed in float32 for a float partial (pack())
            dtype = self.packed.dtype
            out = torch.ops.mkldnn._linear_pointwise(x.to(dtype), self.packed, self.packed_bias,
                                                     "none", [], "")
            return out if self.float_partial else out.to(x.dtype)
        if self.float_partial:
            return _float_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        extra = ", packed" if self.packed is not None else ""
        if self.quantized is not None:
            extra += f", quantized up to {self.quantized_max_tokens} tokens"
        return super().extra_repr() + extra


def _float_linear(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """x @ weight^T (+ bias) in float32 without rounding the products' sums: on CUDA the GEMM
    writes its float32 accumulators (mm's out_dtype); elsewhere both operands are widened
    (exact for bfloat16 and float16 values)."""
    if x.is_cuda:
        out = torch.mm(x, weight.t(), out_dtype=torch.float32)
    else:
        out = F.linear(x.float(), weight.float())
    return out if bias is None else out.add_(bias)


def pack_linears(model: nn.Module, upcast: bool = False) -> int:
    """Pack every Linear of a CPU model in place (float32 if `upcast`) but those that
    dropped their float weight; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack(upcast=upcast)
            count += module.packed is not None
    return count
