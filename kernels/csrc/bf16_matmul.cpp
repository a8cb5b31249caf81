// Small-batch matmuls on bfloat16 weights (a bfloat16 checkpoint's linears): the quantized
// matmuls' contract (quant_tiles.h QuantMatmul, kind 30: GGML's BF16 type id) on tiles of
// plain bfloat16, so a decode step reads 2 bytes a weight through the same entry point and
// the fused decode stack, not oneDNN's per-call path.
//
// A BF16 tile is 16 output rows by 32 columns, 1024 bytes: 16 lines of 64 bytes, line j
// holding columns (2j, 2j + 1) of the 16 rows, a row's pair one 32-bit lane (vdpbf16ps's
// operand; kernels/quant.py pack_bf16 lays it out). Products are exact in float32: each
// weight is a bfloat16 and each activation too (bfloat16 input) or split into three
// bfloat16 parts (float32 input, as the Q4 kernels do), summed in float32.
//
// Work is split by 16-row groups, every token chunk of a group in turn, so a group's weights
// are read from memory once per step and from cache by the other chunks (a prefill chunk
// multiplies here too).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "bf16.h"
#include "quant_tiles.h"
#if defined(__AVX512BF16__)
#include "quant_avx512.h"      // Activations (bfloat16 parts), bcast_pair, store_rows
#elif defined(__AVX2__)
#include "quant_avx2.h"        // Activations (float32), store8
#endif

namespace {

using pw::bf16;
constexpr int64_t kRows = 16, kTileBytes = 1024;

#if defined(__AVX512BF16__)
using namespace pw::avx512;
constexpr int kChunk = 8;          // tokens a weight line is reused for (registers)

// Group g's 16 rows for M tokens (x rows K apart in each of P parts).
template <int M, int P, typename Out>
void group(Out* out, int64_t os, const bf16* x, int64_t part_stride, int64_t K,
           const uint8_t* tiles, int64_t g) {
  const uint8_t* tile = tiles + g * (K / 32) * kTileBytes;
  __m512 even[M], odd[M];           // two chains a token: lines j even and odd
  for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b, tile += kTileBytes)
    for (int j = 0; j < 16; j += 2) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile + 64 * j);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(tile + 64 * (j + 1));
      for (int p = 0; p < P; ++p)
        for (int m = 0; m < M; ++m) {
          const bf16* xb = x + p * part_stride + m * K + b * 32 + 2 * j;
          even[m] = _mm512_dpbf16_ps(even[m], w0, (__m512bh)bcast_pair(xb));
          odd[m] = _mm512_dpbf16_ps(odd[m], w1, (__m512bh)bcast_pair(xb + 2));
        }
    }
  for (int m = 0; m < M; ++m) store_rows(out + m * os + g * kRows, _mm512_add_ps(even[m], odd[m]));
}

template <int P, typename Out>
void chunk(Out* out, int64_t os, const bf16* x, int64_t part_stride, int64_t K, int64_t M,
           const uint8_t* tiles, int64_t g) {
  switch (M) {
    case 1: return group<1, P>(out, os, x, part_stride, K, tiles, g);
    case 2: return group<2, P>(out, os, x, part_stride, K, tiles, g);
    case 3: return group<3, P>(out, os, x, part_stride, K, tiles, g);
    case 4: return group<4, P>(out, os, x, part_stride, K, tiles, g);
    case 5: return group<5, P>(out, os, x, part_stride, K, tiles, g);
    case 6: return group<6, P>(out, os, x, part_stride, K, tiles, g);
    case 7: return group<7, P>(out, os, x, part_stride, K, tiles, g);
    default: return group<8, P>(out, os, x, part_stride, K, tiles, g);
  }
}

template <typename Out>
void matmul(Out* out, int64_t os, const Out* x, int64_t xs, int64_t T, const uint8_t* tiles,
            int64_t N, int64_t K) {
  const Activations in(x, xs, T, K, kParts, 0);
  at::parallel_for(0, N / kRows, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t t = 0; t < T; t += kChunk) {
        const int64_t m = std::min<int64_t>(kChunk, T - t);
        const bf16* xt = in.parts.data() + t * K;
        if (in.P == 1)
          chunk<1>(out + t * os, os, xt, T * K, K, m, tiles, g);
        else
          chunk<3>(out + t * os, os, xt, T * K, K, m, tiles, g);
      }
  });
}

#elif defined(__AVX2__)
using pw::avx2::Activations;
using pw::avx2::store8;
constexpr int kChunk = 4;          // tokens a weight line is reused for (16 ymm registers)

// Rows 8 half .. 8 half + 7 of their group for M tokens: a line's 32 bytes of those rows
// hold 8 pairs; the low bfloat16 of a lane is column 2j, the high 2j + 1.
template <int M, typename Out>
void half_rows(Out* out, int64_t os, const float* x, int64_t K, const uint8_t* tiles,
               int64_t half) {
  const uint8_t* tile = tiles + (half / 2) * (K / 32) * kTileBytes + 32 * (half % 2);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 even[M], odd[M];
  for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b, tile += kTileBytes)
    for (int j = 0; j < 16; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 * j));
      const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
      const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(w, high));
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * K + b * 32 + 2 * j;
        even[m] = _mm256_fmadd_ps(lo, _mm256_set1_ps(xb[0]), even[m]);
        odd[m] = _mm256_fmadd_ps(hi, _mm256_set1_ps(xb[1]), odd[m]);
      }
    }
  for (int m = 0; m < M; ++m) store8(out + m * os + half * 8, _mm256_add_ps(even[m], odd[m]));
}

template <typename Out>
void matmul(Out* out, int64_t os, const Out* x, int64_t xs, int64_t T, const uint8_t* tiles,
            int64_t N, int64_t K) {
  const Activations in(x, xs, T, K, 0);
  at::parallel_for(0, N / 8, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t half = h0; half < h1; ++half)
      for (int64_t t = 0; t < T; t += kChunk) {
        const float* xt = in.xf.data() + t * K;
        switch (std::min<int64_t>(kChunk, T - t)) {
          case 1: half_rows<1>(out + t * os, os, xt, K, tiles, half); break;
          case 2: half_rows<2>(out + t * os, os, xt, K, tiles, half); break;
          case 3: half_rows<3>(out + t * os, os, xt, K, tiles, half); break;
          default: half_rows<4>(out + t * os, os, xt, K, tiles, half); break;
        }
      }
  });
}
#endif

}  // namespace

namespace pw {

template <typename T>
QuantMatmul<T> bf16_matmul() {
#if defined(__AVX512BF16__) || defined(__AVX2__)
  return matmul<T>;
#else
  return nullptr;
#endif
}

template QuantMatmul<float> bf16_matmul<float>();
template QuantMatmul<bf16> bf16_matmul<bf16>();

}  // namespace pw
