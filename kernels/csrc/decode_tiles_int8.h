// Decode attention's tiles over an int8 cache (decode_tiles.h).
#pragma once
#if defined(__AVX512BF16__)
#include <cmath>
#include <cstring>

#include "decode_tiles.h"
#include "kv_quant.h"

namespace pw::decode {

// An int8 cache (kv_quant.h: each head's D codes, then its float32 scale): integer tiles.
// The query is rounded to 15 bits a head (error 2^-16 of its largest value, where bfloat16
// keeps 2^-9 of each) and split into bytes for vpdpbusd against the codes as stored; each
// tile's probabilities, times their value rows' scales, are rounded to 15 bits of the tile's
// largest for vpdpwssd against the value codes widened to int16. The key scales multiply the
// integer scores. Sums stay in int32: |code| <= 128, at most 128 dims or 16 keys of 2^15 x 2^7.
struct Int8Tiles {
  using E = uint8_t;
  static constexpr int64_t kExtra = kvq::kScaleBytes;
  static constexpr float kTop = 32767.f;

  // The query heads rounded to 15 bits each, q = 256 hi + lo (lo unsigned).
  template <int kD>
  struct Query {
    std::vector<uint8_t> q_lo;
    std::vector<int8_t> q_hi;
    std::vector<int32_t> hi_sum;   // 128 sum(hi): what hi . (k + 128) counts beyond hi . k
    std::vector<float> qscale;     // the float one unit of q is, times the scores' scale

    void set(const bf16* q, int64_t H, float scale) {
      q_lo.resize(H * kD);
      q_hi.resize(H * kD);
      hi_sum.resize(H);
      qscale.resize(H);
      for (int64_t h = 0; h < H; ++h) {
        __m512 x[kD / 16], top = _mm512_setzero_ps();
        for (int c = 0; c < kD / 16; ++c) {
          x[c] = to_floats(q + h * kD + 16 * c);
          top = _mm512_max_ps(top, _mm512_abs_ps(x[c]));
        }
        const float amax = _mm512_reduce_max_ps(top), inv = amax > 0.f ? kTop / amax : 0.f;
        __m512i sum = _mm512_setzero_si512();
        for (int c = 0; c < kD / 16; ++c) {
          const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(x[c], _mm512_set1_ps(inv)));
          const __m512i hi = _mm512_srai_epi32(v, 8);          // v = 256 hi + lo, lo unsigned
          _mm_storeu_si128(reinterpret_cast<__m128i*>(&q_lo[h * kD + 16 * c]),
                           _mm512_cvtepi32_epi8(v));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(&q_hi[h * kD + 16 * c]),
                           _mm512_cvtepi32_epi8(hi));
          sum = _mm512_add_epi32(sum, hi);
        }
        hi_sum[h] = 128 * _mm512_reduce_add_epi32(sum);
        qscale[h] = amax / kTop * scale;
      }
    }
  };

  template <int kD>
  static void finish(const float* out, float inv, bf16* o) {
    finish_interleaved<kD>(out, inv, o);
  }

  // As Bf16Tiles::tile, on codes; row_stride in bytes.
  template <int kD, int NG>
  __attribute__((noinline)) static void tile(Head<kD>* heads, const Query<kD>& query, int64_t h,
                                             const uint8_t* k0, const uint8_t* v0,
                                             const uint8_t* k_next, const uint8_t* v_next,
                                             int64_t row_stride, __mmask16 seen,
                                             int /*valid: codes past it are finite*/) {
    constexpr int C = kD / 16;
    constexpr int64_t kLast = kD + kExtra - 1;   // a row's last byte: hints cover both ends
    // The rows' scales, gathered first: the scores do not wait for them.
    const __m512 k_scale = row_scales<kD>(k0, row_stride);
    const __m512 v_scale = row_scales<kD>(v0, row_stride);
    // Scores on vpdpbusd (unsigned x signed bytes, four products a lane): lo . k, and
    // hi . (k + 128) less 128 sum(hi), so a transpose serves 64 dims and no code is widened.
    const uint8_t* qlo = query.q_lo.data() + h * kD;
    const int8_t* qhi = query.q_hi.data() + h * kD;
    __m512i s_lo[NG], s_hi[NG];
    for (int g = 0; g < NG; ++g) s_lo[g] = s_hi[g] = _mm512_setzero_si512();
    for (int z = 0; z < kD / 64; ++z) {
      __m512i kt[kTile];
      for (int t = 0; t < kTile; ++t) kt[t] = _mm512_loadu_si512(k0 + t * row_stride + 64 * z);
      transpose16(kt);                          // kt[i] lane t = key t's dims 64z + 4i .. + 3
      for (int i = 0; i < kTile; ++i) {
        __builtin_prefetch(k_next + i * row_stride + 64 * z, 0, 2);
        if (z + 1 == kD / 64) __builtin_prefetch(k_next + i * row_stride + kLast, 0, 2);
        const __m512i ku = _mm512_xor_si512(kt[i], _mm512_set1_epi8(static_cast<char>(0x80)));
        for (int g = 0; g < NG; ++g) {
          int32_t lo, hi;
          std::memcpy(&lo, qlo + g * kD + 64 * z + 4 * i, 4);
          std::memcpy(&hi, qhi + g * kD + 64 * z + 4 * i, 4);
          s_lo[g] = _mm512_dpbusd_epi32(s_lo[g], _mm512_set1_epi32(lo), kt[i]);
          s_hi[g] = _mm512_dpbusd_epi32(s_hi[g], ku, _mm512_set1_epi32(hi));
        }
      }
    }
    __m512i s[NG];
    for (int g = 0; g < NG; ++g)
      s[g] = _mm512_add_epi32(
          _mm512_slli_epi32(_mm512_sub_epi32(s_hi[g], _mm512_set1_epi32(query.hi_sum[h + g])), 8),
          s_lo[g]);
    alignas(64) uint32_t pp[NG][kTile / 2];     // probabilities x value scales, int16 key pairs
    float unit[NG], alpha[NG];
    for (int g = 0; g < NG; ++g) {
      const __m512 sg = _mm512_mask_mul_ps(
          _mm512_set1_ps(kNoScore), seen, _mm512_cvtepi32_ps(s[g]),
          _mm512_mul_ps(k_scale, _mm512_set1_ps(query.qscale[h + g])));
      __m512 a;
      const __m512 pv = _mm512_maskz_mul_ps(seen, softmax_step(heads[g], sg, seen, a), v_scale);
      alpha[g] = _mm512_cvtss_f32(a);
      const float top = _mm512_reduce_max_ps(pv);
      unit[g] = top / kTop;
      const __m512 r = _mm512_mul_ps(pv, _mm512_set1_ps(top > 0.f ? kTop / top : 0.f));
      _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g]),
                         _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(r)));
    }
    __m512i acc[NG][C];
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_si512();
    for (int kp = 0; kp < kTile / 2; ++kp) {
      __m512i vt[C];                            // keys 2kp, 2kp + 1 as int16 pairs (finish's order)
      const uint8_t* ra = v0 + 2 * kp * row_stride;
      for (int w = 0; w < kD / 64; ++w) {
        __m256i half[4];
        interleave_rows(ra + 64 * w, true, ra + row_stride + 64 * w, true, half);
        for (int c = 0; c < 4; ++c) vt[4 * w + c] = _mm512_cvtepi8_epi16(half[c]);
      }
      for (int64_t off = 0; off <= kLast; off += 64) {   // rows are 4-byte aligned: this covers
        __builtin_prefetch(v_next + 2 * kp * row_stride + off, 0, 2);
        __builtin_prefetch(v_next + (2 * kp + 1) * row_stride + off, 0, 2);
      }
      for (int g = 0; g < NG; ++g) {
        const __m512i pr = _mm512_set1_epi32(static_cast<int32_t>(pp[g][kp]));
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_dpwssd_epi32(acc[g][c], pr, vt[c]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < C; ++c) {
        float* o = heads[g].out + 16 * c;
        const __m512 kept = _mm512_mul_ps(_mm512_load_ps(o), _mm512_set1_ps(alpha[g]));
        _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[g][c]), _mm512_set1_ps(unit[g]),
                                           kept));
      }
  }
};

}  // namespace pw::decode
#endif
