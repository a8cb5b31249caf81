// LoRA deltas of one linear for a step's rows, each row with its own adapter (or none):
// y[t] += Bt_a^T (A_a x[t]) for a = adapter_of_row[t] >= 0. The per-op path (kernels/ops.py
// CpuOps.lora_delta) and the fused decode interpreter (decode_stack.cpp) both call it.
// An adapter's weights are float32 whatever the activations' type: A [R, K] and Bt [R, N]
// (B transposed, the scale folded in), so both products run along contiguous rows.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16.h"

using bf16 = uint16_t;

namespace {

constexpr int64_t kSerialMacs = 1 << 18;

// table: [adapters][num_slots][3] int64: (A, Bt, R) of each adapter for each linear slot; A
// null where the adapter leaves that linear alone. Two passes, each split over the threads
// (a single stream's one row still uses every core): mid = A x for every (row, rank), then
// y += mid Bt over chunks of columns.
template <typename T>
void lora_delta(T* y, int64_t y_stride, const T* x, int64_t x_stride, int64_t tokens,
                int64_t n, int64_t k, const int64_t* adapter_of_row, const int64_t* table,
                int64_t slot, int64_t num_slots) {
  auto weights = [&](int64_t t) -> const int64_t* {   // (A, Bt, R) of row t, or null
    const int64_t a = adapter_of_row[t];
    const int64_t* w = a < 0 ? nullptr : table + (a * num_slots + slot) * 3;
    return w && w[0] ? w : nullptr;
  };
  int64_t rank = 0;
  for (int64_t t = 0; t < tokens; ++t)
    if (const int64_t* w = weights(t)) rank = std::max(rank, w[2]);
  if (rank == 0) return;
  // Small work runs on the calling thread: waking the pool costs more than a single stream's
  // products (parallel_for runs inline when the range is within the grain).
  const bool small = tokens * rank * (n + k) < kSerialMacs;
  std::vector<float> mid(tokens * rank, 0.f);
  at::parallel_for(0, tokens * rank, small ? tokens * rank : 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / rank, r = i % rank;
      const int64_t* w = weights(t);
      if (!w || r >= w[2]) continue;
      const auto* a = reinterpret_cast<const float*>(w[0]) + r * k;
      const T* xt = x + t * x_stride;
      float s = 0.f;
      for (int64_t j = 0; j < k; ++j) s += a[j] * pw::to_float(xt[j]);
      mid[i] = s;
    }
  });
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  at::parallel_for(0, tokens * chunks, small ? tokens * chunks : 1, [&](int64_t i0, int64_t i1) {
    float acc[kChunk];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / chunks, j0 = (i % chunks) * kChunk, m = std::min(kChunk, n - j0);
      const int64_t* w = weights(t);
      if (!w) continue;
      std::fill(acc, acc + m, 0.f);
      for (int64_t r = 0; r < w[2]; ++r) {
        const float v = mid[t * rank + r];
        const float* b = reinterpret_cast<const float*>(w[1]) + r * n + j0;
        for (int64_t j = 0; j < m; ++j) acc[j] += v * b[j];
      }
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
