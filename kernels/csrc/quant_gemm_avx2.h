// Large steps (prefill chunks, big decode batches) of the quantized matmuls with int16
// activations (built into every tier from AVX2 up): a GEMM on the tiles as stored, so on the
// avx2 tier a GGUF model needs no dequantized float copy (kernels/quant.py
// blocks_serve_large_steps).
//
// Why integers: on AVX2 a vpmaddwd is 16 multiply-adds (8 lanes of two int16 products) and
// issues beside vpaddd, where vfmadd231ps is 8; at these sizes both are bound by the
// arithmetic, not the bytes read (bench/NOTES.md "int16 GEMM on AVX2").
//
// Each token's activations are rounded per 32-column block to 15 bits (scale max|x| / 16256,
// as the small kernels' IntActivations<2>: RoundedRows below rounds for both). A 16-row
// group's tiles are widened once per chunk of tokens into a panel of int16 pairs, whatever
// their tile type: per block and 8-row half, 16 steps s of 8 rows x (column 2s, 2s + 1) as
// one register, so vpmaddwd(panel, broadcast x pair) adds a row's two products into its
// int32 lane. A block's (or split's) int32 sums (<= 16 * 2 * 128 * 16256 < 2^31) then meet
// the scales in float32: acc += sum * d * scale(x) (+ m * sum(x) for tiles with minimums),
// as the small kernels do.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "quant_avx2.h"       // store8, kRows
#include "quant_tiles.h"

namespace pw::avx2 {

// Token chunk a panel serves before the next group's: its activations (<= 96 x K int16)
// stay in L2 while every group of a thread's share reads them.
constexpr int64_t kGemmChunk = 96;
constexpr int kGemmTokens = 3;    // tokens a kernel call keeps in registers (2 x 3 x 2 sums)
// From this many tokens of a step the GEMM beats the small kernels (quant_int_avx2.h), whose
// every pass of 4 tokens reads all the tiles again.
constexpr int64_t kGemmFrom = 12;
constexpr float kInt16Top = 127.f * 128.f;   // 16256: two int8 planes, 128 hi + lo

// x rounded per 32-column block to integers of at most `top` (r = nearbyint(x * top /
// max|x|): 16256 for int16 activations, 127 for int8; quant_int_avx2.h's IntActivations
// split them into planes), split over the threads: the values, each block's unit and the
// sums of the unrounded x over each of a block's `groups` column groups (0: none).
// The float sum of n (a multiple of 8) values in one fixed order, 8 lanes then halves, so
// that every tier's build (whose compiler would vectorize a loop its own way under
// -ffast-math) adds them alike: the int8 kernels' outputs then agree across tiers.
inline float column_sum(const float* v, int n) {
  __m256 lanes = _mm256_loadu_ps(v);
  for (int k = 8; k < n; k += 8) lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(v + k));
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
}

struct RoundedRows {
  int64_t T, K, nb, groups;
  std::vector<int16_t> value;      // [T][K]
  std::vector<float> scale;        // [T][nb]
  std::vector<float> sum;          // [T][nb][groups]

  template <typename In>
  RoundedRows(const In* x, int64_t x_stride, int64_t T_, int64_t K_, int groups_, float top)
      : T(T_), K(K_), nb(K_ / 32), groups(groups_), value(T_ * K_), scale(T_ * nb),
        sum(T_ * nb * groups_) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
      float v[32];
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t b = 0; b < nb; ++b) {
          const In* row = x + t * x_stride + b * 32;
          for (int k = 0; k < 32; ++k) v[k] = to_float(row[k]);
          __m256 peaks = _mm256_setzero_ps();
          for (int k = 0; k < 32; k += 8)
            peaks = _mm256_max_ps(peaks, _mm256_and_ps(_mm256_loadu_ps(v + k), abs_mask));
          alignas(32) float lanes[8];
          _mm256_store_ps(lanes, peaks);
          const float peak = *std::max_element(lanes, lanes + 8);
          const __m256 inv = _mm256_set1_ps(peak > 0.f ? top / peak : 0.f);
          auto rounded = [&](int k) {       // nearbyint, as the default rounding mode does
            return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + k), inv),
                                                      _MM_FROUND_TO_NEAREST_INT));
          };
          for (int k = 0; k < 32; k += 16) {
            // packs interleaves 128-bit halves: put them back in column order
            const __m256i packed = _mm256_permute4x64_epi64(
                _mm256_packs_epi32(rounded(k), rounded(k + 8)), 0xD8);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(value.data() + t * K + b * 32 + k),
                                packed);
          }
          scale[t * nb + b] = peak / top;
          float* s = sum.data() + (t * nb + b) * groups;
          for (int g = 0; g < groups; ++g) s[g] = column_sum(v + g * (32 / groups), 32 / groups);
        }
    });
  }
};

// The rounded values (RoundedRows: `value`, each block's `scale` = the last plane's unit,
// `sum`) split into P int8 planes.
template <int P>
struct IntActivations : RoundedRows {
  std::vector<int8_t> q;           // [T][P][K], plane 0 the most significant

  const int8_t* plane(int64_t t, int p) const { return q.data() + (t * P + p) * K; }

  // groups: the column groups of a block a tile's minimums need sums of (Tile::kSumGroups).
  template <typename In>
  IntActivations(const In* x, int64_t x_stride, int64_t T_, int64_t K_, int groups)
      : RoundedRows(x, x_stride, T_, K_, groups, P == 1 ? 127.f : kInt16Top), q(T_ * P * K_) {
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int32_t r = value[t * K + k];
        const int32_t hi = P == 1 ? r : (r + 64) >> 7;    // floor((r + 64) / 128)
        q[(t * P) * K + k] = static_cast<int8_t>(hi);
        if (P == 2) q[(t * P + 1) * K + k] = static_cast<int8_t>(r - 128 * hi);
      }
  }
};

// One 16-row group's tiles as int16 pairs: [nb][2 halves][16 steps][8 rows x 2] and each
// block's scale arrays as float32 [nb][arrays][16].
template <typename Tile>
struct Panel {
  std::vector<int16_t> q;
  std::vector<float> scales;
  explicit Panel(int64_t nb) : q(nb * 2 * 16 * 16), scales(nb * Tile::kArrays * 16) {}

  void fill(const uint8_t* tiles, int64_t nb) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* tile = Tile::at(tiles, b);
      for (int h = 0; h < 2; ++h) {
        __m256i* out = reinterpret_cast<__m256i*>(q.data() + (b * 2 + h) * 256);
        if constexpr (Tile::kQ4) widen_nibbles(tile, h, out);
        else widen_bytes(tile, h, out);
        for (int a = 0; a < Tile::kArrays; ++a)
          _mm256_storeu_ps(scales.data() + (b * Tile::kArrays + a) * 16 + 8 * h,
                           Tile::scales8(tile, b, a, h));
      }
    }
  }

  // Q4 tiles: byte [j][l][p] of 32 j + 2 l + p holds row l's column 2j + p (low nibble) and
  // 2j + 16 + p (high): a half's 16 bytes of step j are already row-major pairs.
  static void widen_nibbles(const uint8_t* tile, int h, __m256i* out) {
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int j = 0; j < 8; ++j) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 32 * j + 16 * h));
      _mm256_storeu_si256(out + j, _mm256_cvtepu8_epi16(_mm_and_si128(v, low)));
      _mm256_storeu_si256(out + j + 8,
                          _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), low)));
    }
  }

  // Q8 tiles packed for integer activations: byte [j][l][c] of 64 j + 4 l + c is row l's
  // column 4j + c. A half's 32 bytes (rows 0-3 | rows 4-7, four columns a row) become step
  // 2j (columns c 0, 1 of the 8 rows) and step 2j + 1 (c 2, 3).
  static void widen_bytes(const uint8_t* tile, int h, __m256i* out) {
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    for (int j = 0; j < 8; ++j) {
      const __m256i v = int_codes<Tile>(tile, j, h);   // a level tile's looked up
      // [rows 0-3 c01 | rows 0-3 c23 | rows 4-7 c01 | rows 4-7 c23] -> c01 rows 0-7 | c23
      const __m256i pairs = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, split), 0xD8);
      _mm256_storeu_si256(out + 2 * j, _mm256_cvtepi8_epi16(_mm256_castsi256_si128(pairs)));
      _mm256_storeu_si256(out + 2 * j + 1,
                          _mm256_cvtepi8_epi16(_mm256_extracti128_si256(pairs, 1)));
    }
  }
};

// out rows t .. t + M - 1, the group's 16 columns, from its panel.
template <int M, typename Tile, typename Out>
void gemm_tokens(Out* out, int64_t os, const RoundedRows& a, int64_t t, const Panel<Tile>& p) {
  constexpr int kSteps = 16 / Tile::kSplits;
  __m256 acc[2][M];                   // [rows 0-7, rows 8-15][token]
  for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const __m256i* w = reinterpret_cast<const __m256i*>(p.q.data() + b * 512);
    const int32_t* x[M];
    for (int m = 0; m < M; ++m)
      x[m] = reinterpret_cast<const int32_t*>(a.value.data() + (t + m) * a.K + b * 32);
    for (int s = 0; s < Tile::kSplits; ++s) {
      __m256i sum[2][M];
      for (int m = 0; m < M; ++m) sum[0][m] = sum[1][m] = _mm256_setzero_si256();
      // Two steps an iteration: GCC unrolling all 16 reassociates the sums and spills them.
#pragma GCC unroll 2
      for (int j = s * kSteps; j < (s + 1) * kSteps; ++j) {
        const __m256i w0 = _mm256_loadu_si256(w + j), w1 = _mm256_loadu_si256(w + 16 + j);
        for (int m = 0; m < M; ++m) {
          const __m256i xv = _mm256_set1_epi32(x[m][j]);
          sum[0][m] = _mm256_add_epi32(sum[0][m], _mm256_madd_epi16(w0, xv));
          sum[1][m] = _mm256_add_epi32(sum[1][m], _mm256_madd_epi16(w1, xv));
        }
      }
      const float* sc = p.scales.data() + b * Tile::kArrays * 16;
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_loadu_ps(sc + s * 16 + 8 * h);
        for (int m = 0; m < M; ++m) {
          const __m256 dx = _mm256_mul_ps(d, _mm256_set1_ps(a.scale[(t + m) * a.nb + b]));
          acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h][m]), dx, acc[h][m]);
          if constexpr (Tile::kMin) {
            const __m256 mn = _mm256_loadu_ps(sc + Tile::minimum(s) * 16 + 8 * h);
            const float xs = a.sum[((t + m) * a.nb + b) * a.groups + s];
            acc[h][m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs), acc[h][m]);
          }
        }
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) store8(out + (t + m) * os + 8 * h, acc[h][m]);
}

// out [T, N] = x [T, K] @ W^T for T large enough that widening each group's tiles once per
// chunk of tokens pays (matmul_int takes it from kGemmFrom tokens).
template <typename Tile, typename T>
void matmul_int16_gemm(T* out, int64_t out_stride, const T* x, int64_t x_stride, int64_t tokens,
                       const uint8_t* packed, int64_t N, int64_t K) {
  const RoundedRows a(x, x_stride, tokens, K, Tile::kSumGroups, kInt16Top);
  const int64_t nb = K / 32;
  for (int64_t t0 = 0; t0 < tokens; t0 += kGemmChunk) {
    const int64_t t1 = std::min(tokens, t0 + kGemmChunk);
    at::parallel_for(0, N / kRows, 1, [&](int64_t g0, int64_t g1) {
      Panel<Tile> panel(nb);
      for (int64_t g = g0; g < g1; ++g) {
        panel.fill(packed + g * nb * Tile::kBytes, nb);
        T* o = out + g * kRows;
        int64_t t = t0;
        for (; t + kGemmTokens <= t1; t += kGemmTokens)
          gemm_tokens<kGemmTokens, Tile>(o, out_stride, a, t, panel);
        if (t1 - t == 2) gemm_tokens<2, Tile>(o, out_stride, a, t, panel);
        if (t1 - t == 1) gemm_tokens<1, Tile>(o, out_stride, a, t, panel);
      }
    });
  }
}

}  // namespace pw::avx2
