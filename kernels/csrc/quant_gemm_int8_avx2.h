// Large steps (prefill chunks, big decode batches) of the quantized matmuls with int8
// activations on the tiers without VNNI (avx2, avx512): a GEMM on the tiles as stored, in
// place of quant_int_avx2.h's small kernels, whose every pass of 4 tokens reads all the tiles
// again. The arithmetic is theirs: the same rounded activations (IntActivations<1>), the same
// exact int32 block sums and the same float steps in the same order, so the outputs equal
// theirs bit for bit (tests/kernels/test_quant_int8.py).
//
// vpmaddubsw multiplies a register of UNSIGNED bytes (the weights) by one of SIGNED bytes (a
// token's four adjacent int8 activations, a broadcast 32-bit word) and adds adjacent pairs
// into int16 lanes: 32 multiply-adds an instruction, twice vpmaddwd's 16 and four times an
// 8-lane FMA's. Q4 tiles' nibbles (0..15) are unsigned already, and a lane's pair sums stay
// within int16 over a whole block's 8 steps (8 * 2 * 15 * 127 = 30480), so a block costs 8
// vpmaddubsw and 8 vpaddw a register, then one vpmaddwd by ones to int32 rows. Q8 tiles of
// six-bit codes are unsigned bytes below 64 in the panel (kSixBit) and sum two steps in
// int16; those of any int8 code take |w| times x with w's sign (vpsignb), each step's pairs
// widened by vpmaddwd at once (2 * 128 * 127 fits int16, two steps would not).
//
// Registers hold 8 rows x 4 columns (a row's four bytes a 32-bit lane); a 16-row group is two.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_avx2.h"       // store8, kRows
#include "quant_gemm_avx2.h"  // IntActivations
#include "quant_tiles.h"

namespace pw::avx2 {

// Tokens a call keeps in registers: Q4 tiles 4 (q4_block_sums, whose 8 int16 sums fill half
// the registers), Q8 tiles 2 (the intrinsics below: 3 spilled their sums).
constexpr int kQ4GemmTokens = 4, kInt8GemmTokens = 2;
// Tokens a panel serves before the next group's: their int8 rows (<= 192 KB, at most 128
// tokens) stay in L2 beside the panel while every group of a thread's share reads them.
inline int64_t int8_gemm_chunk(int64_t K) {
  return std::clamp<int64_t>(196608 / K, 8, 128) / kQ4GemmTokens * kQ4GemmTokens;
}

// Q8 tiles of six-bit codes (Q6_K, Q3_K: -32..31, stored + 32 in the panel; Q5_K, Q2_K:
// 0..63) are unsigned bytes below 64, so two steps' pair sums stay within int16
// (2 * 2 * 63 * 127 = 32004) and need no vpsignb; other Q8 tiles' codes take any int8.
template <typename Tile>
constexpr bool kSixBit = !Tile::kQ4 && Tile::kCodes != kAnyInt8;

// From this many tokens of a step the GEMM beats the small int8 kernels (bench/int8_gemm.py):
// 8 for Q4 tiles and six-bit codes; any-int8 codes, whose vpsignb the small kernels pay too,
// gain only from ~32 (Zen 3: 0.9x at 8 tokens, 1.0x at 16, 1.1-1.2x at 128).
template <typename Tile>
constexpr int64_t kInt8GemmFrom = Tile::kQ4 || kSixBit<Tile> ? 8 : 32;

// x rounded to int8 (IntActivations<1>) and, for a panel whose codes are stored + 32
// (kSigned6), each split's -32 * sum(q) over its columns, [T][nb][splits]: where the split's
// int32 chains start, so that they sum (w + 32) q - 32 q = w q.
struct Int8GemmRows : IntActivations<1> {
  int splits;
  std::vector<int32_t> start;

  template <typename In>
  Int8GemmRows(const In* x, int64_t x_stride, int64_t T_, int64_t K_, int groups, int splits_)
      : IntActivations<1>(x, x_stride, T_, K_, groups), splits(splits_),
        start(T_ * nb * splits_) {
    const int width = splits ? 32 / splits : 0;
    for (int64_t i = 0; i < T * nb * splits; ++i) {   // i: (token, block, split)
      const int8_t* v = q.data() + i / splits * 32 + i % splits * width;
      int32_t total = 0;
      for (int k = 0; k < width; ++k) total += v[k];
      start[i] = -32 * total;
    }
  }
};

// One 16-row group's operands: Q4 tiles' nibbles, six-bit codes and level tiles' levels as
// [nb][8 steps][2 halves] registers of 8 rows x columns 4s .. 4s + 3 (a row's four bytes a
// 32-bit lane); other Q8 tiles are read in place (their bytes are already in that order).
// Each block's scale arrays as float32 [nb][arrays][16] (a superblock tile's computed once a
// fill, not once a token).
template <typename Tile>
struct Int8Panel {
  static constexpr bool kQuants = Tile::kQ4 || kSixBit<Tile> || Tile::kLevels != kNoLevels;
  std::vector<__m256i> q;
  std::vector<float> scales;
  explicit Int8Panel(int64_t nb) : q(kQuants ? nb * 16 : 0), scales(nb * Tile::kArrays * 16) {}

  void fill(const uint8_t* group, int64_t nb) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* tile = Tile::at(group, b);
      prefetch_ahead<Tile>(group, b);
      if constexpr (Tile::kQ4) nibbles(tile, q.data() + b * 16);
      if constexpr (kSixBit<Tile>) six_bits(tile, q.data() + b * 16);
      if constexpr (Tile::kLevels != kNoLevels)   // looked up once a chunk, as a Q8 tile
        for (int i = 0; i < 16; ++i) q[b * 16 + i] = level_codes<Tile>(tile, i / 2, i % 2);
      for (int a = 0; a < Tile::kArrays; ++a)
        for (int h = 0; h < 2; ++h)
          _mm256_storeu_ps(scales.data() + (b * Tile::kArrays + a) * 16 + 8 * h,
                           Tile::scales8(tile, b, a, h));
    }
  }

  // Byte [j][l][p] of a Q4 tile (32 j + 2 l + p) holds row l's column 2j + p (low nibble) and
  // 2j + 16 + p (high): steps j = 2i and 2i + 1 interleaved by 16-bit words give a row's
  // columns 4i .. 4i + 3 (low nibbles: step i) and 16 + 4i .. (high: step 4 + i).
  static void nibbles(const uint8_t* tile, __m256i* out) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < 4; ++i)
      for (int h = 0; h < 2; ++h) {
        auto rows = [&](int j) {   // rows 8h .. 8h + 7 of step j: 16 bytes
          return _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 32 * j + 16 * h));
        };
        const __m128i a = rows(2 * i), c = rows(2 * i + 1);
        const __m256i v = _mm256_set_m128i(_mm_unpackhi_epi16(a, c), _mm_unpacklo_epi16(a, c));
        out[2 * i + h] = _mm256_and_si256(v, low);
        out[2 * (4 + i) + h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
  }

  // A Q8 tile's step j, rows 8h .. 8h + 7, is its 32 bytes at 64 j + 32 h; signed codes + 32.
  static void six_bits(const uint8_t* tile, __m256i* out) {
    const __m256i offset = _mm256_set1_epi8(Tile::kCodes == kSigned6 ? 32 : 0);
    for (int i = 0; i < 16; ++i)
      out[i] = _mm256_add_epi8(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * i)), offset);
  }
};

inline __m256i quad_of(const int8_t* q) {     // q[0..3] in every 32-bit lane
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}

// Q4 tiles, 4 tokens: block b's int16 pair sums [half][token] (rows 0-7, 8-15) from its
// panel registers w (8 steps x 2 halves) and the tokens' int8 rows (token 0's block at x,
// the next ones `stride` bytes apart). Written in assembly: GCC, given these as intrinsics,
// folds each panel load into every product (8 loads a step for 2) and spills sums; here a
// step is 2 panel loads, 4 broadcasts, 8 vpmaddubsw and 8 vpaddw (step 0's products are the
// sums: no zeroing, no adds), the sums and temporaries the 12 registers named.
#define PW_Q4_W(s) "vmovdqa " #s "*64(%[w]), %[w0]\n vmovdqa " #s "*64+32(%[w]), %[w1]\n"
#define PW_Q4_TOKEN(s, X, A, B)                                                         \
  "vpbroadcastd " #s "*4" X ", %[x]\n"                                                   \
  "vpmaddubsw %[x], %[w0], %[p]\n vpaddw %[p], %[" #A "], %[" #A "]\n"                  \
  "vpmaddubsw %[x], %[w1], %[p]\n vpaddw %[p], %[" #B "], %[" #B "]\n"
#define PW_Q4_FIRST(X, A, B) \
  "vpbroadcastd " X ", %[x]\n vpmaddubsw %[x], %[w0], %[" #A "]\n vpmaddubsw %[x], %[w1], %[" #B "]\n"
#define PW_Q4_STEP(s) PW_Q4_W(s)                                                        \
  PW_Q4_TOKEN(s, "(%[x0])", a0, b0) PW_Q4_TOKEN(s, "(%[x0],%[stride],1)", a1, b1)         \
  PW_Q4_TOKEN(s, "(%[x0],%[stride],2)", a2, b2) PW_Q4_TOKEN(s, "(%[x3])", a3, b3)

inline void q4_block_sums(__m256i (&sum)[2][4], const __m256i* w, const int8_t* x,
                          int64_t stride) {
  const int8_t* x3 = x + 3 * stride;
  __m256i w0, w1, xv, p;
  asm(PW_Q4_W(0) PW_Q4_FIRST("(%[x0])", a0, b0) PW_Q4_FIRST("(%[x0],%[stride],1)", a1, b1)
      PW_Q4_FIRST("(%[x0],%[stride],2)", a2, b2) PW_Q4_FIRST("(%[x3])", a3, b3)
      PW_Q4_STEP(1) PW_Q4_STEP(2) PW_Q4_STEP(3) PW_Q4_STEP(4) PW_Q4_STEP(5) PW_Q4_STEP(6)
      PW_Q4_STEP(7)
      : [a0] "=&x"(sum[0][0]), [a1] "=&x"(sum[0][1]), [a2] "=&x"(sum[0][2]),
        [a3] "=&x"(sum[0][3]), [b0] "=&x"(sum[1][0]), [b1] "=&x"(sum[1][1]),
        [b2] "=&x"(sum[1][2]), [b3] "=&x"(sum[1][3]), [w0] "=&x"(w0), [w1] "=&x"(w1),
        [x] "=&x"(xv), [p] "=&x"(p)
      : [w] "r"(w), [x0] "r"(x), [x3] "r"(x3), [stride] "r"(stride)
      : "memory");
}
#undef PW_Q4_W
#undef PW_Q4_TOKEN
#undef PW_Q4_FIRST
#undef PW_Q4_STEP

// Q4 tiles: out rows t .. t + M - 1 (`out` at row t), the group's 16 columns. Per block and
// half the small kernels' float steps: acc += (sum * scale(x)) * d, then m * sum(x). The
// accumulators live in memory (L1), touched once a block, so that the registers hold the
// sums (four tokens': q4_block_sums; fewer, the chunk's last, the intrinsics below).
template <int M, typename Tile, typename Out>
void int8_gemm_q4(Out* out, int64_t os, const Int8GemmRows& a, int64_t t,
                  const Int8Panel<Tile>& p, const uint8_t* ahead) {
  static_assert(Tile::kSplits == 1, "a Q4 block has one scale (and minimum) a row");
  const int64_t nb = a.K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float acc[M][16] = {};     // [token][rows 0-15]
  for (int64_t b = 0; b < nb; ++b) {
    fetch_ahead<Tile>(ahead, b);
    const __m256i* w = p.q.data() + b * 16;
    __m256i sum[2][M];               // int16 pair sums, [rows 0-7, 8-15][token]
    if constexpr (M == kQ4GemmTokens) {
      q4_block_sums(sum, w, a.plane(t, 0) + b * 32, a.K);   // one plane: tokens K bytes apart
    } else {
      for (int m = 0; m < M; ++m) sum[0][m] = sum[1][m] = _mm256_setzero_si256();
      // Two steps an iteration: GCC unrolling all 8 reassociates the sums into a tree of
      // products and spills them (as quant_gemm_avx2.h's).
#pragma GCC unroll 2
      for (int s = 0; s < 8; ++s) {
        const __m256i w0 = _mm256_load_si256(w + 2 * s), w1 = _mm256_load_si256(w + 2 * s + 1);
        for (int m = 0; m < M; ++m) {
          const __m256i x = quad_of(a.plane(t + m, 0) + b * 32 + 4 * s);
          sum[0][m] = _mm256_add_epi16(sum[0][m], _mm256_maddubs_epi16(w0, x));
          sum[1][m] = _mm256_add_epi16(sum[1][m], _mm256_maddubs_epi16(w1, x));
        }
      }
    }
    const float* sc = p.scales.data() + b * Tile::kArrays * 16;
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_loadu_ps(sc + 8 * h);
      for (int m = 0; m < M; ++m) {
        const __m256 qx = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[h][m], ones));
        const __m256 dx = _mm256_set1_ps(a.scale[(t + m) * nb + b]);
        __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(qx, dx), d, _mm256_load_ps(acc[m] + 8 * h));
        if constexpr (Tile::kMin) {
          const __m256 mn = _mm256_loadu_ps(sc + Tile::minimum(0) * 16 + 8 * h);
          v = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.sum[(t + m) * nb + b]), v);
        }
        _mm256_store_ps(acc[m] + 8 * h, v);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) store8(out + m * os + 8 * h, _mm256_load_ps(acc[m] + 8 * h));
}

// Split s of block b's int32 sums [half][token] from a Q8 tile of any int8 codes, read in place
// (byte [j][l][c] of 64 j + 4 l + c is row l's column 4j + c): |w| times x with w's sign.
template <int M, typename Tile>
inline void signed_sums(__m256i (&sum)[2][M], const Int8GemmRows& a, int64_t t,
                        const uint8_t* tile, int64_t b, int s) {
  constexpr int kSteps = 8 / Tile::kSplits;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < M; ++m) sum[0][m] = sum[1][m] = _mm256_setzero_si256();
#pragma GCC unroll 2
  for (int j = s * kSteps; j < (s + 1) * kSteps; ++j)
    for (int h = 0; h < 2; ++h) {
      const __m256i w =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 * j + 32 * h));
      const __m256i w_abs = _mm256_abs_epi8(w);
      for (int m = 0; m < M; ++m) {
        const __m256i x = _mm256_sign_epi8(quad_of(a.plane(t + m, 0) + b * 32 + 4 * j), w);
        sum[h][m] = _mm256_add_epi32(sum[h][m],
                                     _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, x), ones));
      }
    }
}

// The same from a panel of six-bit codes: two steps' pair sums in int16, then int32; chains
// start at -32 sum(q) where the panel holds codes + 32.
template <int M, typename Tile>
inline void six_bit_sums(__m256i (&sum)[2][M], const Int8GemmRows& a, int64_t t,
                         const Int8Panel<Tile>& p, int64_t b, int s) {
  constexpr int kSteps = 8 / Tile::kSplits;
  static_assert(kSteps % 2 == 0, "steps in pairs");
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t nb = a.nb;
  for (int m = 0; m < M; ++m)
    sum[0][m] = sum[1][m] = Tile::kCodes == kSigned6
        ? _mm256_set1_epi32(a.start[((t + m) * nb + b) * Tile::kSplits + s])
        : _mm256_setzero_si256();
  const __m256i* w = p.q.data() + b * 16;
#pragma GCC unroll 1
  for (int j = s * kSteps; j < (s + 1) * kSteps; j += 2)
    for (int h = 0; h < 2; ++h) {
      const __m256i w0 = _mm256_load_si256(w + 2 * j + h);
      const __m256i w1 = _mm256_load_si256(w + 2 * j + 2 + h);
      for (int m = 0; m < M; ++m) {
        const int8_t* x = a.plane(t + m, 0) + b * 32 + 4 * j;
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w0, quad_of(x)),
                                               _mm256_maddubs_epi16(w1, quad_of(x + 4)));
        sum[h][m] = _mm256_add_epi32(sum[h][m], _mm256_madd_epi16(pairs, ones));
      }
    }
}

// Q8 tiles: the small kernels' order, each split's minimums first, then its sums.
template <int M, typename Tile, typename Out>
void int8_gemm_q8(Out* out, int64_t os, const Int8GemmRows& a, int64_t t,
                  const uint8_t* group, const Int8Panel<Tile>& p, const uint8_t* ahead) {
  const int64_t nb = a.K / 32;
  __m256 acc[2][M];
  for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    fetch_ahead<Tile>(ahead, b);
    const float* sc = p.scales.data() + b * Tile::kArrays * 16;
    if constexpr (Tile::kMin)
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < Tile::kSplits; ++s) {
          const __m256 mn = _mm256_loadu_ps(sc + Tile::minimum(s) * 16 + 8 * h);
          for (int m = 0; m < M; ++m) {
            const float xs = a.sum[((t + m) * nb + b) * Tile::kSplits + s];
            acc[h][m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs), acc[h][m]);
          }
        }
    for (int s = 0; s < Tile::kSplits; ++s) {
      __m256i sum[2][M];
      if constexpr (kSixBit<Tile>) six_bit_sums<M, Tile>(sum, a, t, p, b, s);
      else if constexpr (Tile::kLevels != kNoLevels)
        signed_sums<M, Tile>(sum, a, t, reinterpret_cast<const uint8_t*>(p.q.data() + b * 16),
                             b, s);
      else signed_sums<M, Tile>(sum, a, t, Tile::at(group, b), b, s);
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_loadu_ps(sc + s * 16 + 8 * h);
        for (int m = 0; m < M; ++m) {
          const __m256 dx = _mm256_set1_ps(a.scale[(t + m) * nb + b]);
          acc[h][m] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum[h][m]), dx), d,
                                      acc[h][m]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) store8(out + m * os + 8 * h, acc[h][m]);
}

// `ahead`: the next group's tiles, fetched while these products run (fetch_ahead).
template <int M, typename Tile, typename Out>
inline void int8_gemm_call(Out* o, int64_t os, const Int8GemmRows& a, int64_t t,
                           const uint8_t* group, const Int8Panel<Tile>& p, const uint8_t* ahead) {
  if constexpr (Tile::kQ4) int8_gemm_q4<M, Tile>(o + t * os, os, a, t, p, ahead);
  else int8_gemm_q8<M, Tile>(o + t * os, os, a, t, group, p, ahead);
}

// out [T, N] = x [T, K] @ W^T with x rounded to int8 per block, for T >= kInt8GemmFrom<Tile>:
// one parallel region, each thread's groups chunk of tokens by chunk, a group's first call
// fetching the next group's tiles (or the next chunk's first).
template <typename Tile, typename T>
void matmul_int8_gemm(T* out, int64_t out_stride, const T* x, int64_t x_stride, int64_t tokens,
                      const uint8_t* packed, int64_t N, int64_t K) {
  const Int8GemmRows a(x, x_stride, tokens, K, Tile::kSumGroups,
                       Tile::kCodes == kSigned6 && kSixBit<Tile> ? Tile::kSplits : 0);
  const int64_t nb = K / 32, chunk = int8_gemm_chunk(K);
  at::parallel_for(0, N / kRows, 1, [&](int64_t g0, int64_t g1) {
    Int8Panel<Tile> panel(nb);
    for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
      const int64_t t1 = std::min(tokens, t0 + chunk);
      for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* group = packed + g * nb * Tile::kBytes;
        const uint8_t* ahead = group_ahead(packed, nb * Tile::kBytes, g, g0, g1, t1 < tokens);
        panel.fill(group, nb);
        T* o = out + g * kRows;
        int64_t t = t0;
        if constexpr (Tile::kQ4)
          for (; t + kQ4GemmTokens <= t1; t += kQ4GemmTokens, ahead = nullptr)
            int8_gemm_call<kQ4GemmTokens, Tile>(o, out_stride, a, t, group, panel, ahead);
        for (; t < t1; t += kInt8GemmTokens, ahead = nullptr)
          if (t + 1 < t1) int8_gemm_call<2, Tile>(o, out_stride, a, t, group, panel, ahead);
          else int8_gemm_call<1, Tile>(o, out_stride, a, t, group, panel, ahead);
      }
    }
  });
}

}  // namespace pw::avx2
