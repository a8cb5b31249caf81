// What decode_attention.cpp's tile kinds share (AVX512-BF16 builds only): the 16x16 dword
// transpose that puts a tile's keys on the lanes, a query head's online-softmax state, and
// for caches of codes their scales and value layout. Each kind also says how it holds a
// sequence's query (its Query, set once an item).
// decode_tiles_bf16.h, decode_tiles_int8.h and decode_tiles_fp8.h are the kinds: each says
// how a tile's keys and values are read and multiplied, and how a head's output is written.
#pragma once
#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_tiles.h"
#include "bf16.h"

namespace pw::decode {

// Rows r[0..15] of 16 dwords -> columns: r[c] lane t = old r[t] lane c. Always inlined: as a
// call (GCC's choice once four tile kinds called it) the rows went through memory, ~10 %.
__attribute__((always_inline)) inline void transpose16(__m512i* r) {
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

// Caches of one-byte codes (kv_quant.h: each head's kD codes, then its float32 scale).

// The scales of a tile's 16 rows (row0: the first row's head, rows row_stride bytes apart).
template <int kD>
inline __m512 row_scales(const uint8_t* row0, int64_t row_stride) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i at = _mm512_add_epi32(
      _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(row_stride))),
      _mm512_set1_epi32(kD));
  return _mm512_i32gather_ps(at, row0, 1);
}

// Two keys' rows of codes, 64 at a time (w), interleaved for P . V: byte unpacks work within
// 128-bit lanes, so half[c'] (c' = 0..3, 32 bytes: 16 pairs of codes (a, b)) holds dims
// 64w + 0..7 then 16..23 (c' = 0), 32..39 then 48..55 (1), 8..15 then 24..31 (2), 40..47
// then 56..63 (3). A row not `live` reads as zeros.
inline void interleave_rows(const uint8_t* a, bool a_live, const uint8_t* b, bool b_live,
                            __m256i* half) {
  const __m512i x = _mm512_maskz_loadu_epi8(a_live ? ~0ull : 0, a);
  const __m512i y = _mm512_maskz_loadu_epi8(b_live ? ~0ull : 0, b);
  const __m512i lo = _mm512_unpacklo_epi8(x, y), hi = _mm512_unpackhi_epi8(x, y);
  half[0] = _mm512_castsi512_si256(lo);
  half[1] = _mm512_extracti64x4_epi64(lo, 1);
  half[2] = _mm512_castsi512_si256(hi);
  half[3] = _mm512_extracti64x4_epi64(hi, 1);
}

// out [kD] accumulated in interleave_rows' order (accumulator c = 4w + c', 16 lanes), times
// inv -> bfloat16 o in dim order: c' = 0 and 2's low halves are dims 0..15, their high
// halves 16..31; c' = 1 and 3 the same 32 further on.
template <int kD>
inline void finish_interleaved(const float* out, float inv, bf16* o) {
  const __m512 f = _mm512_set1_ps(inv);
  for (int w = 0; w < kD / 64; ++w) {
    __m512 a[4];
    for (int c = 0; c < 4; ++c) a[c] = _mm512_mul_ps(_mm512_load_ps(out + 64 * w + 16 * c), f);
    store_bf16(o + 64 * w, _mm512_shuffle_f32x4(a[0], a[2], 0x44));
    store_bf16(o + 64 * w + 16, _mm512_shuffle_f32x4(a[0], a[2], 0xEE));
    store_bf16(o + 64 * w + 32, _mm512_shuffle_f32x4(a[1], a[3], 0x44));
    store_bf16(o + 64 * w + 48, _mm512_shuffle_f32x4(a[1], a[3], 0xEE));
  }
}

}  // namespace pw::decode
#endif
