// Writing keys and values into the paged KV cache, plain or quantized (kv_quant.h), and decode
// attention over a quantized cache (paged_decode.h with its Cache).
//
// Cache layout (per layer, keys and values separately): [num_blocks, block_size, Hkv, D], or
// [..., Hkv, D + 4] one-byte codes and a float32 scale per head.
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "kv_quant.h"
#include "paged_decode.h"
#include "pagewire_api.h"

namespace {

using pw::bf16;
namespace kvq = pw::kvq;

// Each token's Hkv heads of D values (rows `stride` elements apart) -> codes and scales at
// cache slot slots[t].
template <typename T>
void write_quantized(uint8_t* cache, const T* x, const int64_t* slots, int64_t tokens,
                     int64_t Hkv, int64_t D, int64_t stride, kvq::Kind kind) {
  const int64_t head = D + kvq::kScaleBytes;
  at::parallel_for(0, tokens * Hkv, 64, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / Hkv, h = i % Hkv;
      const T* src = x + t * stride + h * D;
      for (int64_t d = 0; d < D; ++d) row[d] = pw::to_float(src[d]);
      kvq::encode_row(row.data(), D, kind, cache + (slots[t] * Hkv + h) * head);
    }
  });
}

template <typename T>
void decode_quantized(T* out, const T* q, const uint8_t* k_cache, const uint8_t* v_cache,
                      const int64_t* block_tables, const int64_t* context_lens, int64_t B,
                      int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t table_stride,
                      int64_t q_stride, int64_t out_stride, float scale, int64_t window,
                      float softcap, int64_t kind, float* lse) {
  using pw::paged::decode_attention;
  if constexpr (std::is_same_v<T, bf16>)
    if (pw_decode_attention_tiled_q8(out, q, k_cache, v_cache, block_tables, context_lens, B, Hq,
                                     Hkv, D, bs, table_stride, q_stride, out_stride, scale,
                                     window, softcap, kind, lse))
      return;
  auto fn = kind == kvq::kInt8   ? decode_attention<T, kvq::Cache<kvq::kInt8>>
            : kind == kvq::kE4M3 ? decode_attention<T, kvq::Cache<kvq::kE4M3>>
                                 : decode_attention<T, kvq::Cache<kvq::kE5M2>>;
  fn(out, q, k_cache, v_cache, block_tables, context_lens, B, Hq, Hkv, D, bs, table_stride,
     q_stride, out_stride, scale, window, softcap, lse);
}

}  // namespace

extern "C" {   // the entry points' contracts: pagewire_api.h

// Slots are distinct, so tokens are independent.
void pw_write_kv(char* k_cache, char* v_cache, const char* k, const char* v,
                 const int64_t* slots, int64_t T, int64_t row_bytes, int64_t k_stride,
                 int64_t v_stride) {
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(k_cache + slots[t] * row_bytes, k + t * k_stride, row_bytes);
    std::memcpy(v_cache + slots[t] * row_bytes, v + t * v_stride, row_bytes);
  }
}

#define PW_WRITE_KV_Q8(T, sfx)                                                                \
  void pw_write_kv_q8_##sfx(uint8_t* k_cache, uint8_t* v_cache, const T* k, const T* v,        \
                            const int64_t* slots, int64_t tokens, int64_t Hkv, int64_t D,     \
                            int64_t k_stride, int64_t v_stride, int64_t kind) {               \
    write_quantized(k_cache, k, slots, tokens, Hkv, D, k_stride, kvq::Kind(kind));            \
    write_quantized(v_cache, v, slots, tokens, Hkv, D, v_stride, kvq::Kind(kind));            \
  }
PW_WRITE_KV_Q8(float, f32)
PW_WRITE_KV_Q8(bf16, bf16)

#define PW_DECODE_Q8(T, sfx)                                                                  \
  void pw_decode_attention_q8_##sfx(T* out, const T* q, const uint8_t* k_cache,               \
                                    const uint8_t* v_cache, const int64_t* block_tables,      \
                                    const int64_t* context_lens, int64_t B, int64_t Hq,       \
                                    int64_t Hkv, int64_t D, int64_t bs, int64_t table_stride, \
                                    int64_t q_stride, int64_t out_stride, float scale,        \
                                    int64_t window, float softcap, int64_t kind, float* lse) {\
    decode_quantized(out, q, k_cache, v_cache, block_tables, context_lens, B, Hq, Hkv, D, bs,  \
                     table_stride, q_stride, out_stride, scale, window, softcap, kind, lse);  \
  }
PW_DECODE_Q8(float, f32)
PW_DECODE_Q8(bf16, bf16)

}  // extern "C"
