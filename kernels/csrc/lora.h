// The LoRA kernel's entry for the fused decode stack (decode_stack.cpp): a linear's own
// product and its rows' adapter deltas in one parallel region (lora.cpp).
#pragma once
#include <cstdint>

namespace pw {

// A linear's own product by groups of 16 output columns: run(g0, g1) writes columns
// [16 g0, 16 g1) of every row of y (bias included), for any split of [0, groups). It refers
// to the caller's callable (no copy, no allocation: one per adapted linear a step).
struct BaseProduct {
  void (*call)(const void*, int64_t, int64_t);
  const void* callable;
  int64_t groups;

  void run(int64_t g0, int64_t g1) const { call(callable, g0, g1); }
  template <typename F>
  static BaseProduct of(const F& f, int64_t groups) {
    return {[](const void* c, int64_t g0, int64_t g1) { (*static_cast<const F*>(c))(g0, g1); },
            &f, groups};
  }
};

// y [tokens, n] = base's product, then += each row's adapter delta of x [tokens, k] for
// linear `slot` (lora.cpp's table; rows of adapter -1 keep the product alone). Both in one
// parallel region: the delta's first pass (x A^T) and this thread's share of the base
// product, a barrier, the second pass (+ mid Bt). The same values as the base product
// followed by pw_lora_delta: each column's product is computed by the same kernel.
template <typename T>
void linear_with_lora(T* y, int64_t n, const T* x, int64_t k, int64_t tokens,
                      const int64_t* adapter_of_row, const int64_t* table, int64_t slot,
                      int64_t num_slots, const BaseProduct& base);

}  // namespace pw
