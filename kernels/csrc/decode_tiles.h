// What decode_attention.cpp's tile kinds share (AVX512-BF16 builds only): the 16x16 dword
// transpose that puts a tile's keys on the lanes, a query head's online-softmax state, and a
// thread's state for one sequence. decode_tiles_bf16.h and decode_tiles_int8.h are the kinds:
// each says how a tile's keys and values are read and multiplied, and how a head's output is
// written.
#pragma once
#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_tiles.h"
#include "bf16.h"

namespace pw::decode {

// Rows r[0..15] of 16 dwords -> columns: r[c] lane t = old r[t] lane c.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {   // r[4i + c], 128-bit lane L: rows 4i..4i+3 at column 4L + c
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
    t[4 + c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    t[8 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    t[12 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xDD);
  }
}

inline __m512 to_floats(const bf16* x) {   // 16 bfloat16 -> float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}

inline void store_bf16(bf16* o, __m512 x) {   // rounded to nearest even, as from_float
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(x));
}

// One decoding query head's running state.
template <int kD>
struct Head {
  alignas(64) float out[kD];   // unnormalized output (in the tile kind's dim order)
  alignas(64) float l[kTile];  // per-lane sums of exponentials
  float m;                     // running score maximum
};

// One tile's step of a head's online softmax, sg its scores (kNoScore where not seen): m and l
// move to the new maximum. Returns the probabilities (0 where not seen); alpha: the factor the
// head's output is rescaled by.
template <int kD>
inline __m512 softmax_step(Head<kD>& h, __m512 sg, __mmask16 seen, __m512& alpha) {
  const float m_new = std::max(h.m, _mm512_reduce_max_ps(sg));
  const __m512 p = _mm512_maskz_mov_ps(seen, exp_ps(_mm512_sub_ps(sg, _mm512_set1_ps(m_new))));
  alpha = exp_ps(_mm512_set1_ps(h.m - m_new));
  h.m = m_new;
  _mm512_store_ps(h.l, _mm512_fmadd_ps(_mm512_load_ps(h.l), alpha, p));
  return p;
}

// A thread's state for one sequence: its query heads' running states, and the query as the
// tile kind multiplies it.
template <int kD>
struct Seq {
  std::vector<Head<kD>> heads;
  const bf16* q;                 // the sequence's first query head handled here
  float scale;                   // of scores
  // int8 caches: each query head rounded to 15 bits, q = 256 hi + lo (lo unsigned), and
  std::vector<uint8_t> q_lo;
  std::vector<int8_t> q_hi;
  std::vector<int32_t> hi_sum;   // 128 sum(hi): what hi . (k + 128) counts beyond hi . k
  std::vector<float> qscale;     // the float one unit of q is, times `scale`
};

}  // namespace pw::decode
#endif
