// CPU kernels for pagewire, called through ctypes (kernels/native.py builds and loads this).
//
// Built per CPU tier (-O3 and the tier's -m flags, kernels/tiers.py) against torch's headers
// only for at::parallel_for, so the work runs on torch's own OpenMP pool (same libgomp, same
// thread count as torch.set_num_threads).
// Every function takes raw pointers and explicit strides (in elements); the Python side checks
// shapes, dtypes and devices before calling.
//
// Cache layout (per layer, keys and values separately): [num_blocks, block_size, Hkv, D].
#include <ATen/Parallel.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "paged_decode.h"
#include "pagewire_api.h"

namespace {

using pw::bf16;
using pw::from_float;
using pw::to_float;

// bf16 arithmetic as torch does it: each op computes in float and rounds its result, so these
// kernels give the same bits as the torch reference path (up to exp/rsqrt implementations).
inline float round_as(float x, const float*) { return x; }
inline float round_as(float x, const bf16*) {
  bf16 b;
  from_float(x, &b);
  return to_float(b);
}

// row = x's row, or residual' = x + residual rounded to T (written back to the residual's row
// `rt` where there is one): what a norm after the residual add reads.
template <typename T>
void take_residual(float* row, const T* xt, T* rt, int64_t hidden) {
  for (int64_t i = 0; i < hidden; ++i) {
    float v = to_float(xt[i]);
    if (rt) {
      v = round_as(v + to_float(rt[i]), xt);
      from_float(v, rt + i);
    }
    row[i] = v;
  }
}

template <typename T>
void add_rms_norm(T* out, T* residual, const T* x, const T* weight, int64_t tokens,
                  int64_t hidden, int64_t x_stride, float eps) {
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t t = begin; t < end; ++t) {
      const T* xt = x + t * x_stride;
      take_residual(row.data(), xt, residual ? residual + t * hidden : nullptr, hidden);
      float ss = 0.f;
      for (int64_t i = 0; i < hidden; ++i) ss += row[i] * row[i];
      const float inv = 1.f / std::sqrt(ss / hidden + eps);
      T* ot = out + t * hidden;
      for (int64_t i = 0; i < hidden; ++i)
        from_float(to_float(weight[i]) * round_as(row[i] * inv, xt), ot + i);
    }
  });
}

// The GPT family's LayerNorm with add_rms_norm's residual: (v - mean) / sqrt(var + eps) * w
// + b, mean and variance in two passes (double sums), the output rounded once, as torch's
// layer_norm (float32 inside).
template <typename T>
void add_layer_norm(T* out, T* residual, const T* x, const T* weight, const T* bias,
                    int64_t tokens, int64_t hidden, int64_t x_stride, float eps) {
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t t = begin; t < end; ++t) {
      take_residual(row.data(), x + t * x_stride, residual ? residual + t * hidden : nullptr,
                    hidden);
      double sum = 0.0, ss = 0.0;
      for (int64_t i = 0; i < hidden; ++i) sum += row[i];
      const float mean = static_cast<float>(sum / hidden);
      for (int64_t i = 0; i < hidden; ++i) ss += double(row[i] - mean) * (row[i] - mean);
      const float inv = static_cast<float>(1.0 / std::sqrt(ss / hidden + eps));
      T* ot = out + t * hidden;
      for (int64_t i = 0; i < hidden; ++i)
        from_float((row[i] - mean) * inv * to_float(weight[i]) + to_float(bias[i]), ot + i);
    }
  });
}

// GELU of `count` values: exact (erf) or tanh's approximation, in float32, rounded once.
template <typename T>
void gelu(T* out, const T* x, int64_t count, bool tanh_form) {
  at::parallel_for(0, count, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float v = to_float(x[i]);
      const float g = tanh_form
          ? 0.5f * v * (1.f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)))
          : 0.5f * v * (1.f + std::erf(v * 0.7071067811865476f));
      from_float(g, out + i);
    }
  });
}

// Neox rotary embedding, in place, on the query and key heads of a fused qkv row: the first
// `rotary` columns of each head of D (the GPT family rotates part of a head; else D), whose
// pairs are (i, rotary / 2 + i); cos_sin rows are `rotary` wide.
template <typename T>
void rope_inplace(T* qkv, int64_t row_stride, const float* cos_sin, const int64_t* positions,
                  int64_t tokens, int64_t heads, int64_t D, int64_t rotary) {
  const int64_t half = rotary / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cs = cos_sin + positions[t] * rotary;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qkv + t * row_stride + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float c = round_as(cs[i], x), s = round_as(cs[half + i], x);
          const float x1 = to_float(x[i]), x2 = to_float(x[half + i]);
          from_float(round_as(x1 * c, x) - round_as(x2 * s, x), x + i);
          from_float(round_as(x2 * c, x) + round_as(x1 * s, x), x + half + i);
        }
      }
    }
  });
}

template <typename T>
void silu_and_mul(T* out, const T* gate_up, int64_t tokens, int64_t inter) {
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gate_up + t * 2 * inter;
      const T* u = g + inter;
      T* o = out + t * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = to_float(g[i]);
        const float silu = round_as(gv / (1.f + std::exp(-gv)), g);
        from_float(silu * to_float(u[i]), o + i);
      }
    }
  });
}

// pw_apply_sinks: each row's share of its softmax once the sink joins it, Z / (Z + e^sink).
template <typename T>
void apply_sinks(T* out, const float* lse, const float* sinks, int64_t B, int64_t Hq,
                 int64_t D) {
  for (int64_t r = 0; r < B * Hq; ++r) {
    const float share = 1.f / (1.f + std::exp(sinks[r % Hq] - lse[r]));
    for (int64_t j = 0; j < D; ++j)
      from_float(pw::to_float(out[r * D + j]) * share, &out[r * D + j]);
  }
}

}  // namespace

extern "C" {   // the entry points' contracts: pagewire_api.h

int64_t pw_avx512_bf16() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

void pw_add_rms_norm_f32(float* out, float* residual, const float* x, const float* w,
                         int64_t tokens, int64_t hidden, int64_t x_stride, float eps) {
  add_rms_norm(out, residual, x, w, tokens, hidden, x_stride, eps);
}
void pw_add_rms_norm_bf16(bf16* out, bf16* residual, const bf16* x, const bf16* w,
                          int64_t tokens, int64_t hidden, int64_t x_stride, float eps) {
  add_rms_norm(out, residual, x, w, tokens, hidden, x_stride, eps);
}

void pw_add_layer_norm_f32(float* out, float* residual, const float* x, const float* w,
                           const float* b, int64_t tokens, int64_t hidden, int64_t x_stride,
                           float eps) {
  add_layer_norm(out, residual, x, w, b, tokens, hidden, x_stride, eps);
}
void pw_add_layer_norm_bf16(bf16* out, bf16* residual, const bf16* x, const bf16* w,
                            const bf16* b, int64_t tokens, int64_t hidden, int64_t x_stride,
                            float eps) {
  add_layer_norm(out, residual, x, w, b, tokens, hidden, x_stride, eps);
}

void pw_gelu_f32(float* out, const float* x, int64_t count, int64_t tanh_form) {
  gelu(out, x, count, tanh_form != 0);
}
void pw_gelu_bf16(bf16* out, const bf16* x, int64_t count, int64_t tanh_form) {
  gelu(out, x, count, tanh_form != 0);
}

void pw_rope_f32(float* qkv, int64_t row_stride, const float* cos_sin, const int64_t* positions,
                 int64_t tokens, int64_t heads, int64_t D) {
  rope_inplace(qkv, row_stride, cos_sin, positions, tokens, heads, D, D);
}
void pw_rope_bf16(bf16* qkv, int64_t row_stride, const float* cos_sin, const int64_t* positions,
                  int64_t tokens, int64_t heads, int64_t D) {
  rope_inplace(qkv, row_stride, cos_sin, positions, tokens, heads, D, D);
}
void pw_rope_partial_f32(float* qkv, int64_t row_stride, const float* cos_sin,
                         const int64_t* positions, int64_t tokens, int64_t heads, int64_t D,
                         int64_t rotary) {
  rope_inplace(qkv, row_stride, cos_sin, positions, tokens, heads, D, rotary);
}
void pw_rope_partial_bf16(bf16* qkv, int64_t row_stride, const float* cos_sin,
                          const int64_t* positions, int64_t tokens, int64_t heads, int64_t D,
                          int64_t rotary) {
  rope_inplace(qkv, row_stride, cos_sin, positions, tokens, heads, D, rotary);
}

void pw_silu_and_mul_f32(float* out, const float* gate_up, int64_t tokens, int64_t inter) {
  silu_and_mul(out, gate_up, tokens, inter);
}
void pw_silu_and_mul_bf16(bf16* out, const bf16* gate_up, int64_t tokens, int64_t inter) {
  silu_and_mul(out, gate_up, tokens, inter);
}

void pw_decode_attention_f32(float* out, const float* q, const float* k_cache,
                             const float* v_cache, const int64_t* block_tables,
                             const int64_t* context_lens, int64_t B, int64_t Hq, int64_t Hkv,
                             int64_t D, int64_t bs, int64_t table_stride, int64_t q_stride,
                             int64_t out_stride, float scale, int64_t window, float softcap,
                             float* lse) {
  pw::paged::decode_attention<float, pw::paged::PlainCache<float>>(
      out, q, k_cache, v_cache, block_tables, context_lens, B, Hq, Hkv, D, bs, table_stride,
      q_stride, out_stride, scale, window, softcap, lse);
}

void pw_apply_sinks_f32(float* out, const float* lse, const float* sinks, int64_t B,
                        int64_t Hq, int64_t D) {
  apply_sinks(out, lse, sinks, B, Hq, D);
}
void pw_apply_sinks_bf16(bf16* out, const float* lse, const float* sinks, int64_t B, int64_t Hq,
                         int64_t D) {
  apply_sinks(out, lse, sinks, B, Hq, D);
}

void pw_decode_attention_bf16(bf16* out, const bf16* q, const bf16* k_cache,
                              const bf16* v_cache, const int64_t* block_tables,
                              const int64_t* context_lens, int64_t B, int64_t Hq, int64_t Hkv,
                              int64_t D, int64_t bs, int64_t table_stride, int64_t q_stride,
                              int64_t out_stride, float scale, int64_t window, float softcap,
                              float* lse) {
  if (pw_decode_attention_tiled_bf16(out, q, k_cache, v_cache, block_tables, context_lens, B,
                                     Hq, Hkv, D, bs, table_stride, q_stride, out_stride, scale,
                                     window, softcap, lse))
    return;
  pw::paged::decode_attention<bf16, pw::paged::PlainCache<bf16>>(
      out, q, k_cache, v_cache, block_tables, context_lens, B, Hq, Hkv, D, bs, table_stride,
      q_stride, out_stride, scale, window, softcap, lse);
}

}  // extern "C"
