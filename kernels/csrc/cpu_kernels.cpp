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

namespace {

using pw::bf16;
using pw::from_float;
using pw::to_float;

// Built with -ffast-math (vectorized exp, reassociated sums), which assumes finite values:
// "no score yet" is a large finite negative, not -inf.
constexpr float kNoScore = -1e30f;
constexpr int64_t kPrefetchAhead = 1;

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// One sequence and a range of its kv heads [h0, h1): each kv head's G query heads attend over
// the sequence's context, block by block, with an online softmax (scores never leave this
// function). Token rows hold all kv heads contiguously, so a row is read once for all heads.
// q . k for one query head and one cached token. bf16 inputs on AVX512-BF16 multiply in
// pairs straight from memory (vdpbf16ps: exact products, float32 sums); elsewhere both are
// widened to float32 first (`qf` holds the query pre-widened, `row` the token's keys).
template <typename T, int64_t kD>
inline float qk_dot(const T* q, const float* qf, const T* k, const float* row, int64_t D) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16> && kD > 0 && kD % 32 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < kD; i += 32)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + i),
                             (__m512bh)_mm512_loadu_si512(k + i));
    return _mm512_reduce_add_ps(acc);
  }
#endif
  return dot(qf, row, D);
}

template <typename T, int64_t kD>
constexpr bool kDirectQK =
#if defined(__AVX512BF16__)
    std::is_same_v<T, bf16> && kD > 0 && kD % 32 == 0;
#else
    false;
#endif

#if defined(__AVX512BF16__)
// acc[h] += sum_t p[h][t] * V[t][kv(h)] for NG query heads sharing one kv head, kD/16 zmm per
// head: the accumulators stay in registers for the whole block, and each value row is widened
// from bf16 once for all NG heads.
template <int64_t kD, int NG>
inline void pv_heads(float* acc, const float* p, const bf16* v, int64_t n, int64_t row_stride,
                     int64_t bs) {
  constexpr int C = kD / 16;
  __m512 a[NG][C];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * kD + c * 16);
  for (int64_t t = 0; t < n; ++t) {
    const bf16* vr = v + t * row_stride;
    __m512 vv[C];
    for (int c = 0; c < C; ++c)
      vv[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + c * 16))), 16));
    for (int g = 0; g < NG; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * bs + t]);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pg, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * kD + c * 16, a[g][c]);
}
#endif

// The value half of a block: acc[h][:] += sum_t scores[h][t] * V[t][kv head of h][:], for the
// G query heads of each of the nkv kv heads starting at `v` (the block's first row).
template <typename T, int64_t kD>
inline void accumulate_pv(float* acc, const float* scores, const T* v, float* row, int64_t n,
                          int64_t row_stride, int64_t nkv, int64_t G, int64_t bs, int64_t D) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16> && kD > 0 && kD % 16 == 0) {
    constexpr int kChunk = kD <= 64 ? 4 : 2;   // heads per pass: accumulators fit the registers
    for (int64_t j = 0; j < nkv; ++j)
      for (int64_t g0 = 0; g0 < G; g0 += kChunk) {
        float* a = acc + (j * G + g0) * kD;
        const float* p = scores + (j * G + g0) * bs;
        const bf16* vj = v + j * kD;
        switch (std::min<int64_t>(kChunk, G - g0)) {
          case 1: pv_heads<kD, 1>(a, p, vj, n, row_stride, bs); break;
          case 2: pv_heads<kD, 2>(a, p, vj, n, row_stride, bs); break;
          case 3: pv_heads<kD, 3>(a, p, vj, n, row_stride, bs); break;
          default: pv_heads<kD, 4>(a, p, vj, n, row_stride, bs); break;
        }
      }
    return;
  }
#endif
  const int64_t H = nkv * G;
  for (int64_t t = 0; t < n; ++t) {
    load_row(v + t * row_stride, row, nkv * D);
    for (int64_t h = 0; h < H; ++h) axpy(acc + h * D, scores[h * bs + t], row + (h / G) * D, D);
  }
}

// window > 0: only the last `window` positions are attended (sliding-window layers);
// softcap > 0: each score becomes softcap * tanh(score / softcap) (Gemma2).
template <typename T, int64_t kD>
void decode_seq(T* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t context, int64_t h0, int64_t h1, int64_t Hkv, int64_t G, int64_t D_,
                int64_t bs, float scale, int64_t window, float softcap) {
  const int64_t D = kD ? kD : D_;   // a compile-time head dim unrolls the inner loops
  const int64_t H = (h1 - h0) * G;          // query heads handled here
  std::vector<float> qf(H * D), acc(H * D, 0.f), row((h1 - h0) * D), scores(H * bs);
  std::vector<float> m(H, kNoScore), l(H, 0.f);
  const T* qh0 = q + h0 * G * D;
  load_row(qh0, qf.data(), H * D);
  const int64_t row_stride = Hkv * D;
  const int64_t row_bytes = (h1 - h0) * D * static_cast<int64_t>(sizeof(T));
  const int64_t first = window > 0 ? std::max<int64_t>(0, context - window) : 0;
  for (int64_t start = first / bs * bs; start < context; start += bs) {
    const int64_t n = std::min(bs, context - start);
    const int64_t base = table[start / bs] * bs * row_stride + h0 * D;
    // Blocks are scattered, so the hardware cannot guess the next one: prefetch the rows of
    // the block kPrefetchAhead blocks ahead while this one is computed.
    const bool has_next = start + kPrefetchAhead * bs < context;
    const int64_t next = has_next ? table[start / bs + kPrefetchAhead] * bs * row_stride + h0 * D : 0;
    for (int64_t t = 0; t < n; ++t) {
      if (has_next) {
        const char* nk = reinterpret_cast<const char*>(k_cache + next + t * row_stride);
        const char* nv = reinterpret_cast<const char*>(v_cache + next + t * row_stride);
        for (int64_t off = 0; off < row_bytes; off += 64) {
          __builtin_prefetch(nk + off);
          __builtin_prefetch(nv + off);
        }
      }
      const T* krow = k_cache + base + t * row_stride;
      if (!kDirectQK<T, kD>) load_row(krow, row.data(), (h1 - h0) * D);
      for (int64_t h = 0; h < H; ++h)
        scores[h * bs + t] = scale * qk_dot<T, kD>(qh0 + h * D, qf.data() + h * D,
                                                   krow + (h / G) * D, row.data() + (h / G) * D, D);
    }
    if (softcap > 0.f)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < n; ++t)
          scores[h * bs + t] = softcap * std::tanh(scores[h * bs + t] / softcap);
    for (int64_t t = 0; start + t < first; ++t)      // before the window: never attended
      for (int64_t h = 0; h < H; ++h) scores[h * bs + t] = -INFINITY;
    for (int64_t h = 0; h < H; ++h) {
      float* sh = scores.data() + h * bs;
      const float new_m = std::max(m[h], *std::max_element(sh, sh + n));
      const float alpha = std::exp(m[h] - new_m);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) { sh[t] = std::exp(sh[t] - new_m); sum += sh[t]; }
      l[h] = l[h] * alpha + sum;
      m[h] = new_m;
      if (alpha != 1.f)
        for (int64_t d = 0; d < D; ++d) acc[h * D + d] *= alpha;
    }
    accumulate_pv<T, kD>(acc.data(), scores.data(), v_cache + base, row.data(), n, row_stride,
                         h1 - h0, G, bs, D);
  }
  for (int64_t h = 0; h < H; ++h) {
    T* oh = out + (h0 * G + h) * D;
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    for (int64_t d = 0; d < D; ++d) from_float(acc[h * D + d] * inv, oh + d);
  }
}

template <typename T>
void decode_attention(T* out, const T* q, const T* k_cache, const T* v_cache,
                      const int64_t* block_tables, const int64_t* context_lens, int64_t B,
                      int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t table_stride,
                      int64_t q_stride, int64_t out_stride, float scale, int64_t window,
                      float softcap) {
  const int64_t G = Hq / Hkv;
  // Whole sequences per work item when there are enough of them (each token row is then read
  // once); split a small batch by kv head so every thread has work.
  const int64_t splits = B < 2 * at::get_num_threads() ? Hkv : 1;
  at::parallel_for(0, B * splits, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / splits, part = item % splits;
      const int64_t h0 = part * Hkv / splits, h1 = (part + 1) * Hkv / splits;
      auto fn = D == 64 ? decode_seq<T, 64> : D == 128 ? decode_seq<T, 128> : decode_seq<T, 0>;
      fn(out + b * out_stride, q + b * q_stride, k_cache, v_cache,
         block_tables + b * table_stride, context_lens[b], h0, h1, Hkv, G, D, bs, scale,
         window, softcap);
    }
  });
}

// bf16 arithmetic as torch does it: each op computes in float and rounds its result, so these
// kernels give the same bits as the torch reference path (up to exp/rsqrt implementations).
inline float round_as(float x, const float*) { return x; }
inline float round_as(float x, const bf16*) {
  bf16 b;
  from_float(x, &b);
  return to_float(b);
}

template <typename T>
void add_rms_norm(T* out, T* residual, const T* x, const T* weight, int64_t tokens,
                  int64_t hidden, int64_t x_stride, float eps) {
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t t = begin; t < end; ++t) {
      const T* xt = x + t * x_stride;
      T* rt = residual ? residual + t * hidden : nullptr;
      float ss = 0.f;
      for (int64_t i = 0; i < hidden; ++i) {
        float v = to_float(xt[i]);
        if (rt) {                     // residual' = x + residual, rounded to T
          v = round_as(v + to_float(rt[i]), xt);
          from_float(v, rt + i);
        }
        row[i] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / hidden + eps);
      T* ot = out + t * hidden;
      for (int64_t i = 0; i < hidden; ++i)
        from_float(to_float(weight[i]) * round_as(row[i] * inv, xt), ot + i);
    }
  });
}

// Neox rotary embedding, in place, on the query and key heads of a fused qkv row.
template <typename T>
void rope_inplace(T* qkv, int64_t row_stride, const float* cos_sin, const int64_t* positions,
                  int64_t tokens, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cs = cos_sin + positions[t] * D;
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

}  // namespace

extern "C" {

// 1 when this build has the AVX512-BF16 kernels (prefill_attention, decode_attention,
// sampling, quant_kernels, decode_stack's quantized linears); without them (0) they do
// nothing and callers take the torch or float paths.
int64_t pw_avx512_bf16() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

int64_t pw_decode_attention_tiled_bf16(bf16*, const bf16*, const bf16*, const bf16*,
                                       const int64_t*, const int64_t*, int64_t, int64_t, int64_t,
                                       int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t,
                                       float);  // decode_attention.cpp

// out [T, H]; residual [T, H] (updated in place) or null; x rows x_stride apart.
void pw_add_rms_norm_f32(float* out, float* residual, const float* x, const float* w,
                         int64_t tokens, int64_t hidden, int64_t x_stride, float eps) {
  add_rms_norm(out, residual, x, w, tokens, hidden, x_stride, eps);
}
void pw_add_rms_norm_bf16(bf16* out, bf16* residual, const bf16* x, const bf16* w,
                          int64_t tokens, int64_t hidden, int64_t x_stride, float eps) {
  add_rms_norm(out, residual, x, w, tokens, hidden, x_stride, eps);
}

// qkv [T, row_stride]: the first `heads` heads of each row (queries then keys) are rotated.
void pw_rope_f32(float* qkv, int64_t row_stride, const float* cos_sin, const int64_t* positions,
                 int64_t tokens, int64_t heads, int64_t D) {
  rope_inplace(qkv, row_stride, cos_sin, positions, tokens, heads, D);
}
void pw_rope_bf16(bf16* qkv, int64_t row_stride, const float* cos_sin, const int64_t* positions,
                  int64_t tokens, int64_t heads, int64_t D) {
  rope_inplace(qkv, row_stride, cos_sin, positions, tokens, heads, D);
}

// gate_up [T, 2I] (gate first) -> out [T, I].
void pw_silu_and_mul_f32(float* out, const float* gate_up, int64_t tokens, int64_t inter) {
  silu_and_mul(out, gate_up, tokens, inter);
}
void pw_silu_and_mul_bf16(bf16* out, const bf16* gate_up, int64_t tokens, int64_t inter) {
  silu_and_mul(out, gate_up, tokens, inter);
}

// out, q: [B, Hq, D] (token stride q_stride / out_stride, heads contiguous);
// block_tables: [B, table_stride] int64; context_lens: [B] int64 (tokens to attend, >= 1);
// window > 0: a sliding window; softcap > 0: capped scores.
void pw_decode_attention_f32(float* out, const float* q, const float* k_cache,
                             const float* v_cache, const int64_t* block_tables,
                             const int64_t* context_lens, int64_t B, int64_t Hq, int64_t Hkv,
                             int64_t D, int64_t bs, int64_t table_stride, int64_t q_stride,
                             int64_t out_stride, float scale, int64_t window, float softcap) {
  decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, B, Hq, Hkv, D, bs,
                   table_stride, q_stride, out_stride, scale, window, softcap);
}

void pw_decode_attention_bf16(bf16* out, const bf16* q, const bf16* k_cache,
                              const bf16* v_cache, const int64_t* block_tables,
                              const int64_t* context_lens, int64_t B, int64_t Hq, int64_t Hkv,
                              int64_t D, int64_t bs, int64_t table_stride, int64_t q_stride,
                              int64_t out_stride, float scale, int64_t window, float softcap) {
  if (pw_decode_attention_tiled_bf16(out, q, k_cache, v_cache, block_tables, context_lens, B, Hq,
                                     Hkv, D, bs, table_stride, q_stride, out_stride, scale,
                                     window, softcap))
    return;
  decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, B, Hq, Hkv, D, bs,
                   table_stride, q_stride, out_stride, scale, window, softcap);
}

// Copy each token's keys and values (row_bytes each, rows `k_stride` / `v_stride` bytes apart)
// into cache slot slots[t] (rows row_bytes apart). Slots are distinct, so tokens are
// independent.
void pw_write_kv(char* k_cache, char* v_cache, const char* k, const char* v,
                 const int64_t* slots, int64_t T, int64_t row_bytes, int64_t k_stride,
                 int64_t v_stride) {
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(k_cache + slots[t] * row_bytes, k + t * k_stride, row_bytes);
    std::memcpy(v_cache + slots[t] * row_bytes, v + t * v_stride, row_bytes);
  }
}

}  // extern "C"
