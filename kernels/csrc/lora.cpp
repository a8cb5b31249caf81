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

// table: [adapters][num_slots][3] int64: (A, Bt, R) of each adapter for each linear slot; A
// null where the adapter leaves that linear alone.
template <typename T>
void lora_delta(T* y, int64_t y_stride, const T* x, int64_t x_stride, int64_t tokens,
                int64_t n, int64_t k, const int64_t* adapter_of_row, const int64_t* table,
                int64_t slot, int64_t num_slots) {
  at::parallel_for(0, tokens, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> xf(k), acc(n), mid;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t a = adapter_of_row[t];
      if (a < 0) continue;
      const int64_t* w = table + (a * num_slots + slot) * 3;
      if (!w[0]) continue;
      const auto* A = reinterpret_cast<const float*>(w[0]);
      const auto* Bt = reinterpret_cast<const float*>(w[1]);
      const int64_t r = w[2];
      for (int64_t j = 0; j < k; ++j) xf[j] = pw::to_float(x[t * x_stride + j]);
      mid.assign(r, 0.f);
      for (int64_t i = 0; i < r; ++i) {
        float s = 0.f;
        for (int64_t j = 0; j < k; ++j) s += A[i * k + j] * xf[j];
        mid[i] = s;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < r; ++i) {
        const float m = mid[i];
        const float* b = Bt + i * n;
        for (int64_t j = 0; j < n; ++j) acc[j] += m * b[j];
      }
      T* out = y + t * y_stride;
      for (int64_t j = 0; j < n; ++j) pw::from_float(pw::to_float(out[j]) + acc[j], &out[j]);
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
