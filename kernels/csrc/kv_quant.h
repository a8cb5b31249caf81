// A quantized KV cache (kernels/kv_quant.py): each head's row is D one-byte codes (int8,
// float8 e4m3 or e5m2) then its float32 scale; a value is code * scale. What the cache
// kernels need: a row's codes from float32 (the write) and back (attention's reads).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "pagewire_api.h"

namespace pw::kvq {

enum Kind : int64_t { kInt8 = PW_KV_CACHE_INT8, kE4M3 = PW_KV_CACHE_E4M3,
                      kE5M2 = PW_KV_CACHE_E5M2 };   // pagewire_api.h PwKvCache
constexpr int64_t kScaleBytes = 4;

inline float qmax(Kind kind) {
  return kind == kInt8 ? 127.f : kind == kE4M3 ? 448.f : 57344.f;
}

// Round to nearest even with `mant` mantissa bits, exponent bias `bias` (|y| <= the format's
// largest finite value; the caller clamps). Subnormals below 2^(1 - bias).
inline uint8_t to_float8(float y, int mant, int bias) {
  uint32_t bits;
  std::memcpy(&bits, &y, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const float a = std::fabs(y);
  const float min_normal = std::ldexp(1.f, 1 - bias);
  if (a < min_normal)   // steps of 2^(1 - bias - mant); a code of 2^mant is the least normal
    return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(a, bias - 1 + mant)));
  uint32_t ab = bits & 0x7fffffff;
  const int drop = 23 - mant;
  ab += ((1u << (drop - 1)) - 1) + ((ab >> drop) & 1);
  const int e = static_cast<int>(ab >> 23) - 127 + bias;
  const uint32_t m = (ab >> drop) & ((1u << mant) - 1);
  return sign | static_cast<uint8_t>((e << mant) | m);
}

inline uint8_t encode(float y, Kind kind) {
  switch (kind) {
    case kInt8: return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)));
    case kE4M3: return to_float8(y, 3, 7);
    default: return to_float8(y, 2, 15);
  }
}

// codes [n] of one head's row (each row's scale multiplied in) -> float32. e4m3 and e5m2
// widen through float16: e5m2 is a float16's high byte; e4m3's sign, exponent and mantissa
// shifted into a float16 read 2^-8 of the value (folded into the scale).
template <Kind K>
inline void decode_row(const uint8_t* codes, float scale, float* dst, int64_t n) {
  const float s = K == kE4M3 ? scale * 256.f : scale;
  const __m256 sv = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
    __m256 v;
    if constexpr (K == kInt8) {
      v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    } else {
      const __m128i w = _mm_cvtepu8_epi16(b);
      const __m128i h = K == kE5M2 ? _mm_slli_epi16(w, 8)
                                   : _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                                  _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
      v = _mm256_cvtph_ps(h);
    }
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(v, sv));
  }
  for (; i < n; ++i) {
    const uint8_t c = codes[i];
    float v;
    if constexpr (K == kInt8) {
      v = static_cast<float>(static_cast<int8_t>(c));
    } else {
      const uint16_t h = K == kE5M2 ? static_cast<uint16_t>(c << 8)
                                    : static_cast<uint16_t>(((c & 0x80) << 8) | ((c & 0x7f) << 7));
      v = _cvtsh_ss(h);
    }
    dst[i] = v * s;
  }
}

// One head's row of `n` floats -> its codes and scale (max |x| / qmax; 0 for a zero row).
inline void encode_row(const float* x, int64_t n, Kind kind, uint8_t* out) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float top = qmax(kind), scale = amax / top, inv = amax > 0.f ? top / amax : 0.f;
  for (int64_t i = 0; i < n; ++i) out[i] = encode(std::clamp(x[i] * inv, -top, top), kind);
  std::memcpy(out + n, &scale, kScaleBytes);
}

// The cache as attention reads it: rows of nkv heads, each head D codes and a scale.
template <Kind K>
struct Cache {
  using E = uint8_t;
  static constexpr int64_t kExtra = kScaleBytes;
  static void load(const uint8_t* row, float* dst, int64_t nkv, int64_t D) {
    for (int64_t j = 0; j < nkv; ++j) {
      const uint8_t* head = row + j * (D + kScaleBytes);
      float scale;
      std::memcpy(&scale, head + D, kScaleBytes);
      decode_row<K>(head, scale, dst + j * D, D);
    }
  }
};

}  // namespace pw::kvq
