// The quantized matmuls (quant_kernels.cpp) on CPUs without a bfloat16 dot product: AVX2 +
// FMA + F16C, the x86-64 baseline (also built into the AVX-512 tier). Same tiles, same
// contract: each weight's exact value (d * q + m, d * q) times the activations in float32.
//
// A 16-row tile is read as two 8-row halves, a float32 lane per output row: the nibbles or
// bytes of 8 rows widen to int32 lanes, convert exactly to float32 and multiply a broadcast
// activation, so a block's sums need no horizontal adds. Per 32-column block a half keeps
// sum(x q) per token in float32, then adds d * sum(x q) + m * sum(x) to the row's total, the
// order the AVX512-BF16 kernels use.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

namespace pw::avx2 {

constexpr int64_t kRows = 16, kQ4Tile = 320, kQ8Tile = 544;
constexpr int kMaxBatch = 4;      // tokens per pass over the weights (16 ymm registers)

// x in float32 [T][K] and, for Q4_1's minimum, its sums over each 32-column block [T][K/32].
struct Activations {
  int64_t T, K;
  std::vector<float> xf, sums;

  template <typename In>
  Activations(const In* x, int64_t x_stride, int64_t T_, int64_t K_, bool block_sums)
      : T(T_), K(K_), xf(T_ * K_) {
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) xf[t * K + k] = to_float(x[t * x_stride + k]);
    if (!block_sums) return;
    sums.assign(T * (K / 32), 0.f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) sums[t * (K / 32) + k / 32] += xf[t * K + k];
  }
};

inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store8(bf16* out, __m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int i = 0; i < 8; ++i) from_float(f[i], out + i);
}

inline __m256 fp16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Q4_1, rows [8h, 8h + 8) of tile groups [g0, g1), M tokens. Byte [j][l][p] of a tile holds
// columns 2j + p (low nibble) and 2j + 16 + p (high) of row l, so row l's 16-bit word at step
// j carries four columns: bits 0-3 (2j), 8-11 (2j + 1), 4-7 (2j + 16), 12-15 (2j + 17).
template <int M, typename Out>
void q4_1_rows(Out* out, int64_t os, const float* x, const float* sums, const uint8_t* packed,
               int64_t K, int64_t g0, int64_t g1, int h) {
  const int64_t nb = K / 32;
  const __m256i nibble = _mm256_set1_epi32(0xF);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* tile = packed + g * nb * kQ4Tile;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, tile += kQ4Tile) {
      __m256 lo[M], hi[M];          // columns < 16 and >= 16: two FMA chains per token
      for (int m = 0; m < M; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_cvtepu16_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 32 * j + 16 * h)));
        const __m256 c0 = _mm256_cvtepi32_ps(_mm256_and_si256(w, nibble));
        const __m256 c1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, 8), nibble));
        const __m256 c16 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, 4), nibble));
        const __m256 c17 = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 12));
        for (int m = 0; m < M; ++m) {
          const float* xb = x + m * K + b * 32 + 2 * j;
          lo[m] = _mm256_fmadd_ps(c0, _mm256_broadcast_ss(xb), lo[m]);
          hi[m] = _mm256_fmadd_ps(c16, _mm256_broadcast_ss(xb + 16), hi[m]);
          lo[m] = _mm256_fmadd_ps(c1, _mm256_broadcast_ss(xb + 1), lo[m]);
          hi[m] = _mm256_fmadd_ps(c17, _mm256_broadcast_ss(xb + 17), hi[m]);
        }
      }
      const __m256 d = fp16x8(tile + 256 + 16 * h), mn = fp16x8(tile + 288 + 16 * h);
      for (int m = 0; m < M; ++m) {   // sum of x * (d q + m) = d * sum(x q) + m * sum(x)
        acc[m] = _mm256_fmadd_ps(_mm256_add_ps(lo[m], hi[m]), d, acc[m]);
        acc[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sums[m * nb + b]), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) store8(out + m * os + g * kRows + 8 * h, acc[m]);
  }
}

// Q8_0, rows [8h, 8h + 8): byte [k][l] of a tile is column k of row l.
template <int M, typename Out>
void q8_0_rows(Out* out, int64_t os, const float* x, const uint8_t* packed, int64_t K,
               int64_t g0, int64_t g1, int h) {
  const int64_t nb = K / 32;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* tile = packed + g * nb * kQ8Tile;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, tile += kQ8Tile) {
      __m256 even[M], odd[M];
      for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm256_setzero_ps();
      for (int k = 0; k < 32; k += 2) {
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + 16 * k + 8 * h))));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + 16 * k + 16 + 8 * h))));
        for (int m = 0; m < M; ++m) {
          const float* xb = x + m * K + b * 32 + k;
          even[m] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xb), even[m]);
          odd[m] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(xb + 1), odd[m]);
        }
      }
      const __m256 d = fp16x8(tile + 512 + 16 * h);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_add_ps(even[m], odd[m]), d, acc[m]);
    }
    for (int m = 0; m < M; ++m) store8(out + m * os + g * kRows + 8 * h, acc[m]);
  }
}

// Work items are (group, half) pairs, so even a 16-row weight splits over two threads.
template <int M, typename Out>
void pass(Out* out, int64_t os, const Activations& a, int64_t t, const uint8_t* packed,
          int64_t N, bool q4) {
  const float* x = a.xf.data() + t * a.K;
  const float* sums = q4 ? a.sums.data() + t * (a.K / 32) : nullptr;
  at::parallel_for(0, 2 * (N / kRows), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (q4)
        q4_1_rows<M>(out, os, x, sums, packed, a.K, i / 2, i / 2 + 1, static_cast<int>(i % 2));
      else
        q8_0_rows<M>(out, os, x, packed, a.K, i / 2, i / 2 + 1, static_cast<int>(i % 2));
    }
  });
}

// out [T, N] = x [T, K] @ W^T from the packed tiles (N a multiple of 16, K of 32).
template <typename T>
void matmul(T* out, int64_t out_stride, const T* x, int64_t x_stride, int64_t tokens,
            const uint8_t* packed, int64_t N, int64_t K, bool q4) {
  const Activations a(x, x_stride, tokens, K, q4);
  for (int64_t t = 0; t < tokens; t += kMaxBatch) {
    T* o = out + t * out_stride;
    switch (std::min<int64_t>(kMaxBatch, tokens - t)) {
      case 1: pass<1>(o, out_stride, a, t, packed, N, q4); break;
      case 2: pass<2>(o, out_stride, a, t, packed, N, q4); break;
      case 3: pass<3>(o, out_stride, a, t, packed, N, q4); break;
      default: pass<4>(o, out_stride, a, t, packed, N, q4); break;
    }
  }
}

}  // namespace pw::avx2
