// How the AVX512-BF16 quantized matmuls (quant_kernels.cpp) turn a tile's codes into the
// bfloat16 pairs vdpbf16ps multiplies, exactly: Q4 nibbles, level tiles' nibbles and six-bit
// Q8 codes through a table (vpermw, vpermt2w), FP8 codes by moving their bits. Each decoder
// gives, for each of a 32-column block's 8 steps s, two vectors of bfloat16 pairs (a row's
// pair a 32-bit lane): w0 for the x pair at x0(s) and w1 for the one at x1(s).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "quant_avx512.h"   // to_bf16
#include "quant_tiles.h"    // Codes

#if defined(__AVX512BF16__)
namespace pw::avx512 {

// bfloat16 of i & 15 for word i of 32: vpermw reads an index's low 5 bits, so a byte's low
// nibble indexes it directly.
inline __m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    float f = static_cast<float>(i & 15);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    t[i] = static_cast<uint16_t>(bits >> 16);   // small integers are exact in bfloat16
  }
  return _mm512_load_si512(t);
}

// bfloat16 of the e4m3 codes 0-7 (exponent 0: m * 2^-9), indexed by a lane's low 5 bits.
inline __m512i fp8_subnormals() {
  alignas(64) uint16_t t[32] = {};
  for (int i = 0; i < 8; ++i) t[i] = to_bf16(static_cast<float>(i) / 512);   // exact
  return _mm512_load_si512(t);
}

// word i of 32 <- word (i % 2) * 16 + i / 2: a row's codes of two adjacent columns (16 bytes
// apart in the tile) side by side, as vdpbf16ps pairs them.
inline __m512i pair_order() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = static_cast<uint16_t>((i % 2) * 16 + i / 2);
  return _mm512_load_si512(t);
}

// An FP8 tile's columns (2j, 2j + 1) of its 16 rows as bfloat16 pairs, a row a 32-bit lane
// (vdpbf16ps's operand), exact: a normal code's exponent and mantissa moved into
// bfloat16's and rebiased (120 = 127 - 7), a subnormal's from the table, then the sign
// (bit 7 of the code to bit 15, one bit-select).
inline __m512bh fp8_pairs(const uint8_t* tile, int j, __m512i subnormals, __m512i order) {
  const __m512i c = _mm512_permutexvar_epi16(
      order, _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * j))));
  const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi16(0x7f));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4),
                                          _mm512_set1_epi16(120 << 7));
  const __m512i v = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)),
                                            normal, _mm512_permutexvar_epi16(mag, subnormals));
  // (v & ~0x8000) | (c << 8 & 0x8000): v's bit 15 is 0, c << 8 holds the sign there
  return (__m512bh)_mm512_ternarylogic_epi32(v, _mm512_slli_epi16(c, 8),
                                             _mm512_set1_epi16(static_cast<short>(0x8000)), 0xf8);
}

// Q4: the 32 bytes of step s hold columns (2s, 2s + 1) in their low nibbles, (2s + 16,
// 2s + 17) in their high ones; a nibble indexes its bfloat16 value.
struct Nibbles {
  const __m512i table = nibble_table();
  static constexpr int x0(int s) { return 2 * s; }
  static constexpr int x1(int s) { return 2 * s + 16; }
  void operator()(const uint8_t* tile, int s, __m512bh& w0, __m512bh& w1) const {
    const __m512i w = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * s)));
    w0 = (__m512bh)_mm512_permutexvar_epi16(w, table);
    w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
  }
};

// FP8: step s decodes columns (4s, 4s + 1) and (4s + 2, 4s + 3).
struct Fp8Codes {
  const __m512i subnormals = fp8_subnormals(), order = pair_order();
  static constexpr int x0(int s) { return 4 * s; }
  static constexpr int x1(int s) { return 4 * s + 2; }
  void operator()(const uint8_t* tile, int s, __m512bh& w0, __m512bh& w1) const {
    w0 = fp8_pairs(tile, 2 * s, subnormals, order);
    w1 = fp8_pairs(tile, 2 * s + 1, subnormals, order);
  }
};

// bfloat16 of each six-bit code, indexed by its low 6 bits (vpermt2w's two tables: entries
// 0-31, 32-63): a signed code's (two's complement: index 32-63 are -32..-1) or an unsigned's.
template <pw::Codes kCodes>
inline __m512i six_bit_table(int half) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const int index = 32 * half + i;
    t[i] = to_bf16(static_cast<float>(kCodes == pw::kSigned6 && index >= 32 ? index - 64 : index));
  }
  return _mm512_load_si512(t);
}

// Q8 tiles of six-bit codes (Tile::kCodes): step s decodes columns (2s, 2s + 1) and (2s + 16,
// 2s + 17), 32 bytes each (a column's 16 rows, then the next's): their words interleaved into
// a row's pairs (pair_order), then each code's bfloat16 from the table, exact; two vector
// ops a column pair where int8 codes (q8_pair_groups) take five.
template <pw::Codes kCodes>
struct SixBitCodes {
  const __m512i low = six_bit_table<kCodes>(0), high = six_bit_table<kCodes>(1);
  const __m512i order = pair_order();
  static constexpr int x0(int s) { return 2 * s; }
  static constexpr int x1(int s) { return 2 * s + 16; }
  __m512bh pairs(const uint8_t* columns) const {
    const __m512i codes = _mm512_permutexvar_epi16(order, _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(columns))));
    return (__m512bh)_mm512_permutex2var_epi16(low, codes, high);
  }
  void operator()(const uint8_t* tile, int s, __m512bh& w0, __m512bh& w1) const {
    w0 = pairs(tile + 32 * s);
    w1 = pairs(tile + 32 * (s + 8));
  }
};

// A level tile's codebook (quant_tiles.h level_table) as bfloat16, indexed by a word's low 5
// bits: entries i and i + 16 alike, so that a byte's low nibble needs no mask (exact: the
// levels are integers of at most 8 bits).
template <pw::Levels L>
inline __m512i level_bf16_table() {
  alignas(32) int8_t levels[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(levels), pw::level_table<L>());
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = to_bf16(static_cast<float>(levels[i & 15]));
  return _mm512_load_si512(t);
}

// Level tiles for exact activations (byte [k][l]: row l's column k in its low nibble, k + 16
// in its high one): step s's 32 bytes, columns 2s and 2s + 1, interleaved into a row's pairs
// (pair_order); each nibble's level from the table gives columns (2s, 2s + 1), the high
// nibbles' (2s + 16, 2s + 17): four vector ops a 64 weights.
template <pw::Levels L>
struct LevelCodes {
  const __m512i table = level_bf16_table<L>(), order = pair_order();
  static constexpr int x0(int s) { return 2 * s; }
  static constexpr int x1(int s) { return 2 * s + 16; }
  void operator()(const uint8_t* tile, int s, __m512bh& w0, __m512bh& w1) const {
    const __m512i codes = _mm512_permutexvar_epi16(order, _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * s))));
    w0 = (__m512bh)_mm512_permutexvar_epi16(codes, table);
    w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), table);
  }
};

}  // namespace pw::avx512
#endif
