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
//   IQ4_NL, MXFP4  256 bytes of nibbles, d[16] fp16  (d level[q]: a 16-entry int8 codebook,
//         IQ4_NL's levels or MXFP4's doubled e2m1 ones; level tiles, the file's 4.5 bits a
//         weight where Q8_0's tiles of the same values took 8.5; IQ4_XS's as superblock
//         level tiles, below)
// The K-quants' superblock tiles (SuperTile) hold the same values in fewer bytes: the file's
// sub-block scales as it stores them, int8 a row, beside their superblock's fp16 d.
//   Q6_KP  Q6_K's superblocks as bit planes (kPlanes; int8 activations on avx512_bf16): a
//         block's six-bit codes q + 32 as 256 bytes of low nibbles and 128 of high crumbs (two
//         bits each), 26.25 bytes a 32 weights with the scales, the file's own, where Q6_KS
//         takes 34.25 (quant_step_vnni.h plane_operands reads them).
//   Q5_KP  Q5_K's superblocks likewise: its five-bit codes as 256 bytes of low nibbles and 64
//         of fifth bits a block, 22.5 bytes a 32 weights (the file's 22) where Q5_KS takes 34.5.
//
// A kernel walks a 16-row group's blocks b = 0 .. K / 32 - 1 through at(group, b), and reads
// a block's scales through scales8 / scales16(tile, b, array): one interface for both (kSuper
// tells them apart where a kernel's choices differ: quant_gemm_vnni.h kMayFold).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "bf16.h"

namespace pw {

// The range of a Q8 tile's codes: any int8 (Q8_0's; IQ4's levels), or six bits, signed
// (-32..31: Q6_K, Q3_K) or unsigned (0..63: Q5_K, Q5_1, Q2_K), which the AVX512-BF16 kernels
// turn into bfloat16 with one 64-entry table lookup (quant_kernels.cpp SixBitCodes).
enum Codes { kAnyInt8, kSigned6, kUnsigned6 };

// A level tile's codebook: its nibbles index 16 int8 levels (a weight is d * level), which
// make it a Q8_0 tile of kAnyInt8 codes once looked up (vpshufb, 32 a instruction).
// Its nibbles: for exact activations byte [k][l] holds row l's column k (low nibble) and
// k + 16 (high), as the file's bytes do; for integer ones byte [j][w][p] holds, of the row
// word w stands for (rows 0-3, 8-11, 4-7, 12-15), columns 4j + p (low) and 4j + 2 + p
// (high), so that a step's 32 bytes looked up are a Q8 tile's integer layout (level_codes).
enum Levels { kNoLevels, kIQ4NLLevels, kMXFP4Levels };

// S: a scale's storage (uint16_t: fp16; float); kSplits: the column groups of a block with
// a scale each (Q6_K, Q2_K: 2 of 16 columns); kMin: a minimum added to each group's weights
// too. The arrays after the quants: each group's scales, then (kMin) each group's minimums.
// kFp8: the quants are e4m3 codes, not int8 (fp8_lanes decodes them); kCodes: their range.
// kPlanes: codes held as bit planes (Q6_KP, Q5_KP). kBias: what vpdpbusd's unsigned operand
// adds to a tile's code (its chains start at -kBias sum(x): quant_step_vnni.h; none where
// 0): 128 (a Q8 tile's code ^ 0x80), a plane tile's 32 (signed codes: its planes join into
// code + 32), or 0 (Q4 nibbles, Q5_KP's codes: unsigned as they are).
// What the kernels read of every layout (Tile, SuperTile).
template <int64_t kQuantBytes_, int kSplits_, bool kMin_, bool kFp8_, Codes kCodes_,
          Levels kLevels_ = kNoLevels, bool kPlanes_ = false>
struct TileShape {
  static constexpr int64_t kQuantBytes = kQuantBytes_;
  static constexpr int kSplits = kSplits_;
  static constexpr Levels kLevels = kLevels_;
  static constexpr bool kPlanes = kPlanes_;
  // kQ4: Q4_1's nibbles (codes 0..15); a level tile's nibbles are codebook indices
  static constexpr bool kMin = kMin_, kQ4 = kQuantBytes == 256 && !kLevels_, kFp8 = kFp8_;
  static constexpr int kBias = kQ4 ? 0 : !kPlanes_ ? 128 : kCodes_ == kSigned6 ? 32 : 0;
  static constexpr Codes kCodes = kCodes_;
  static constexpr int kArrays = kSplits * (kMin ? 2 : 1);
  // The column groups of a block whose activation sums the minimums meet (0: none needed).
  static constexpr int kSumGroups = kMin ? kSplits : 0;
  static constexpr int minimum(int split) { return kSplits + split; }   // its array
};

template <int64_t kQuantBytes_, int kSplits_, typename S, bool kMin_, bool kFp8_ = false,
          Codes kCodes_ = kAnyInt8, Levels kLevels_ = kNoLevels>
struct Tile : TileShape<kQuantBytes_, kSplits_, kMin_, kFp8_, kCodes_, kLevels_> {
  static constexpr bool kSuper = false;
  static constexpr int64_t kBytes = kQuantBytes_ + kSplits_ * (kMin_ ? 2 : 1) * 16 * sizeof(S);

  static const S* scales(const uint8_t* tile, int array) {
    return reinterpret_cast<const S*>(tile + kQuantBytes_) + 16 * array;
  }
  // Block b of a group's tiles (a group: K / 32 tiles, K / 32 * kBytes bytes).
  static const uint8_t* at(const uint8_t* group, int64_t b) { return group + b * kBytes; }
#if defined(__AVX2__)
  // Array `array`'s lanes of rows 8 half .. 8 half + 7 of block b (at `tile`), as float32.
  static __m256 scales8(const uint8_t* tile, int64_t /*b*/, int array, int half) {
    const S* p = scales(tile, array) + 8 * half;
    if constexpr (std::is_same<S, float>::value)
      return _mm256_loadu_ps(p);
    else
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
#endif
#if defined(__AVX512F__)
  static __m512 scales16(const uint8_t* tile, int64_t /*b*/, int array) {
    const S* p = scales(tile, array);
    if constexpr (std::is_same<S, float>::value)
      return _mm512_loadu_ps(p);
    else
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
#endif
};

// A K-quant's superblock tiles: 16 rows by 256 columns (8 blocks), the classic tile's quants
// block by block (kQuantBytes each), then int8 scale bytes [8 blocks][kArrays][16 rows], then
// fp16 heads [kHeads][16 rows]: d, which a scale array's bytes multiply, and (kMin) -dmin,
// which a minimum array's do. Block b's effective scale is head * byte: an fp16 times an
// integer of at most 7 bits, exact in float32, the very float32 the classic tile holds, so
// both multiply alike (Q4_K: 4.625 bits a weight against its 6; the file's 4.5).
template <int64_t kQuantBytes_, int kSplits_, bool kMin_, Codes kCodes_ = kAnyInt8,
          Levels kLevels_ = kNoLevels, bool kPlanes_ = false>
struct SuperTile : TileShape<kQuantBytes_, kSplits_, kMin_, false, kCodes_, kLevels_, kPlanes_> {
  using Shape = TileShape<kQuantBytes_, kSplits_, kMin_, false, kCodes_, kLevels_, kPlanes_>;
  using Shape::kArrays, Shape::kQuantBytes, Shape::kSplits;
  static constexpr bool kSuper = true;
  static constexpr int kHeads = kMin_ ? 2 : 1;
  static constexpr int64_t kSuperBytes = 8 * (kQuantBytes + kArrays * 16) + kHeads * 32;
  static constexpr int64_t kBytes = kSuperBytes / 8;   // a block's share: a group is nb of it
  static_assert(kSuperBytes % 8 == 0, "whole bytes a block");

  static const uint8_t* at(const uint8_t* group, int64_t b) {
    return group + (b >> 3) * kSuperBytes + (b & 7) * kQuantBytes;
  }
  // Block b's (at `tile`) bytes of scale array `array`, and the heads they multiply.
  static const int8_t* bytes(const uint8_t* tile, int64_t b, int array) {
    const uint8_t* scales = tile + (8 - (b & 7)) * kQuantBytes;
    return reinterpret_cast<const int8_t*>(scales) + ((b & 7) * kArrays + array) * 16;
  }
  static const uint16_t* heads(const uint8_t* tile, int64_t b, int array) {
    const uint8_t* p = tile + (8 - (b & 7)) * kQuantBytes + 8 * kArrays * 16;
    return reinterpret_cast<const uint16_t*>(p) + (array >= kSplits ? 16 : 0);
  }
#if defined(__AVX2__)
  static __m256 scales8(const uint8_t* tile, int64_t b, int array, int half) {
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes(tile, b, array) + 8 * half))));
    const __m256 d = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(heads(tile, b, array) + 8 * half)));
    return _mm256_mul_ps(d, q);
  }
#endif
#if defined(__AVX512F__)
  static __m512 scales16(const uint8_t* tile, int64_t b, int array) {
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes(tile, b, array)))));
    const __m512 d = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(heads(tile, b, array))));
    return _mm512_mul_ps(d, q);
  }
#endif
};

using Q4_1Tile = Tile<256, 1, uint16_t, true>;
using Q4_KTile = Tile<256, 1, float, true>;
using Q8_0Tile = Tile<512, 1, uint16_t, false>;
using Q6_KTile = Tile<512, 2, float, false>;      // also IQ4_XS's cut superblocks
using Q5_KTile = Tile<512, 1, float, true, false, kUnsigned6>;
using Q2_KTile = Tile<512, 2, float, true, false, kUnsigned6>;
using FP8Tile = Tile<512, 1, float, false, true>;
using Q4_KSuper = SuperTile<256, 1, true>;                 // Q4_K
using Q5_KSuper = SuperTile<512, 1, true, kUnsigned6>;     // Q5_K
using Q6_KSuper = SuperTile<512, 2, false, kSigned6>;      // Q6_K, Q3_K
using Q2_KSuper = SuperTile<512, 2, true, kUnsigned6>;     // Q2_K
using IQ4_XSSuper = SuperTile<512, 2, false>;              // IQ4_XS's int8 levels
// Q6_K (and Q3_K) as bit planes: 384 bytes a block, 26.25 a 32 weights with the scales
using Q6_KPSuper = SuperTile<384, 2, false, kSigned6, kNoLevels, true>;
// Q5_K as bit planes: 320 bytes a block, 22.5 a 32 weights with scales and minimums
using Q5_KPSuper = SuperTile<320, 1, true, kUnsigned6, kNoLevels, true>;
// IQ4_XS as level superblocks: the file's nibbles and sub-block scales, 4.31 bits a weight
using IQ4_XSLSuper = SuperTile<256, 1, false, kAnyInt8, kIQ4NLLevels>;
using IQ4_NLTile = Tile<256, 1, uint16_t, false, false, kAnyInt8, kIQ4NLLevels>;
using MXFP4Tile = Tile<256, 1, uint16_t, false, false, kAnyInt8, kMXFP4Levels>;

#if defined(__AVX2__)
// A level tile's codebook in both 128-bit lanes (vpshufb's table): kernels/gguf_blocks.py's
// IQ4_NL_LEVELS and MXFP4_LEVELS.
template <Levels L>
inline __m256i level_table() {
  static_assert(L != kNoLevels, "a level tile's");
  if constexpr (L == kIQ4NLLevels)
    return _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69,
                            89, 113, -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38,
                            53, 69, 89, 113);
  else
    return _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3,
                            4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
}

// Step j of a level tile packed for integer activations, rows 8h .. 8h + 7: the 32 int8
// codes a Q8 tile holds at 64 j + 32 h (row l's columns 4j .. 4j + 3 in its 32-bit lane).
// The step's words are rows 0-3, 8-11, 4-7, 12-15, so that interleaving the low nibbles'
// levels (columns 4j, 4j + 1) with the high ones' (4j + 2, 4j + 3) by 16-bit words, lane by
// lane, gives rows 0-7 (unpacklo) and 8-15 (unpackhi).
template <typename Tile>
inline __m256i level_codes(const uint8_t* tile, int j, int h) {
  const __m256i table = level_table<Tile::kLevels>(), low = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * j));
  const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
  const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
  return h ? _mm256_unpackhi_epi16(lo, hi) : _mm256_unpacklo_epi16(lo, hi);
}

// A tile's step j, rows 8h .. 8h + 7, as a Q8 tile packed for integer activations holds it.
template <typename Tile>
inline __m256i int_codes(const uint8_t* tile, int j, int h) {
  if constexpr (Tile::kLevels != kNoLevels)
    return level_codes<Tile>(tile, j, h);
  else
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 * j + 32 * h));
}
#endif

// Block b's share of a 16-row group's tiles at `ahead` (nullptr: none) fetched into L2. The
// GEMMs, and the AVX-512 small steps of 2-7 tokens (exact and int8), call it block by block
// while they multiply a group, for the next group, so that a step's reading overlaps its
// products (prefetching a whole group at once stalled the core until the lines landed:
// bench/NOTES.md "Small steps on the GEMM"; small steps: "Small steps fetch ahead").
// Its `ahead` for group g of a thread's share [g0, g1), groups `bytes` apart from `packed`:
// the next group's tiles, at the share's end its first again if another chunk of tokens
// follows (`more`), else none.
inline const uint8_t* group_ahead(const uint8_t* packed, int64_t bytes, int64_t g, int64_t g0,
                                  int64_t g1, bool more) {
  return g + 1 < g1 ? packed + (g + 1) * bytes : more ? packed + g0 * bytes : nullptr;
}
// A small step's `ahead` (M tokens, one pass over the groups): the next group's tiles from 2
// tokens, where a group's products outlast its reading (from DRAM, 1.4x at 2 tokens); none
// for one token, which streams at about the read bandwidth without them and whose fetches'
// loads cost more than they gain (bench/NOTES.md "Small steps fetch ahead").
template <int M>
inline const uint8_t* step_ahead(const uint8_t* packed, int64_t bytes, int64_t g, int64_t g0,
                                 int64_t g1) {
  return M > 1 ? group_ahead(packed, bytes, g, g0, g1, false) : nullptr;
}
#if defined(__AVX2__)
template <typename Tile>
inline void fetch_ahead(const uint8_t* ahead, int64_t b) {
  if (ahead)
    for (int64_t at = b * Tile::kBytes & ~int64_t(63); at < (b + 1) * Tile::kBytes; at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + at), _MM_HINT_T1);
}
#endif

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
