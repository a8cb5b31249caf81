// The quantized matmuls' tiles (quant_tiles.h) times activations rounded to integers, on
// every tier from AVX2 up (quant_kernels.cpp's kinds + 100 and + 200).
//
// Each token's activations are rounded per 32-column block to P int8 planes: P = 1 is int8
// (scale max|x| / 127: llama.cpp's arithmetic, --quantized-activations int8); P = 2 is
// int16 split as q = 128 hi + lo, hi in [-127, 127] and lo in [-64, 63] (scale
// max|x| / 16256: 15 bits a block, finer than bfloat16's 8-bit mantissa). Products are then
// integer: vpmaddubsw multiplies a row's two adjacent nibble columns (bytes [j][l][0..1] of a
// tile, unsigned) by a plane's broadcast pair and adds them, one int16 lane per row; eight
// steps of <= 2 * 15 * 127 each stay within int16. A block's plane sums combine exactly in
// int32 (128 s_hi + s_lo), times d and the activation scale, plus m * sum(x) (the float sum
// of the unrounded activations). A plane costs about a third of the exact kernels'
// instructions a weight; the error is the rounding's, at most half a scale an activation.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "quant_avx2.h"     // store8, add_minimums, in_register, kRows, kMaxBatch
#include "quant_tiles.h"
#include "quant_gemm_avx2.h"   // int16 activations from kGemmFrom tokens; IntActivations
#include "quant_gemm_int8_avx2.h"   // int8 activations from kInt8GemmFrom tokens

namespace pw::avx2 {

inline __m256i pair_of(const int8_t* q) {    // (q[0], q[1]) in every 16-bit lane
  int16_t v;
  std::memcpy(&v, q, 2);
  return _mm256_set1_epi16(v);
}

// The P planes' int32 sums of one row lane, combined: plane 0 the most significant.
template <int P>
inline __m256i combine(const __m256i* planes) {
  __m256i total = planes[0];
  for (int p = 1; p < P; ++p) total = _mm256_add_epi32(_mm256_slli_epi32(total, 7), planes[p]);
  return total;
}

inline __m256i widen_half(__m256i v, int half) {   // int16 lanes 8 half .. 8 half + 7 as int32
  return _mm256_cvtepi16_epi32(half ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v));
}

// Tile groups [g0, g1) (16 rows each) of Q4 tiles for M tokens starting at token t.
template <int M, int P, typename Tile, typename Out>
void q4_int_groups(Out* out, int64_t os, const IntActivations<P>& a, int64_t t,
                   const uint8_t* packed, int64_t g0, int64_t g1) {
  const int64_t nb = a.K / 32;
  const float* sums = Tile::kMin ? a.sum.data() + t * nb * Tile::kSplits : nullptr;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = packed + g * nb * Tile::kBytes;
    __m256 acc[2][M];                 // [rows 0-7, rows 8-15][token]
    for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* tile = Tile::at(group, b);
      prefetch_ahead<Tile>(group, b);
      __m256i lo[M][P], hi[M][P];     // int16 sums of columns < 16 and >= 16, a lane per row
      for (int m = 0; m < M; ++m)
        for (int p = 0; p < P; ++p) lo[m][p] = hi[m][p] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * j));
        const __m256i w_lo = _mm256_and_si256(w, low);
        const __m256i w_hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
        for (int m = 0; m < M; ++m)
          for (int p = 0; p < P; ++p) {
            const int8_t* xq = a.plane(t + m, p) + b * 32 + 2 * j;
            lo[m][p] = _mm256_add_epi16(lo[m][p], _mm256_maddubs_epi16(w_lo, pair_of(xq)));
            hi[m][p] = _mm256_add_epi16(hi[m][p], _mm256_maddubs_epi16(w_hi, pair_of(xq + 16)));
            in_register(lo[m][p]), in_register(hi[m][p]);
          }
      }
      for (int half = 0; half < 2; ++half) {
        const __m256 d = Tile::scales8(tile, b, 0, half);
        for (int m = 0; m < M; ++m) {
          __m256i planes[P];
          for (int p = 0; p < P; ++p)
            planes[p] = _mm256_add_epi32(widen_half(lo[m][p], half), widen_half(hi[m][p], half));
          const __m256 qx = _mm256_cvtepi32_ps(combine<P>(planes));
          const __m256 dx = _mm256_set1_ps(a.scale[(t + m) * nb + b]);
          acc[half][m] = _mm256_fmadd_ps(_mm256_mul_ps(qx, dx), d, acc[half][m]);
        }
        add_minimums<Tile>(acc[half], tile, half, sums, nb, b);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int half = 0; half < 2; ++half)
        store8(out + m * os + g * kRows + 8 * half, acc[half][m]);
  }
}

// Q8 tiles for integer activations (kernels/quant.py packs them so when asked): byte
// [j][l][c] is column 4j + c of row l (a row's four columns adjacent), then the scales. A
// block's steps j split evenly among its scale arrays (Q6_K: j < 4 under the first).
//
// Times int16 activations: a half's 32 bytes (8 rows x 4 columns) widen to int16 as two
// registers of 4 rows, two 32-bit lanes a row (columns 4j, 4j + 1 and 4j + 2, 4j + 3), and
// vpmaddwd multiplies them by the token's four activations (a broadcast 64-bit word):
// 2 * 128 * 16256 a lane, 32 columns' sums well within int32. vphaddd joins a row's two lanes
// at a split's end; its order (rows 0 1 4 5 | 2 3 6 7) is undone by row_order.
//
// i16_split_sums: split s of block b's int32 sums for kHalves halves from h0 (a row's two lanes, [token][half]
// [rows 0-3, rows 4-7]): the tile's codes widened to int16, times the token's four
// activations broadcast as one 64-bit word.
template <int M, int kHalves, typename Tile>
inline void i16_split_sums(__m256i (&sum)[M][kHalves][2], const IntActivations<2>& a, int64_t t,
                           const uint8_t* tile, int64_t b, int s, int h0) {
  constexpr int kSteps = 8 / Tile::kSplits;
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < kHalves; ++i) sum[m][i][0] = sum[m][i][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int j = s * kSteps; j < (s + 1) * kSteps; ++j) {
    __m256i xq[M];
    for (int m = 0; m < M; ++m) {
      int64_t quad;
      std::memcpy(&quad, a.value.data() + (t + m) * a.K + b * 32 + 4 * j, 8);
      xq[m] = _mm256_set1_epi64x(quad);
    }
    for (int i = 0; i < kHalves; ++i) {
      __m256i w0, w1;
      if constexpr (Tile::kLevels != kNoLevels) {
        const __m256i w = level_codes<Tile>(tile, j, h0 + i);
        w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
        w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
      } else {
        const uint8_t* w = tile + 64 * j + 32 * (h0 + i);
        w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
        w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
      }
      for (int m = 0; m < M; ++m) {
        sum[m][i][0] = _mm256_add_epi32(sum[m][i][0], _mm256_madd_epi16(w0, xq[m]));
        sum[m][i][1] = _mm256_add_epi32(sum[m][i][1], _mm256_madd_epi16(w1, xq[m]));
      }
    }
  }
}

// q8_i16_groups: the kernel, a row's float32 lane at each split's end.
template <int M, typename Tile, typename Out>
void q8_i16_groups(Out* out, int64_t os, const IntActivations<2>& a, int64_t t,
                   const uint8_t* packed, int64_t g0, int64_t g1) {
  // Both 8-row halves at once where the sums fit the registers (one or two tokens: one pass
  // over the tiles), else one half after the other.
  constexpr int kHalves = M <= 2 ? 2 : 1;
  const int64_t nb = a.K / 32;
  const float* sums = Tile::kMin ? a.sum.data() + t * nb * Tile::kSplits : nullptr;
  const __m256i row_order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  for (int64_t g = g0; g < g1; ++g)
    for (int h0 = 0; h0 < 2; h0 += kHalves) {
      const uint8_t* group = packed + g * nb * Tile::kBytes;
      __m256 acc[kHalves][M];
      for (int i = 0; i < kHalves; ++i)
        for (int m = 0; m < M; ++m) acc[i][m] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* tile = Tile::at(group, b);
        prefetch_ahead<Tile>(group, b);
        for (int i = 0; i < kHalves; ++i)
          add_minimums<Tile>(acc[i], tile, h0 + i, sums, nb, b);    // sums of the unrounded x
        for (int s = 0; s < Tile::kSplits; ++s) {
          __m256i sum[M][kHalves][2];
          i16_split_sums<M, kHalves, Tile>(sum, a, t, tile, b, s, h0);
          for (int i = 0; i < kHalves; ++i) {
            const __m256 d = Tile::scales8(tile, b, s, h0 + i);
            for (int m = 0; m < M; ++m) {
              const __m256i rows = _mm256_permutevar8x32_epi32(
                  _mm256_hadd_epi32(sum[m][i][0], sum[m][i][1]), row_order);
              const __m256 dx = _mm256_set1_ps(a.scale[(t + m) * nb + b]);
              acc[i][m] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(rows), dx), d,
                                          acc[i][m]);
            }
          }
        }
      }
      for (int i = 0; i < kHalves; ++i)
        for (int m = 0; m < M; ++m) store8(out + m * os + g * kRows + 8 * (h0 + i), acc[i][m]);
    }
}

// Times int8 activations: vpmaddubsw wants unsigned times signed: |w| times x with w's sign,
// two products a lane (<= 2 * 128 * 127), then vpmaddwd adds the lanes of one row: an int32
// lane per row.
template <int M, typename Tile, typename Out>
void q8_i8_groups(Out* out, int64_t os, const IntActivations<1>& a, int64_t t,
                  const uint8_t* packed, int64_t g0, int64_t g1) {
  constexpr int kSteps = 8 / Tile::kSplits;
  const int64_t nb = a.K / 32;
  const float* sums = Tile::kMin ? a.sum.data() + t * nb * Tile::kSplits : nullptr;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = packed + g * nb * Tile::kBytes;
    __m256 acc[2][M];                 // [rows 0-7, rows 8-15][token]
    for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* tile = Tile::at(group, b);
      prefetch_ahead<Tile>(group, b);
      for (int half = 0; half < 2; ++half)     // sums of the unrounded x
        add_minimums<Tile>(acc[half], tile, half, sums, nb, b);
      for (int s = 0; s < Tile::kSplits; ++s) {
        __m256i sum[M][2];
        for (int m = 0; m < M; ++m) sum[m][0] = sum[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = s * kSteps; j < (s + 1) * kSteps; ++j)
          for (int half = 0; half < 2; ++half) {
            const __m256i w = int_codes<Tile>(tile, j, half);
            const __m256i w_abs = _mm256_abs_epi8(w);
            for (int m = 0; m < M; ++m) {
              int32_t quad;
              std::memcpy(&quad, a.plane(t + m, 0) + b * 32 + 4 * j, 4);
              const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(quad), w);
              sum[m][half] = _mm256_add_epi32(
                  sum[m][half], _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, xs), ones));
            }
          }
        for (int half = 0; half < 2; ++half) {
          const __m256 d = Tile::scales8(tile, b, s, half);
          for (int m = 0; m < M; ++m) {
            const __m256 dx = _mm256_set1_ps(a.scale[(t + m) * nb + b]);
            const __m256 qx = _mm256_cvtepi32_ps(sum[m][half]);
            acc[half][m] = _mm256_fmadd_ps(_mm256_mul_ps(qx, dx), d, acc[half][m]);
          }
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int half = 0; half < 2; ++half)
        store8(out + m * os + g * kRows + 8 * half, acc[half][m]);
  }
}

// M tokens of one tile format's groups: Q4 tiles keep P planes' sums a token in registers.
template <int M, int P, typename Tile, typename T> struct IntGroups {
  static constexpr int kBatch = Tile::kQ4 ? kMaxBatch / P : kMaxBatch;
  static void run(T* o, int64_t os, const IntActivations<P>& a, int64_t t, const uint8_t* p,
                  int64_t g0, int64_t g1) {
    if constexpr (Tile::kQ4)
      q4_int_groups<M, P, Tile>(o, os, a, t, p, g0, g1);
    else if constexpr (P == 2)
      q8_i16_groups<M, Tile>(o, os, a, t, p, g0, g1);
    else
      q8_i8_groups<M, Tile>(o, os, a, t, p, g0, g1);
  }
};

// out [T, N] = x [T, K] @ W^T with x rounded to P int8 planes per block (N a multiple of 16,
// K of 32), kBatch tokens a pass (as many as keep the sums in registers).
template <int P, typename Tile, typename T>
void matmul_int(T* out, int64_t out_stride, const T* x, int64_t x_stride, int64_t tokens,
                const uint8_t* packed, int64_t N, int64_t K) {
  constexpr int kBatch = IntGroups<1, P, Tile, T>::kBatch;
  if constexpr (P == 2)
    if (tokens >= kGemmFrom)
      return matmul_int16_gemm<Tile>(out, out_stride, x, x_stride, tokens, packed, N, K);
  if constexpr (P == 1)
    if (tokens >= kInt8GemmFrom<Tile>)
      return matmul_int8_gemm<Tile>(out, out_stride, x, x_stride, tokens, packed, N, K);
  const IntActivations<P> a(x, x_stride, tokens, K, Tile::kSumGroups);
  for (int64_t t = 0; t < tokens; t += kBatch) {
    T* o = out + t * out_stride;
    const int64_t m = std::min<int64_t>(kBatch, tokens - t);
    at::parallel_for(0, N / kRows, 1, [&](int64_t g0, int64_t g1) {
      switch (m) {
        case 1: IntGroups<1, P, Tile, T>::run(o, out_stride, a, t, packed, g0, g1); break;
        case 2: IntGroups<2, P, Tile, T>::run(o, out_stride, a, t, packed, g0, g1); break;
        case 3: IntGroups<3, P, Tile, T>::run(o, out_stride, a, t, packed, g0, g1); break;
        default: IntGroups<4, P, Tile, T>::run(o, out_stride, a, t, packed, g0, g1); break;
      }
    });
  }
}

}  // namespace pw::avx2
