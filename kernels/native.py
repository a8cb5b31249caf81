"""Native CPU kernels (csrc/*.cpp: cpu_kernels, prefill_attention, decode_attention,
kv_cache, sampling, quant_kernels, bf16_matmul, decode_stack, lora, core_rates, api_table),
compiled once per instruction-set tier (kernels/tiers.py) on first use and called via ctypes
with the prototypes native_api.py reads from their one declaration, csrc/pagewire_api.h.

Each tier's library is built with g++ -O3 and that tier's -m flags (not -march=native, so an
AVX512-BF16 machine also builds and tests its AVX-512 and AVX2 variants) against torch's
headers (for at::parallel_for, so it runs on torch's own thread pool). The sources compile
with -ffast-math, but the library links without it: GCC before 13 then adds crtfastmath.o,
whose constructor would set flush-to-zero for the whole process that loads the library (every
torch op of a user's process would round denormals to 0). The kernels' own exponentials stop
at e^-87, above the smallest normal float. Built libraries are cached under
$PAGEWIRE_CACHE_DIR/kernels (default ~/.cache/pagewire/kernels), keyed by the sources, the
flags and torch's version. If no compiler is available (or PAGEWIRE_NATIVE=0), load()
returns None and the torch reference runs.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import subprocess

import torch

from . import kv_quant, native_api, tiers

log = logging.getLogger(__name__)
_SOURCES = [os.path.join(os.path.dirname(__file__), "csrc", name)
            for name in ("cpu_kernels.cpp", "prefill_attention.cpp", "decode_attention.cpp",
                         "kv_cache.cpp", "sampling.cpp", "quant_kernels.cpp", "bf16_matmul.cpp",
                         "decode_stack.cpp", "moe.cpp", "lora.cpp", "core_rates.cpp",
                         "api_table.cpp")]
_HEADERS = [os.path.join(os.path.dirname(__file__), "csrc", name)
            for name in ("pagewire_api.h", "bf16.h", "attention_tiles.h", "quant_tiles.h",
                         "quant_avx512.h", "quant_avx2.h", "quant_decode_bf16.h", "lora.h",
                         "float_vec.h", "quant_int_avx2.h", "quant_gemm_avx2.h",
                         "quant_gemm_int8_avx2.h", "quant_gemm_vnni.h", "quant_step_vnni.h",
                         "kv_quant.h", "paged_decode.h", "paged_decode_avx2.h", "decode_tiles.h",
                         "decode_tiles_bf16.h", "decode_tiles_int8.h", "decode_tiles_fp8.h")]
_FLAGS = ["-O3", "-mtune=native", "-ffast-math", "-std=c++17", "-fPIC", "-fopenmp",
          "-Wno-unused-parameter"]                        # compiling each source
_LINK = ["-shared", "-fopenmp"]                          # no -ffast-math: see above

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def kernel_cache_dir() -> str:
    """Where built libraries live (made if missing)."""
    root = os.environ.get("PAGEWIRE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagewire")
    path = os.path.join(root, "kernels")
    os.makedirs(path, exist_ok=True)
    return path


def _build(target: str, flags: list[str]) -> None:
    """Compile every source with `flags` (several at once), then link."""
    torch_dir = os.path.dirname(torch.__file__)
    tmp = f"{target}.{os.getpid()}.tmp"
    objects = [f"{tmp}.{i}.o" for i in range(len(_SOURCES))]
    cxx = os.environ.get("CXX", "g++")
    # One compiler per CPU at a time: each holds torch's headers (~0.5 GB).
    at_once = max(1, min(len(_SOURCES), os.cpu_count() or 1))
    try:
        for i in range(0, len(_SOURCES), at_once):
            jobs = [subprocess.Popen([cxx, *flags, f"-I{torch_dir}/include", "-c", src, "-o",
                                      obj], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
                    for src, obj in zip(_SOURCES[i:i + at_once], objects[i:i + at_once])]
            outputs = [job.communicate()[0] for job in jobs]     # every job ended
            for job, out in zip(jobs, outputs):
                if job.returncode:
                    raise subprocess.CalledProcessError(job.returncode, job.args, stderr=out)
        subprocess.run([cxx, *_LINK, *objects, f"-L{torch_dir}/lib", "-ltorch_cpu", "-lc10",
                        f"-Wl,-rpath,{torch_dir}/lib", "-o", tmp],
                       check=True, capture_output=True, text=True)
    finally:
        for obj in objects:
            if os.path.exists(obj):
                os.remove(obj)
    os.replace(tmp, target)


def library_path(tier: str) -> str:
    """Where `tier`'s build lives (built there if missing; the CPU need not run the tier)."""
    flags = [*_FLAGS, *tiers.compiler_flags(tier)]
    sources = b"".join(open(path, "rb").read() for path in [*_SOURCES, *_HEADERS])
    key = hashlib.sha256(sources + " ".join(flags + _LINK).encode() + torch.__version__.encode()
                         ).hexdigest()[:16]
    target = os.path.join(kernel_cache_dir(), f"cpu_kernels-{tier}-{key}.so")
    if not os.path.exists(target):
        with open(target + ".lock", "w") as lock:   # several executors may start at once
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(target):
                _build(target, flags)
    return target


@functools.lru_cache(maxsize=None)
def load(tier: str | None = None) -> "Library | None":
    """`tier`'s library (default: the best tier this CPU runs), or None where the native
    kernels cannot run here: no tier, no compiler, or PAGEWIRE_NATIVE=0."""
    if os.environ.get("PAGEWIRE_NATIVE", "1") == "0":
        return None
    tier = tier or tiers.best()
    if tier is None:
        log.warning("this CPU runs no native kernel tier (%s): using the torch reference",
                    ", ".join(tiers.TIERS))
        return None
    if tier not in tiers.runnable():
        raise ValueError(f"this CPU cannot run the {tier} kernels")
    try:
        cdll = ctypes.CDLL(library_path(tier))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("native CPU kernels unavailable, using the torch reference: %s",
                    detail[-2000:])
        return None
    # A library that disagrees with the header is a bug, not a missing compiler: it raises.
    return Library(native_api.bind(cdll), tier)


def _check_cpu(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"native CPU kernels need CPU tensors, got {t.device}")


class Library:
    """One tier's build, loaded: its kernels with the checks their memory safety needs.
    `cdll`: the entry points pagewire_api.h declares, typed (native_api.bind)."""

    def __init__(self, cdll: native_api.Bound, tier: str):
        self.cdll, self.tier = cdll, tier
        self.bf16_dot = bool(cdll.pw_avx512_bf16())          # asked once, not per step
        self.quant_matmuls = bool(cdll.pw_quant_matmuls())

    def __repr__(self) -> str:
        return f"native.Library({self.tier})"

    @functools.cache
    def quant_kind(self, kind: int) -> bool:
        """Whether this build multiplies weights packed as `kind` (csrc/quant_kernels.cpp)."""
        return bool(self.cdll.pw_quant_kind(kind))

    @functools.cached_property
    def int16_mac_ratio(self) -> float:
        """Multiply-adds a second of 256-bit int16 products (vpmaddwd + vpaddd) over float32
        FMAs' on the calling core (csrc/core_rates.cpp: ~0.5 ms, measured once a library)."""
        ratio = self.cdll.pw_int16_mac_ratio(8)
        log.info("int16 products run %.2fx the multiply-adds of float32 FMAs on this core",
                 ratio)
        return ratio

    def typed(self, name: str, dtype: torch.dtype):
        """The library's `name`_f32 or `name`_bf16 function for tensors of `dtype`."""
        if dtype not in _SUFFIX:
            raise ValueError(f"{name}: dtype {dtype} not supported by the native kernels")
        return getattr(self.cdll, f"{name}_{_SUFFIX[dtype]}")

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         scale: float, window: int | None = None,
                         softcap: float | None = None, lse: bool = False):
        """q: [B, Hq, D] (heads contiguous); k_cache, v_cache: [num_blocks, bs, Hkv, D]
        contiguous; block_tables: [B, W] int64; context_lens: [B] int64 (each in [1, W * bs]).
        `window`: attend only the last `window` tokens; `softcap`: capped scores (see
        attention.Variant). Returns [B, Hq, D] in q's dtype; with `lse`, also each row's
        log-sum-exp of its scores, float32 [B, Hq] (cascade.merge_attention)."""
        _check_cpu(q, k_cache, v_cache, block_tables, context_lens)
        batch, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, width = k_cache.shape
        kind = kv_quant.KINDS.get(k_cache.dtype)            # a quantized cache (kv_quant.py)
        if q.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype \
                or (kind is None and k_cache.dtype != q.dtype):
            raise ValueError(f"unsupported dtypes q={q.dtype} cache={k_cache.dtype}")
        if width != head_dim + (0 if kind is None else kv_quant.SCALE_BYTES):
            raise ValueError(f"decode_attention: cache rows of {width} for head dim {head_dim}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or q.stride(2) != 1 \
                or q.stride(1) != head_dim or num_heads % num_kv_heads:
            raise ValueError("decode_attention: bad strides or head counts")
        if block_tables.dtype != torch.int64 or context_lens.dtype != torch.int64 \
                or not block_tables.is_contiguous() or block_tables.shape[0] != batch:
            raise ValueError("decode_attention: block_tables/context_lens must be int64 "
                             "[B, W], [B]")
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype)
        fn = self.typed("pw_decode_attention" if kind is None else "pw_decode_attention_q8",
                        q.dtype)
        sums = torch.empty((batch, num_heads), dtype=torch.float32) if lse else None
        fn(out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
           block_tables.data_ptr(), context_lens.data_ptr(), batch, num_heads, num_kv_heads,
           head_dim, block_size, block_tables.shape[1], q.stride(0), out.stride(0), scale,
           window or 0, softcap or 0.0, *(() if kind is None else (kind,)),
           None if sums is None else sums.data_ptr())
        return (out, sums) if lse else out

    def prefill_attention_serves(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether prefill_attention takes these: bfloat16 queries over a bfloat16 or
        quantized cache, head dim 64 or 128, blocks of a multiple of 16 tokens, and a build
        with AVX512-BF16."""
        block_size, head_dim = k_cache.shape[1], kv_quant.head_dim(k_cache)
        return (self.bf16_dot and q.dtype == torch.bfloat16 and q.device.type == "cpu"
                and (k_cache.dtype == torch.bfloat16 or kv_quant.is_quantized(k_cache))
                and head_dim in (64, 128) and block_size % 16 == 0)

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          chunks: torch.Tensor, tables: torch.Tensor, scale: float,
                          window: int | None, out: torch.Tensor,
                          blocks: torch.Tensor | None = None,
                          sinks: torch.Tensor | None = None,
                          key_ends: torch.Tensor | None = None) -> None:
        """Causal attention of prefill chunks whose keys and values are already in the cache.
        q, out: [T, Hq, D] (heads contiguous); caches [num_blocks, bs, Hkv, D] contiguous;
        chunks: [S, 4] int64 rows (first row in q, queries n, context ctx, offset of its block
        table in `tables`); a chunk's queries are positions ctx - n .. ctx - 1. Writes those rows
        of out. Only what prefill_attention_serves accepts. A quantized cache's blocks that
        `tables` names are dequantized to bfloat16 first: the values the torch reference
        attends. `blocks` (quantized caches): those blocks [U], `tables` then indexing them
        (AttentionBatch.packed_prefill_blocks, found once a step); found here if None.
        `sinks`: float32 [Hq], a logit per query head in each row's softmax (gpt-oss), or
        None. `key_ends`: int64 [T'] (T' at least every chunk's last row + 1), per row of q
        the end (exclusive) of the keys it sees (attention.PrefillSpan.key_ends), or None:
        causal."""
        _check_cpu(q, k_cache, v_cache, chunks, tables, out)
        if kv_quant.is_quantized(k_cache):
            if blocks is None:
                blocks, tables = torch.unique(tables, return_inverse=True)
            k_cache = kv_quant.dequantize(k_cache[blocks], torch.bfloat16)  # [U, bs, Hkv, D]
            v_cache = kv_quant.dequantize(v_cache[blocks], torch.bfloat16)
        _, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or q.stride(2) != 1 \
                or q.stride(1) != head_dim or out.stride(2) != 1 or out.stride(1) != head_dim \
                or num_heads % num_kv_heads or out.dtype != q.dtype \
                or not q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16:
            raise ValueError("prefill_attention: bad strides, dtypes or head counts")
        if chunks.dtype != torch.int64 or not chunks.is_contiguous() or chunks.shape[1:] != (4,) \
                or tables.dtype != torch.int64 or not tables.is_contiguous():
            raise ValueError("prefill_attention: chunks [S, 4] and tables must be contiguous "
                             "int64")
        if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()
                                  or sinks.shape != (num_heads,)):
            raise ValueError("prefill_attention: sinks must be contiguous float32 [Hq]")
        if key_ends is not None:
            _check_key_ends(key_ends, chunks)
        self.cdll.pw_prefill_attention_bf16(
            out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            tables.data_ptr(), chunks.data_ptr(), chunks.shape[0], num_heads, num_kv_heads,
            head_dim, block_size, q.stride(0), out.stride(0), scale, window or 0,
            None if sinks is None else sinks.data_ptr(),
            None if key_ends is None else key_ends.data_ptr())

    def sample_serves(self, logits: torch.Tensor) -> bool:
        """Whether sample_rows takes these logits: float32 on the CPU, rows contiguous."""
        return (logits.device.type == "cpu" and logits.dtype == torch.float32
                and logits.dim() == 2 and logits.stride(1) == 1)

    def sample_rows(self, logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF draws: for each row of logits [S, V], the first token whose cumulative
        softmax mass reaches uniforms[s] (in (0, 1]) of the row's total; -inf logits weigh
        nothing. uniforms: [S] float32. Returns [S] int64. Only what sample_serves accepts."""
        rows, vocab = logits.shape
        u = uniforms.reshape(rows).to(torch.float32).contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        self.cdll.pw_sample_rows(logits.data_ptr(), rows, vocab, logits.stride(0),
                                 u.data_ptr(), out.data_ptr())
        return out

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [T, Hkv, D] with each token's row contiguous; caches [num_blocks, bs, Hkv, D]
        contiguous, or quantized ([..., D + 4], kv_quant.py: k, v float32 or bfloat16 are
        quantized as they are written); slots: [T] int64, distinct. Mutates the caches."""
        _check_cpu(k_cache, v_cache, k, v, slots)
        row = k.shape[1] * k.shape[2]
        kind = kv_quant.KINDS.get(k_cache.dtype)
        values = k.dtype if kind is not None else k_cache.dtype    # a quantized cache: any
        for t in (k, v):
            if t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.dtype != values:
                raise ValueError("write_kv: each token's row must be contiguous, cache dtype")
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            raise ValueError("write_kv: slots must be contiguous int64")
        if kind is not None:
            if k_cache.shape[-1] != k.shape[2] + kv_quant.SCALE_BYTES:
                raise ValueError("write_kv: quantized cache rows must be D + 4 bytes")
            return self.typed("pw_write_kv_q8", k.dtype)(
                k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(),
                slots.data_ptr(), k.shape[0], k.shape[1], k.shape[2], k.stride(0), v.stride(0),
                kind)
        size = k.element_size()
        self.cdll.pw_write_kv(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(),
                              slots.data_ptr(), k.shape[0], row * size, k.stride(0) * size,
                              v.stride(0) * size)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """As kernels.norm.add_rms_norm: x [T, H] (rows may be strided); residual [T, H]
        contiguous is updated in place to x + residual. Returns (normed, residual)."""
        return self._add_norm("pw_add_rms_norm", x, residual, weight, eps)

    def _add_norm(self, name: str, x, residual, weight, eps, *bias):
        _check_cpu(x, weight)
        tokens, hidden = x.shape
        if x.stride(1) != 1 or weight.dtype != x.dtype or weight.shape != (hidden,):
            raise ValueError(f"{name}: x rows must be contiguous, weight [H] of x's dtype")
        if residual is not None and (not residual.is_contiguous() or residual.shape != x.shape
                                     or residual.dtype != x.dtype):
            raise ValueError(f"{name}: residual must be contiguous and shaped like x")
        out = torch.empty((tokens, hidden), dtype=x.dtype)
        self.typed(name, x.dtype)(
            out.data_ptr(), residual.data_ptr() if residual is not None else None, x.data_ptr(),
            weight.data_ptr(), *(b.data_ptr() for b in bias), tokens, hidden, x.stride(0), eps)
        return out, (x if residual is None else residual)

    def add_layer_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                       weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """As add_rms_norm with a LayerNorm's weight and bias [H] (kernels.norm.add_layer_norm)."""
        if bias.dtype != x.dtype or bias.shape != weight.shape or not bias.is_contiguous():
            raise ValueError("add_layer_norm: bias [H] of x's dtype")
        return self._add_norm("pw_add_layer_norm", x, residual, weight, eps, bias)

    def gelu(self, x: torch.Tensor, tanh_form: bool) -> torch.Tensor:
        """gelu(x) of a contiguous x: exact, or tanh's approximation."""
        _check_cpu(x)
        if not x.is_contiguous():
            raise ValueError("gelu: x must be contiguous")
        out = torch.empty_like(x)
        self.typed("pw_gelu", x.dtype)(out.data_ptr(), x.data_ptr(), x.numel(), int(tanh_form))
        return out

    def rope_(self, qkv: torch.Tensor, num_heads: int, head_dim: int, table: torch.Tensor,
              positions: torch.Tensor, rotary: int | None = None) -> None:
        """Rotate, in place, the first num_heads heads of each row of qkv [T, W] (queries, then
        keys) by their token's position: their first `rotary` columns (None: all D). table:
        [P, rotary] float32 cos|sin; positions: [T] int64."""
        _check_cpu(qkv, table, positions)
        rotary = head_dim if rotary is None else rotary
        if qkv.stride(1) != 1 or num_heads * head_dim > qkv.shape[1] \
                or table.dtype != torch.float32 or not table.is_contiguous() \
                or table.shape[1] != rotary or not 0 < rotary <= head_dim or rotary % 2 \
                or positions.dtype != torch.int64 or not positions.is_contiguous() \
                or positions.shape[0] != qkv.shape[0]:
            raise ValueError("rope_: bad shapes, strides or dtypes")
        self.typed("pw_rope_partial", qkv.dtype)(
            qkv.data_ptr(), qkv.stride(0), table.data_ptr(), positions.data_ptr(), qkv.shape[0],
            num_heads, head_dim, rotary)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] contiguous -> [T, I]."""
        _check_cpu(gate_up)
        if not gate_up.is_contiguous() or gate_up.shape[1] % 2:
            raise ValueError("silu_and_mul: gate_up must be contiguous [T, 2I]")
        tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((tokens, inter), dtype=gate_up.dtype)
        self.typed("pw_silu_and_mul", gate_up.dtype)(out.data_ptr(), gate_up.data_ptr(), tokens,
                                                     inter)
        return out

    def apply_sinks_(self, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
        """decode_attention's rows out [B, Hq, D] (contiguous) and their lse [B, Hq], in place:
        as if each row's softmax had had its head's sink (float32 [Hq]) too
        (attention.apply_sinks' arithmetic, the fused decode's bits)."""
        _check_cpu(out, lse, sinks)
        batch, heads, head_dim = out.shape
        if not out.is_contiguous() or lse.dtype != torch.float32 or not lse.is_contiguous() \
                or lse.shape != (batch, heads) or sinks.dtype != torch.float32 \
                or not sinks.is_contiguous() or sinks.shape != (heads,):
            raise ValueError("apply_sinks_: out [B, Hq, D] contiguous, lse float32 [B, Hq], "
                             "sinks float32 [Hq]")
        self.typed("pw_apply_sinks", out.dtype)(out.data_ptr(), lse.data_ptr(), sinks.data_ptr(),
                                                batch, heads, head_dim)

    def moe(self, x: torch.Tensor, words: torch.Tensor,
            adapter_of_row: torch.Tensor | None = None,
            table: torch.Tensor | None = None, partial: bool = False) -> torch.Tensor:
        """The mixture-of-experts block `words` describes (kernels/moe.py native_spec, for
        x's dtype) of x [T, H] contiguous -> [T, H] (`partial`: a rank's float32 partial);
        each row's adapter's deltas added to its experts' products where `adapter_of_row`
        and `table` are given (as lora_delta's)."""
        _check_cpu(x, words)
        if not x.is_contiguous() or x.dim() != 2 or words.dtype != torch.int64:
            raise ValueError("moe: x must be contiguous [T, H], words int64")
        rows = slots = 0
        if adapter_of_row is not None:
            _check_adapters(adapter_of_row, table, x.shape[0], "moe")
            rows, slots = adapter_of_row.data_ptr(), table.shape[1]
        out = torch.empty_like(x, dtype=torch.float32 if partial else x.dtype)
        self.typed("pw_moe_partial" if partial else "pw_moe", x.dtype)(
            out.data_ptr(), x.data_ptr(), x.shape[0], words.data_ptr(), rows,
            table.data_ptr() if rows else 0, slots)
        return out

    def lora_delta(self, y: torch.Tensor, x: torch.Tensor, adapter_of_row: torch.Tensor,
                   table: torch.Tensor, slot: int) -> None:
        """y [T, N] += each row's adapter delta of x [T, K] for linear `slot` (rows of
        adapter -1 untouched). table: [adapters, slots, 6] int64, LoraWeights.entry() of
        each (kernels/lora.py); A null where that adapter leaves the linear alone."""
        _check_cpu(y, x)
        tokens, n = y.shape
        _check_adapters(adapter_of_row, table, tokens, "lora_delta")
        if y.stride(1) != 1 or x.stride(1) != 1 or x.shape[0] != tokens or x.dtype != y.dtype \
                or not 0 <= slot < table.shape[1]:
            raise ValueError("lora_delta: bad shapes, strides or dtypes")
        self.typed("pw_lora_delta", y.dtype)(
            y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), tokens, n, x.shape[1],
            adapter_of_row.data_ptr(), table.data_ptr(), slot, table.shape[1])


def _check_adapters(adapter_of_row: torch.Tensor, table: torch.Tensor, tokens: int,
                    name: str) -> None:
    """A step's adapter rows [tokens] and table [adapters, slots, 6] (int64, kernels/lora.py
    LoraWeights.entry() of each), as lora.cpp reads them."""
    _check_cpu(adapter_of_row, table)
    if adapter_of_row.dtype != torch.int64 or adapter_of_row.shape != (tokens,) \
            or table.dtype != torch.int64 or not table.is_contiguous() \
            or table.dim() != 3 or table.shape[2] != 6:
        raise ValueError(f"{name}: bad adapter rows or table")


def _check_key_ends(key_ends: torch.Tensor, chunks: torch.Tensor) -> None:
    """Each chunk row's key end within [its causal end, the chunk's ctx]: past ctx the kernel
    would read keys outside the chunk's blocks."""
    start, n, ctx = chunks[:, 0], chunks[:, 1], chunks[:, 2]
    rows = int((start + n).max()) if len(chunks) else 0
    if key_ends.dtype != torch.int64 or not key_ends.is_contiguous() or key_ends.dim() != 1 \
            or key_ends.shape[0] < rows:
        raise ValueError(f"prefill_attention: key_ends must be contiguous int64 [T >= {rows}]")
    within = _offsets(n)                                     # each row's index in its chunk
    causal = torch.repeat_interleave(ctx - n, n) + within + 1
    ends = key_ends[torch.repeat_interleave(start, n) + within]
    if bool(((ends < causal) | (ends > torch.repeat_interleave(ctx, n))).any()):
        raise ValueError("prefill_attention: a key end before its query's own key or past its "
                         "chunk's context")


def _offsets(n: torch.Tensor) -> torch.Tensor:
    """0 .. n[i] - 1 for each i, concatenated."""
    return torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
