// Decode attention's tiles over a bfloat16 cache (decode_tiles.h).
#pragma once
#if defined(__AVX512BF16__)
#include <cstring>

#include "decode_tiles.h"

namespace pw::decode {

// A bfloat16 cache ([.., Hkv, D] rows): tiles multiply on vdpbf16ps.
struct Bf16Tiles {
  using E = bf16;
  static constexpr int64_t kExtra = 0;   // elements after a head's D values
  template <int kD>
  static void prepare(Seq<kD>&, int64_t) {}
  template <int kD>
  static void finish(const float* out, float inv, bf16* o) {
    for (int c = 0; c < kD / 16; ++c)
      store_bf16(o + 16 * c, _mm512_mul_ps(_mm512_load_ps(out + 16 * c), _mm512_set1_ps(inv)));
  }

  // NG query heads (from seq's head h) of kv head `k0`'s tile of 16 keys: scores (16 dim
  // pairs of the tile transposed at a time, in registers), the online softmax, and P . V with
  // the accumulators in registers. `seen`: the keys that count; `valid`: keys whose value
  // rows may be read (the rest are 0).
  template <int kD, int NG>
  // Not inlined: inside decode_attention.cpp's driver the hot case ran ~12 % slower.
  __attribute__((noinline)) static void tile(Head<kD>* heads, const Seq<kD>& seq, int64_t h,
                                             const bf16* k0, const bf16* v0, const bf16* k_next,
                                             const bf16* v_next, int64_t row_stride,
                                             __mmask16 seen, int valid) {
    constexpr int C = kD / 16;
    const bf16* q = seq.q + h * kD;
    __m512 s[NG];
    for (int g = 0; g < NG; ++g) s[g] = _mm512_setzero_ps();
    for (int z = 0; z < kD / 32; ++z) {
      __m512i kt[kTile];
      for (int t = 0; t < kTile; ++t) kt[t] = _mm512_loadu_si512(k0 + t * row_stride + 32 * z);
      transpose16(kt);                          // kt[i] lane t = key t's dims 32z + 2i, + 1
      for (int i = 0; i < kTile; ++i) {
        // The next tile's rows, a line per step: spread over the arithmetic (a burst of
        // prefetches stalls on the few outstanding misses a core may have). Into L2: decode_seq.
        __builtin_prefetch(k_next + i * row_stride + 32 * z, 0, 2);
        for (int g = 0; g < NG; ++g) {
          int32_t pair;
          std::memcpy(&pair, q + g * kD + 32 * z + 2 * i, 4);
          s[g] = _mm512_dpbf16_ps(s[g], (__m512bh)kt[i], (__m512bh)_mm512_set1_epi32(pair));
        }
      }
    }
    alignas(64) uint32_t pp[NG][kTile / 2];     // probabilities as bf16 key pairs
    __m512 acc[NG][C];
    for (int g = 0; g < NG; ++g) {
      Head<kD>& hd = heads[g];
      const __m512 sg = _mm512_mask_mul_ps(_mm512_set1_ps(kNoScore), seen, s[g],
                                           _mm512_set1_ps(seq.scale));
      __m512 alpha;
      const __m512 p = softmax_step(hd, sg, seen, alpha);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g]), (__m256i)_mm512_cvtneps_pbh(p));
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_mul_ps(_mm512_load_ps(hd.out + 16 * c), alpha);
    }
    for (int kp = 0; kp < kTile / 2; ++kp) {
      __m512i vt[C];                            // keys 2kp, 2kp + 1 interleaved, by dims
      for (int c = 0; c < C; ++c) {
        const bf16* ra = v0 + 2 * kp * row_stride + 16 * c;
        vt[c] = value_pair(ra, 2 * kp < valid, ra + row_stride, 2 * kp + 1 < valid);
        constexpr int kLines = kD / 32;      // 64-byte lines per row: C = 2 kLines steps here
        __builtin_prefetch(v_next + (2 * kp + c / kLines) * row_stride + 32 * (c % kLines), 0, 2);
      }
      for (int g = 0; g < NG; ++g) {
        const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pp[g][kp]));
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], pr, (__m512bh)vt[c]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < C; ++c) _mm512_store_ps(heads[g].out + 16 * c, acc[g][c]);
  }
};

}  // namespace pw::decode
#endif
