// Small steps (1-7 tokens: decode) of the quantized matmuls with int8 activations on the
// avx512_bf16 tier, whose CPUs all have AVX512-VNNI: the tiles as stored, 16 rows a zmm,
// vpdpbusd's 64 byte products an instruction. A decode step is bound by instructions a weight
// on a core, not by bytes (bench/tile_rate.py): the exact kernels spend three decode
// shuffles and two vdpbf16ps on 64 weights, this one a vpermw, two ANDs and two vpdpbusd on
// 128 (Q4), or an XOR and one vpdpbusd on 64 (Q8 tiles).
//
// The arithmetic is quant_int_avx2.h's small kernels' exactly (the integer sums of a block
// are exact in int32; the float steps follow in the same order, lane by lane), so the
// outputs equal theirs bit for bit, and the GEMM's (quant_gemm_vnni.h) from 8 tokens.
//
// Q4 tiles: 64 bytes (steps 2i, 2i + 1: row l's bytes qs[4i], qs[4i + 1] | qs[4i + 2],
// qs[4i + 3], 16-bit words l and 16 + l) go through one vpermw (row_quads) into a 32-bit
// lane a row: low nibbles columns 4i .. 4i + 3, high ones 16 + 4i .. 16 + 4i + 3. The high
// nibbles are multiplied in place (v & 0xF0 = 16 q), their chain shifted right by 4 at the
// block's end (exact: a multiple of 16), which saves a shift a step.
// Q8 tiles (integer layout: byte [j][l][c] is row l's column 4j + c): code ^ 0x80 is the
// code + 128 as vpdpbusd's unsigned operand; a split's chain starts at -128 sum(x) over it.
// Level tiles (IQ4_NL, MXFP4, IQ4_XS) multiply as the Q8 tiles of their levels, looked up
// (q8_operands): the same integer sums, so the same outputs bit for bit; Q6_K's bit planes
// as its codes + 32, their chains starting at -32 sum(x) (plane_operands), Q5_K's as its
// codes, from 0 (fifth_bit_operands).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_avx512.h"       // store_rows, add_minimums
#include "quant_int_avx2.h"     // IntActivations
#include "quant_tiles.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
namespace pw::vnni {

inline __m512i x_quad(const int8_t* x) {    // (x[0] .. x[3]) in every 32-bit lane
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

// 64 bytes as two 32-byte loads: a Q8 tile (544 bytes; a Q6_K superblock's 4,384) starts
// every other one 32 bytes into a cache line, where one 64-byte load would span two lines
// (from memory such split loads streamed at 0.75x the exact kernels' bytes a second).
inline __m512i load_halves(const uint8_t* p) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), 1);
}

// Where a Q8 tile split's vpdpbusd chain starts: -bias times the sum of a token's int8 x over
// the split's columns (`block`: the token's 32 rounded values), since its codes are operands
// + bias (Tile::kBias). Split `split` of `splits` (1, or 2: columns < 16 and >= 16).
inline int32_t split_start(const int16_t* block, int split, int splits, int bias) {
  const int width = 32 / splits;
  int32_t total = 0;
  for (int k = split * width; k < (split + 1) * width; ++k) total += block[k];
  return -bias * total;
}

// A Q4 tile's 64 bytes at `step_pair` (steps 2i, 2i + 1) with row l's four bytes qs[4i ..
// 4i + 3] in 32-bit lane l: word w <- word (w % 2) * 16 + w / 2, one vpermw (here 1.3x
// the rate of widening each step's words as quant_gemm_vnni.h's panels do; there, beside
// the panel's stores, the reverse).
inline __m512i row_quads(const uint8_t* step_pair) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  return _mm512_permutexvar_epi16(order, _mm512_loadu_si512(step_pair));
}

// A Q4 tile's integer sums (16 rows) for M tokens, each token's block at x[m].
template <int M>
inline void q4_sums(__m512i (&sum)[M], const uint8_t* tile, const int8_t* const (&x)[M]) {
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512i hi[M];
  for (int m = 0; m < M; ++m) sum[m] = hi[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512i v = row_quads(tile + 64 * i);
    const __m512i v_lo = _mm512_and_si512(v, low), v_hi = _mm512_and_si512(v, high);
    for (int m = 0; m < M; ++m) {
      sum[m] = _mm512_dpbusd_epi32(sum[m], v_lo, x_quad(x[m] + 4 * i));
      hi[m] = _mm512_dpbusd_epi32(hi[m], v_hi, x_quad(x[m] + 16 + 4 * i));
    }
  }
  for (int m = 0; m < M; ++m) sum[m] = _mm512_add_epi32(sum[m], _mm512_srai_epi32(hi[m], 4));
}

// A level tile's codebook + 128 in every 128-bit lane (vpshufb's table): its levels as the
// unsigned operand a Q8 tile's codes ^ 0x80 are.
template <Levels L>
inline __m512i biased_levels() {
  const __m256i t =
      _mm256_xor_si256(level_table<L>(), _mm256_set1_epi8(static_cast<char>(0x80)));
  return _mm512_inserti64x4(_mm512_castsi256_si512(t), t, 1);
}

// Q6_KP's bit planes for integer activations, steps j and j + 1 (j even) as vpdpbusd's
// operands: code + 32, six bits. Their 64 nibble bytes (at 32 j) are both steps' operand
// order: byte 4l + c holds row l's column 4j + c (low nibble) and 4j + 4 + c (high). Their
// 32 crumb bytes (at 256 + 16 j), byte k, hold the high bits of nibble bytes k and k + 32:
// bits 0-1 byte k's low, 2-3 byte k + 32's low, 4-5 byte k's high, 6-7 byte k + 32's high.
// The crumbs, and beside them the same shifted right by 2 (nibble bytes 32-63's), give the
// low nibbles' high bits shifted left by 4, the high nibbles' as they lie (a word's shift
// carries bits between its bytes: the mask drops them). Fixed shifts: vpsllvw's variable
// ones ran slower.
inline void plane_operands(const uint8_t* tile, int j, __m512i (&w)[2]) {
  const __m512i v = load_halves(tile + 32 * j);
  const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 256 + 16 * j));
  const __m512i crumbs =
      _mm512_inserti64x4(_mm512_castsi256_si512(c), _mm256_srli_epi16(c, 2), 1);
  const __m512i nibble = _mm512_set1_epi8(0x0F), crumb = _mm512_set1_epi8(0x30);
  const __m512i lo_bits = _mm512_and_si512(_mm512_slli_epi16(crumbs, 4), crumb);
  const __m512i hi_bits = _mm512_and_si512(crumbs, crumb);
  w[0] = _mm512_ternarylogic_epi32(v, nibble, lo_bits, 0xEA);                 // A & B | C
  w[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nibble, hi_bits, 0xEA);
}

// Q5_KP's bit planes, steps j and j + 1 (j even): code, five bits. The nibbles as Q6_KP's;
// their fifth bits (16 bytes at 256 + 8 j) two 64-bit masks, bit n nibble byte n's: its low
// nibble's, then its high one's, added as 16 under the mask (no shift or lane insert: the
// pipes vpdpbusd's broadcasts share).
inline void fifth_bit_operands(const uint8_t* tile, int j, __m512i (&w)[2]) {
  const __m512i v = load_halves(tile + 32 * j);
  uint64_t fifth[2];
  std::memcpy(fifth, tile + 256 + 8 * j, sizeof fifth);
  const __m512i nibble = _mm512_set1_epi8(0x0F), bit = _mm512_set1_epi8(0x10);
  const __m512i lo = _mm512_and_si512(v, nibble);
  const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  w[0] = _mm512_mask_add_epi8(lo, _cvtu64_mask64(fifth[0]), lo, bit);
  w[1] = _mm512_mask_add_epi8(hi, _cvtu64_mask64(fifth[1]), hi, bit);
}

// Steps j and j + 1 of a Q8 tile (integer layout), a level tile or a plane tile, as
// vpdpbusd's unsigned operand (code + Tile::kBias). A level tile's 64 bytes are the two
// steps' nibbles (quant_tiles.h Levels: byte [j][w][p], rows 0-3, 8-11, 4-7, 12-15 a word
// each), looked up; interleaving
// the low nibbles' levels (columns 4j + p) with the high ones' (4j + 2 + p) by 16-bit words
// gives, 128-bit lane by lane, rows 0-3, 4-7 of each step (unpacklo) and 8-11, 12-15
// (unpackhi), which two lane shuffles order: ten ops a 128 codes.
template <typename Tile>
inline void q8_operands(const uint8_t* tile, int j, __m512i (&w)[2]) {
  if constexpr (Tile::kLevels != kNoLevels) {
    const __m512i table = biased_levels<Tile::kLevels>(), low = _mm512_set1_epi8(0x0F);
    const __m512i v = load_halves(tile + 32 * j);     // split lines: see there
    const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
    const __m512i hi =
        _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    const __m512i rows_lo = _mm512_unpacklo_epi16(lo, hi);   // rows 0-3, 4-7 of each step
    const __m512i rows_hi = _mm512_unpackhi_epi16(lo, hi);   // rows 8-11, 12-15
    w[0] = _mm512_shuffle_i64x2(rows_lo, rows_hi, 0x44);    // lanes 0, 1 of each: step j
    w[1] = _mm512_shuffle_i64x2(rows_lo, rows_hi, 0xEE);    // lanes 2, 3: step j + 1
  } else if constexpr (Tile::kPlanes && Tile::kCodes == kSigned6) {
    plane_operands(tile, j, w);
  } else if constexpr (Tile::kPlanes) {
    fifth_bit_operands(tile, j, w);
  } else {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    w[0] = _mm512_xor_si512(load_halves(tile + 64 * j), bias);
    w[1] = _mm512_xor_si512(load_halves(tile + 64 * (j + 1)), bias);
  }
}

// Steps [j0, j1) of a Q8 or level tile (one split's; j1 - j0 even) for M tokens, each chain
// starting at start[m]: two chains a token (vpdpbusd's latency, not its throughput, would
// bound one).
template <int M, typename Tile>
inline void q8_sums(__m512i (&sum)[M], const uint8_t* tile, int j0, int j1,
                    const int8_t* const (&x)[M], const int32_t* start) {
  __m512i odd[M];
  for (int m = 0; m < M; ++m) {
    sum[m] = _mm512_set1_epi32(start[m]);
    odd[m] = _mm512_setzero_si512();
  }
#pragma GCC unroll 4
  for (int j = j0; j < j1; j += 2) {
    __m512i w[2];
    q8_operands<Tile>(tile, j, w);
    for (int m = 0; m < M; ++m) {
      sum[m] = _mm512_dpbusd_epi32(sum[m], w[0], x_quad(x[m] + 4 * j));
      odd[m] = _mm512_dpbusd_epi32(odd[m], w[1], x_quad(x[m] + 4 * j + 4));
    }
  }
  for (int m = 0; m < M; ++m) sum[m] = _mm512_add_epi32(sum[m], odd[m]);
}

// Output groups [g0, g1) of 16 rows for M tokens from token t. starts: [t][nb][kSplits],
// -128 times the sum of the int8 x over each split's columns (Q8 tiles). The float steps in
// quant_int_avx2.h's order: Q4 tiles scale then add minimums, Q8 tiles the reverse.
template <int M, typename Tile, typename Out>
void step_groups(Out* out, int64_t os, const avx2::IntActivations<1>& a, const int32_t* starts,
                 int64_t t, const uint8_t* packed, int64_t g0, int64_t g1) {
  static_assert(!Tile::kQ4 || Tile::kSplits == 1, "a Q4 tile's block has one scale");
  const int64_t nb = a.K / 32;
  const float* sums = Tile::kMin ? a.sum.data() + t * nb * Tile::kSplits : nullptr;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = packed + g * nb * Tile::kBytes;
    const uint8_t* ahead = step_ahead<M>(packed, nb * Tile::kBytes, g, g0, g1);
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* tile = Tile::at(group, b);
      fetch_ahead<Tile>(ahead, b);
      const int8_t* x[M];
      __m512 dx[M];
      for (int m = 0; m < M; ++m) {
        x[m] = a.plane(t + m, 0) + b * 32;
        dx[m] = _mm512_set1_ps(a.scale[(t + m) * nb + b]);
      }
      if constexpr (!Tile::kQ4) avx512::add_minimums<Tile>(acc, tile, sums, nb, b);
      for (int s = 0; s < Tile::kSplits; ++s) {
        __m512i sum[M];
        if constexpr (Tile::kQ4) {
          q4_sums<M>(sum, tile, x);
        } else {
          int32_t start[M] = {};
          if constexpr (Tile::kBias != 0)
            for (int m = 0; m < M; ++m)
              start[m] = starts[((t + m) * nb + b) * Tile::kSplits + s];
          constexpr int kSteps = 8 / Tile::kSplits;
          q8_sums<M, Tile>(sum, tile, s * kSteps, (s + 1) * kSteps, x, start);
        }
        const __m512 d = Tile::scales16(tile, b, s);
        for (int m = 0; m < M; ++m)
          acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum[m]), dx[m]), d, acc[m]);
      }
      if constexpr (Tile::kQ4) avx512::add_minimums<Tile>(acc, tile, sums, nb, b);
    }
    for (int m = 0; m < M; ++m) avx512::store_rows(out + m * os + g * avx2::kRows, acc[m]);
  }
}

// out [T, N] = x [T, K] @ W^T for T < kUpTo (at most 8) tokens with x rounded to int8 per
// block (larger steps take quant_gemm_vnni.h's GEMM: only these sizes are built).
template <typename Tile, int64_t kUpTo, typename T>
void matmul_int8_step(T* out, int64_t out_stride, const T* x, int64_t x_stride, int64_t tokens,
                      const uint8_t* packed, int64_t N, int64_t K) {
  static_assert(kUpTo <= 8, "step_groups keeps at most 7 tokens' sums");
  const avx2::IntActivations<1> a(x, x_stride, tokens, K, Tile::kSumGroups);
  const int64_t nb = K / 32;
  std::vector<int32_t> starts;      // where each split's chains start (biased operands)
  if constexpr (Tile::kBias != 0) {
    starts.resize(tokens * nb * Tile::kSplits);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t b = 0; b < nb; ++b)
        for (int s = 0; s < Tile::kSplits; ++s)
          starts[(t * nb + b) * Tile::kSplits + s] =
              split_start(a.value.data() + t * K + b * 32, s, Tile::kSplits, Tile::kBias);
  }
  at::parallel_for(0, N / avx2::kRows, 1, [&](int64_t g0, int64_t g1) {
    switch (tokens) {
#define PW_STEP(M)                                                                          \
      case M:                                                                                 \
        if constexpr (M < kUpTo)                                                              \
          return step_groups<M, Tile>(out, out_stride, a, starts.data(), 0, packed, g0, g1);  \
        break;
      PW_STEP(1) PW_STEP(2) PW_STEP(3) PW_STEP(4) PW_STEP(5) PW_STEP(6) PW_STEP(7)
#undef PW_STEP
    }
  });
}

}  // namespace pw::vnni
#endif
