// Decode attention's tiles over a float8 cache (decode_tiles.h).
#pragma once
#if defined(__AVX512BF16__)
#include <algorithm>
#include <cstring>

#include "decode_tiles.h"
#include "kv_quant.h"

namespace pw::decode {

// 32 codes of float8 kind K -> 32 bfloat16, exactly (both formats' values fit bfloat16).
// Through float16, as kv_quant.h's decode_row: e5m2 is a float16's high byte; e4m3's bits
// shifted into a float16 read 2^-8 of its value (Fp8Tiles::kUnit puts it back in the scales).
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

// A float8 cache (kv_quant.h: each head's D codes, then its float32 scale): the codes widened
// to bfloat16 as they are read, then Bf16Tiles' arithmetic (vdpbf16ps, the bfloat16 query as
// it is); the key scales multiply the scores, the value scales the probabilities before
// they are rounded to bfloat16. Value rows past `valid` are masked: e5m2 codes can read inf.
template <kvq::Kind K>
struct Fp8Tiles {
  using E = uint8_t;
  static constexpr int64_t kExtra = kvq::kScaleBytes;
  static constexpr float kUnit = K == kvq::kE4M3 ? 256.f : 1.f;   // fp8_to_bf16's value x this

  template <int kD>
  static void prepare(Seq<kD>&, int64_t) {}
  template <int kD>
  static void finish(const float* out, float inv, bf16* o) {
    finish_interleaved<kD>(out, inv, o);
  }

  // As Bf16Tiles::tile, on codes; row_stride in bytes.
  template <int kD, int NG>
  __attribute__((noinline)) static void tile(Head<kD>* heads, const Seq<kD>& seq, int64_t h,
                                             const uint8_t* k0, const uint8_t* v0,
                                             const uint8_t* k_next, const uint8_t* v_next,
                                             int64_t row_stride, __mmask16 seen, int valid) {
    constexpr int C = kD / 16;
    constexpr int64_t kLast = kD + kExtra - 1;   // a row's last byte: hints cover both ends
    const __m512 k_scale = _mm512_mul_ps(row_scales<kD>(k0, row_stride),
                                         _mm512_set1_ps(kUnit * seq.scale));
    const __m512 v_scale = _mm512_mul_ps(row_scales<kD>(v0, row_stride), _mm512_set1_ps(kUnit));
    const bf16* q = seq.q + h * kD;
    __m512 s[NG];
    for (int g = 0; g < NG; ++g) s[g] = _mm512_setzero_ps();
    for (int z = 0; z < kD / 32; ++z) {
      __m512i kt[kTile];
      for (int t = 0; t < kTile; ++t)
        kt[t] = fp8_to_bf16<K>(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0 + t * row_stride + 32 * z)));
      transpose16(kt);                          // kt[i] lane t = key t's dims 32z + 2i, + 1
      for (int i = 0; i < kTile; ++i) {
        __builtin_prefetch(k_next + i * row_stride + std::min<int64_t>(64 * z, kLast), 0, 2);
        for (int g = 0; g < NG; ++g) {
          int32_t pair;
          std::memcpy(&pair, q + g * kD + 32 * z + 2 * i, 4);
          s[g] = _mm512_dpbf16_ps(s[g], (__m512bh)kt[i], (__m512bh)_mm512_set1_epi32(pair));
        }
      }
    }
    alignas(64) uint32_t pp[NG][kTile / 2];     // probabilities x value scales, bf16 key pairs
    __m512 acc[NG][C];
    for (int g = 0; g < NG; ++g) {
      const __m512 sg = _mm512_mask_mul_ps(_mm512_set1_ps(kNoScore), seen, s[g], k_scale);
      __m512 alpha;
      const __m512 pv = _mm512_maskz_mul_ps(seen, softmax_step(heads[g], sg, seen, alpha),
                                            v_scale);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g]), (__m256i)_mm512_cvtneps_pbh(pv));
      for (int c = 0; c < C; ++c)
        acc[g][c] = _mm512_mul_ps(_mm512_load_ps(heads[g].out + 16 * c), alpha);
    }
    for (int kp = 0; kp < kTile / 2; ++kp) {
      __m512i vt[C];                            // keys 2kp, 2kp + 1 as bf16 pairs (finish's order)
      const uint8_t* ra = v0 + 2 * kp * row_stride;
      for (int w = 0; w < kD / 64; ++w) {
        __m256i half[4];
        interleave_rows(ra + 64 * w, 2 * kp < valid, ra + row_stride + 64 * w, 2 * kp + 1 < valid,
                        half);
        for (int c = 0; c < 4; ++c) vt[4 * w + c] = fp8_to_bf16<K>(half[c]);
      }
      for (int64_t off = 0; off <= kLast; off += 64) {   // rows are 4-byte aligned: this covers
        __builtin_prefetch(v_next + 2 * kp * row_stride + off, 0, 2);
        __builtin_prefetch(v_next + (2 * kp + 1) * row_stride + off, 0, 2);
      }
      for (int g = 0; g < NG; ++g) {
        const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pp[g][kp]));
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], pr, (__m512bh)vt[c]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < C; ++c) _mm512_store_ps(heads[g].out + 16 * c, acc[g][c]);
  }
};

}  // namespace pw::decode
#endif
