// LoRA deltas of one linear for a step's rows, each row with its own adapter (or none):
// y[t] += scale * Bt_a^T (A_a x[t]) for a = adapter_of_row[t] >= 0. The per-op path
// (kernels/ops.py CpuOps.lora_delta) calls it after a linear, for a prefill chunk's thousands
// of rows as for one; the fused decode interpreter (decode_stack.cpp) with the linear's own
// product in the same parallel region (lora.h linear_with_lora): one fork per linear.
//
// The weights come as float32, bfloat16 or float16 (the file's dtype, or the model's where
// that is narrower: a step reads them all) and Bt holds only its nonzero spans: a fused
// linear's B^T is block-diagonal (projection j's rank rows reach only its own output
// columns), so rank row r of Bt is `width` values from column `col`, at `offset` in one packed
// array. Products accumulate in float32.
//
// Rows are grouped by adapter into tiles of up to kTile rows (a batch's rows interleave
// adapters), so each weight loaded from memory serves every row of a tile: shrink computes a
// tile's mid = scale * x A^T over runs of kRun rank rows, expand adds mid Bt over chunks of
// columns, both with tile x 4-vector register blocks.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "float_vec.h"
#include "lora.h"
#include "pagewire_api.h"

using bf16 = uint16_t;

namespace {

using namespace pw::vec;

constexpr int64_t kSerialMacs = 1 << 14;   // multiply-adds below which one thread does it all
constexpr int64_t kEntry = PW_LORA_TABLE_ENTRY;   // int64 per (adapter, slot); see Entry
constexpr int kTile = 4;          // rows of one adapter sharing each weight load
constexpr int kRun = 4;           // rank rows of A a shrink work item reads
constexpr int64_t kChunk = 256;   // output columns an expand work item writes
enum Kind : int64_t {   // pagewire_api.h PwLoraWeights
  kF32 = PW_LORA_WEIGHTS_F32, kBF16 = PW_LORA_WEIGHTS_BF16, kF16 = PW_LORA_WEIGHTS_F16
};

// One adapter's weights for one linear: A [R, K], Bt's packed spans, spans [R, 3] int64
// (col, width, offset), R, the weights' Kind, and alpha / r as float64 bits.
struct Entry {
  const void* a;
  const void* bt;
  const int64_t* spans;
  int64_t rank;
  Kind kind;
  float scale;

  explicit Entry(const int64_t* w)
      : a(reinterpret_cast<const void*>(w[0])), bt(reinterpret_cast<const void*>(w[1])),
        spans(reinterpret_cast<const int64_t*>(w[2])), rank(w[3]), kind(Kind(w[4])) {
    double s;
    std::memcpy(&s, &w[5], 8);
    scale = static_cast<float>(s);
  }
};

// The weights of Kind K: their vector and scalar loads.
template <Kind K> struct W;
template <> struct W<kF32> {
  using T = float;
  static Vec load(const T* p) { return vload(p); }
  static float at(const T* p) { return *p; }
};
template <> struct W<kBF16> {
  using T = uint16_t;
  static Vec load(const T* p) { return vload_bf16(p); }
  static float at(const T* p) { return pw::to_float(*p); }
};
template <> struct W<kF16> {
  using T = uint16_t;
  static Vec load(const T* p) { return vload_f16(p); }
  static float at(const T* p) { return _cvtsh_ss(*p); }
};

// x rows as float32 vectors and scalars, from float32 or bfloat16 activations.
inline Vec vload_x(const float* p) { return vload(p); }
inline Vec vload_x(const bf16* p) { return vload_bf16(p); }

// y[0, kLanes) += v, rounded once to y's type.
inline void add_store(float* y, Vec v) { vstore(y, vadd(vload(y), v)); }
inline void add_store(bf16* y, Vec v) { vstore_bf16(y, vadd(vload_bf16(y), v)); }

#if defined(__AVX512BF16__)
// shrink_tile for bfloat16 x and A: 32 products a vdpbf16ps (each exact in float32, as the
// float path's; a denormal input reads as zero), summed in pairs before the accumulator.
template <int M, int R>
void shrink_pairs(float* mid, int64_t ld, const bf16* const* xs, const bf16* a, int64_t k,
                  float scale) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= k; j += 32) {
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(xs[m] + j);
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_loadu_si512(a + r * k + j);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], av, xv[m]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float s = _mm512_reduce_add_ps(acc[m][r]);
      for (int64_t i = j; i < k; ++i) s += pw::to_float(a[r * k + i]) * pw::to_float(xs[m][i]);
      mid[m * ld + r] = scale * s;
    }
}
#endif

// mid[m * ld + r] = scale * <xs[m], a row r> for m < M tile rows, r < R rank rows of a (row
// stride k): M x R accumulators, each x and weight vector loaded once for all of them.
template <typename X, Kind K, int M, int R>
void shrink_tile(float* mid, int64_t ld, const X* const* xs, const void* a_rows, int64_t k,
                 float scale) {
  const auto* a = static_cast<const typename W<K>::T*>(a_rows);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<X, bf16> && K == kBF16)
    return shrink_pairs<M, R>(mid, ld, xs, a, k, scale);
#endif
  Vec acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vzero();
  int64_t j = 0;
  for (; j + kLanes <= k; j += kLanes) {
    Vec xv[M];
    for (int m = 0; m < M; ++m) xv[m] = vload_x(xs[m] + j);
    for (int r = 0; r < R; ++r) {
      const Vec av = W<K>::load(a + r * k + j);
      for (int m = 0; m < M; ++m) acc[m][r] = vfma(av, xv[m], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float s = vsum(acc[m][r]);
      for (int64_t i = j; i < k; ++i) s += W<K>::at(a + r * k + i) * pw::to_float(xs[m][i]);
      mid[m * ld + r] = scale * s;
    }
}

template <typename X, Kind K, int M>
void shrink_rows(float* mid, int64_t ld, const X* const* xs, const void* a, int64_t ranks,
                 int64_t k, float scale) {
  switch (ranks) {
    case 1: return shrink_tile<X, K, M, 1>(mid, ld, xs, a, k, scale);
    case 2: return shrink_tile<X, K, M, 2>(mid, ld, xs, a, k, scale);
    case 3: return shrink_tile<X, K, M, 3>(mid, ld, xs, a, k, scale);
    default: return shrink_tile<X, K, M, kRun>(mid, ld, xs, a, k, scale);
  }
}

template <typename X, Kind K>
void shrink(float* mid, int64_t ld, const X* const* xs, int rows, const void* a, int64_t ranks,
            int64_t k, float scale) {
  switch (rows) {
    case 1: return shrink_rows<X, K, 1>(mid, ld, xs, a, ranks, k, scale);
    case 2: return shrink_rows<X, K, 2>(mid, ld, xs, a, ranks, k, scale);
    case 3: return shrink_rows<X, K, 3>(mid, ld, xs, a, ranks, k, scale);
    default: return shrink_rows<X, K, kTile>(mid, ld, xs, a, ranks, k, scale);
  }
}

// ys[m][0, width) += sum_r mid[m * ld + r] * b[r][0, width) over `ranks` rows of b (row
// stride bld) for M tile rows: V vectors of columns at a time, their M x V accumulators kept
// in registers across the rank rows and added to y once (each y value rounded once: the
// spans of one linear never share a column, LoraWeights).
template <typename Y, Kind K, int M, int V>
int64_t expand_cols(Y* const* ys, int64_t j, const float* mid, int64_t ld,
                    const typename W<K>::T* b, int64_t ranks, int64_t bld, int64_t width) {
  for (; j + V * kLanes <= width; j += V * kLanes) {
    Vec c[M][V];
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < V; ++v) c[m][v] = vzero();
    for (int64_t r = 0; r < ranks; ++r) {
      Vec bv[V];
      for (int v = 0; v < V; ++v) bv[v] = W<K>::load(b + r * bld + j + v * kLanes);
      for (int m = 0; m < M; ++m) {
        const Vec s = vset1(mid[m * ld + r]);
        for (int v = 0; v < V; ++v) c[m][v] = vfma(s, bv[v], c[m][v]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < V; ++v) add_store(ys[m] + j + v * kLanes, c[m][v]);
  }
  return j;
}

template <typename Y, Kind K, int M>
void expand_tile(Y* const* ys, const float* mid, int64_t ld, const void* b_rows, int64_t ranks,
                 int64_t bld, int64_t width) {
  const auto* b = static_cast<const typename W<K>::T*>(b_rows);
  // Wide blocks for few rows: each rank row of b is then read in long contiguous runs.
  int64_t j = expand_cols<Y, K, M, 4>(ys, 0, mid, ld, b, ranks, bld, width);
  j = expand_cols<Y, K, M, 1>(ys, j, mid, ld, b, ranks, bld, width);
  for (; j < width; ++j)
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t r = 0; r < ranks; ++r) s += mid[m * ld + r] * W<K>::at(b + r * bld + j);
      pw::from_float(pw::to_float(ys[m][j]) + s, &ys[m][j]);
    }
}

template <typename Y, Kind K>
void expand(Y* const* ys, int rows, const float* mid, int64_t ld, const void* b, int64_t ranks,
            int64_t bld, int64_t width) {
  switch (rows) {
    case 1: return expand_tile<Y, K, 1>(ys, mid, ld, b, ranks, bld, width);
    case 2: return expand_tile<Y, K, 2>(ys, mid, ld, b, ranks, bld, width);
    case 3: return expand_tile<Y, K, 3>(ys, mid, ld, b, ranks, bld, width);
    default: return expand_tile<Y, K, kTile>(ys, mid, ld, b, ranks, bld, width);
  }
}

size_t kind_bytes(Kind kind) { return kind == kF32 ? 4 : 2; }

// A tile: up to kTile rows of one adapter.
struct Tile {
  const Entry* entry;
  int64_t rows[kTile];
  int count;
};

template <typename X>
void shrink_any(float* mid, int64_t ld, const X* const* xs, const Tile& tile, int64_t r0,
                int64_t k) {
  const Entry& e = *tile.entry;
  const char* a = static_cast<const char*>(e.a) + r0 * k * kind_bytes(e.kind);
  const int64_t ranks = std::min<int64_t>(kRun, e.rank - r0);
  switch (e.kind) {
    case kBF16: return shrink<X, kBF16>(mid + r0, ld, xs, tile.count, a, ranks, k, e.scale);
    case kF16: return shrink<X, kF16>(mid + r0, ld, xs, tile.count, a, ranks, k, e.scale);
    default: return shrink<X, kF32>(mid + r0, ld, xs, tile.count, a, ranks, k, e.scale);
  }
}

// y's tile rows [j0, j0 + m) += the tile's mid times each run of rank rows that share one
// span (a projection's block: its rows lie `width` apart), where the span meets the columns.
template <typename Y>
void add_spans(Y* const* ys, const float* mid, int64_t ld, const Tile& tile, int64_t j0,
               int64_t m) {
  const Entry& e = *tile.entry;
  const int64_t* sp = e.spans;
  for (int64_t r = 0; r < e.rank;) {
    const int64_t col = sp[r * 3], width = sp[r * 3 + 1], offset = sp[r * 3 + 2];
    int64_t ranks = 1;
    while (r + ranks < e.rank && sp[(r + ranks) * 3] == col &&
           sp[(r + ranks) * 3 + 1] == width && sp[(r + ranks) * 3 + 2] == offset + ranks * width)
      ++ranks;
    const int64_t lo = std::max(col, j0), hi = std::min(col + width, j0 + m);
    if (lo < hi) {
      const char* b = static_cast<const char*>(e.bt) + (offset + lo - col) * kind_bytes(e.kind);
      Y* at[kTile];
      for (int i = 0; i < tile.count; ++i) at[i] = ys[i] + lo;
      switch (e.kind) {
        case kBF16: expand<Y, kBF16>(at, tile.count, mid + r, ld, b, ranks, width, hi - lo); break;
        case kF16: expand<Y, kF16>(at, tile.count, mid + r, ld, b, ranks, width, hi - lo); break;
        default: expand<Y, kF32>(at, tile.count, mid + r, ld, b, ranks, width, hi - lo);
      }
    }
    r += ranks;
  }
}

// A call's tiles and buffers, kept between the calls of one calling thread: a decode step
// makes one call per adapted linear, and allocating them anew each time costs about what a
// single row's shrink does.
struct Scratch {
  std::vector<int64_t> rows;      // rows with an adapter, by adapter, then row
  std::vector<Entry> entries;     // one per adapter that touches the linear (tiles point in)
  std::vector<Tile> tiles;
  std::vector<float> mid;
};

// The step's tiles: each adapter's rows (in row order) cut into tiles of kTile.
void make_tiles(Scratch& s, const int64_t* adapter_of_row, int64_t tokens,
                const int64_t* table, int64_t slot, int64_t num_slots) {
  s.rows.clear(), s.entries.clear(), s.tiles.clear();
  for (int64_t t = 0; t < tokens; ++t)
    if (adapter_of_row[t] >= 0) s.rows.push_back(t);
  std::stable_sort(s.rows.begin(), s.rows.end(),
                   [&](int64_t a, int64_t b) { return adapter_of_row[a] < adapter_of_row[b]; });
  s.entries.reserve(s.rows.size());           // no reallocation: tiles point into it
  for (size_t i = 0, end; i < s.rows.size(); i = end) {
    const int64_t a = adapter_of_row[s.rows[i]];
    for (end = i; end < s.rows.size() && adapter_of_row[s.rows[end]] == a;) ++end;
    const int64_t* w = table + (a * num_slots + slot) * kEntry;
    if (!w[0]) continue;                      // this adapter leaves the linear alone
    s.entries.emplace_back(w);
    for (size_t j = i; j < end; j += kTile) {
      Tile tile{&s.entries.back(), {}, 0};
      for (size_t r = j; r < std::min(end, j + kTile); ++r) tile.rows[tile.count++] = s.rows[r];
      s.tiles.push_back(tile);
    }
  }
}

// table: [adapters][num_slots][kEntry] int64 (Entry), A null where the adapter leaves that
// linear alone. Two passes, their work items dealt to the threads in turn: mid = scale * x A^T
// per (tile, run of rank rows), then y += mid Bt per (tile, chunk of columns). `base`, when
// given, writes the linear's own product into y (its `groups` of 16 columns, a share a call)
// in the same parallel region, between the passes: y holds it before any delta is added.
template <typename T>
void lora_delta(T* y, int64_t y_stride, const T* x, int64_t x_stride, int64_t tokens,
                int64_t n, int64_t k, const int64_t* adapter_of_row, const int64_t* table,
                int64_t slot, int64_t num_slots, const pw::BaseProduct* base) {
  static thread_local Scratch scratch;
  make_tiles(scratch, adapter_of_row, tokens, table, slot, num_slots);
  const std::vector<Tile>& tiles = scratch.tiles;
  int64_t rank = 0, rows = 0;
  for (const Entry& e : scratch.entries) rank = std::max(rank, e.rank);
  for (const Tile& tile : tiles) rows += tile.count;
  if (tiles.empty() || rank == 0) {
    if (base) base->run(0, base->groups);        // on its own threads
    return;
  }
  const int64_t count = static_cast<int64_t>(tiles.size());
  std::vector<float>& mid = scratch.mid;       // every value read is written first
  if (mid.size() < static_cast<size_t>(count * kTile * rank)) mid.resize(count * kTile * rank);
  const int64_t runs = (rank + kRun - 1) / kRun, chunks = (n + kChunk - 1) / kChunk;
  auto shrink_item = [&](int64_t i) {
    const Tile& tile = tiles[i / runs];
    const int64_t r0 = (i % runs) * kRun;
    if (r0 >= tile.entry->rank) return;
    const T* xs[kTile];
    for (int m = 0; m < tile.count; ++m) xs[m] = x + tile.rows[m] * x_stride;
    shrink_any(mid.data() + (i / runs) * kTile * rank, rank, xs, tile, r0, k);
  };
  auto expand_item = [&](int64_t i) {
    const Tile& tile = tiles[i / chunks];
    const int64_t j0 = (i % chunks) * kChunk;
    T* ys[kTile];
    for (int m = 0; m < tile.count; ++m) ys[m] = y + tile.rows[m] * y_stride;
    add_spans(ys, mid.data() + (i / chunks) * kTile * rank, rank, tile, j0,
              std::min(kChunk, n - j0));
  };
  // One parallel region, the passes apart by a barrier: a single stream's row is bound by
  // reading the weights (the adapter's, and the base linear's beside them), two threads read
  // them faster than one, and each region's fork and join costs about what a small linear's
  // products do. Tiny work alone stays on the calling thread. Inside the region the base's
  // own at::parallel_for runs inline (ATen does not nest), on this thread's share.
  const int threads =
      !base && rows * rank * (n + k) < kSerialMacs ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const int64_t id = omp_get_thread_num(), step = omp_get_num_threads();
    for (int64_t i = id; i < count * runs; i += step) shrink_item(i);
    if (base) {
      const int64_t g0 = base->groups * id / step, g1 = base->groups * (id + 1) / step;
      if (g0 < g1) base->run(g0, g1);
    }
#pragma omp barrier
    for (int64_t i = id; i < count * chunks; i += step) expand_item(i);
  }
}

}  // namespace

namespace pw {

template <typename T>
void linear_with_lora(T* y, int64_t n, const T* x, int64_t k, int64_t tokens,
                      const int64_t* adapter_of_row, const int64_t* table, int64_t slot,
                      int64_t num_slots, const BaseProduct& base) {
  lora_delta(y, n, x, k, tokens, n, k, adapter_of_row, table, slot, num_slots, &base);
}
template void linear_with_lora<float>(float*, int64_t, const float*, int64_t, int64_t,
                                      const int64_t*, const int64_t*, int64_t, int64_t,
                                      const BaseProduct&);
template void linear_with_lora<bf16>(bf16*, int64_t, const bf16*, int64_t, int64_t,
                                     const int64_t*, const int64_t*, int64_t, int64_t,
                                     const BaseProduct&);

}  // namespace pw

extern "C" {   // the entry points' contracts: pagewire_api.h

void pw_lora_delta_f32(float* y, int64_t y_stride, const float* x, int64_t x_stride,
                       int64_t tokens, int64_t n, int64_t k, const int64_t* adapter_of_row,
                       const int64_t* table, int64_t slot, int64_t num_slots) {
  lora_delta(y, y_stride, x, x_stride, tokens, n, k, adapter_of_row, table, slot, num_slots,
             nullptr);
}
void pw_lora_delta_bf16(bf16* y, int64_t y_stride, const bf16* x, int64_t x_stride,
                        int64_t tokens, int64_t n, int64_t k, const int64_t* adapter_of_row,
                        const int64_t* table, int64_t slot, int64_t num_slots) {
  lora_delta(y, y_stride, x, x_stride, tokens, n, k, adapter_of_row, table, slot, num_slots,
             nullptr);
}

}  // extern "C"
