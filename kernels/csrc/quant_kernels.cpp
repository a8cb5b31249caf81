// Matrix-vector products with GGUF-quantized weights (Q4_1, Q4_K, Q8_0, Q6_K, Q5_K, Q2_K tiles) for
// small batches, reading the weights in their quantized form: at batch 1 a step is bound by
// the bytes of weights read, and Q4_1 is 0.625 bytes a weight against bfloat16's 2.
//
// The values are exactly the file's: each weight is d * q + m (Q4_1) or d * q (Q8_0) with
// its fp16 d and m, as dequantization gives; only the order of the float32 sums differs.
//
// Layout (kernels/quant.py packs it once at load; quant_tiles.h): output rows in groups of
// 16, one tile per (group, 32-column block). A SIMD lane owns an output row, so a tile's
// products land in the 16 lanes of one register and no horizontal sums are needed. In Q4
// tiles byte [j][l][p] is the file's qs[2j + p] of row l (low nibble column 2j + p, high
// nibble column 2j + 16 + p); in Q8 tiles byte [k][l] is column k of row l.
// Built into the same library as cpu_kernels.cpp (kernels/native.py). Tiers without
// AVX512-BF16 multiply the same tiles with quant_avx2.h's kernels.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "pagewire_api.h"
#include "quant_tiles.h"
#if defined(__AVX2__)
#include "quant_avx2.h"        // the exact kernels below AVX512-BF16
#include "quant_int_avx2.h"    // int8 and int16 activations, on every tier
#endif
#include "quant_avx512.h"
#include "quant_decode_bf16.h" // the tiles' codes as vdpbf16ps's bfloat16 pairs
#include "quant_gemm_vnni.h"   // int8 activations' large steps where VNNI is built

namespace {

using pw::bf16;
using pw::from_float;
using pw::to_float;
constexpr int64_t kRows = 16;     // output rows per group (one zmm of float32 lanes)
constexpr int kMaxBatch = 8;

#if defined(__AVX512BF16__)
using namespace pw::avx512;

// A Q8 tile's column of 16 rows (16 bytes) as float32 lanes.
inline __m512 q8_lanes(const uint8_t* column) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(column));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

// acc[m] += a Q8 tile block's two chains under their scales: one scale for both (Q8_0, Q5_K),
// or the first chain's (columns < 16) and the second's (Q6_K, Q2_K: kSplits 2).
template <typename Tile, int M>
inline void add_q8_block(__m512 (&acc)[M], const __m512 (&first)[M], const __m512 (&second)[M],
                         const uint8_t* tile, int64_t b) {
  const __m512 d0 = Tile::scales16(tile, b, 0);
  if constexpr (Tile::kSplits == 2) {
    const __m512 d1 = Tile::scales16(tile, b, 1);
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_fmadd_ps(second[m], d1, _mm512_fmadd_ps(first[m], d0, acc[m]));
  } else {
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_add_ps(first[m], second[m]), d0, acc[m]);
  }
}

// The walk every exact kernel here shares: output groups [g0, g1) of 16 rows for M tokens;
// per 32-column block, `chains(tile, b, first, second)` sums the block's products into two
// chains a token (FMA and dot-product latency, not throughput, would bound one chain), which
// then take the block's scale (or each half its own: add_q8_block) and, for tiles with
// minimums, m * sum(x) (sum of x * (d q + m) = d * sum(x q) + m * sum(x)).
template <int M, typename Tile, typename Out, typename Chains>
inline void walk_groups(Out* out, int64_t out_stride, const float* sums, const uint8_t* packed,
                        int64_t nb, int64_t g0, int64_t g1, const Chains& chains) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = packed + g * nb * Tile::kBytes;
    const uint8_t* ahead = pw::step_ahead<M>(packed, nb * Tile::kBytes, g, g0, g1);
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* tile = Tile::at(group, b);
      pw::fetch_ahead<Tile>(ahead, b);
      __m512 first[M], second[M];
      for (int m = 0; m < M; ++m) first[m] = second[m] = _mm512_setzero_ps();
      chains(tile, b, first, second);
      add_q8_block<Tile>(acc, first, second, tile, b);
      add_minimums<Tile>(acc, tile, sums, nb, b);
    }
    for (int m = 0; m < M; ++m) store_rows(out + m * out_stride + g * kRows, acc[m]);
  }
}

// Q4, FP8 or six-bit Q8 tiles (rows x_stride apart in each of P parts of the activations):
// the two vectors of each of a block's 8 steps, through the decoder, one chain each.
template <int M, int P, typename Tile, typename Decode, typename Out>
void pair_groups(Out* out, int64_t out_stride, const bf16* parts, int64_t part_stride,
                 int64_t x_stride, const float* sums, const uint8_t* packed, int64_t nb,
                 int64_t g0, int64_t g1) {
  const Decode decode;
  walk_groups<M, Tile>(out, out_stride, sums, packed, nb, g0, g1,
                       [&](const uint8_t* tile, int64_t b, __m512 (&sum0)[M],
                           __m512 (&sum1)[M]) {
    for (int s = 0; s < 8; ++s) {
      __m512bh w0, w1;
      decode(tile, s, w0, w1);
      for (int p = 0; p < P; ++p)
        for (int m = 0; m < M; ++m) {
          const bf16* xb = parts + p * part_stride + m * x_stride + b * 32;
          sum0[m] = _mm512_dpbf16_ps(sum0[m], w0, (__m512bh)bcast_pair(xb + Decode::x0(s)));
          sum1[m] = _mm512_dpbf16_ps(sum1[m], w1, (__m512bh)bcast_pair(xb + Decode::x1(s)));
        }
    }
  });
}

// Q8 tiles of any int8, float32 activations: each column widened to float32 lanes; the
// chains even and odd columns under one scale (Q8_0, Q5_K: plus m * sum(x)), or columns < 16
// and >= 16 under their own (Q6_K).
template <int M, typename Tile, typename Out>
void q8_groups(Out* out, int64_t out_stride, const float* xf, const float* sums, int64_t K,
               const uint8_t* packed, int64_t nb, int64_t g0, int64_t g1) {
  constexpr bool kSplit = Tile::kSplits == 2;
  walk_groups<M, Tile>(out, out_stride, sums, packed, nb, g0, g1,
                       [&](const uint8_t* tile, int64_t b, __m512 (&first)[M],
                           __m512 (&second)[M]) {
    for (int i = 0; i < 16; ++i) {
      const int k0 = kSplit ? i : 2 * i, k1 = k0 + (kSplit ? 16 : 1);
      const __m512 w0 = q8_lanes(tile + 16 * k0), w1 = q8_lanes(tile + 16 * k1);
      for (int m = 0; m < M; ++m) {
        const float* xb = xf + m * K + b * 32;
        first[m] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xb[k0]), first[m]);
        second[m] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xb[k1]), second[m]);
      }
    }
  });
}

// Q8 tiles of any int8 without minimums (Q8_0, IQ4_XS's levels) for several tokens of
// bfloat16 activations: a column pair's codes, exact in bfloat16, laid out once as vdpbf16ps
// pairs (lane l: columns 2j, 2j + 1 of row l) and multiplied by every token's x pair, half
// the multiply instructions of q8_groups' float32 FMAs; a single token keeps q8_groups, whose
// decode is cheaper. The chains: even and odd pairs under one scale (Q8_0), or columns < 16
// and >= 16 under their own.
template <int M, typename Tile, typename Out>
void q8_pair_groups(Out* out, int64_t out_stride, const bf16* x, int64_t K,
                    const uint8_t* packed, int64_t nb, int64_t g0, int64_t g1) {
  static_assert(!Tile::kMin && !Tile::kQ4 && !Tile::kFp8, "Q8 tiles without minimums");
  constexpr bool kSplit = Tile::kSplits == 2;
  const __m512i order = pair_order();
  walk_groups<M, Tile>(out, out_stride, nullptr, packed, nb, g0, g1,
                       [&](const uint8_t* tile, int64_t b, __m512 (&first)[M],
                           __m512 (&second)[M]) {
    for (int j = 0; j < 16; ++j) {
      const __m512 lo = q8_lanes(tile + 32 * j), hi = q8_lanes(tile + 32 * j + 16);
      const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(
          order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));      // exact: |code| <= 128
      const bool to_first = kSplit ? j < 8 : j % 2 == 0;
      for (int m = 0; m < M; ++m) {
        const __m512bh xp = (__m512bh)bcast_pair(x + m * K + b * 32 + 2 * j);
        if (to_first)
          first[m] = _mm512_dpbf16_ps(first[m], w, xp);
        else
          second[m] = _mm512_dpbf16_ps(second[m], w, xp);
      }
    }
  });
}

// The tiles pair_groups multiplies through a decoder (Nibbles, Fp8Codes, SixBitCodes,
// LevelCodes).
template <typename Tile>
constexpr bool kDecoded = Tile::kQ4 || Tile::kFp8 || Tile::kCodes != pw::kAnyInt8 ||
                          Tile::kLevels != pw::kNoLevels;
// Whether a Q8 tile format's steps of `tokens` bfloat16 tokens take q8_pair_groups: from 4
// tokens its once-a-chunk decode costs less than the FMAs it saves.
template <typename Tile, typename Out>
constexpr bool kQ8Pairs = !kDecoded<Tile> && !Tile::kMin && std::is_same<Out, bf16>::value;
constexpr int64_t kQ8PairTokens = 4;

// One chunk of up to kMaxBatch tokens of one tile format over output groups [g0, g1): its
// weights are unpacked once for all of them.
template <int M, typename Tile, typename Out>
void chunk(Out* out, int64_t os, const Activations& a, int64_t t, const uint8_t* packed,
           int64_t g0, int64_t g1) {
  const int64_t nb = a.K / 32;
  if constexpr (kDecoded<Tile>) {
    using Decode = std::conditional_t<Tile::kFp8, Fp8Codes, std::conditional_t<
        Tile::kQ4, Nibbles, std::conditional_t<Tile::kLevels != pw::kNoLevels,
        LevelCodes<Tile::kLevels>, SixBitCodes<Tile::kCodes>>>>;
    const bf16* x = a.parts.data() + t * a.K;
    const float* sums = Tile::kMin ? a.sums.data() + t * nb * Tile::kSplits : nullptr;
    if (a.P == 1)
      pair_groups<M, 1, Tile, Decode>(out, os, x, a.T * a.K, a.K, sums, packed, nb, g0, g1);
    else
      pair_groups<M, 3, Tile, Decode>(out, os, x, a.T * a.K, a.K, sums, packed, nb, g0, g1);
  } else if (!a.parts.empty()) {    // kQ8Pairs: bfloat16 activations as parts (P == 1)
    if constexpr (kQ8Pairs<Tile, Out>)
      q8_pair_groups<M, Tile>(out, os, a.parts.data() + t * a.K, a.K, packed, nb, g0, g1);
  } else {
    const float* sums = Tile::kMin ? a.sums.data() + t * nb * Tile::kSplits : nullptr;
    q8_groups<M, Tile>(out, os, a.xf.data() + t * a.K, sums, a.K, packed, nb, g0, g1);
  }
}

template <typename Tile, typename Out>
void matmul(Out* out, int64_t out_stride, const Out* x, int64_t x_stride, int64_t tokens,
            const uint8_t* packed, int64_t N, int64_t K) {
  const bool pairs = kQ8Pairs<Tile, Out> && tokens >= kQ8PairTokens;
  const Activations a(x, x_stride, tokens, K, kDecoded<Tile> || pairs ? kParts : kFloat,
                      Tile::kSumGroups);
  // One parallel region for the step, each thread's share of the groups chunk by chunk: no
  // barrier between chunks (a prefill step has hundreds).
  at::parallel_for(0, N / kRows, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t t = 0; t < a.T; t += kMaxBatch) {
      Out* o = out + t * out_stride;
      switch (std::min<int64_t>(kMaxBatch, a.T - t)) {
        case 1: chunk<1, Tile>(o, out_stride, a, t, packed, g0, g1); break;
        case 2: chunk<2, Tile>(o, out_stride, a, t, packed, g0, g1); break;
        case 3: chunk<3, Tile>(o, out_stride, a, t, packed, g0, g1); break;
        case 4: chunk<4, Tile>(o, out_stride, a, t, packed, g0, g1); break;
        case 5: chunk<5, Tile>(o, out_stride, a, t, packed, g0, g1); break;
        case 6: chunk<6, Tile>(o, out_stride, a, t, packed, g0, g1); break;
        case 7: chunk<7, Tile>(o, out_stride, a, t, packed, g0, g1); break;
        default: chunk<8, Tile>(o, out_stride, a, t, packed, g0, g1); break;
      }
    }
  });
}

#endif  // __AVX512BF16__

}  // namespace

namespace pw {

// Each tile type's PwTile name and layout (quant_tiles.h); FP8 has no integer kernels. The
// level tiles (IQ4_NL, MXFP4, IQ4_XSL) multiply on every tier too: avx512_bf16's exact kernels
// decode them with LevelCodes, its VNNI ones look them up as Q8 codes (q8_operands).
#define PW_INT_TILES(X) X(Q4_1, Q4_1Tile) X(Q8_0, Q8_0Tile) X(Q4_K, Q4_KTile)         \
  X(Q5_K, Q5_KTile) X(Q6_K, Q6_KTile) X(Q2_K, Q2_KTile) X(Q4_KS, Q4_KSuper)           \
  X(Q5_KS, Q5_KSuper) X(Q6_KS, Q6_KSuper) X(Q2_KS, Q2_KSuper) X(IQ4_XSS, IQ4_XSSuper) \
  X(IQ4_NL, IQ4_NLTile) X(MXFP4, MXFP4Tile) X(IQ4_XSL, IQ4_XSLSuper)
// Q6_K's and Q5_K's bit planes: int8 activations on VNNI only (avx512_bf16); elsewhere, and
// for the other roundings, kernels/quant.py keeps Q6_KS and Q5_KS tiles (pw_quant_kind).
// Exact kernels on Q6_KP joined a nibble and a crumb into SixBitCodes' index at 0.70-0.89x
// Q6_KS's rate (shifts and shuffles share a Zen 4 core's two pipes; bench/NOTES.md "Q6_K's
// bit planes").
#define PW_PLANE_TILES(X) X(Q6_KP, Q6_KPSuper) X(Q5_KP, Q5_KPSuper)
#define PW_TILES(X) PW_INT_TILES(X) PW_PLANE_TILES(X) X(FP8, FP8Tile)
#define PW_Q4_TILES(X) X(Q4_1, Q4_1Tile) X(Q4_K, Q4_KTile) X(Q4_KS, Q4_KSuper)

// PW_ROUNDING_INT8_LARGE: a step of kLargeFrom tokens or more (a prefill chunk, a big batch)
// takes the int8 kernels (vpdpbusd's GEMM where built), a smaller one the tier's default
// rounding (kernels/tiers.py default_activations): exact where the CPU has a bfloat16 dot
// product, int16 below it (avx2, avx512), whose exact kernels run ~1.6x slower. Q4 tiles
// only: their layout is the same for all three.
constexpr int64_t kLargeFrom = 8;

template <typename Tile, typename T>
void large_int8(T* out, int64_t out_stride, const T* x, int64_t x_stride, int64_t tokens,
                const uint8_t* packed, int64_t N, int64_t K) {
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  if (tokens >= kLargeFrom)
    return vnni::matmul_int8<Tile, T>(out, out_stride, x, x_stride, tokens, packed, N, K);
  return matmul<Tile, T>(out, out_stride, x, x_stride, tokens, packed, N, K);
#elif defined(__AVX2__)
  if (tokens >= kLargeFrom)
    return avx2::matmul_int<1, Tile, T>(out, out_stride, x, x_stride, tokens, packed, N, K);
  return avx2::matmul_int<2, Tile, T>(out, out_stride, x, x_stride, tokens, packed, N, K);
#endif
}

// Kinds: a tile type plus a rounding (pagewire_api.h PwTile, PwRounding). The exact kernels are
// AVX512-BF16's where the CPU has it, else AVX2's; the integer ones AVX2's on every tier but
// int8's on AVX512-VNNI (quant_step_vnni.h for the smallest steps, quant_gemm_vnni.h from
// its kGemmFrom<Tile>: 7 tokens for Q6_K's planes, 8 for the rest).
template <typename T>
QuantMatmul<T> quant_matmul(int64_t kind) {
  if (kind == PW_TILE_BF16) return bf16_matmul<T>();
#if defined(__AVX512BF16__)
#define PW_EXACT(name, Tile) case PW_TILE_##name: return matmul<Tile, T>;
#elif defined(__AVX2__)
#define PW_EXACT(name, Tile) case PW_TILE_##name: return avx2::matmul<Tile, T>;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)   // vpdpbusd: small steps, then the GEMM
#define PW_INT8(name, Tile) \
  case PW_TILE_##name + PW_ROUNDING_INT8: return vnni::matmul_int8<Tile, T>;
#elif defined(__AVX2__)
#define PW_INT8(name, Tile) \
  case PW_TILE_##name + PW_ROUNDING_INT8: return avx2::matmul_int<1, Tile, T>;
#endif
#if defined(__AVX2__)
#define PW_INT16(name, Tile) \
  case PW_TILE_##name + PW_ROUNDING_INT16: return avx2::matmul_int<2, Tile, T>;
#define PW_INT8_LARGE(name, Tile) \
  case PW_TILE_##name + PW_ROUNDING_INT8_LARGE: return large_int8<Tile, T>;
  switch (kind) {
    PW_INT_TILES(PW_EXACT) PW_EXACT(FP8, FP8Tile)
    PW_INT_TILES(PW_INT8)
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
    PW_PLANE_TILES(PW_INT8)
#endif
    PW_INT_TILES(PW_INT16)
    PW_Q4_TILES(PW_INT8_LARGE)
  }
#undef PW_EXACT
#undef PW_INT8
#undef PW_INT16
#undef PW_INT8_LARGE
#endif
  return nullptr;
}

static_assert(PW_TILE_BF16 < PW_ROUNDING_INT8 && PW_TILE_FP8 < PW_ROUNDING_INT8,
              "kind % PW_ROUNDING_INT8 is a kind's tile type");

int64_t quant_group_bytes(int64_t kind, int64_t K) {
  int64_t tile = 0;
  switch (kind % PW_ROUNDING_INT8) {   // its tile type
    case PW_TILE_BF16: tile = 16 * 32 * 2; break;              // bf16_matmul.cpp's BF16 tiles
#define PW_BYTES(name, Tile) case PW_TILE_##name: tile = Tile::kBytes; break;
    PW_TILES(PW_BYTES)
#undef PW_BYTES
  }
  return K / 32 * tile;
}

template QuantMatmul<float> quant_matmul<float>(int64_t);
template QuantMatmul<bf16> quant_matmul<bf16>(int64_t);

}  // namespace pw

extern "C" {   // the entry points' contracts: pagewire_api.h

// W packed as above.
#define PW_QUANT_MATMUL(type, sfx)                                                           \
  void pw_quant_matmul_##sfx(int64_t kind, type* out, int64_t out_stride, const type* x,     \
                             int64_t x_stride, int64_t T, const uint8_t* packed, int64_t N,  \
                             int64_t K) {                                                    \
    pw::quant_matmul<type>(kind)(out, out_stride, x, x_stride, T, packed, N, K);             \
  }
PW_QUANT_MATMUL(float, f32)
PW_QUANT_MATMUL(bf16, bf16)

int64_t pw_quant_kind(int64_t kind) { return pw::quant_matmul<float>(kind) != nullptr; }

int64_t pw_quant_matmuls() {
#if defined(__AVX512BF16__) || defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
