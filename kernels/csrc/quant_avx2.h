// The quantized matmuls (quant_kernels.cpp) on CPUs without a bfloat16 dot product: AVX2 +
// FMA + F16C, the x86-64 baseline (also built into the AVX-512 tier). Same tiles
// (quant_tiles.h), same contract: each weight's exact value (d * q + m, d * q) times the
// activations in float32.
//
// A 16-row tile is read as two 8-row halves, a float32 lane per output row: the nibbles or
// bytes of 8 rows widen to int32 lanes, convert exactly to float32 and multiply a broadcast
// activation, so a block's sums need no horizontal adds; a half is a work item (taking two or
// four at once measured the same: the conversions, not the FMA chains, bound it). Per
// 32-column block a half keeps sum(x q) per token in float32, then adds d * sum(x q) +
// m * sum(x) to the row's total, the order the AVX512-BF16 kernels use.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "quant_tiles.h"

namespace pw::avx2 {

constexpr int64_t kRows = 16;
constexpr int kMaxBatch = 4;      // tokens per pass over the weights (16 ymm registers)

// x in float32 [T][K] and, for a tile's minimums, its sums over each of a 32-column block's
// `groups` column groups [T][K / 32 * groups] (0 groups: none).
struct Activations {
  int64_t T, K;
  std::vector<float> xf, sums;

  template <typename In>
  Activations(const In* x, int64_t x_stride, int64_t T_, int64_t K_, int groups)
      : T(T_), K(K_), xf(T_ * K_) {
    const int64_t per_token = K / 32 * groups, width = groups ? 32 / groups : 32;
    sums.assign(T * per_token, 0.f);
    // Token by token, split over the threads for a prefill chunk's (16 tokens each).
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t k = 0; k < K; ++k) {
          xf[t * K + k] = to_float(x[t * x_stride + k]);
          if (groups) sums[t * per_token + k / width] += xf[t * K + k];
        }
    });
  }
};

// Prefetches the lines kAheadBytes on from block b in a group's stream of tiles (past the
// group's end, the next group's, which a thread's share of the groups takes next). A
// superblock tile's scales lie up to 4 KB past its first quants, often in a page the hardware
// prefetcher has not entered yet (it stops at page ends): on Zen 3 a superblock's first scale
// load waited on DRAM, and the AVX2 one-token kernels call this once a block (bench/NOTES.md,
// "Real shapes on an AVX2-only core"). The AVX-512 kernels fetch the next group's tiles a
// block at a time instead, from 2 tokens only (quant_tiles.h fetch_ahead: on Zen 4 one token
// streams at about the read bandwidth without it, and ran slower with it). A hint only: no
// result depends on it.
constexpr int64_t kAheadBytes = 6144;

template <typename Tile>
inline void prefetch_ahead(const uint8_t* group, int64_t b) {
  const uint8_t* p = group + b * Tile::kBytes + kAheadBytes;
  for (int64_t i = 0; i < Tile::kBytes; i += 64) __builtin_prefetch(p + i, 0, 0);
}

// v stays in a register, its sum so far: GCC otherwise reassociates an unrolled chain of
// integer adds into a tree of the products, which outnumber the registers, and spills them
// to the stack (quant_int_avx2.h's Q4 block at four tokens: 64 products stored and loaded
// again). The GEMMs' loops answer the same by unrolling 2 steps, not 8 (quant_gemm_avx2.h,
// quant_gemm_int8_avx2.h); their 4-token Q4 block is assembly.
inline void in_register(__m256i& v) { asm("" : "+v"(v)); }   // v: any of ymm0-31

inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store8(bf16* out, __m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int i = 0; i < 8; ++i) from_float(f[i], out + i);
}

// acc[m] += each of block b's column groups' minimums (rows 8 half .. 8 half + 7) times token
// m's sum of x over that group, sums[(m * nb + b) * kSplits + group] (`sums` at the first
// of the M tokens): the m * sum(x) of d q + m. Nothing for a tile without minimums.
template <typename Tile, int M>
inline void add_minimums(__m256 (&acc)[M], const uint8_t* tile, int half, const float* sums,
                         int64_t nb, int64_t b) {
  if constexpr (Tile::kMin)
    for (int s = 0; s < Tile::kSplits; ++s) {
      const __m256 mn = Tile::scales8(tile, b, Tile::minimum(s), half);
      for (int m = 0; m < M; ++m) {
        const float sum = sums[(m * nb + b) * Tile::kSplits + s];
        acc[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sum), acc[m]);
      }
    }
}

// Q4 tiles (Q4_1, Q4_K). Byte [j][l][p] of a tile holds columns 2j + p (low nibble) and
// 2j + 16 + p (high) of row l, so row l's 16-bit word at step j carries four columns: bits
// 0-3 (2j), 8-11 (2j + 1), 4-7 (2j + 16), 12-15 (2j + 17). Half `half` is rows 8 half ..
// 8 half + 7 (tile group half / 2); each of the M tokens keeps two sums a block (columns < 16
// and >= 16).
template <int M, typename Tile, typename Out>
void q4_half(Out* out, int64_t os, const float* x, const float* sums, const uint8_t* packed,
             int64_t K, int64_t half) {
  const int64_t nb = K / 32;
  const __m256i nibble = _mm256_set1_epi32(0xF);
  const uint8_t* tiles = packed + (half / 2) * nb * Tile::kBytes;
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tile = Tile::at(tiles, b);
    if (half % 2 == 0) prefetch_ahead<Tile>(tiles, b);   // the odd half reads the same tiles
    __m256 lo[M], hi[M];
    for (int m = 0; m < M; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(tile + 32 * j + 16 * (half % 2))));
      const __m256 c0 = _mm256_cvtepi32_ps(_mm256_and_si256(w, nibble));
      const __m256 c1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, 8), nibble));
      const __m256 c16 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, 4), nibble));
      const __m256 c17 = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 12));
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * K + b * 32 + 2 * j;
        lo[m] = _mm256_fmadd_ps(c0, _mm256_broadcast_ss(xb), lo[m]);
        hi[m] = _mm256_fmadd_ps(c16, _mm256_broadcast_ss(xb + 16), hi[m]);
        lo[m] = _mm256_fmadd_ps(c1, _mm256_broadcast_ss(xb + 1), lo[m]);
        hi[m] = _mm256_fmadd_ps(c17, _mm256_broadcast_ss(xb + 17), hi[m]);
      }
    }
    // sum of x * (d q + m) = d * sum(x q) + m * sum(x)
    const __m256 d = Tile::scales8(tile, b, 0, half % 2);
    for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(_mm256_add_ps(lo[m], hi[m]), d, acc[m]);
    add_minimums<Tile>(acc, tile, half % 2, sums, nb, b);
  }
  for (int m = 0; m < M; ++m) store8(out + m * os + half * 8, acc[m]);
}

// 8 rows of a Q8 tile's column (8 bytes) as float32 lanes: int8 codes, or e4m3 (FP8).
template <typename Tile>
inline __m256 q8_lanes(const uint8_t* rows) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows));
  if constexpr (Tile::kFp8)
    return fp8_lanes(_mm256_cvtepu8_epi32(bytes));
  else
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// 8 rows of a level tile's columns k (w0) and k + 16 (w1): their byte [k][l] (`rows` at
// row 8 half), each nibble's level as float32 lanes.
template <typename Tile>
inline void level_lanes(const uint8_t* rows, __m256& w0, __m256& w1) {
  const __m128i table = _mm256_castsi256_si128(level_table<Tile::kLevels>());
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows));
  w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(table, _mm_and_si128(v, low))));
  w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), low))));
}

// Q8 tiles (Q8_0, Q6_K, Q5_K, Q2_K, FP8): byte [k][l] of a tile is column k of row l. Two chains a
// token: even and odd columns under one scale (Q8_0, Q5_K), or columns < 16 and >= 16 under
// their own (Q6_K, Q2_K; a level tile's, under one); plus each group's m * sum(x) (Q5_K,
// Q2_K).
template <int M, typename Tile, typename Out>
void q8_half(Out* out, int64_t os, const float* x, const float* sums, const uint8_t* packed,
             int64_t K, int64_t half) {
  constexpr bool kSplit = Tile::kSplits == 2, kByHalves = kSplit || Tile::kLevels;
  const int64_t nb = K / 32;
  const uint8_t* tiles = packed + (half / 2) * nb * Tile::kBytes;
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tile = Tile::at(tiles, b);
    if (half % 2 == 0) prefetch_ahead<Tile>(tiles, b);   // the odd half reads the same tiles
    __m256 first[M], second[M];
    for (int m = 0; m < M; ++m) first[m] = second[m] = _mm256_setzero_ps();
    for (int i = 0; i < 16; ++i) {
      const int k0 = kByHalves ? i : 2 * i, k1 = k0 + (kByHalves ? 16 : 1);
      const uint8_t* rows = tile + 8 * (half % 2);
      __m256 w0, w1;
      if constexpr (Tile::kLevels != kNoLevels) {
        level_lanes<Tile>(rows + 16 * i, w0, w1);
      } else {
        w0 = q8_lanes<Tile>(rows + 16 * k0);
        w1 = q8_lanes<Tile>(rows + 16 * k1);
      }
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * K + b * 32;
        first[m] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xb + k0), first[m]);
        second[m] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(xb + k1), second[m]);
      }
    }
    const __m256 d0 = Tile::scales8(tile, b, 0, half % 2);
    if constexpr (kSplit) {
      const __m256 d1 = Tile::scales8(tile, b, 1, half % 2);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm256_fmadd_ps(second[m], d1, _mm256_fmadd_ps(first[m], d0, acc[m]));
    } else {
      for (int m = 0; m < M; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_add_ps(first[m], second[m]), d0, acc[m]);
    }
    add_minimums<Tile>(acc, tile, half % 2, sums, nb, b);
  }
  for (int m = 0; m < M; ++m) store8(out + m * os + half * 8, acc[m]);
}

// M tokens over every 8-row half, one half a work item.
template <int M, typename Tile, typename Out>
void pass(Out* out, int64_t os, const Activations& a, int64_t t, const uint8_t* packed,
          int64_t N) {
  const float* x = a.xf.data() + t * a.K;
  const float* sums = Tile::kMin ? a.sums.data() + t * (a.K / 32) * Tile::kSplits : nullptr;
  at::parallel_for(0, N / 8, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t half = h0; half < h1; ++half) {
      if constexpr (Tile::kQ4)
        q4_half<M, Tile>(out, os, x, sums, packed, a.K, half);
      else
        q8_half<M, Tile>(out, os, x, sums, packed, a.K, half);
    }
  });
}

// out [T, N] = x [T, K] @ W^T from the packed tiles (N a multiple of 16, K of 32).
template <typename Tile, typename T>
void matmul(T* out, int64_t out_stride, const T* x, int64_t x_stride, int64_t tokens,
            const uint8_t* packed, int64_t N, int64_t K) {
  const Activations a(x, x_stride, tokens, K, Tile::kSumGroups);
  for (int64_t t = 0; t < tokens; t += kMaxBatch) {
    T* o = out + t * out_stride;
    switch (std::min<int64_t>(kMaxBatch, tokens - t)) {
      case 1: pass<1, Tile>(o, out_stride, a, t, packed, N); break;
      case 2: pass<2, Tile>(o, out_stride, a, t, packed, N); break;
      case 3: pass<3, Tile>(o, out_stride, a, t, packed, N); break;
      default: pass<4, Tile>(o, out_stride, a, t, packed, N); break;
    }
  }
}

}  // namespace pw::avx2
