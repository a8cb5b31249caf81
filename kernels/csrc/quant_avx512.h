// What the AVX512-BF16 matmuls share (quant_kernels.cpp's quantized tiles, bf16_matmul.cpp's
// BF16 tiles; quant_step_vnni.h's small int8 steps): the activations as they read them, an x
// pair broadcast for vdpbf16ps, a block's minimums times the sums of x, and rows stored in
// the output's type.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"

#if defined(__AVX512BF16__)
namespace pw::avx512 {

// acc[m] += each of block b's column groups' minimums (a lane per row) times token m's sum of
// x over that group, sums[(m * nb + b) * kSplits + group] (`sums` at the first of the M
// tokens): the m * sum(x) of d q + m. Nothing for a tile without minimums.
template <typename Tile, int M>
inline void add_minimums(__m512 (&acc)[M], const uint8_t* tile, const float* sums, int64_t nb,
                         int64_t b) {
  if constexpr (Tile::kMin)
    for (int s = 0; s < Tile::kSplits; ++s) {
      const __m512 mn = Tile::scales16(tile, b, Tile::minimum(s));
      for (int m = 0; m < M; ++m) {
        const float sum = sums[(m * nb + b) * Tile::kSplits + s];
        acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sum), acc[m]);
      }
    }
}

inline __m512 bcast_pair(const bf16* x) {    // (x[0], x[1]) in every 32-bit lane
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_castsi512_ps(_mm512_set1_epi32(v));
}

inline void store_rows(bf16* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(v));
}

inline void store_rows(float* out, __m512 v) { _mm512_storeu_ps(out, v); }

inline bf16 to_bf16(float x) {
  bf16 out;
  from_float(x, &out);
  return out;
}

// The activations as the kernels read them, for T tokens of K columns; each kernel has only
// its own form built (`use`):
//   kParts (Q4, FP8, six-bit Q8 and BF16 tiles): parts[p][t][k], bfloat16 x split into P
//     parts whose sum is x (P = 1 for bfloat16 input; 3 for float32, each part the bfloat16 of what the earlier ones left: 24
//     bits in all, float32's precision, so a float32 engine multiplies float32 activations),
//     and (groups > 0) sums[t][b][g], the float32 sum of x over each of block b's `groups`
//     column groups (the minimums multiply them);
//   kFloat (Q8 tiles): xf[t][k], x in float32 (they convert their weights to float32 instead),
//     and for minimums (Q5_K, Q2_K) sums[t][b][g] over each of a block's `groups` column groups.
enum Use { kParts, kFloat };
constexpr int64_t kTokenGrain = 16;   // tokens below which the calling thread converts them

struct Activations {
  int64_t T, K, P;
  std::vector<bf16> parts;
  std::vector<float> sums, xf;

  template <typename In>
  Activations(const In* x, int64_t x_stride, int64_t T_, int64_t K_, Use use, int groups)
      : T(T_), K(K_), P(std::is_same<In, float>::value ? 3 : 1) {
    if (use == kFloat) {
      xf.resize(T * K);
      sums.assign(T * (K / 32) * groups, 0.f);
    } else {
      parts.resize(P * T * K);
      sums.assign(T * (K / 32) * groups, 0.f);
    }
    // Token by token, split over the threads for a prefill chunk's (kTokenGrain each).
    at::parallel_for(0, T, kTokenGrain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        if (use == kFloat)
          as_float(x + t * x_stride, t, groups);
        else
          as_parts(x + t * x_stride, t, groups);
    });
  }

 private:
  template <typename In>
  void as_float(const In* x, int64_t t, int groups) {
    for (int64_t k = 0; k < K; ++k) {
      xf[t * K + k] = to_float(x[k]);
      if (groups) sums[(t * K + k) / (32 / groups)] += xf[t * K + k];
    }
  }

  template <typename In>
  void as_parts(const In* x, int64_t t, int groups) {
    for (int64_t k = 0; k < K; ++k) {
      float rest = to_float(x[k]);
      if (groups) sums[(t * K + k) / (32 / groups)] += rest;
      for (int64_t p = 0; p < P; ++p) {
        const bf16 part = to_bf16(rest);
        parts[(p * T + t) * K + k] = part;
        rest -= to_float(part);
      }
    }
  }
};

}  // namespace pw::avx512
#endif
