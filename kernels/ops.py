"""The one dispatch point: which backend (kernel set) a model runs, chosen once per process.

    ops = select_ops(device, "auto")   # torch | cpu | avx2 | avx512 | avx512_bf16 | triton
    ops.attention(q, k, v, kv_cache, batch, scale)

TorchOps is plain torch on any device: the reference every other backend is tested against.
CpuOps runs one instruction-set tier's native kernels (kernels/tiers.py, kernels/native.py):
"cpu" (and "auto" on a CPU) is the best tier this CPU runs, a tier's name forces that tier
(any tier up to the CPU's own). TritonOps runs the Triton kernels, on CUDA. Every backend
has the same methods and contracts; `backend` names it for logs and metrics.

Only the backend's modules (this one, tiers.py, native.py, triton_ops.py) name a tier, a
device type or a backend. Everything else, the executor's backend.py (which lays a model out
for the kernels) included, asks the kernel set's `capabilities` (Capabilities below);
tests/kernels/test_backend_boundary.py holds the code to that.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import activation, attention, cascade, kv_quant, moe, native, norm, quant, rotary
from . import token_sampling
from . import tiers
from . import lora as lora_kernels
from .encoder_attention import encoder_attention


_PLAIN = attention.PLAIN


@dataclass(frozen=True)
class Capabilities:
    """What a backend on its device does, for the code that prepares and runs a model there.
    Each field is a decision that used to be spelled as a tier, device or backend name."""
    host_memory: bool = True        # its tensors are host memory: pools may lie on huge pages
    native_weights: bool = False    # lays linears out for the native CPU kernels (prepare):
    #                                 blocks as stored, BF16 tiles, oneDNN-packed dense weights
    bf16_dot: bool = False          # multiplies bfloat16 in hardware (else dense weights of a
    #                                 bfloat16 model are packed as float32)
    block_kinds: frozenset = frozenset()   # packed weight kinds (quant.KINDS) it multiplies
    int16_large_steps: bool = False   # int16 blocks may serve large steps too, where the core's
    #                                   int16 GEMM outruns oneDNN (quant.blocks_serve_large_steps)
    int8_large_steps: bool = False    # int8 blocks serve large steps too: its library's VNNI GEMM
    #                                   outruns oneDNN's bfloat16 (csrc/quant_gemm_vnni.h)
    fused_decode: bool = False      # runs a decode step's every layer in one native call
    graphs: bool = False            # replays decode steps as CUDA graphs
    lora_in_graphs: bool = False    # takes LoRA inputs as static graph buffers (GraphLora)


def _on_host(device: torch.device | None) -> bool:
    return device is None or device.type == "cpu"


class TorchOps:
    name = backend = "torch"
    lib = None                          # the native library, for backends that have one
    cascade_thresholds = cascade.CPU_THRESHOLDS     # (rows, tokens): when a cascade pays

    def __init__(self, device: torch.device | None = None):
        """device: where it runs (None: the CPU); a GPU's steps may be graphs."""
        host = _on_host(device)
        self.capabilities = Capabilities(host_memory=host, bf16_dot=not host, graphs=not host)

    def linear(self, linear, x):
        """x @ W^T (+ bias) through the layout prepare gave the Linear (kernels/linear.py):
        its blocks or tiles for steps up to its `quantized_max_tokens`, else its packed or
        plain float weight."""
        return linear.forward(x)

    def sample(self, logits, params, uniforms):
        """kernels/token_sampling.py sample(): one token a row, native where the backend has it."""
        return token_sampling.sample(logits, params, uniforms, self.lib)

    def add_rms_norm(self, x, residual, weight, eps):
        return norm.add_rms_norm(x, residual, weight, eps)

    def add_layer_norm(self, x, residual, weight, bias, eps):
        """As add_rms_norm with the GPT family's LayerNorm (weight and bias)."""
        return norm.add_layer_norm(x, residual, weight, bias, eps)

    def gelu(self, x, approximate: str):
        """GELU of the GPT family's plain MLP: exact ("none") or tanh's approximation."""
        return torch.nn.functional.gelu(x, approximate=approximate)

    def split_qkv_rope(self, qkv, num_heads, num_kv_heads, head_dim, table, positions):
        """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k, v [T, Hkv, D], q and k rotated."""
        t = qkv.shape[0]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        cos_sin = table[positions].to(qkv.dtype)                       # [T, D]
        return (rotary.apply_rope(q.view(t, num_heads, head_dim), cos_sin),
                rotary.apply_rope(k.view(t, num_kv_heads, head_dim), cos_sin),
                v.view(t, num_kv_heads, head_dim))

    def rms_norm_heads_(self, qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps):
        """RMSNorm of each query and key head of qkv [T, (Hq + 2 Hkv) D], in place (rope then
        rotates them); the values are left alone."""
        t = qkv.shape[0]
        heads = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(t, -1, head_dim)
        q, k = heads[:, :num_heads], heads[:, num_heads:]
        q.copy_(norm.rms_norm(q, q_weight, eps))
        k.copy_(norm.rms_norm(k, k_weight, eps))

    def rms_norm_flat_qk_(self, qkv, q_size, kv_size, q_weight, k_weight, eps):
        """RMSNorm of qkv's query heads as one vector and of its key heads as another
        (OLMoE's norms), in place; the values are left alone."""
        q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
        q.copy_(norm.rms_norm(q, q_weight, eps))
        k.copy_(norm.rms_norm(k, k_weight, eps))

    def moe(self, sparse, x, lora=None):
        """kernels/moe.py sparse_mlp: x [T, H] through the experts its router picks; `lora`:
        the rows' adapters (executor/lora.py LoraBatch) where they adapt experts, else None."""
        return moe.sparse_mlp(self, sparse, x, lora)

    def moe_in_graphs(self, sparse, dtype) -> bool:
        """Whether `moe` runs this block without reading its routing on the host, as a CUDA
        graph's capture needs: not torch's grouping (it loops over the experts chosen)."""
        return False

    def silu_and_mul(self, gate_up):
        return activation.silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up):
        return activation.gelu_tanh_and_mul(gate_up)

    def split_qkv_partial_rope(self, qkv, num_heads, num_kv_heads, head_dim, rotary_dim, table,
                               positions):
        """As split_qkv_rope on the first rotary_dim columns of each head (0: none)."""
        return rotary.partial_rope(qkv, num_heads, num_kv_heads, head_dim, rotary_dim, table,
                                   positions)

    def attention(self, q, k, v, kv_cache, batch, scale, variant=attention.PLAIN):
        """`variant`: a sliding window and/or soft-capping (attention.Variant): the torch
        kernels and the native CPU decode implement them; Triton falls back to these."""
        return attention.paged_attention(q, k, v, kv_cache, batch, scale, variant=variant)

    def full_attention(self, q, k, v, scale):
        """A vision tower's attention over each image (attention.full_attention): the
        native kernel where this backend has one, else torch's SDPA."""
        return attention.full_attention(q, k, v, scale, self.lib)

    def encoder_attention(self, q, k, v, seq_lens, scale, bias=None, window=None):
        """An encoder's bidirectional attention over a flat batch of sequences, each seeing
        only its own keys (kernels/encoder_attention.py: `bias` MPNet's relative position
        scores, `window` ModernBERT's local layers): the native kernel where this backend has
        one and it serves, else torch's (SDPA; explicit scores with a bias)."""
        return encoder_attention(q, k, v, seq_lens, scale, self.lib, bias, window)

    def write_kv(self, kv_cache, k, v, slots):
        """k, v [T, Hkv, D] into cache slots [T] (all of them >= 0)."""
        attention.write_kv(kv_cache, k, v, slots)

    def decode(self, q, kv_cache, tables, lens, scale, variant=_PLAIN):
        """decode_attention's contract: q [B, Hq, D], one query token a row -> [B, Hq, D]."""
        return attention.decode_attention(q, kv_cache, tables, lens, scale, variant)

    def decode_lse(self, q, kv_cache, tables, lens, scale, variant=_PLAIN):
        """decode_attention's rows and each one's log-sum-exp: (out [B, Hq, D], lse [B, Hq]
        float32), for merging with attention over other keys (cascade, context parallelism).
        A row may attend no token (lens 0): lse -inf (or a large negative)."""
        return attention.decode_attention(q, kv_cache, tables, lens, scale, variant, lse=True)

    def lora_delta(self, y, x, lora, slot):
        """y [T, N] += the LoRA delta of x [T, K] through linear `slot`, each row with its
        adapter. `lora` (executor/lora.py LoraBatch): per adapter its {slot: (A [R, K],
        Bt [R, N])} float32 and its rows; `adapter_of_row` and `table` for native kernels."""
        lora_kernels.lora_delta(y, x, zip(lora.weights, lora.rows), slot)


class CpuOps(TorchOps):
    name = "cpu"

    def __init__(self, lib: native.Library):
        self.lib, self.backend = lib, f"cpu-{lib.tier}"
        blocks = quant.available(lib)
        self.capabilities = Capabilities(
            native_weights=True, bf16_dot=lib.bf16_dot, fused_decode=True,
            block_kinds=frozenset(k for k in quant.KINDS if lib.quant_kind(k)) if blocks
            else frozenset(),
            # csrc/quant_gemm_avx2.h: the avx2 tier's int16 GEMM; wider tiers' oneDNN wins
            int16_large_steps=blocks and lib.tier == "avx2",
            # csrc/quant_gemm_vnni.h: vpdpbusd, on every avx512_bf16 CPU (it has VNNI);
            # csrc/quant_gemm_int8_avx2.h: vpmaddubsw on avx2 (avx512's is unmeasured)
            int8_large_steps=blocks and lib.tier in ("avx2", "avx512_bf16"))

    def add_rms_norm(self, x, residual, weight, eps):
        return self.lib.add_rms_norm(x, residual, weight, eps)

    def split_qkv_rope(self, qkv, num_heads, num_kv_heads, head_dim, table, positions):
        """Rotates q and k in place inside qkv, then returns views (no copies)."""
        self.lib.rope_(qkv, num_heads + num_kv_heads, head_dim, table, positions)
        t = qkv.shape[0]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return (q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim),
                v.view(t, num_kv_heads, head_dim))

    def split_qkv_partial_rope(self, qkv, num_heads, num_kv_heads, head_dim, rotary_dim, table,
                               positions):
        """Rotates the first rotary_dim columns of q's and k's heads in place, then views."""
        if rotary_dim:
            self.lib.rope_(qkv, num_heads + num_kv_heads, head_dim, table, positions,
                           rotary_dim)
        return super().split_qkv_partial_rope(qkv, num_heads, num_kv_heads, head_dim, 0, table,
                                              positions)

    def add_layer_norm(self, x, residual, weight, bias, eps):
        return self.lib.add_layer_norm(x, residual, weight, bias, eps)

    def gelu(self, x, approximate: str):
        return self.lib.gelu(x, approximate == "tanh")

    def silu_and_mul(self, gate_up):
        return self.lib.silu_and_mul(gate_up)

    def rms_norm_heads_(self, qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps):
        """The native norm over every token's heads as rows, as the fused stack's QK_NORM."""
        t = qkv.shape[0]
        for start, heads, weight in ((0, num_heads, q_weight),
                                     (num_heads * head_dim, num_kv_heads, k_weight)):
            part = qkv[:, start:start + heads * head_dim]
            rows = part.reshape(t * heads, head_dim)          # a copy: heads as rows
            part.copy_(self.lib.add_rms_norm(rows, None, weight, eps)[0].view(part.shape))

    def rms_norm_flat_qk_(self, qkv, q_size, kv_size, q_weight, k_weight, eps):
        for start, size, weight in ((0, q_size, q_weight), (q_size, kv_size, k_weight)):
            part = qkv[:, start:start + size]
            part.copy_(self.lib.add_rms_norm(part, None, weight, eps)[0])

    def moe(self, sparse, x, lora=None):
        """csrc/moe.cpp where the block's layout is native (its native_spec), adapters of
        its experts included, else torch's grouping over this backend's linears."""
        native = sparse.native_spec
        if native is None or x.dtype != native.dtype or not x.is_contiguous():
            return super().moe(sparse, x, lora)
        return self.lib.moe(x, native.words, None if lora is None else lora.adapter_of_row,
                            None if lora is None else lora.table, native.partial)

    def lora_delta(self, y, x, lora, slot):
        self.lib.lora_delta(y, x, lora.adapter_of_row, lora.table, slot)

    def attention(self, q, k, v, kv_cache, batch, scale, variant=attention.PLAIN):
        return attention.paged_attention(q, k, v, kv_cache, batch, scale, write=self.write_kv,
                                         decode=self._decode, prefill=self._prefill,
                                         variant=variant)

    def write_kv(self, kv_cache, k, v, slots):
        self.lib.write_kv(kv_cache[0], kv_cache[1], k, v, slots)

    def decode(self, q, kv_cache, tables, lens, scale, variant=_PLAIN):
        return self._decode(q, kv_cache, tables, lens, scale, variant)

    def decode_lse(self, q, kv_cache, tables, lens, scale, variant=_PLAIN):
        return self._decode(q, kv_cache, tables, lens, scale, variant, lse=True)

    def _prefill(self, q, cache, batch, scale, variant, out) -> bool:
        """bfloat16 prefills (plain, windowed, with sinks, with key ends) on the native
        kernel; the rest (soft-capped) on torch."""
        if variant.softcap is not None or not self.lib.prefill_attention_serves(q, cache[0]):
            return False
        chunks, tables = batch.packed_prefills
        blocks = None
        if kv_quant.is_quantized(cache[0]):
            blocks, tables = batch.packed_prefill_blocks
        ends = batch.packed_key_ends          # (named only where a span has them)
        self.lib.prefill_attention(q, cache[0], cache[1], chunks, tables, scale, variant.window,
                                   out, blocks, variant.sinks,
                                   **({} if ends is None else {"key_ends": ends}))
        return True

    def _decode(self, q, cache, tables, lens, scale, variant, lse=False):
        """The native kernel; sinks (which it has none of) applied to its rows after, from
        their log-sum-exp (native apply_sinks_, as the fused decode does)."""
        if variant.sinks is None:
            return self.lib.decode_attention(q, cache[0], cache[1], tables, lens, scale,
                                             variant.window, variant.softcap, lse)
        out, sums = self.lib.decode_attention(q, cache[0], cache[1], tables, lens, scale,
                                              variant.window, variant.softcap, True)
        self.lib.apply_sinks_(out, sums, variant.sinks)
        return (out, torch.logaddexp(sums, variant.sinks)) if lse else out




def select_ops(device: torch.device, name: str = "auto") -> TorchOps:
    """The backend for `device`: "auto" is triton on CUDA and the best native tier on a CPU
    (the torch reference where no tier runs or no compiler builds it, with a warning). A
    named tier this CPU cannot run is an error."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "torch":
        return TorchOps(device)
    if tiers.runs_on_cpu(name):     # load(None): the best tier, or None + warning
        lib = native.load(None if name == "cpu" else tiers.resolve(name))
        return CpuOps(lib) if lib is not None else TorchOps(device)
    if name == "triton":
        from .triton_ops import TritonOps
        return TritonOps(device)
    raise ValueError(f"unknown backend {name!r} ({', '.join(tiers.BACKENDS)})")


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """The device tensor-parallel rank `rank` runs on (--device: auto, cpu, cuda): on CUDA a
    GPU of its own (NCCL takes one rank a GPU; config refuses more local ranks than GPUs)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cuda":
        return torch.device(name)
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def collective_library(device: torch.device) -> str:
    """torch.distributed's backend for ranks on `device`: NCCL between GPUs, else gloo."""
    return "nccl" if device.type == "cuda" else "gloo"
