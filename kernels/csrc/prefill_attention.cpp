// Causal attention of prefill chunks over the paged KV cache, bfloat16 (attention_tiles.h).
//
// A chunk's n queries are the last n positions of its sequence's ctx tokens, whose keys and
// values are already in the cache ([num_blocks, bs, Hkv, D] per layer, bs a multiple of 16).
// Query i (position ctx - n + i) attends keys [0, ctx - n + i] (the last `window` of them with
// a window), or keys below key_ends[row] where the batch has key ends (Gemma 3's image tokens
// see their whole image: an end past the query's own position, never past ctx; the window
// still counts back from the query's position). torch's SDPA ran these at 60-90 GFLOP/s
// here; this kernel keeps every product on vdpbf16ps and every softmax step vertical:
//
// * Sixteen query positions of one head form a row group, one zmm lane per position. Their
//   queries are transposed once per work item into pairs of dims (Qt[d/2] = 16 lanes of two
//   bf16), so q . k for key t is 32 (D = 64) vdpbf16ps of Qt against key t's dims broadcast
//   straight from the cache row: no transposed copy of K, no horizontal sums.
// * Keys come 16 at a time (a tile, inside one cache block). Scores, row maxima, the online
//   softmax's rescaling and the exponentials run on the 16 lanes of a tile's 16 score vectors.
// * The values of a tile are interleaved once into key pairs (Vt[t/2][d] = V[t][d], V[t+1][d]);
//   P . V then accumulates each query's output (D float32, kept in this item's scratch) with
//   vdpbf16ps of Vt against the query's two probabilities broadcast, probabilities rounded to
//   bfloat16 as SDPA's CPU kernel rounds them for its second matmul.
//
// Work items are (chunk, kv head, 32 query positions), largest first, pulled from a shared
// counter so the causal triangle's uneven costs balance over the threads.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_tiles.h"
#include "bf16.h"
#include "pagewire_api.h"

namespace pw {
namespace {

#if defined(__AVX512BF16__)
// Two vectors of 16 floats -> 16 dwords, each the pair (lo[i], hi[i]) rounded to bfloat16.
inline __m512i pair_bf16(__m512 lo, __m512 hi) {
  const __m512i a = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
  const __m512i b = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
  return _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
}

struct Chunk {         // one prefill chunk, as the Python side packs it (int64 x 4)
  int64_t start;       // its first query's row in q / out
  int64_t n;           // queries
  int64_t ctx;         // tokens in the cache, its own included
  int64_t table;       // offset of its block table in the concatenated tables
};

struct Shape {
  int64_t Hq, Hkv, bs, q_stride, out_stride, window;
  float scale;
  const float* sinks;   // a logit per query head joining each row's softmax, or null
  const int64_t* key_ends;   // per row of q: the end (exclusive) of its keys, or null: causal
};

// One row group's state: 16 query positions of one head.
template <int kD>
struct Rows {
  alignas(64) uint32_t qt[kD / 2][kTile];   // queries, dim pairs x lanes
  alignas(64) float out[kTile][kD];         // unnormalized output per query
  alignas(64) float m[kTile];               // running score maximum per query
  alignas(64) float l[kTile];               // running sum of exponentials per query
  alignas(64) int32_t end[kTile];           // per query, the end (exclusive) of its keys
  int64_t head;                             // query head
  int64_t first;                            // chunk index of lane 0's query
  int64_t last_end;                         // the largest of end[]: no key at or past it
};

// Scores of one row group against one tile, softmax-updated in place; returns the tile's
// probabilities as key pairs (pp[t/2] lane r = P[r][t], P[r][t+1]) and each lane's rescale.
template <int kD>
inline __m512 score_tile(Rows<kD>& rows, const bf16* const* krow, int64_t key0, int64_t pos0,
                         int64_t window, float scale, __m512i* pp) {
  const __m512i end = _mm512_load_si512(rows.end);
  __m512 s[kTile];
  for (int t = 0; t < kTile; ++t) s[t] = _mm512_setzero_ps();
  for (int dp = 0; dp < kD / 2; ++dp) {
    const __m512bh qv = (__m512bh)_mm512_load_si512(rows.qt[dp]);
    for (int t = 0; t < kTile; ++t) {
      int32_t pair;
      std::memcpy(&pair, krow[t] + 2 * dp, 4);
      s[t] = _mm512_dpbf16_ps(s[t], qv, (__m512bh)_mm512_set1_epi32(pair));
    }
  }
  // lane r is query position pos0 + r; key key0 + t is visible to it when
  // pos - window < key < end (end: pos + 1 unless the batch has key ends).
  const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(pos0)),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                         12, 13, 14, 15));
  const __m512i lowest = window > 0 ? _mm512_sub_epi32(pos, _mm512_set1_epi32(
                                          static_cast<int32_t>(window - 1)))
                                    : _mm512_setzero_si512();
  const __m512 m_old = _mm512_load_ps(rows.m);
  __m512 m_new = m_old;
  __mmask16 seen[kTile];
  for (int t = 0; t < kTile; ++t) {
    const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(key0 + t));
    seen[t] = _mm512_cmplt_epi32_mask(key, end) & _mm512_cmpge_epi32_mask(key, lowest);
    s[t] = _mm512_mask_mul_ps(_mm512_set1_ps(kNoScore), seen[t], s[t], _mm512_set1_ps(scale));
    m_new = _mm512_max_ps(m_new, s[t]);
  }
  const __m512 alpha = exp_ps(_mm512_sub_ps(m_old, m_new));
  __m512 sum = _mm512_setzero_ps();
  for (int t = 0; t < kTile; ++t) {
    s[t] = _mm512_maskz_mov_ps(seen[t], exp_ps(_mm512_sub_ps(s[t], m_new)));
    sum = _mm512_add_ps(sum, s[t]);
  }
  _mm512_store_ps(rows.m, m_new);
  _mm512_store_ps(rows.l, _mm512_fmadd_ps(_mm512_load_ps(rows.l), alpha, sum));
  for (int t = 0; t < kTile; t += 2) pp[t / 2] = pair_bf16(s[t], s[t + 1]);
  return alpha;
}

// out[r] = out[r] * alpha[r] + sum_t P[r][t] V[t], for the group's live lanes, kR at a time
// (their accumulators stay in registers across the tile's 8 key pairs).
template <int kD, int kR>
inline void accumulate_tile(Rows<kD>& rows, const __m512i* pp, const __m512i* vt, __m512 alpha,
                            int live) {
  constexpr int C = kD / 16;
  alignas(64) float a[kTile];
  alignas(64) uint32_t p[kTile / 2][kTile];
  _mm512_store_ps(a, alpha);
  for (int kp = 0; kp < kTile / 2; ++kp) _mm512_store_si512(p[kp], pp[kp]);
  for (int r0 = 0; r0 < live; r0 += kR) {
    __m512 acc[kR][C];
    for (int r = 0; r < kR; ++r)
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_mul_ps(_mm512_load_ps(rows.out[r0 + r] + 16 * c),
                                  _mm512_set1_ps(a[r0 + r]));
    for (int kp = 0; kp < kTile / 2; ++kp)
      for (int r = 0; r < kR; ++r) {
        const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(p[kp][r0 + r]));
        for (int c = 0; c < C; ++c)
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pr, (__m512bh)vt[kp * C + c]);
      }
    for (int r = 0; r < kR; ++r)
      for (int c = 0; c < C; ++c) _mm512_store_ps(rows.out[r0 + r] + 16 * c, acc[r][c]);
  }
}

// The tile's values as key pairs: vt[t/2 * C + c] lane i = V[t][16c + i], V[t+1][16c + i].
// Keys at or past `valid` (unwritten slots of the last block) become zeros.
template <int kD>
inline void pair_values(const bf16* const* vrow, int valid, __m512i* vt) {
  constexpr int C = kD / 16;
  for (int t = 0; t < kTile; t += 2)
    for (int c = 0; c < C; ++c)
      vt[t / 2 * C + c] = value_pair(vrow[t] + 16 * c, t < valid, vrow[t + 1] + 16 * c,
                                     t + 1 < valid);
}

// One work item: chunk `ch`, kv head j, its queries [i0, i1).
template <int kD>
void attend_item(bf16* out, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                 const int64_t* tables, const Chunk& ch, int64_t j, int64_t i0, int64_t i1,
                 const Shape& sh, std::vector<Rows<kD>>& groups) {
  constexpr int C = kD / 16;
  constexpr int kR = kD == 64 ? 4 : 2;           // accumulators: kR * C zmm
  const int64_t G = sh.Hq / sh.Hkv, row_stride = sh.Hkv * kD;
  const int64_t past = ch.ctx - ch.n;            // position of query 0
  const int64_t per_head = (i1 - i0 + kTile - 1) / kTile;
  groups.resize(G * per_head);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t b = 0; b < per_head; ++b) {
      Rows<kD>& rows = groups[g * per_head + b];
      rows.head = j * G + g;
      rows.first = i0 + b * kTile;
      std::memset(rows.qt, 0, sizeof(rows.qt));
      std::memset(rows.out, 0, sizeof(rows.out));
      std::fill(rows.m, rows.m + kTile, kNoScore);
      std::fill(rows.l, rows.l + kTile, 0.f);
      rows.last_end = 0;
      for (int64_t r = 0; r < kTile; ++r) {     // a dead lane's end: its position + 1
        const bool live = rows.first + r < i1;
        const int64_t e = live && sh.key_ends ? sh.key_ends[ch.start + rows.first + r]
                                              : past + rows.first + r + 1;
        rows.end[r] = static_cast<int32_t>(e);
        if (live) rows.last_end = std::max(rows.last_end, e);
      }
      for (int64_t r = 0; r < kTile && rows.first + r < i1; ++r) {
        const bf16* qr = q + (ch.start + rows.first + r) * sh.q_stride + rows.head * kD;
        for (int dp = 0; dp < kD / 2; ++dp) std::memcpy(&rows.qt[dp][r], qr + 2 * dp, 4);
      }
    }
  int64_t end = past + i1;                       // keys [lo, end) are visible to someone
  for (const Rows<kD>& rows : groups) end = std::max(end, rows.last_end);
  const int64_t lo = sh.window > 0 ? std::max<int64_t>(0, past + i0 - sh.window + 1) : 0;
  const int64_t* table = tables + ch.table;
  __m512i vt[kTile / 2 * C], pp[kTile / 2];
  const bf16* krow[kTile];
  const bf16* vrow[kTile];
  for (int64_t key0 = lo / kTile * kTile; key0 < end; key0 += kTile) {
    const int64_t slot0 = table[key0 / sh.bs] * sh.bs + key0 % sh.bs;
    const int valid = static_cast<int>(std::min<int64_t>(kTile, end - key0));
    for (int t = 0; t < kTile; ++t) {   // past `valid`: still inside the block, never used
      krow[t] = k_cache + (slot0 + t) * row_stride + j * kD;
      vrow[t] = v_cache + (slot0 + t) * row_stride + j * kD;
    }
    pair_values<kD>(vrow, valid, vt);
    for (Rows<kD>& rows : groups) {
      const int64_t pos0 = past + rows.first;
      const int live = static_cast<int>(std::min<int64_t>(kTile, i1 - rows.first));
      if (key0 >= rows.last_end) continue;                           // all keys unseen
      if (sh.window > 0 && key0 + kTile <= pos0 - sh.window + 1) continue;   // all too old
      const __m512 alpha = score_tile<kD>(rows, krow, key0, pos0, sh.window, sh.scale, pp);
      accumulate_tile<kD, kR>(rows, pp, vt, alpha, (live + kR - 1) / kR * kR);
    }
  }
  for (const Rows<kD>& rows : groups)
    for (int64_t r = 0; r < kTile && rows.first + r < i1; ++r) {
      bf16* o = out + (ch.start + rows.first + r) * sh.out_stride + rows.head * kD;
      // a sink adds its exponential (on the row's running maximum's scale) to the sum alone
      const float sink = sh.sinks ? std::exp(sh.sinks[rows.head] - rows.m[r]) : 0.f;
      const float inv = 1.f / (rows.l[r] + sink);
      for (int d = 0; d < kD; ++d) pw::from_float(rows.out[r][d] * inv, o + d);
    }
}

// A work item's query positions: enough items to balance the threads (the causal triangle's
// costs differ), as many positions as that allows, up to 256: each key tile's values are
// paired once per item, so an item of many positions (a vision tower's image, G = 1) pairs
// them for all its row groups at once (bench/NOTES.md "Vision tower": a LLM prefill's
// speed unchanged, a SigLIP tile's attention 1.4x).
int64_t item_positions(const Chunk* chunks, int64_t num_chunks, int64_t Hkv) {
  int64_t rows = 0;
  for (int64_t c = 0; c < num_chunks; ++c) rows += chunks[c].n * Hkv;
  const int64_t per = rows / (8 * at::get_num_threads()) / 32 * 32;
  return std::clamp<int64_t>(per, 32, 256);
}

template <int kD>
void prefill_attention(bf16* out, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                       const int64_t* tables, const Chunk* chunks, int64_t num_chunks,
                       const Shape& sh) {
  struct Item { int64_t chunk, head, i0, i1, cost; };
  const int64_t positions = item_positions(chunks, num_chunks, sh.Hkv);
  std::vector<Item> items;
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t j = 0; j < sh.Hkv; ++j)
      for (int64_t i0 = 0; i0 < chunks[c].n; i0 += positions) {
        const int64_t i1 = std::min(chunks[c].n, i0 + positions);
        const int64_t keys = chunks[c].ctx - chunks[c].n + i1;
        const int64_t seen = sh.window > 0 ? std::min(keys, sh.window) : keys;
        items.push_back({c, j, i0, i1, (i1 - i0) * seen});
      }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<Rows<kD>> groups;
    for (int64_t i = next++; i < static_cast<int64_t>(items.size()); i = next++) {
      const Item& it = items[i];
      attend_item<kD>(out, q, k_cache, v_cache, tables, chunks[it.chunk], it.head, it.i0, it.i1,
                      sh, groups);
    }
  });
}
#endif

}  // namespace
}  // namespace pw

extern "C" {   // the entry point's contract: pagewire_api.h

void pw_prefill_attention_bf16(pw::bf16* out, const pw::bf16* q, const pw::bf16* k_cache,
                               const pw::bf16* v_cache, const int64_t* tables,
                               const int64_t* chunks, int64_t num_chunks, int64_t Hq,
                               int64_t Hkv, int64_t D, int64_t bs, int64_t q_stride,
                               int64_t out_stride, float scale, int64_t window,
                               const float* sinks, const int64_t* key_ends) {
#if defined(__AVX512BF16__)
  const pw::Shape sh{Hq, Hkv, bs, q_stride, out_stride, window, scale, sinks, key_ends};
  const pw::Chunk* c = reinterpret_cast<const pw::Chunk*>(chunks);
  if (D == 64) pw::prefill_attention<64>(out, q, k_cache, v_cache, tables, c, num_chunks, sh);
  else if (D == 128)
    pw::prefill_attention<128>(out, q, k_cache, v_cache, tables, c, num_chunks, sh);
#endif
}

}  // extern "C"
