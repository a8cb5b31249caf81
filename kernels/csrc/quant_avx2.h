// The quantized matmuls (quant_kernels.cpp) on CPUs without a bfloat16 dot product: AVX2 +
// FMA + F16C, the x86-64 baseline (also built into the AVX-512 tier). Same tiles, same
// contract: each weight's exact value (d * q + m, d * q) times the activations in float32.
//
// A 16-row tile is read as two 8-row halves, a float32 lane per output row: the nibbles or
// bytes of 8 rows widen to int32 lanes, convert exactly to float32 and multiply a broadcast
// activation, so a block's sums need no horizontal adds. A work item takes several halves at
// once, so enough independent FMA chains run to keep both FMA units busy. Per 32-column block a half keeps
// sum(x q) per token in float32, then adds d * sum(x q) + m * sum(x) to the row's total, the
// order the AVX512-BF16 kernels use.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
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

// A run of R consecutive 8-row halves starting at half `first` (half i: rows 8i .. 8i + 7,
// tile group i / 2): R * M independent sums per 32-column block (two chains each), so the
// FMAs' latency is hidden at batch 1 too (one chain per half would wait on itself).
template <int R>
struct Halves {
  const uint8_t* tile[R];     // each half's tile for the current block, at its half's offset
  int64_t col[R];             // each half's first output row
  Halves(const uint8_t* packed, int64_t tile_bytes, int64_t nb, int64_t first) {
    for (int r = 0; r < R; ++r) {
      const int64_t half = first + r;
      tile[r] = packed + (half / 2) * nb * tile_bytes;
      col[r] = half * 8;
    }
  }
};

// Q4_1. Byte [j][l][p] of a tile holds columns 2j + p (low nibble) and 2j + 16 + p (high) of
// row l, so row l's 16-bit word at step j carries four columns: bits 0-3 (2j), 8-11 (2j + 1),
// 4-7 (2j + 16), 12-15 (2j + 17).
template <int M, int R, typename Out>
void q4_1_halves(Out* out, int64_t os, const float* x, const float* sums, const uint8_t* packed,
                 int64_t K, int64_t first) {
  const int64_t nb = K / 32;
  const __m256i nibble = _mm256_set1_epi32(0xF);
  Halves<R> hv(packed, kQ4Tile, nb, first);
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 lo[M][R], hi[M][R];        // columns < 16 and >= 16
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) lo[m][r] = hi[m][r] = _mm256_setzero_ps();
    for (int j = 0; j < 8; ++j)
      for (int r = 0; r < R; ++r) {
        const int h = static_cast<int>(hv.col[r] / 8 % 2);
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(hv.tile[r] + b * kQ4Tile + 32 * j + 16 * h)));
        const __m256 c0 = _mm256_cvtepi32_ps(_mm256_and_si256(w, nibble));
        const __m256 c1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, 8), nibble));
        const __m256 c16 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, 4), nibble));
        const __m256 c17 = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 12));
        for (int m = 0; m < M; ++m) {
          const float* xb = x + m * K + b * 32 + 2 * j;
          lo[m][r] = _mm256_fmadd_ps(c0, _mm256_broadcast_ss(xb), lo[m][r]);
          hi[m][r] = _mm256_fmadd_ps(c16, _mm256_broadcast_ss(xb + 16), hi[m][r]);
          lo[m][r] = _mm256_fmadd_ps(c1, _mm256_broadcast_ss(xb + 1), lo[m][r]);
          hi[m][r] = _mm256_fmadd_ps(c17, _mm256_broadcast_ss(xb + 17), hi[m][r]);
        }
      }
    for (int r = 0; r < R; ++r) {     // sum of x * (d q + m) = d * sum(x q) + m * sum(x)
      const int h = static_cast<int>(hv.col[r] / 8 % 2);
      const uint8_t* tile = hv.tile[r] + b * kQ4Tile;
      const __m256 d = fp16x8(tile + 256 + 16 * h), mn = fp16x8(tile + 288 + 16 * h);
      for (int m = 0; m < M; ++m) {
        acc[m][r] = _mm256_fmadd_ps(_mm256_add_ps(lo[m][r], hi[m][r]), d, acc[m][r]);
        acc[m][r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sums[m * nb + b]), acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) store8(out + m * os + hv.col[r], acc[m][r]);
}

// Q8_0: byte [k][l] of a tile is column k of row l.
template <int M, int R, typename Out>
void q8_0_halves(Out* out, int64_t os, const float* x, const uint8_t* packed, int64_t K,
                 int64_t first) {
  const int64_t nb = K / 32;
  Halves<R> hv(packed, kQ8Tile, nb, first);
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 even[M][R], odd[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) even[m][r] = odd[m][r] = _mm256_setzero_ps();
    for (int k = 0; k < 32; k += 2)
      for (int r = 0; r < R; ++r) {
        const uint8_t* q = hv.tile[r] + b * kQ8Tile + 16 * k + 8 * (hv.col[r] / 8 % 2);
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16))));
        for (int m = 0; m < M; ++m) {
          const float* xb = x + m * K + b * 32 + k;
          even[m][r] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xb), even[m][r]);
          odd[m][r] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(xb + 1), odd[m][r]);
        }
      }
    for (int r = 0; r < R; ++r) {
      const __m256 d = fp16x8(hv.tile[r] + b * kQ8Tile + 512 + 16 * (hv.col[r] / 8 % 2));
      for (int m = 0; m < M; ++m)
        acc[m][r] = _mm256_fmadd_ps(_mm256_add_ps(even[m][r], odd[m][r]), d, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) store8(out + m * os + hv.col[r], acc[m][r]);
}

// Halves per work item for M tokens: about eight sums in flight whatever M.
template <int M> constexpr int kRun = M == 1 ? 4 : (M == 2 ? 2 : 1);

// M tokens over every half: work items of kRun<M> halves, a shorter run for the tail.
template <int M, typename Out>
void pass(Out* out, int64_t os, const Activations& a, int64_t t, const uint8_t* packed,
          int64_t N, bool q4) {
  constexpr int R = kRun<M>;
  const float* x = a.xf.data() + t * a.K;
  const float* sums = q4 ? a.sums.data() + t * (a.K / 32) : nullptr;
  const int64_t halves = N / 8, runs = halves / R;
  auto run = [&](auto r_const, int64_t first) {
    constexpr int RR = decltype(r_const)::value;
    if (q4)
      q4_1_halves<M, RR>(out, os, x, sums, packed, a.K, first);
    else
      q8_0_halves<M, RR>(out, os, x, packed, a.K, first);
  };
  at::parallel_for(0, runs, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) run(std::integral_constant<int, R>(), i * R);
  });
  for (int64_t half = runs * R; half < halves; ++half)
    run(std::integral_constant<int, 1>(), half);
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
