// Decode attention's tiles with bfloat16 arithmetic (decode_tiles.h): over a bfloat16 cache
// (Bf16Rows) and, through the same tile, over float8 codes widened as they are read
// (decode_tiles_fp8.h's Fp8Rows).
#pragma once
#if defined(__AVX512BF16__)
#include <cstring>

#include "decode_tiles.h"

namespace pw::decode {

// A tile's factors: of the scores (a lane a key) and of the probabilities (Rows::kScaled).
struct TileScales {
  __m512 k, v;
};

// A bfloat16 cache ([.., Hkv, D] rows) as BfTiles reads it.
struct Bf16Rows {
  using E = bf16;
  static constexpr int64_t kExtra = 0;     // elements after a head's D values
  static constexpr bool kScaled = false;   // no per-row scales

  template <int kD>
  static TileScales scales(const bf16*, const bf16*, int64_t, float scale) {
    return {_mm512_set1_ps(scale), _mm512_set1_ps(1.f)};
  }
  // Dims 32z .. 32z + 31 of one key's row, as bfloat16.
  static __m512i key_dims(const bf16* row, int z) { return _mm512_loadu_si512(row + 32 * z); }
  // The next tile's rows, a line per step: spread over the arithmetic (a burst of prefetches
  // stalls on the few outstanding misses a core may have). Into L2: decode_attention.cpp.
  template <int kD>
  static void prefetch_key(const bf16* row, int z) { __builtin_prefetch(row + 32 * z, 0, 2); }
  // Two keys' value rows (a, a + row_stride) as bfloat16 pairs, dims in order: vt[kD / 16];
  // the same rows of the next tile (`next`) prefetched, a line between loads.
  template <int kD>
  static void value_pairs(const bf16* a, const bf16* next, int64_t row_stride, bool a_live,
                          bool b_live, __m512i* vt) {
    constexpr int kLines = kD / 32;      // 64-byte lines a row: kD / 16 = 2 kLines steps here
    for (int c = 0; c < kD / 16; ++c) {
      vt[c] = value_pair(a + 16 * c, a_live, a + row_stride + 16 * c, b_live);
      __builtin_prefetch(next + (c / kLines) * row_stride + 32 * (c % kLines), 0, 2);
    }
  }
  template <int kD>
  static void finish(const float* out, float inv, bf16* o) {
    for (int c = 0; c < kD / 16; ++c)
      store_bf16(o + 16 * c, _mm512_mul_ps(_mm512_load_ps(out + 16 * c), _mm512_set1_ps(inv)));
  }
};

// Tiles multiplied on vdpbf16ps: the query as it is against keys read as bfloat16 by Rows.
template <typename Rows>
struct BfTiles {
  using E = typename Rows::E;
  static constexpr int64_t kExtra = Rows::kExtra;
  template <int kD>
  struct Query {                 // the query heads as they are
    const bf16* q;               // the first head handled
    float scale;                 // of scores
    void set(const bf16* first, int64_t /*heads*/, float s) { q = first, scale = s; }
  };
  template <int kD>
  static void finish(const float* out, float inv, bf16* o) {
    Rows::template finish<kD>(out, inv, o);
  }

  // NG query heads (from the query's head h) of kv head `k0`'s tile of 16 keys: scores (16 dim
  // pairs of the tile transposed at a time, in registers), the online softmax, and P . V with
  // the accumulators in registers. `seen`: the keys that count; `valid`: keys whose value
  // rows may be read (the rest are 0). Not inlined: inside decode_attention.cpp's driver the
  // hot case ran ~12 % slower.
  template <int kD, int NG>
  __attribute__((noinline)) static void tile(Head<kD>* heads, const Query<kD>& query, int64_t h,
                                             const E* k0, const E* v0, const E* k_next,
                                             const E* v_next, int64_t row_stride,
                                             __mmask16 seen, int valid) {
    constexpr int C = kD / 16;
    // Gathered scales are asked for first, so the scores do not wait for them; plain factors
    // after the scores, where the registers are free.
    auto tile_scales = [&] { return Rows::template scales<kD>(k0, v0, row_stride, query.scale); };
    TileScales scales;
    if constexpr (Rows::kScaled) scales = tile_scales();
    const bf16* q = query.q + h * kD;
    __m512 s[NG];
    for (int g = 0; g < NG; ++g) s[g] = _mm512_setzero_ps();
    for (int z = 0; z < kD / 32; ++z) {
      __m512i kt[kTile];
      for (int t = 0; t < kTile; ++t) kt[t] = Rows::key_dims(k0 + t * row_stride, z);
      transpose16(kt);                          // kt[i] lane t = key t's dims 32z + 2i, + 1
      for (int i = 0; i < kTile; ++i) {
        Rows::template prefetch_key<kD>(k_next + i * row_stride, z);
        for (int g = 0; g < NG; ++g) {
          int32_t pair;
          std::memcpy(&pair, q + g * kD + 32 * z + 2 * i, 4);
          s[g] = _mm512_dpbf16_ps(s[g], (__m512bh)kt[i], (__m512bh)_mm512_set1_epi32(pair));
        }
      }
    }
    if constexpr (!Rows::kScaled) scales = tile_scales();
    alignas(64) uint32_t pp[NG][kTile / 2];     // probabilities as bf16 key pairs
    __m512 acc[NG][C];
    for (int g = 0; g < NG; ++g) {
      const __m512 sg = _mm512_mask_mul_ps(_mm512_set1_ps(kNoScore), seen, s[g], scales.k);
      __m512 alpha;
      __m512 p = softmax_step(heads[g], sg, seen, alpha);
      if constexpr (Rows::kScaled) p = _mm512_maskz_mul_ps(seen, p, scales.v);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g]), (__m256i)_mm512_cvtneps_pbh(p));
      for (int c = 0; c < C; ++c)
        acc[g][c] = _mm512_mul_ps(_mm512_load_ps(heads[g].out + 16 * c), alpha);
    }
    for (int kp = 0; kp < kTile / 2; ++kp) {
      __m512i vt[C];                            // keys 2kp, 2kp + 1 as pairs (finish's order)
      Rows::template value_pairs<kD>(v0 + 2 * kp * row_stride, v_next + 2 * kp * row_stride,
                                     row_stride, 2 * kp < valid, 2 * kp + 1 < valid, vt);
      for (int g = 0; g < NG; ++g) {
        const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pp[g][kp]));
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], pr, (__m512bh)vt[c]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < C; ++c) _mm512_store_ps(heads[g].out + 16 * c, acc[g][c]);
  }
};

using Bf16Tiles = BfTiles<Bf16Rows>;

}  // namespace pw::decode
#endif
