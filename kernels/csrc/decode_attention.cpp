// Decode attention over the paged KV cache: bfloat16, int8 or float8 (decode_tiles.h).
//
// One query per sequence, so no query block to put on the lanes: the 16 keys of a tile
// are transposed instead (Kt[i] lane t = key t's i-th dword of dims: a bfloat16 pair or four
// codes; 64 shuffles per 16x16 dwords, shared by the kv head's G query heads), scores come
// out one lane per key, and the softmax and P . V run as in prefill_attention.cpp. Replaces
// per-key horizontal sums (cpu_kernels.cpp's kernel, which keeps float32 caches, other head
// dims, blocks not a multiple of 16 and soft-capped scores: paged_decode.h's row kernels).
// A tile kind (Bf16Tiles, Fp8Tiles, Int8Tiles: decode_tiles*.h) says how a tile's keys and
// values are read and multiplied; attend_range walks a sequence's tiles the same way for all,
// over paged_decode.h's work items.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16.h"
#include "decode_tiles_bf16.h"
#include "paged_decode.h"     // DecodeItems, exp_normal
#include "decode_tiles_fp8.h"
#include "decode_tiles_int8.h"
#include "pagewire_api.h"

namespace pw {
namespace {

#if defined(__AVX512BF16__)
using namespace pw::decode;

constexpr int64_t kAhead = 1;      // tiles ahead that decode prefetches

// The online softmax of one sequence's kv heads [h0, h1) (and their G query heads each) over
// its keys [lo, hi) (a DecodeItems item's): heads [(h1 - h0) G] start empty.
template <typename Tiles, int kD>
void attend_range(Head<kD>* heads, const bf16* q, const typename Tiles::E* k_cache,
                  const typename Tiles::E* v_cache, const int64_t* table, int64_t lo,
                  int64_t hi, int64_t h0, int64_t h1, int64_t Hkv, int64_t G, int64_t bs,
                  float scale, typename Tiles::template Query<kD>& query) {
  using E = typename Tiles::E;
  constexpr int kChunk = kD == 64 ? 4 : 2;    // query heads per pass: accumulators in registers
  constexpr int64_t kHead = kD + Tiles::kExtra;
  const int64_t row_stride = Hkv * kHead;
  for (int64_t i = 0; i < (h1 - h0) * G; ++i) {
    std::memset(heads[i].out, 0, sizeof(heads[i].out));
    std::memset(heads[i].l, 0, sizeof(heads[i].l));
    heads[i].m = kNoScore;
  }
  query.set(q + h0 * G * kD, (h1 - h0) * G, scale);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t key0 = lo / kTile * kTile; key0 < hi; key0 += kTile) {
    const int64_t slot0 = table[key0 / bs] * bs + key0 % bs;
    const int valid = static_cast<int>(std::min<int64_t>(kTile, hi - key0));
    // Blocks are scattered, so no hardware prefetcher guesses the next one: fetch the rows
    // kAhead tiles on while this one is computed, into L2 (prefetcht1). Hints into L1 each
    // hold one of the few L1 miss buffers until their line arrives: from DRAM a thread then
    // read ~8 GB/s of cache, against ~13 with L2 hints (bench/NOTES.md "Decode attention").
    const int64_t ahead = key0 + kAhead * kTile;
    const int64_t next = ahead < hi ? (table[ahead / bs] * bs + ahead % bs) * row_stride : -1;
    const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(key0)));
    const __mmask16 seen =
        _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(hi))) &
        _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(lo)));
    for (int64_t j = h0; j < h1; ++j) {
      const E* k0 = k_cache + slot0 * row_stride + j * kHead;
      const E* v0 = v_cache + slot0 * row_stride + j * kHead;
      const int64_t pre = (next >= 0 ? next : slot0 * row_stride) + j * kHead;
      const E *kn = k_cache + pre, *vn = v_cache + pre;
      for (int64_t g0 = 0; g0 < G; g0 += kChunk) {
        const int64_t h = (j - h0) * G + g0;
        Head<kD>* hs = heads + h;
        auto tile = [&](auto ng) {
          Tiles::template tile<kD, decltype(ng)::value>(hs, query, h, k0, v0, kn, vn, row_stride,
                                                        seen, valid);
        };
        switch (std::min<int64_t>(kChunk, G - g0)) {
          case 1: tile(std::integral_constant<int, 1>{}); break;
          case 2: tile(std::integral_constant<int, 2>{}); break;
          case 3: tile(std::integral_constant<int, 3>{}); break;
          default: tile(std::integral_constant<int, kChunk>{});
        }
      }
    }
  }
}

// One query head's output from its states over `parts` ranges of the context (`stride` Heads
// apart): each rescaled to the largest maximum, summed, normalized. lse (if not null): the
// log of its sum of exp(score), kNoScore where it attended nothing (paged_decode.h's too).
template <typename Tiles, int kD>
void finish_head(bf16* out, const Head<kD>* part, int64_t parts, int64_t stride, float* lse) {
  float top = kNoScore, total = 0.f;
  for (int64_t p = 0; p < parts; ++p) top = std::max(top, part[p * stride].m);
  alignas(64) float acc[kD];
  const float* sum = part->out;                 // one part (the usual case): its own sums
  if (parts == 1) {
    total = _mm512_reduce_add_ps(_mm512_load_ps(part->l));
  } else {
    std::memset(acc, 0, sizeof(acc));
    for (int64_t p = 0; p < parts; ++p) {
      const Head<kD>& h = part[p * stride];
      const float w = paged::exp_normal(h.m - top);
      total += w * _mm512_reduce_add_ps(_mm512_load_ps(h.l));
      for (int c = 0; c < kD / 16; ++c) {
        const __m512 a = _mm512_load_ps(acc + 16 * c), x = _mm512_load_ps(h.out + 16 * c);
        _mm512_store_ps(acc + 16 * c, _mm512_fmadd_ps(_mm512_set1_ps(w), x, a));
      }
    }
    sum = acc;
  }
  Tiles::template finish<kD>(sum, total > 0.f ? 1.f / total : 0.f, out);
  if (lse) *lse = total > 0.f ? top + std::log(total) : kNoScore;
}

// Work items as paged_decode.h's row kernels take them (DecodeItems): whole sequences when
// there are enough; else split by kv head, and long contexts of a batch still too small for
// the threads split into parts whose states finish_head merges.
template <typename Tiles, int kD>
void decode_attention(bf16* out, const bf16* q, const typename Tiles::E* k_cache,
                      const typename Tiles::E* v_cache, const int64_t* block_tables,
                      const int64_t* context_lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t bs,
                      int64_t table_stride, int64_t q_stride, int64_t out_stride, float scale,
                      int64_t window, float* lse) {
  const int64_t G = Hq / Hkv;
  const paged::DecodeItems items(context_lens, B, Hkv, bs, window);
  std::vector<Head<kD>> states(items.parts > 1 ? items.count() * Hq : 0);   // Hq an item
  auto finish = [&](const paged::DecodeItems::Item& it, const Head<kD>* part0) {
    for (int64_t i = 0; i < (it.h1 - it.h0) * G; ++i) {
      const int64_t h = it.h0 * G + i;
      finish_head<Tiles, kD>(out + it.b * out_stride + h * kD, part0 + i, items.parts, Hq,
                             lse ? lse + it.b * Hq + h : nullptr);
    }
  };
  at::parallel_for(0, items.count(), 1, [&](int64_t begin, int64_t end) {
    std::vector<Head<kD>> own;                    // one part an item: states finished at once
    typename Tiles::template Query<kD> query;
    for (int64_t i = begin; i < end; ++i) {
      const paged::DecodeItems::Item it = items.item(i);
      Head<kD>* heads = states.data() + i * Hq;
      if (items.parts == 1) {
        own.resize((it.h1 - it.h0) * G);
        heads = own.data();
      }
      attend_range<Tiles, kD>(heads, q + it.b * q_stride, k_cache, v_cache,
                              block_tables + it.b * table_stride, it.lo, it.hi, it.h0, it.h1,
                              Hkv, G, bs, scale, query);
      if (items.parts == 1) finish(it, heads);
    }
  });
  if (items.parts == 1) return;
  at::parallel_for(0, B * items.splits, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)
      finish(items.item(s * items.parts), states.data() + s * items.parts * Hq);
  });
}

// Runs what the tiled kernels take (D 64 or 128, blocks a multiple of 16, no soft-cap) and
// returns 1; else 0, doing nothing.
template <typename Tiles>
int64_t run_tiled(bf16* out, const bf16* q, const typename Tiles::E* k_cache,
                  const typename Tiles::E* v_cache, const int64_t* block_tables,
                  const int64_t* context_lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                  int64_t bs, int64_t table_stride, int64_t q_stride, int64_t out_stride,
                  float scale, int64_t window, float softcap, float* lse) {
  if (bs % kTile != 0 || softcap > 0.f || (D != 64 && D != 128)) return 0;
  auto fn = D == 64 ? decode_attention<Tiles, 64> : decode_attention<Tiles, 128>;
  fn(out, q, k_cache, v_cache, block_tables, context_lens, B, Hq, Hkv, bs, table_stride,
     q_stride, out_stride, scale, window, lse);
  return 1;
}
#endif

}  // namespace
}  // namespace pw

extern "C" {   // the entry points' contracts: pagewire_api.h

int64_t pw_decode_attention_tiled_bf16(pw::bf16* out, const pw::bf16* q,
                                       const pw::bf16* k_cache, const pw::bf16* v_cache,
                                       const int64_t* block_tables, const int64_t* context_lens,
                                       int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                                       int64_t table_stride, int64_t q_stride, int64_t out_stride,
                                       float scale, int64_t window, float softcap, float* lse) {
#if defined(__AVX512BF16__)
  return pw::run_tiled<pw::Bf16Tiles>(out, q, k_cache, v_cache, block_tables, context_lens, B,
                                      Hq, Hkv, D, bs, table_stride, q_stride, out_stride, scale,
                                      window, softcap, lse);
#else
  return 0;
#endif
}

int64_t pw_decode_attention_tiled_q8(pw::bf16* out, const pw::bf16* q, const uint8_t* k_cache,
                                     const uint8_t* v_cache, const int64_t* block_tables,
                                     const int64_t* context_lens, int64_t B, int64_t Hq,
                                     int64_t Hkv, int64_t D, int64_t bs, int64_t table_stride,
                                     int64_t q_stride, int64_t out_stride, float scale,
                                     int64_t window, float softcap, int64_t kind, float* lse) {
#if defined(__AVX512BF16__)
  using pw::Int8Tiles, pw::Fp8Tiles, pw::kvq::kE4M3, pw::kvq::kE5M2;
  auto fn = kind == pw::kvq::kInt8 ? pw::run_tiled<Int8Tiles>
            : kind == kE4M3        ? pw::run_tiled<Fp8Tiles<kE4M3>>
                                   : pw::run_tiled<Fp8Tiles<kE5M2>>;
  return fn(out, q, k_cache, v_cache, block_tables, context_lens, B, Hq, Hkv, D, bs,
            table_stride, q_stride, out_stride, scale, window, softcap, lse);
#else
  return 0;
#endif
}

}  // extern "C"
