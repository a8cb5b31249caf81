// Decode attention over the paged KV cache, bfloat16 (attention_tiles.h).
//
// One query per sequence, so no query block to put on the lanes: the 16 keys of a tile
// are transposed into dim pairs instead (Kt[d/2] lane t = key t's dims d, d+1; 64 shuffles per
// 16x16 dwords, shared by the kv head's G query heads), scores come out one lane per key, and
// the softmax and P . V run as in prefill_attention.cpp. Replaces per-key horizontal sums
// (cpu_kernels.cpp's kernel, which keeps float32 caches, other head dims, blocks not a
// multiple of 16 and soft-capped scores).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_tiles.h"
#include "bf16.h"

namespace pw {
namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kAhead = 1;      // tiles ahead that decode prefetches

// Rows r[0..15] of 16 dwords -> columns: r[c] lane t = old r[t] lane c.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {   // r[4i + c], 128-bit lane L: rows 4i..4i+3 at column 4L + c
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
    t[4 + c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    t[8 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    t[12 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xDD);
  }
}

// One decoding query head's running state.
template <int kD>
struct Head {
  alignas(64) float out[kD];   // unnormalized output
  alignas(64) float l[kTile];  // per-lane sums of exponentials
  float m;                     // running score maximum
};

// NG query heads of kv head `k0`'s tile of 16 keys: scores (16 dim pairs of the tile transposed
// at a time, in registers), the online softmax, and P . V with the accumulators in registers.
// `seen`: the keys that count; `valid`: keys whose value rows may be read (the rest are 0).
template <int kD, int NG>
inline void decode_tile(Head<kD>* heads, const bf16* q, const bf16* k0, const bf16* v0,
                        const bf16* k_next, const bf16* v_next, int64_t row_stride,
                        __mmask16 seen, int valid, float scale) {
  constexpr int C = kD / 16;
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
    Head<kD>& h = heads[g];
    const __m512 sg = _mm512_mask_mul_ps(_mm512_set1_ps(kNoScore), seen, s[g],
                                         _mm512_set1_ps(scale));
    const float m_new = std::max(h.m, _mm512_reduce_max_ps(sg));
    const __m512 p = _mm512_maskz_mov_ps(seen, exp_ps(_mm512_sub_ps(sg, _mm512_set1_ps(m_new))));
    const __m512 alpha = exp_ps(_mm512_set1_ps(h.m - m_new));
    h.m = m_new;
    _mm512_store_ps(h.l, _mm512_fmadd_ps(_mm512_load_ps(h.l), alpha, p));
    _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g]), (__m256i)_mm512_cvtneps_pbh(p));
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_mul_ps(_mm512_load_ps(h.out + 16 * c), alpha);
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

// One sequence's kv heads [h0, h1) (and their G query heads each) over its context.
template <int kD>
void decode_seq(bf16* out, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                const int64_t* table, int64_t ctx, int64_t h0, int64_t h1, int64_t Hkv,
                int64_t G, int64_t bs, float scale, int64_t window, std::vector<Head<kD>>& heads) {
  constexpr int kChunk = kD == 64 ? 4 : 2;    // query heads per pass: accumulators in registers
  const int64_t row_stride = Hkv * kD, first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
  heads.resize((h1 - h0) * G);
  for (Head<kD>& h : heads) {
    std::memset(h.out, 0, sizeof(h.out));
    std::memset(h.l, 0, sizeof(h.l));
    h.m = kNoScore;
  }
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t key0 = first / kTile * kTile; key0 < ctx; key0 += kTile) {
    const int64_t slot0 = table[key0 / bs] * bs + key0 % bs;
    const int valid = static_cast<int>(std::min<int64_t>(kTile, ctx - key0));
    // Blocks are scattered, so no hardware prefetcher guesses the next one: fetch the rows
    // kAhead tiles on while this one is computed, into L2 (prefetcht1). Hints into L1 each
    // hold one of the few L1 miss buffers until their line arrives: from DRAM a thread then
    // read ~8 GB/s of cache, against ~13 with L2 hints (bench/NOTES.md, session 19).
    const int64_t ahead = key0 + kAhead * kTile;
    const int64_t next = ahead < ctx ? (table[ahead / bs] * bs + ahead % bs) * row_stride : -1;
    const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(key0)));
    const __mmask16 seen =
        _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(ctx))) &
        _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(first)));
    for (int64_t j = h0; j < h1; ++j) {
      const bf16* k0 = k_cache + slot0 * row_stride + j * kD;
      const bf16* v0 = v_cache + slot0 * row_stride + j * kD;
      const int64_t pre = next >= 0 ? next + j * kD : slot0 * row_stride + j * kD;
      for (int64_t g0 = 0; g0 < G; g0 += kChunk) {
        Head<kD>* hs = heads.data() + (j - h0) * G + g0;
        const bf16* qg = q + (j * G + g0) * kD;
        const bf16 *kn = k_cache + pre, *vn = v_cache + pre;
        switch (std::min<int64_t>(kChunk, G - g0)) {
          case 1: decode_tile<kD, 1>(hs, qg, k0, v0, kn, vn, row_stride, seen, valid, scale); break;
          case 2: decode_tile<kD, 2>(hs, qg, k0, v0, kn, vn, row_stride, seen, valid, scale); break;
          case 3: decode_tile<kD, 3>(hs, qg, k0, v0, kn, vn, row_stride, seen, valid, scale); break;
          default:
            decode_tile<kD, kChunk>(hs, qg, k0, v0, kn, vn, row_stride, seen, valid, scale);
        }
      }
    }
  }
  for (int64_t i = 0; i < (h1 - h0) * G; ++i) {
    const float inv = 1.f / _mm512_reduce_add_ps(_mm512_load_ps(heads[i].l));
    bf16* o = out + (h0 * G + i) * kD;
    for (int d = 0; d < kD; ++d) pw::from_float(heads[i].out[d] * inv, o + d);
  }
}

template <int kD>
void decode_attention(bf16* out, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                      const int64_t* block_tables, const int64_t* context_lens, int64_t B,
                      int64_t Hq, int64_t Hkv, int64_t bs, int64_t table_stride,
                      int64_t q_stride, int64_t out_stride, float scale, int64_t window) {
  // Whole sequences per work item when there are enough of them; a small batch is split by
  // kv head so every thread has work.
  const int64_t splits = B < 2 * at::get_num_threads() ? Hkv : 1;
  at::parallel_for(0, B * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<Head<kD>> heads;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / splits, part = item % splits;
      decode_seq<kD>(out + b * out_stride, q + b * q_stride, k_cache, v_cache,
                     block_tables + b * table_stride, context_lens[b], part * Hkv / splits,
                     (part + 1) * Hkv / splits, Hkv, Hq / Hkv, bs, scale, window, heads);
    }
  });
}
#endif

}  // namespace
}  // namespace pw

extern "C" {

// As pw_decode_attention_bf16 (cpu_kernels.cpp), which calls this first: returns 0, doing
// nothing, for what this kernel does not take (D not 64 or 128, bs % 16 != 0, a soft-cap, or
// a build without AVX512-BF16).
int64_t pw_decode_attention_tiled_bf16(pw::bf16* out, const pw::bf16* q,
                                       const pw::bf16* k_cache, const pw::bf16* v_cache,
                                       const int64_t* block_tables, const int64_t* context_lens,
                                       int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                                       int64_t table_stride, int64_t q_stride, int64_t out_stride,
                                       float scale, int64_t window, float softcap) {
#if defined(__AVX512BF16__)
  if (bs % pw::kTile != 0 || softcap > 0.f || (D != 64 && D != 128)) return 0;
  auto fn = D == 64 ? pw::decode_attention<64> : pw::decode_attention<128>;
  fn(out, q, k_cache, v_cache, block_tables, context_lens, B, Hq, Hkv, bs, table_stride,
     q_stride, out_stride, scale, window);
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
