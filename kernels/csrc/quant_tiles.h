// The quantized matmuls' tile formats (kernels/quant.py packs them) and their one entry point.
//
// A tile is 16 output rows by one 32-column block: the quants, then arrays of 16 per-row
// scales (one SIMD lane per row). The file's Q4_1 and Q8_0 blocks keep their fp16 d and m;
// the K-quants' effective scales (fp16 d times a 6- or 8-bit sub-block scale) are exact in
// float32, not in fp16, so their tiles hold float32 ones:
//   Q4_1  256 bytes of nibbles, d[16] fp16, m[16] fp16            (a weight: d q + m)
//   Q4_K  256 bytes of nibbles, d[16] f32,  m[16] f32             (Q4_1's arithmetic)
//   Q8_0  512 bytes of int8,    d[16] fp16                         (d q)
//   Q6_K  512 bytes of int8,    d[16] f32 (columns 0-15), d[16] f32 (columns 16-31)
//   Q5_K  512 bytes of int8,    d[16] f32,  m[16] f32             (d q + m; also Q5_1)
//   Q2_K  512 bytes of int8,    d, d (columns 0-15, 16-31), m, m: f32 (d q + m)
//   FP8   512 bytes of e4m3,    d[16] f32                          (d q; an FP8 checkpoint's
//         codes, q decoded exactly to float32: kernels/quant.py FP8)
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "bf16.h"

namespace pw {

// S: a scale's storage (uint16_t: fp16; float); kSplits: the column groups of a block with
// a scale each (Q6_K, Q2_K: 2 of 16 columns); kMin: a minimum added to each group's weights
// too. The arrays after the quants: each group's scales, then (kMin) each group's minimums.
// kFp8: the quants are e4m3 codes, not int8 (fp8_lanes decodes them).
template <int64_t kQuantBytes_, int kSplits_, typename S, bool kMin_, bool kFp8_ = false>
struct Tile {
  static constexpr int64_t kQuantBytes = kQuantBytes_;
  static constexpr int kSplits = kSplits_;
  static constexpr bool kMin = kMin_, kQ4 = kQuantBytes == 256, kFp8 = kFp8_;
  static constexpr int kArrays = kSplits * (kMin ? 2 : 1);
  // The column groups of a block whose activation sums the minimums meet (0: none needed).
  static constexpr int kSumGroups = kMin ? kSplits : 0;
  static constexpr int64_t kBytes = kQuantBytes + kArrays * 16 * sizeof(S);
  static constexpr int minimum(int split) { return kSplits + split; }   // its array

  static const S* scales(const uint8_t* tile, int array) {
    return reinterpret_cast<const S*>(tile + kQuantBytes) + 16 * array;
  }
#if defined(__AVX2__)
  // Array `array`'s lanes of rows 8 half .. 8 half + 7, as float32.
  static __m256 scales8(const uint8_t* tile, int array, int half) {
    const S* p = scales(tile, array) + 8 * half;
    if constexpr (std::is_same<S, float>::value)
      return _mm256_loadu_ps(p);
    else
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
#endif
#if defined(__AVX512F__)
  static __m512 scales16(const uint8_t* tile, int array) {
    const S* p = scales(tile, array);
    if constexpr (std::is_same<S, float>::value)
      return _mm512_loadu_ps(p);
    else
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
#endif
};

using Q4_1Tile = Tile<256, 1, uint16_t, true>;
using Q4_KTile = Tile<256, 1, float, true>;
using Q8_0Tile = Tile<512, 1, uint16_t, false>;
using Q6_KTile = Tile<512, 2, float, false>;
using Q5_KTile = Tile<512, 1, float, true>;
using Q2_KTile = Tile<512, 2, float, true>;
using FP8Tile = Tile<512, 1, float, false, true>;

// e4m3 (fn) codes, widened to int32 lanes, as float32 (the AVX2 kernels'; the AVX512-BF16
// ones decode to bfloat16 pairs instead): a normal code's exponent and mantissa bits moved
// into float32's and rebiased (120 = 127 - 7), a subnormal's mantissa times 2^-9; both exact.
// (No NaN: a checkpoint's weights hold none.)
#if defined(__AVX2__)
inline __m256 fp8_lanes(__m256i code) {
  const __m256i mag = _mm256_and_si256(code, _mm256_set1_epi32(0x7f));
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.f / 512));
  const __m256 v = _mm256_blendv_ps(
      normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
}
#endif

// out [T, N] = x [T, K] @ W^T from W's tiles (N a multiple of 16, K of 32), x and out rows
// x_stride and out_stride apart.
template <typename T>
using QuantMatmul = void (*)(T* out, int64_t out_stride, const T* x, int64_t x_stride,
                             int64_t tokens, const uint8_t* tiles, int64_t N, int64_t K);

// The kernel of a packed weight's kind (pagewire_api.h: a PwTile plus a PwRounding), or
// nullptr for a kind this build lacks.
template <typename T>
QuantMatmul<T> quant_matmul(int64_t kind);

// Bytes of one group of 16 rows of a weight packed as `kind` with K columns (its K / 32
// tiles, in every kind): rows [16 g, 16 g + 16) start g times this into the packed weight,
// so a share of the rows multiplies as a weight of its own.
int64_t quant_group_bytes(int64_t kind, int64_t K);

// PW_TILE_BF16's kernel (bf16_matmul.cpp), for this build's tier.
template <typename T>
QuantMatmul<T> bf16_matmul();

}  // namespace pw
