// The AVX2 + FMA inner loops of paged_decode.h for float32 rows of a compile-time head dim kD
// (a multiple of 32): scores of a block of cached tokens for a few query heads sharing one kv
// head, and the value accumulation. Each kv row is loaded once for those heads; the query
// stays in L1 and the output accumulators in registers for the whole block.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace pw::paged {

// Query heads per pass of the kernels below: a pass's accumulators must fit 16 registers.
constexpr int kHeadsPerPass = 3;

// out[i] = the sum of v[i]'s eight lanes, for eight vectors at once.
inline __m256 hsum8(const __m256* v) {
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7], so after two
  // rounds each 128-bit half holds four vectors' partial sums of that half.
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// scores[g * bs + t] = scale * q[g] . k[t] for NG heads (q: [NG, kD]) and tokens t < n rounded
// up to 8: rows k + t * stride must be readable up to that (bs % 8 == 0 and the block holds
// bs rows); the extra scores are finite or not, and never read.
template <int64_t kD, int NG>
inline void qk_f32(float* scores, int64_t bs, const float* q, const float* k, int64_t stride,
                   int64_t n, float scale) {
  static_assert(kD % 8 == 0);
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    __m256 part[NG][8];
    // Two tokens a pass: each query load feeds two FMAs, each key load NG.
    for (int u = 0; u < 8; u += 2) {
      const float* k0 = k + (t0 + u) * stride;
      const float* k1 = k0 + stride;
      __m256 a[NG][2];
      for (int g = 0; g < NG; ++g) a[g][0] = a[g][1] = _mm256_setzero_ps();
      for (int64_t c = 0; c < kD; c += 8) {
        const __m256 x0 = _mm256_loadu_ps(k0 + c), x1 = _mm256_loadu_ps(k1 + c);
        for (int g = 0; g < NG; ++g) {
          const __m256 qv = _mm256_loadu_ps(q + g * kD + c);
          a[g][0] = _mm256_fmadd_ps(qv, x0, a[g][0]);
          a[g][1] = _mm256_fmadd_ps(qv, x1, a[g][1]);
        }
      }
      for (int g = 0; g < NG; ++g) part[g][u] = a[g][0], part[g][u + 1] = a[g][1];
    }
    for (int g = 0; g < NG; ++g)
      _mm256_storeu_ps(scores + g * bs + t0, _mm256_mul_ps(sc, hsum8(part[g])));
  }
}

// acc[g][:] += sum_{t < n} p[g * bs + t] * v[t][:] for NG heads, 32 columns a pass: NG * 4
// accumulators stay in registers while the block's rows stream by.
template <int64_t kD, int NG>
inline void pv_f32(float* acc, const float* p, int64_t bs, const float* v, int64_t stride,
                     int64_t n) {
  static_assert(kD % 32 == 0);
  for (int64_t c0 = 0; c0 < kD; c0 += 32) {
    __m256 a[NG][4];
    for (int g = 0; g < NG; ++g)
      for (int w = 0; w < 4; ++w) a[g][w] = _mm256_loadu_ps(acc + g * kD + c0 + w * 8);
    for (int64_t t = 0; t < n; ++t) {
      const float* vr = v + t * stride + c0;
      const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8),
                   v2 = _mm256_loadu_ps(vr + 16), v3 = _mm256_loadu_ps(vr + 24);
      for (int g = 0; g < NG; ++g) {
        const __m256 pg = _mm256_broadcast_ss(p + g * bs + t);
        a[g][0] = _mm256_fmadd_ps(pg, v0, a[g][0]);
        a[g][1] = _mm256_fmadd_ps(pg, v1, a[g][1]);
        a[g][2] = _mm256_fmadd_ps(pg, v2, a[g][2]);
        a[g][3] = _mm256_fmadd_ps(pg, v3, a[g][3]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int w = 0; w < 4; ++w) _mm256_storeu_ps(acc + g * kD + c0 + w * 8, a[g][w]);
  }
}

// The two kernels over G query heads of one kv head, kHeadsPerPass at a time.
template <int64_t kD>
inline void qk_f32_group(float* scores, int64_t bs, const float* q, int64_t G, const float* k,
                     int64_t stride, int64_t n, float scale) {
  for (int64_t g0 = 0; g0 < G; g0 += kHeadsPerPass) {
    float* s = scores + g0 * bs;
    const float* qg = q + g0 * kD;
    switch (G - g0) {
      case 1: qk_f32<kD, 1>(s, bs, qg, k, stride, n, scale); break;
      case 2: qk_f32<kD, 2>(s, bs, qg, k, stride, n, scale); break;
      default: qk_f32<kD, 3>(s, bs, qg, k, stride, n, scale); break;
    }
  }
}

template <int64_t kD>
inline void pv_f32_group(float* acc, const float* p, int64_t bs, int64_t G, const float* v,
                     int64_t stride, int64_t n) {
  for (int64_t g0 = 0; g0 < G; g0 += kHeadsPerPass) {
    float* a = acc + g0 * kD;
    const float* pg = p + g0 * bs;
    switch (G - g0) {
      case 1: pv_f32<kD, 1>(a, pg, bs, v, stride, n); break;
      case 2: pv_f32<kD, 2>(a, pg, bs, v, stride, n); break;
      default: pv_f32<kD, 3>(a, pg, bs, v, stride, n); break;
    }
  }
}

}  // namespace pw::paged
