// Decode attention over the paged KV cache for any head dim and cache type: float32 or
// bfloat16 caches (PlainCache) and quantized ones (kv_quant.h Cache), sliding windows and
// soft-capped scores. Each work item (a sequence, some of its kv heads, a range of its
// context) runs an online softmax block by block, all G query heads of a kv head together;
// head dims 64 and 128 take the row kernels of paged_decode_avx2.h. (decode_attention.cpp
// has the tiled AVX512-BF16 kernel for bfloat16 caches of head dim 64 or 128.) Included by
// cpu_kernels.cpp and kv_cache.cpp.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "paged_decode_avx2.h"

namespace pw::paged {

// Built with -ffast-math (vectorized exp, reassociated sums), which assumes finite values:
// "no score yet" is a large finite negative, not -inf.
constexpr float kNoScore = -1e30f;

// e^x for x <= 0, from e^-87 down held there: never a denormal (the library is linked
// without flush-to-zero, kernels/native.py), so no slow denormal arithmetic follows.
inline float exp_normal(float x) { return std::exp(std::max(x, -87.f)); }

// A hint every other 64-byte line: the line beside each comes with it, and a hint per line
// cost more instructions than it saved (bench/NOTES.md "Decode attention").
template <typename E>
inline void prefetch_rows(const E* rows, int64_t n, int64_t row_stride, int64_t row_bytes) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t off = 0; off < row_bytes; off += 128)
      __builtin_prefetch(reinterpret_cast<const char*>(rows + t * row_stride) + off);
}

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// A cache of T as attention reads it: rows of nkv heads of D values (kv_quant.h's Cache is
// the quantized one).
template <typename T>
struct PlainCache {
  using E = T;
  static constexpr int64_t kExtra = 0;     // elements after each head's D values
  static void load(const T* row, float* dst, int64_t nkv, int64_t D) { load_row(row, dst, nkv * D); }
};

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
template <typename C, int64_t kD>
inline void accumulate_pv(float* acc, const float* scores, const typename C::E* v, float* row,
                          int64_t n, int64_t row_stride, int64_t nkv, int64_t G, int64_t bs,
                          int64_t D) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<C, PlainCache<bf16>> && kD > 0 && kD % 16 == 0) {
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
    C::load(v + t * row_stride, row, nkv, D);
    for (int64_t h = 0; h < H; ++h) axpy(acc + h * D, scores[h * bs + t], row + (h / G) * D, D);
  }
}

// The block's n rows (kv heads from the one at `rows`, nh of them) as float32 rows of
// `stride` floats, head j at j * D: a float32 cache as it is, any other widened into buf.
template <typename C>
inline const float* rows_f32(const typename C::E* rows, int64_t n, int64_t row_stride,
                             int64_t nh, int64_t D, float* buf, int64_t& stride) {
  if constexpr (std::is_same_v<C, PlainCache<float>>) {
    stride = row_stride;
    return rows;
  } else {
    for (int64_t t = 0; t < n; ++t) C::load(rows + t * row_stride, buf + t * nh * D, nh, D);
    stride = nh * D;
    return buf;
  }
}

// Whether a block goes through paged_decode_avx2.h: float32 rows of a head dim the kernels
// unroll, unless AVX512-BF16 multiplies a bfloat16 cache directly.
template <typename T, typename C, int64_t kD>
constexpr bool kRowKernels = kD > 0 && kD % 32 == 0 && !(std::is_same_v<C, PlainCache<T>> &&
                                                          kDirectQK<T, kD>);

// Scores of one block: scores[h * bs + t] = scale * q_h . k_t for the H = nh * G query heads.
template <typename T, typename C, int64_t kD>
inline void block_scores(float* scores, const T* q, const float* qf, const typename C::E* krows,
                         float* buf, float* row, int64_t n, int64_t row_stride, int64_t nh,
                         int64_t G, int64_t bs, int64_t D, float scale) {
  const int64_t H = nh * G;
  if constexpr (kRowKernels<T, C, kD>) {
    if (bs % 8 == 0) {
      int64_t stride;
      const float* k = rows_f32<C>(krows, n, row_stride, nh, D, buf, stride);
      for (int64_t j = 0; j < nh; ++j)
        qk_f32_group<kD>(scores + j * G * bs, bs, qf + j * G * kD, G, k + j * kD, stride, n,
                         scale);
      return;
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    const typename C::E* krow = krows + t * row_stride;
    if constexpr (std::is_same_v<C, PlainCache<T>> && kDirectQK<T, kD>) {
      for (int64_t h = 0; h < H; ++h)
        scores[h * bs + t] = scale * qk_dot<T, kD>(q + h * D, nullptr, krow + (h / G) * D,
                                                   nullptr, D);
    } else {
      C::load(krow, row, nh, D);
      for (int64_t h = 0; h < H; ++h)
        scores[h * bs + t] = scale * dot(qf + h * D, row + (h / G) * D, D);
    }
  }
}

// acc[h] += sum_t p[h][t] * V[t][kv head of h] over one block.
template <typename T, typename C, int64_t kD>
inline void block_values(float* acc, const float* p, const typename C::E* vrows, float* buf,
                         float* row, int64_t n, int64_t row_stride, int64_t nh, int64_t G,
                         int64_t bs, int64_t D) {
  if constexpr (kRowKernels<T, C, kD>) {
    if (bs % 8 == 0) {
      int64_t stride;
      const float* v = rows_f32<C>(vrows, n, row_stride, nh, D, buf, stride);
      for (int64_t j = 0; j < nh; ++j)
        pv_f32_group<kD>(acc + j * G * kD, p + j * G * bs, bs, G, v + j * kD, stride, n);
      return;
    }
  }
  accumulate_pv<C, kD>(acc, p, vrows, row, n, row_stride, nh, G, bs, D);
}

// Folds a block's raw scores into the online softmax: scores become exp(s - m) in place, and
// m, l and the accumulators are rescaled to the new running maximum.
inline void online_softmax(float* scores, float* m, float* l, float* acc, int64_t H, int64_t n,
                           int64_t bs, int64_t D) {
  for (int64_t h = 0; h < H; ++h) {
    float* sh = scores + h * bs;
    const float new_m = std::max(m[h], *std::max_element(sh, sh + n));
    const float alpha = exp_normal(m[h] - new_m);
    float sum = 0.f;
#pragma omp simd simdlen(8) reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) { sh[t] = exp_normal(sh[t] - new_m); sum += sh[t]; }
    l[h] = l[h] * alpha + sum;
    m[h] = new_m;
    if (alpha != 1.f)
      for (int64_t d = 0; d < D; ++d) acc[h * D + d] *= alpha;
  }
}

// out [H, D] from `parts` softmax states (m [H], l [H], acc [H, D], `width` floats apart):
// each part's sums rescaled to the largest maximum, then normalized. acc: D floats of room.
// lse (if not null) [H]: log of each head's sum of exp(score), for merging with attention
// over other keys (cascade attention); kNoScore where the head attended nothing.
template <typename T>
void merge_parts(T* out, const float* state, int64_t parts, int64_t width, int64_t H,
                 int64_t D, float* acc, float* lse) {
  for (int64_t h = 0; h < H; ++h) {
    const float* sum = state + 2 * H + h * D;   // one part (the usual case): its own sums
    float total = state[H + h], top = state[h];
    if (parts > 1) {
      top = kNoScore;
      for (int64_t p = 0; p < parts; ++p) top = std::max(top, state[p * width + h]);
      std::fill(acc, acc + D, 0.f);
      total = 0.f;
      for (int64_t p = 0; p < parts; ++p) {
        const float* part = state + p * width;
        const float w = exp_normal(part[h] - top);
        total += part[H + h] * w;
        axpy(acc, w, part + 2 * H + h * D, D);
      }
      sum = acc;
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t d = 0; d < D; ++d) from_float(sum[d] * inv, out + h * D + d);
    if (lse) lse[h] = total > 0.f ? top + std::log(total) : kNoScore;
  }
}

// The online softmax over tokens [lo, hi) of one sequence (lo, hi multiples of bs or the
// ends of its context), for the G query heads of each kv head in [h0, h1): m [H] running
// maxima, l [H] sums and acc [H, D] unnormalized outputs, which start as kNoScore, 0 and 0.
// softcap > 0: each score becomes softcap * tanh(score / softcap) (Gemma2).
template <typename T, typename C, int64_t kD>
void attend_range(float* m, float* l, float* acc, const T* q, const typename C::E* k_cache,
                  const typename C::E* v_cache, const int64_t* table, int64_t lo, int64_t hi,
                  int64_t h0, int64_t h1, int64_t Hkv, int64_t G, int64_t D_, int64_t bs,
                  float scale, float softcap) {
  const int64_t D = kD ? kD : D_;   // a compile-time head dim unrolls the inner loops
  const int64_t nh = h1 - h0, H = nh * G;          // kv heads and query heads handled here
  constexpr bool widens = !std::is_same_v<C, PlainCache<float>>;   // rows_f32 needs a buffer
  std::vector<float> qf(H * D), row(nh * D), scores(H * bs), buf(widens ? bs * nh * D : 0);
  const T* qh0 = q + h0 * G * D;
  load_row(qh0, qf.data(), H * D);
  const int64_t head = D + C::kExtra, row_stride = Hkv * head;     // in cache elements
  const int64_t row_bytes = nh * head * static_cast<int64_t>(sizeof(typename C::E));
  for (int64_t start = lo / bs * bs; start < hi; start += bs) {
    const int64_t n = std::min(bs, hi - start);
    const int64_t base = table[start / bs] * bs * row_stride + h0 * head;
    // Blocks are scattered, so the hardware cannot guess the next one: prefetch the keys of
    // the next block while this one's scores are computed, its values during the value pass.
    const bool has_next = start + bs < hi;
    const int64_t next = has_next ? table[start / bs + 1] * bs * row_stride + h0 * head : 0;
    if (has_next) prefetch_rows(k_cache + next, n, row_stride, row_bytes);
    block_scores<T, C, kD>(scores.data(), qh0, qf.data(), k_cache + base, buf.data(), row.data(),
                           n, row_stride, nh, G, bs, D, scale);
    if (softcap > 0.f)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < n; ++t)
          scores[h * bs + t] = softcap * std::tanh(scores[h * bs + t] / softcap);
    for (int64_t t = 0; start + t < lo; ++t)      // before the range (a window's start)
      for (int64_t h = 0; h < H; ++h) scores[h * bs + t] = -INFINITY;
    online_softmax(scores.data(), m, l, acc, H, n, bs, D);
    if (has_next) prefetch_rows(v_cache + next, n, row_stride, row_bytes);
    block_values<T, C, kD>(acc, scores.data(), v_cache + base, buf.data(), row.data(), n,
                           row_stride, nh, G, bs, D);
  }
}

// Work items of a decode batch: (sequence, kv heads [h0, h1), blocks of its attended range).
// Whole sequences when there are enough of them (each token row is then read once); a small
// batch is split by kv head, and where that still leaves a thread short of two items, long
// contexts are split into parts of at least kPartBlocks blocks, their softmax states merged.
// Items i * parts .. + parts - 1 are one (sequence, kv heads)'s parts. Also the tiled
// kernels' (decode_attention.cpp). window > 0: only the last `window` keys are attended.
constexpr int64_t kPartBlocks = 8;

class DecodeItems {
 public:
  struct Item {
    int64_t b, h0, h1, lo, hi;   // sequence, kv heads, keys [lo, hi) (lo >= a window's start)
  };
  int64_t splits, parts;

  DecodeItems(const int64_t* context_lens, int64_t B, int64_t Hkv, int64_t bs, int64_t window)
      : lens_(context_lens), B_(B), Hkv_(Hkv), bs_(bs), window_(window) {
    int64_t max_blocks = 0;
    for (int64_t b = 0; b < B; ++b)
      max_blocks = std::max(max_blocks, (lens_[b] + bs - 1) / bs - first(b) / bs);
    const int64_t want = 2 * at::get_num_threads();
    splits = B < want ? Hkv : 1;
    parts = B * splits >= want ? 1
            : std::clamp<int64_t>((want + B * splits - 1) / (B * splits), 1,
                                  std::max<int64_t>(1, max_blocks / kPartBlocks));
  }
  int64_t count() const { return B_ * splits * parts; }
  Item item(int64_t i) const {
    const int64_t b = i / (splits * parts), split = i / parts % splits, p = i % parts;
    const int64_t b0 = first(b) / bs_, nblk = (lens_[b] + bs_ - 1) / bs_ - b0;
    return {b, split * Hkv_ / splits, (split + 1) * Hkv_ / splits,
            std::max(first(b), (b0 + p * nblk / parts) * bs_),
            std::min(lens_[b], (b0 + (p + 1) * nblk / parts) * bs_)};
  }

 private:
  int64_t first(int64_t b) const {
    return window_ > 0 ? std::max<int64_t>(0, lens_[b] - window_) : int64_t{0};
  }
  const int64_t* lens_;
  int64_t B_, Hkv_, bs_, window_;
};

// window > 0: only the last `window` positions are attended (sliding-window layers).
// lse (if not null): [B, Hq] log-sum-exp of each row's scores (merge_parts).
template <typename T, typename C>
void decode_attention(T* out, const T* q, const typename C::E* k_cache,
                      const typename C::E* v_cache,
                      const int64_t* block_tables, const int64_t* context_lens, int64_t B,
                      int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t table_stride,
                      int64_t q_stride, int64_t out_stride, float scale, int64_t window,
                      float softcap, float* lse) {
  const int64_t G = Hq / Hkv;
  const DecodeItems items(context_lens, B, Hkv, bs, window);
  const int64_t width = Hq * (D + 2);          // an item's m [H], l [H], acc [H, D]
  // Each item sets its own state first: left uninitialized here.
  const std::unique_ptr<float[]> state(new float[items.count() * width]);
  auto fn = D == 64 ? attend_range<T, C, 64> : D == 128 ? attend_range<T, C, 128>
                                                        : attend_range<T, C, 0>;
  at::parallel_for(0, items.count(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const DecodeItems::Item it = items.item(i);
      const int64_t H = (it.h1 - it.h0) * G;
      float* m = state.get() + i * width;
      std::fill(m, m + H, kNoScore);
      std::fill(m + H, m + 2 * H + H * D, 0.f);
      if (it.lo < it.hi)
        fn(m, m + H, m + 2 * H, q + it.b * q_stride, k_cache, v_cache,
           block_tables + it.b * table_stride, it.lo, it.hi, it.h0, it.h1, Hkv, G, D, bs, scale,
           softcap);
    }
  });
  at::parallel_for(0, B * items.splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t s = begin; s < end; ++s) {
      const DecodeItems::Item it = items.item(s * items.parts);
      merge_parts(out + it.b * out_stride + it.h0 * G * D, state.get() + s * items.parts * width,
                  items.parts, width, (it.h1 - it.h0) * G, D, acc.data(),
                  lse ? lse + it.b * Hq + it.h0 * G : nullptr);
    }
  });
}

}  // namespace pw::paged
