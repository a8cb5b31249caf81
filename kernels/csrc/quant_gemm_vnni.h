// Large steps (prefill chunks, big decode batches) of the quantized matmuls with int8
// activations on the avx512_bf16 tier, whose CPUs all have AVX512-VNNI: a GEMM on the tiles
// as stored with vpdpbusd (16 lanes x 4 byte products a lane: 64 multiply-adds an
// instruction, twice vdpbf16ps's 32, at the same issue rate on Zen 4). Built only where the
// compiler targets VNNI (the avx2 and avx512 tiers keep quant_int_avx2.h's kernels).
//
// The arithmetic is quant_int_avx2.h's int8 kernels' (llama.cpp's): each token's activations
// rounded per 32-column block to int8 (scale max|x| / 127, RoundedRows), a block's integer
// sums exact in int32, then acc += (sum * scale(x)) * d (+ m * sum(x), the float sum of the
// unrounded x, for tiles with minimums) in the same order, so the outputs equal theirs (Q4_0's
// blocks, minimums -8 d, fold theirs into the scale's FMA: equal to the float rounding).
//
// vpdpbusd multiplies UNSIGNED bytes (its first operand) by SIGNED ones: the weights are the
// unsigned side, the int8 activations the signed one (one token's four adjacent columns, a
// 32-bit word broadcast by vpbroadcastd: the embedded-broadcast form ran slower on Zen 4,
// 2.7 G/s a core against 3.3 in a bare loop). Q4 nibbles (0..15) already are unsigned; Q8
// tiles' int8 codes are stored + 128 in the panel, so a sum is S + 128 sum(x): its chain
// starts at -128 sum(x) over the split's columns (exact); Q6_K's bit planes join into code
// + 32, their chains starting at -32 sum(x) (Tile::kBias).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_avx512.h"       // store_rows
#include "quant_gemm_avx2.h"    // RoundedRows
#include "quant_step_vnni.h"    // the small steps' kernels
#include "quant_tiles.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
namespace pw::vnni {

// From this many tokens of a step the GEMM beats quant_step_vnni.h's kernels, which turn
// every tile into operands once per step where a panel serves up to 8 tokens a call. With
// both fetching the next group's tiles while they multiply (Zen 4, tiles streamed from
// memory: bench/NOTES.md "Small steps fetch ahead"; bench/gemm_from.py measures both), the
// small kernels win up to 7 tokens for every tile type but Q6_K's planes, whose decode costs
// them most (the GEMM from 7).
template <typename Tile>
#ifdef PW_GEMM_FROM   // bench/gemm_from.py's builds: every tile type from this many
constexpr int64_t kGemmFrom = PW_GEMM_FROM;
#else
constexpr int64_t kGemmFrom = Tile::kPlanes && Tile::kBias != 0 ? 7 : 8;
#endif
// Token chunk a panel serves before the next group's (a multiple of kGemmTokens): its int8
// activations (chunk x K bytes) stay in L2 while every group of a thread's share reads them.
constexpr int64_t kGemmChunk = 128;
constexpr int kGemmTokens = 8;   // tokens a kernel call keeps in registers (8 sums, 8 totals)

// x rounded to int8 per 32-column block (RoundedRows with top 127: the small kernels' values,
// scales and sums exactly), laid out per kGemmTokens tokens (a kernel call's; the last set
// padded with zeros) and block, so that a call reads one running pointer at fixed offsets:
//   q      [sets][nb][kGemmTokens][32] the int8 values;
//   dx     [sets][nb][kGemmTokens] each block's scale (a unit of q);
//   xsum   [sets][nb][groups][kGemmTokens] the sums of the unrounded x over each column
//          group that a tile's minimums meet (groups = Tile::kSumGroups; 0: none);
//   start  [sets][nb][splits][kGemmTokens] for biased operands (Tile::kBias; splits > 0):
//          -bias * the sum of q over each split's columns, where the split's chains start;
//   x8     [sets][nb][kGemmTokens] for Q4 tiles with minimums (`fold`): -8 * xsum, what a
//          Q4_0 block's minimum (-8 d) meets (gemm_tokens' kFold).
struct Int8Rows : avx2::RoundedRows {
  static constexpr int kSet = kGemmTokens;
  int splits;
  std::vector<int8_t> q;
  std::vector<float> dx, xsum, x8;
  std::vector<int32_t> start;

  int bias;

  template <typename In>
  Int8Rows(const In* x, int64_t x_stride, int64_t T_, int64_t K_, int groups_, int splits_,
           int bias_, bool fold)
      : RoundedRows(x, x_stride, T_, K_, groups_, 127.f), splits(splits_), bias(bias_),
        q(sets() * K * kSet), dx(sets() * nb * kSet), xsum(sets() * nb * groups * kSet),
        x8(fold ? sets() * nb * kSet : 0), start(sets() * nb * splits * kSet) {
    at::parallel_for(0, sets(), 1, [&](int64_t s0, int64_t s1) {
      for (int64_t set = s0; set < s1; ++set)
        for (int64_t b = 0; b < nb; ++b)
          for (int64_t m = 0, t = set * kSet; m < kSet && t < T; ++m, ++t)
            arrange(set, b, m, t);
    });
  }

  int64_t sets() const { return (T + kSet - 1) / kSet; }

  // Token t's block b as the m-th of its set (|value| <= 127: narrowing keeps it).
  void arrange(int64_t set, int64_t b, int64_t m, int64_t t) {
    const int64_t i = set * nb + b;
    const __m512i v = _mm512_loadu_si512(value.data() + t * K + b * 32);    // 32 int16
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + (i * kSet + m) * 32),
                        _mm512_cvtepi16_epi8(v));
    dx[i * kSet + m] = scale[t * nb + b];
    for (int g = 0; g < groups; ++g)
      xsum[(i * groups + g) * kSet + m] = sum[(t * nb + b) * groups + g];
    if (!x8.empty()) x8[i * kSet + m] = -8.f * sum[t * nb + b];
    for (int s = 0; s < splits; ++s)
      start[(i * splits + s) * kSet + m] =
          split_start(value.data() + t * K + b * 32, s, splits, bias);
  }
};

// One 16-row group's tiles in vpdpbusd's unsigned operand: per block 8 steps s of 16 rows x
// columns 4s .. 4s + 3 (a row's four bytes one 32-bit lane; Q4: nibbles 0..15, Q8: code +
// 128), and each block's scale arrays as float32 [nb][arrays][16].
struct alignas(64) Step { uint8_t bytes[64]; };   // one vpdpbusd operand (C++17 new aligns it)

// Tiles whose blocks may all be Q4_0's (minimums -8 d): the classic Q4 tiles with minimums,
// which a Q4_0 file's blocks become; a superblock tile's are -dmin m, not worth a check.
template <typename Tile>
constexpr bool kMayFold = Tile::kQ4 && Tile::kMin && !Tile::kSuper;

template <typename Tile>
struct Panel {
  std::vector<Step> q;         // [nb][8]
  std::vector<float> scales;
  bool q4_0 = false;           // every block's minimums are -8 d (Q4_0's blocks as Q4_1)
  explicit Panel(int64_t nb) : q(nb * 8), scales(nb * Tile::kArrays * 16) {}

  void fill(const uint8_t* tiles, int64_t nb) {
    q4_0 = kMayFold<Tile>;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* tile = Tile::at(tiles, b);
      __m512i* out = reinterpret_cast<__m512i*>(q.data() + b * 8);
      if constexpr (Tile::kQ4) nibbles(tile, out);
      else bytes(tile, out);
      float* sc = scales.data() + b * Tile::kArrays * 16;
      for (int a = 0; a < Tile::kArrays; ++a)
        _mm512_storeu_ps(sc + a * 16, Tile::scales16(tile, b, a));
      if constexpr (kMayFold<Tile>) {   // exact: m and d are fp16 (or float32)
        const __m512 d = _mm512_loadu_ps(sc), m = _mm512_loadu_ps(sc + Tile::minimum(0) * 16);
        q4_0 = q4_0 && _mm512_cmp_ps_mask(m, _mm512_mul_ps(d, _mm512_set1_ps(-8.f)),
                                          _CMP_EQ_OQ) == 0xFFFF;
      }
    }
  }

  // Q4 tiles: byte [j][l][p] of 32 j + 2 l + p holds row l's column 2j + p (low nibble) and
  // 2j + 16 + p (high). Steps j = 2i and 2i + 1 side by side in a row's lane carry columns
  // 4i .. 4i + 3 in their low nibbles (step i) and 16 + 4i .. 16 + 4i + 3 in their high ones
  // (step 4 + i).
  static void nibbles(const uint8_t* tile, __m512i* out) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int i = 0; i < 4; ++i) {
      auto words = [&](int j) {
        return _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * j)));
      };
      const __m512i v = _mm512_or_si512(words(2 * i), _mm512_slli_epi32(words(2 * i + 1), 16));
      out[i] = _mm512_and_si512(v, low);
      out[4 + i] = _mm512_and_si512(_mm512_srli_epi32(v, 4), low);
    }
  }

  // Q8 tiles packed for integer activations: byte [j][l][c] of 64 j + 4 l + c is row l's
  // column 4j + c, already the operand's order; x ^ 0x80 is int8 x + 128 as a byte. Level
  // tiles: their levels + 128 in the same order (q8_operands).
  static void bytes(const uint8_t* tile, __m512i* out) {
    for (int j = 0; j < 8; j += 2) {
      __m512i w[2];
      q8_operands<Tile>(tile, j, w);
      _mm512_storeu_si512(out + j, w[0]);
      _mm512_storeu_si512(out + j + 1, w[1]);
    }
  }
};

// acc[m] += each split's minimums times token m's sum of the unrounded x over it (the
// m * sum(x) of d q + m; xsum at the block's sums), as avx2::add_minimums orders it.
template <typename Tile, int M>
inline void add_minimums(__m512 (&acc)[M], const float* sc, const float* xsum) {
  if constexpr (Tile::kMin)
    for (int s = 0; s < Tile::kSplits; ++s) {
      const __m512 mn = _mm512_loadu_ps(sc + Tile::minimum(s) * 16);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[s * Int8Rows::kSet + m]), acc[m]);
    }
}

// out rows t .. t + M - 1 (t a multiple of kGemmTokens: the first of its set), the group's 16
// columns, from its panel. The order of a block's float steps is the small kernels': Q4
// tiles scale then add minimums, Q8 tiles the reverse. kFold (Q4 tiles whose minimums are
// all -8 d: Q4_0's): d (sum * scale(x) - 8 sum(x)) in two FMAs instead of their three, equal
// to the float rounding (the 3 a block beside 8 vpdpbusd bound the kernel).
// `ahead` (nullptr: none): the tiles the next panel fill reads, fetched while these products
// run (fetch_ahead; at 16 tokens reading was about a quarter of a step's time).
template <int M, bool kFold, typename Tile, typename Out>
void gemm_tokens(Out* out, int64_t os, const Int8Rows& a, int64_t t, const Panel<Tile>& p,
                 const uint8_t* ahead) {
  constexpr int kSteps = 8 / Tile::kSplits, kSet = Int8Rows::kSet;
  const int64_t set = t / kSet, nb = a.nb;
  const int32_t* x = reinterpret_cast<const int32_t*>(a.q.data() + set * nb * kSet * 32);
  const float* dx = a.dx.data() + set * nb * kSet;
  const float* xsum = a.xsum.data() + set * nb * a.groups * kSet;
  const int32_t* start = a.start.data() + set * nb * a.splits * kSet;
  const float* x8 = kFold ? a.x8.data() + set * nb * kSet : nullptr;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, x += kSet * 8, dx += kSet, x8 += kFold ? kSet : 0) {
    const __m512i* w = reinterpret_cast<const __m512i*>(p.q.data() + b * 8);
    fetch_ahead<Tile>(ahead, b);
    const float* sc = p.scales.data() + b * Tile::kArrays * 16;
    if constexpr (!Tile::kQ4) add_minimums<Tile>(acc, sc, xsum + b * Tile::kSumGroups * kSet);
    for (int s = 0; s < Tile::kSplits; ++s) {
      __m512i sum[M];
      for (int m = 0; m < M; ++m)
        sum[m] = Tile::kBias == 0
                     ? _mm512_setzero_si512()
                     : _mm512_set1_epi32(start[(b * Tile::kSplits + s) * kSet + m]);
#pragma GCC unroll 8
      for (int j = s * kSteps; j < (s + 1) * kSteps; ++j) {
        const __m512i wj = _mm512_load_si512(w + j);
        for (int m = 0; m < M; ++m)
          sum[m] = _mm512_dpbusd_epi32(sum[m], wj, _mm512_set1_epi32(x[m * 8 + j]));
      }
      const __m512 d = _mm512_loadu_ps(sc + s * 16);
      for (int m = 0; m < M; ++m) {
        const __m512 qx = _mm512_cvtepi32_ps(sum[m]), dxm = _mm512_set1_ps(dx[m]);
        acc[m] = kFold ? _mm512_fmadd_ps(_mm512_fmadd_ps(qx, dxm, _mm512_set1_ps(x8[m])), d, acc[m])
                       : _mm512_fmadd_ps(_mm512_mul_ps(qx, dxm), d, acc[m]);
      }
    }
    if constexpr (Tile::kQ4 && !kFold)
      add_minimums<Tile>(acc, sc, xsum + b * Tile::kSumGroups * kSet);
  }
  for (int m = 0; m < M; ++m) avx512::store_rows(out + (t + m) * os, acc[m]);
}

// Tokens [t0, t1) of a group from its panel: kGemmTokens a call, then the rest; the first
// call fetches `ahead`.
template <bool kFold, typename Tile, typename Out>
void gemm_group(Out* o, int64_t os, const Int8Rows& a, int64_t t0, int64_t t1,
                const Panel<Tile>& p, const uint8_t* ahead) {
  int64_t t = t0;
  for (; t + kGemmTokens <= t1; t += kGemmTokens, ahead = nullptr)
    gemm_tokens<kGemmTokens, kFold, Tile>(o, os, a, t, p, ahead);
  switch (t1 - t) {
    case 1: gemm_tokens<1, kFold, Tile>(o, os, a, t, p, ahead); break;
    case 2: gemm_tokens<2, kFold, Tile>(o, os, a, t, p, ahead); break;
    case 3: gemm_tokens<3, kFold, Tile>(o, os, a, t, p, ahead); break;
    case 4: gemm_tokens<4, kFold, Tile>(o, os, a, t, p, ahead); break;
    case 5: gemm_tokens<5, kFold, Tile>(o, os, a, t, p, ahead); break;
    case 6: gemm_tokens<6, kFold, Tile>(o, os, a, t, p, ahead); break;
    case 7: gemm_tokens<7, kFold, Tile>(o, os, a, t, p, ahead); break;
  }
}

// out [T, N] = x [T, K] @ W^T with x rounded to int8 per block (N a multiple of 16, K of 32):
// steps of kGemmFrom<Tile> tokens and more take the GEMM, smaller ones quant_step_vnni.h's.
template <typename Tile, typename T>
void matmul_int8(T* out, int64_t out_stride, const T* x, int64_t x_stride, int64_t tokens,
                 const uint8_t* packed, int64_t N, int64_t K) {
  if (tokens < kGemmFrom<Tile>)
    return matmul_int8_step<Tile, kGemmFrom<Tile>>(out, out_stride, x, x_stride, tokens, packed,
                                                    N, K);
  const Int8Rows a(x, x_stride, tokens, K, Tile::kSumGroups,
                   Tile::kBias == 0 ? 0 : Tile::kSplits, Tile::kBias, kMayFold<Tile>);
  const int64_t nb = K / 32;
  // One parallel region for the step: each thread's groups, chunk by chunk, with no barrier
  // between chunks (a group's products fetch the next group's tiles, or the next chunk's
  // first).
  at::parallel_for(0, N / avx2::kRows, 1, [&](int64_t g0, int64_t g1) {
    Panel<Tile> panel(nb);
    for (int64_t t0 = 0; t0 < tokens; t0 += kGemmChunk) {
      const int64_t t1 = std::min(tokens, t0 + kGemmChunk);
      for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* ahead = group_ahead(packed, nb * Tile::kBytes, g, g0, g1, t1 < tokens);
        panel.fill(packed + g * nb * Tile::kBytes, nb);
        T* o = out + g * avx2::kRows;
        if (kMayFold<Tile> && panel.q4_0)
          gemm_group<kMayFold<Tile>, Tile>(o, out_stride, a, t0, t1, panel, ahead);
        else
          gemm_group<false, Tile>(o, out_stride, a, t0, t1, panel, ahead);
      }
    }
  });
}

}  // namespace pw::vnni
#endif
