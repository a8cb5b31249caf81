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
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "quant_tiles.h"

namespace {

using pw::bf16;
constexpr int64_t kRows = 16, kTileBytes = 1024;

// x [T, K] as the kernels read it: float32 (AVX2), or P bfloat16 parts whose sum is x.
struct Input {
  int64_t T, K, P;
  std::vector<bf16> parts;     // [P][T][K]
  std::vector<float> xf;       // [T][K]

  template <typename In>
  Input(const In* x, int64_t stride, int64_t T_, int64_t K_, bool as_parts)
      : T(T_), K(K_), P(std::is_same<In, float>::value ? 3 : 1) {
    if (!as_parts) {
      xf.resize(T * K);
      at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t k = 0; k < K; ++k) xf[t * K + k] = pw::to_float(x[t * stride + k]);
      });
      return;
    }
    parts.resize(P * T * K);
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t k = 0; k < K; ++k) {
          float rest = pw::to_float(x[t * stride + k]);
          for (int64_t p = 0; p < P; ++p) {
            bf16 part;
            pw::from_float(rest, &part);
            parts[(p * T + t) * K + k] = part;
            rest -= pw::to_float(part);
          }
        }
    });
  }
};

#if defined(__AVX512BF16__)
constexpr int kChunk = 8;          // tokens a weight line is reused for (registers)

inline __m512 pair(const bf16* x) {    // (x[0], x[1]) in every 32-bit lane
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_castsi512_ps(_mm512_set1_epi32(v));
}
inline void store16(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
inline void store16(bf16* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(v));
}

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
          even[m] = _mm512_dpbf16_ps(even[m], w0, (__m512bh)pair(xb));
          odd[m] = _mm512_dpbf16_ps(odd[m], w1, (__m512bh)pair(xb + 2));
        }
    }
  for (int m = 0; m < M; ++m) store16(out + m * os + g * kRows, _mm512_add_ps(even[m], odd[m]));
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
  const Input in(x, xs, T, K, true);
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
constexpr int kChunk = 4;          // tokens a weight line is reused for (16 ymm registers)

inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store8(bf16* out, __m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int i = 0; i < 8; ++i) pw::from_float(f[i], out + i);
}

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
  const Input in(x, xs, T, K, false);
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
