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

#include "float_vec.h"

namespace pw {

constexpr int kTile = 16;            // keys per tile; in prefill also query positions per group
constexpr float kNoScore = -1e30f;   // finite: the library is built with -ffast-math

// e^x for x <= 0 (scores minus their running maximum): float_vec.h's (rel. error ~1e-7 plus
// the rounding of x log2 e, ~1e-6 at x = -80; far below bfloat16's 4e-3).
inline __m512 exp_ps(__m512 x) { return vec::vexp(x); }

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
