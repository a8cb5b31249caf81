// bfloat16 as the kernels store it (the high half of a float32) and its conversions.
#pragma once
#include <cstdint>
#include <cstring>

namespace pw {

using bf16 = uint16_t;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline void from_float(float x, float* dst) { *dst = x; }
inline void from_float(float x, bf16* dst) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) { *dst = 0x7fc0; return; }
  bits += 0x7fff + ((bits >> 16) & 1);
  *dst = static_cast<bf16>(bits >> 16);
}

}  // namespace pw
