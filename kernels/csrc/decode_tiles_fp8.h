// Decode attention over a float8 cache (decode_tiles.h): its codes widened to bfloat16 as
// they are read, then decode_tiles_bf16.h's tiles.
#pragma once
#if defined(__AVX512BF16__)
#include <algorithm>

#include "decode_tiles.h"
#include "decode_tiles_bf16.h"
#include "kv_quant.h"

namespace pw::decode {

// 32 codes of float8 kind K -> 32 bfloat16, exactly (both formats' values fit bfloat16).
// Through float16, as kv_quant.h's decode_row: e5m2 is a float16's high byte; e4m3's bits
// shifted into a float16 read 2^-8 of its value (Fp8Rows::kUnit puts it back in the scales).
template <kvq::Kind K>
inline __m512i fp8_to_bf16(__m256i codes) {
  const __m512i w = _mm512_cvtepu8_epi16(codes);
  __m512i h;
  if constexpr (K == kvq::kE5M2) {
    h = _mm512_slli_epi16(w, 8);
  } else {   // w << 7: exponent and mantissa at bits 7..13, the sign at 14, moved to 15 by +
    const __m512i t = _mm512_slli_epi16(w, 7);
    h = _mm512_add_epi16(t, _mm512_and_si512(t, _mm512_set1_epi16(0x4000)));
  }
  const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// A float8 cache (kv_quant.h: each head's D codes, then its float32 scale) as BfTiles reads
// it: key scales multiply the scores, value scales the probabilities before their bfloat16
// rounding. Value rows past `valid` are masked: an unwritten e5m2 code can read inf.
template <kvq::Kind K>
struct Fp8Rows {
  using E = uint8_t;
  static constexpr int64_t kExtra = kvq::kScaleBytes;
  static constexpr bool kScaled = true;
  static constexpr float kUnit = K == kvq::kE4M3 ? 256.f : 1.f;   // fp8_to_bf16's value x this

  template <int kD>
  static TileScales scales(const uint8_t* k0, const uint8_t* v0, int64_t row_stride,
                           float scale) {
    return {_mm512_mul_ps(row_scales<kD>(k0, row_stride), _mm512_set1_ps(kUnit * scale)),
            _mm512_mul_ps(row_scales<kD>(v0, row_stride), _mm512_set1_ps(kUnit))};
  }
  static __m512i key_dims(const uint8_t* row, int z) {
    return fp8_to_bf16<K>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * z)));
  }
  template <int kD>   // rows are 4-byte aligned: lines at 0, 64 and the last byte cover one
  static void prefetch_key(const uint8_t* row, int z) {
    __builtin_prefetch(row + std::min<int64_t>(64 * z, kD + kExtra - 1), 0, 2);
  }
  template <int kD>
  static void value_pairs(const uint8_t* a, const uint8_t* next, int64_t row_stride,
                          bool a_live, bool b_live, __m512i* vt) {
    for (int w = 0; w < kD / 64; ++w) {
      __m256i half[4];
      interleave_rows(a + 64 * w, a_live, a + row_stride + 64 * w, b_live, half);
      for (int c = 0; c < 4; ++c) vt[4 * w + c] = fp8_to_bf16<K>(half[c]);
    }
    for (int64_t off = 0; off < kD + kExtra; off += 64) {
      __builtin_prefetch(next + off, 0, 2);
      __builtin_prefetch(next + row_stride + off, 0, 2);
    }
  }
  template <int kD>
  static void finish(const float* out, float inv, bf16* o) {
    finish_interleaved<kD>(out, inv, o);
  }
};

template <kvq::Kind K>
using Fp8Tiles = BfTiles<Fp8Rows<K>>;

}  // namespace pw::decode
#endif
