// The widest float32 vector a tier has (AVX-512's 16 lanes, else AVX2's 8) and what the
// LoRA kernel (lora.cpp) and the sampler (sampling.cpp) do with it: loads from float32,
// bfloat16 and float16, FMA, sums, maxima, e^x, lanes picked by whether a value is -inf, and
// bfloat16 stores rounded as pw::from_float rounds (bf16.h). The tier is the build's: each
// tier's library compiles its own copy.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace pw::vec {

constexpr uint32_t kMinusInfBits = 0xff800000u;   // -inf, compared as bits: -ffast-math may
                                                  // fold comparisons with infinities away
// e^x for x <= 0 as 2^n * 2^f, f = x log2 e - n in [-0.5, 0.5] (a degree-6 polynomial, rel.
// error ~1e-7); x stops at -87, so the result is a normal float (the library runs without
// flush-to-zero) and n fits the exponent field.
constexpr float kExpPoly[] = {1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f,
                              2.4022651e-1f, 6.9314718e-1f, 1.f};

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vload_bf16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline Vec vload_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float vmax_lane(Vec v) { return _mm512_reduce_max_ps(v); }
// Lanes of `a` where x is not -inf, of `b` where it is.
inline Vec vlive_or(Vec x, Vec a, Vec b) {
  const __mmask16 live = _mm512_cmpneq_epi32_mask(_mm512_castps_si512(x),
                                                  _mm512_set1_epi32(kMinusInfBits));
  return _mm512_mask_mov_ps(b, live, a);
}
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vround(Vec x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Vec vtimes_pow2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }   // p * 2^n
// Rounded to nearest even as pw::from_float rounds (NaN kept quiet), every lane.
inline void vstore_bf16(uint16_t* p, Vec v) {
  const __m512i bits = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
#else
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vload_bf16(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline Vec vload_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float vmax_lane(Vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
// Lanes of `a` where x is not -inf, of `b` where it is.
inline Vec vlive_or(Vec x, Vec a, Vec b) {
  const __m256i dead = _mm256_cmpeq_epi32(_mm256_castps_si256(x),
                                          _mm256_set1_epi32(static_cast<int>(kMinusInfBits)));
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(dead));
}
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vround(Vec x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Vec vtimes_pow2(Vec p, Vec n) {   // p * 2^n for integral n in [-126, 127]
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                          _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
// Rounded to nearest even as pw::from_float rounds (NaN kept quiet), every lane.
inline void vstore_bf16(uint16_t* p, Vec v) {
  const __m256i bits = _mm256_castps_si256(v), one = _mm256_set1_epi32(1);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(
      _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

inline Vec vexp(Vec x) {    // see kExpPoly; x >= -87 keeps n >= -126
  const Vec t = vmul(vmax(x, vset1(-87.f)), vset1(1.44269504f));
  const Vec n = vround(t);
  const Vec f = vsub(t, n);
  Vec p = vset1(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = vfma(p, f, vset1(kExpPoly[i]));
  return vtimes_pow2(p, n);
}

}  // namespace pw::vec
