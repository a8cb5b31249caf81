// LoRA deltas of one linear for a step's rows, each row with its own adapter (or none):
// y[t] += scale * Bt_a^T (A_a x[t]) for a = adapter_of_row[t] >= 0. The per-op path
// (kernels/ops.py CpuOps.lora_delta) and the fused decode interpreter (decode_stack.cpp) both
// call it.
//
// A decode step reads every adapter weight once per row, so the weights are kept as the
// adapter file stores them (float32, bfloat16 or float16: never rounded) and Bt holds only
// its nonzero spans: a fused linear's B^T is block-diagonal (projection j's rank rows reach
// only its own output columns), so rank row r of Bt is `width` values from column `col`, at
// `offset` in one packed array. Products accumulate in float32.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

using bf16 = uint16_t;

namespace {

constexpr int64_t kSerialMacs = 1 << 18;
constexpr int64_t kEntry = 6;     // int64 per (adapter, slot) in the table; see Entry
enum Kind : int64_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

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

// Eight consecutive values as float32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_bf16(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float f16_to_float(uint16_t h) { return _cvtsh_ss(h); }

// The weights of Kind K: their vector and scalar loads.
template <Kind K> struct W;
template <> struct W<kF32> {
  using T = float;
  static __m256 load(const T* p) { return load8(p); }
  static float at(const T* p) { return *p; }
};
template <> struct W<kBF16> {
  using T = uint16_t;
  static __m256 load(const T* p) { return load8_bf16(p); }
  static float at(const T* p) { return pw::to_float(*p); }
};
template <> struct W<kF16> {
  using T = uint16_t;
  static __m256 load(const T* p) { return load8_f16(p); }
  static float at(const T* p) { return f16_to_float(*p); }
};

// out[i] = sum_j a[i][j] * x[j] for `rows` consecutive rows of a (row stride k), x float32.
// Four rows at a time share each load of x and give four independent FMA chains.
template <Kind K>
void dots(float* out, const void* a_rows, int64_t rows, const float* x, int64_t k) {
  const auto* a = static_cast<const typename W<K>::T*>(a_rows);
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) {
    const auto *a0 = a + i * k, *a1 = a0 + k, *a2 = a1 + k, *a3 = a2 + k;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) {
      const __m256 xv = _mm256_loadu_ps(x + j);
      s0 = _mm256_fmadd_ps(W<K>::load(a0 + j), xv, s0);
      s1 = _mm256_fmadd_ps(W<K>::load(a1 + j), xv, s1);
      s2 = _mm256_fmadd_ps(W<K>::load(a2 + j), xv, s2);
      s3 = _mm256_fmadd_ps(W<K>::load(a3 + j), xv, s3);
    }
    float r0 = hsum(s0), r1 = hsum(s1), r2 = hsum(s2), r3 = hsum(s3);
    for (; j < k; ++j) {
      r0 += W<K>::at(a0 + j) * x[j];
      r1 += W<K>::at(a1 + j) * x[j];
      r2 += W<K>::at(a2 + j) * x[j];
      r3 += W<K>::at(a3 + j) * x[j];
    }
    out[i] = r0, out[i + 1] = r1, out[i + 2] = r2, out[i + 3] = r3;
  }
  for (; i < rows; ++i) {
    const auto* ai = a + i * k;
    __m256 s = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) s = _mm256_fmadd_ps(W<K>::load(ai + j), _mm256_loadu_ps(x + j), s);
    float r = hsum(s);
    for (; j < k; ++j) r += W<K>::at(ai + j) * x[j];
    out[i] = r;
  }
}

// acc[0, m) += sum_r v[r] * b[r][0, m) over `rows` rows of b (row stride ld): the
// accumulators stay in registers across the rows, 32 columns at a time.
template <Kind K>
void axpys(float* acc, const float* v, const void* b_rows, int64_t rows, int64_t ld,
           int64_t m) {
  const auto* b = static_cast<const typename W<K>::T*>(b_rows);
  int64_t j = 0;
  for (; j + 32 <= m; j += 32) {
    __m256 c0 = _mm256_loadu_ps(acc + j), c1 = _mm256_loadu_ps(acc + j + 8);
    __m256 c2 = _mm256_loadu_ps(acc + j + 16), c3 = _mm256_loadu_ps(acc + j + 24);
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 vv = _mm256_set1_ps(v[r]);
      const auto* br = b + r * ld + j;
      c0 = _mm256_fmadd_ps(vv, W<K>::load(br), c0);
      c1 = _mm256_fmadd_ps(vv, W<K>::load(br + 8), c1);
      c2 = _mm256_fmadd_ps(vv, W<K>::load(br + 16), c2);
      c3 = _mm256_fmadd_ps(vv, W<K>::load(br + 24), c3);
    }
    _mm256_storeu_ps(acc + j, c0), _mm256_storeu_ps(acc + j + 8, c1);
    _mm256_storeu_ps(acc + j + 16, c2), _mm256_storeu_ps(acc + j + 24, c3);
  }
  for (; j < m; ++j)
    for (int64_t r = 0; r < rows; ++r) acc[j] += v[r] * W<K>::at(b + r * ld + j);
}

size_t kind_bytes(Kind kind) { return kind == kF32 ? 4 : 2; }

void dots_any(float* out, const Entry& e, int64_t r0, int64_t rows, const float* x, int64_t k) {
  const char* a = static_cast<const char*>(e.a) + r0 * k * kind_bytes(e.kind);
  switch (e.kind) {
    case kBF16: return dots<kBF16>(out, a, rows, x, k);
    case kF16: return dots<kF16>(out, a, rows, x, k);
    default: return dots<kF32>(out, a, rows, x, k);
  }
}

// acc [j0, j0 + m) += mid[r] * (rank row r of Bt) over each run of rank rows that share one
// span (a projection's block: its rows lie `width` apart), where the span meets the columns.
void add_spans(float* acc, const float* mid, const Entry& e, int64_t j0, int64_t m) {
  const int64_t* sp = e.spans;
  for (int64_t r = 0; r < e.rank;) {
    const int64_t col = sp[r * 3], width = sp[r * 3 + 1], offset = sp[r * 3 + 2];
    int64_t rows = 1;
    while (r + rows < e.rank && sp[(r + rows) * 3] == col && sp[(r + rows) * 3 + 1] == width &&
           sp[(r + rows) * 3 + 2] == offset + rows * width)
      ++rows;
    const int64_t lo = std::max(col, j0), hi = std::min(col + width, j0 + m);
    if (lo < hi) {
      const char* b = static_cast<const char*>(e.bt) + (offset + lo - col) * kind_bytes(e.kind);
      float* dst = acc + lo - j0;
      switch (e.kind) {
        case kBF16: axpys<kBF16>(dst, mid + r, b, rows, width, hi - lo); break;
        case kF16: axpys<kF16>(dst, mid + r, b, rows, width, hi - lo); break;
        default: axpys<kF32>(dst, mid + r, b, rows, width, hi - lo);
      }
    }
    r += rows;
  }
}

// table: [adapters][num_slots][kEntry] int64 (Entry), A null where the adapter leaves that
// linear alone. Two passes, each split over the threads (a single stream's one row still
// uses every core): mid = scale * A x for every (row, rank), then y += mid Bt over chunks of
// columns.
template <typename T>
void lora_delta(T* y, int64_t y_stride, const T* x, int64_t x_stride, int64_t tokens,
                int64_t n, int64_t k, const int64_t* adapter_of_row, const int64_t* table,
                int64_t slot, int64_t num_slots) {
  std::vector<Entry> entries;
  std::vector<int64_t> entry_of_row(tokens, -1);    // index into entries, -1: base row
  int64_t rank = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t a = adapter_of_row[t];
    const int64_t* w = a < 0 ? nullptr : table + (a * num_slots + slot) * kEntry;
    if (!w || !w[0]) continue;
    entries.emplace_back(w);
    entry_of_row[t] = static_cast<int64_t>(entries.size()) - 1;
    rank = std::max(rank, w[3]);
  }
  if (rank == 0) return;
  // Small work runs on the calling thread: waking the pool costs more than a single stream's
  // products (parallel_for runs inline when the range is within the grain).
  const bool small = tokens * rank * (n + k) < kSerialMacs;
  std::vector<float> xf(tokens * k), mid(tokens * rank, 0.f);
  at::parallel_for(0, tokens, small ? tokens : 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      if (entry_of_row[t] >= 0)
        for (int64_t j = 0; j < k; ++j) xf[t * k + j] = pw::to_float(x[t * x_stride + j]);
  });
  // mid = scale * A x per row, in runs of four rank rows (a work item).
  const int64_t runs = (rank + 3) / 4;
  at::parallel_for(0, tokens * runs, small ? tokens * runs : 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / runs, r0 = (i % runs) * 4;
      if (entry_of_row[t] < 0) continue;
      const Entry& e = entries[entry_of_row[t]];
      const int64_t rows = std::min<int64_t>(4, e.rank - r0);
      if (rows <= 0) continue;
      float* out = mid.data() + t * rank + r0;
      dots_any(out, e, r0, rows, xf.data() + t * k, k);
      for (int64_t r = 0; r < rows; ++r) out[r] *= e.scale;
    }
  });
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  at::parallel_for(0, tokens * chunks, small ? tokens * chunks : 1, [&](int64_t i0, int64_t i1) {
    float acc[kChunk];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / chunks, j0 = (i % chunks) * kChunk, m = std::min(kChunk, n - j0);
      if (entry_of_row[t] < 0) continue;
      const Entry& e = entries[entry_of_row[t]];
      std::fill(acc, acc + m, 0.f);
      add_spans(acc, mid.data() + t * rank, e, j0, m);
      T* out = y + t * y_stride + j0;
      for (int64_t j = 0; j < m; ++j) pw::from_float(pw::to_float(out[j]) + acc[j], &out[j]);
    }
  });
}

}  // namespace

extern "C" {

void pw_lora_delta_f32(float* y, int64_t y_stride, const float* x, int64_t x_stride,
                       int64_t tokens, int64_t n, int64_t k, const int64_t* adapter_of_row,
                       const int64_t* table, int64_t slot, int64_t num_slots) {
  lora_delta(y, y_stride, x, x_stride, tokens, n, k, adapter_of_row, table, slot, num_slots);
}
void pw_lora_delta_bf16(bf16* y, int64_t y_stride, const bf16* x, int64_t x_stride,
                        int64_t tokens, int64_t n, int64_t k, const int64_t* adapter_of_row,
                        const int64_t* table, int64_t slot, int64_t num_slots) {
  lora_delta(y, y_stride, x, x_stride, tokens, n, k, adapter_of_row, table, slot, num_slots);
}

}  // extern "C"
