// What the bfloat16 attention kernels (prefill_attention.cpp, decode_attention.cpp) share:
// 16-key tiles and a vector exponential. AVX512-BF16 builds only.
//
// Both read the paged cache in place ([num_blocks, bs, Hkv, D] per layer, bs a multiple of 16,
// so a tile of 16 keys lies inside one block), multiply on vdpbf16ps (exact bf16 products,
// float32 sums), keep the online softmax on whole vectors, and round probabilities to bfloat16
// for P . V, as SDPA's CPU kernel and transformers' eager attention round them.
#pragma once
#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>

namespace pw {

constexpr int kTile = 16;            // keys per tile; in prefill also query positions per group
constexpr float kNoScore = -1e30f;   // finite: the library is built with -ffast-math

// e^x for x <= 0 (scores minus their running maximum): 2^(x log2 e) split into an integer
// power (scalef) and a degree-6 polynomial of the fraction in [-0.5, 0.5] (rel. error ~1e-7
// plus the rounding of x log2 e, ~1e-6 at x = -80; far below bfloat16's 4e-3).
inline __m512 exp_ps(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)),
                                 _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 16 dims of two keys' value rows interleaved, the pairs P . V multiplies against a query's
// two probabilities: lane i = (a[i], b[i]) as bf16. A row not `live` (a key past the written
// slots of the last block) reads as zeros, so whatever is there never meets a 0 weight; the
// masked load keeps this branch-free.
inline __m512i value_pair(const uint16_t* a, bool a_live, const uint16_t* b, bool b_live) {
  const __m512i wa = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(a_live ? 0xffff : 0, a));
  const __m512i wb = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(b_live ? 0xffff : 0, b));
  return _mm512_or_si512(wa, _mm512_slli_epi32(wb, 16));
}

}  // namespace pw
#endif
