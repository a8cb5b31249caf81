// Every decoder layer of a small decode step in one call: the same kernels, in the same order,
// as the model's Python forward (actors/executor/models/llama.py) runs them one call at a
// time, so the results are bit-identical; only the ~300 Python/ctypes round trips of a step
// (a quarter of a single stream's step) are gone. For plain Llama-shaped layers whose linears
// all hold quantized weights (kernels/quant.py); the Python side decides when it applies.
#include <cstdint>
#include <cstring>
#include <vector>

using bf16 = uint16_t;

extern "C" {
void pw_add_rms_norm_f32(float*, float*, const float*, const float*, int64_t, int64_t, int64_t,
                         float);
void pw_add_rms_norm_bf16(bf16*, bf16*, const bf16*, const bf16*, int64_t, int64_t, int64_t,
                          float);
void pw_rope_f32(float*, int64_t, const float*, const int64_t*, int64_t, int64_t, int64_t);
void pw_rope_bf16(bf16*, int64_t, const float*, const int64_t*, int64_t, int64_t, int64_t);
void pw_silu_and_mul_f32(float*, const float*, int64_t, int64_t);
void pw_silu_and_mul_bf16(bf16*, const bf16*, int64_t, int64_t);
void pw_decode_attention_f32(float*, const float*, const float*, const float*, const int64_t*,
                             const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                             int64_t, int64_t, int64_t, float, int64_t, float);
void pw_decode_attention_bf16(bf16*, const bf16*, const bf16*, const bf16*, const int64_t*,
                              const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, float, int64_t, float);
void pw_write_kv(char*, char*, const char*, const char*, const int64_t*, int64_t, int64_t,
                 int64_t, int64_t);
void pw_q4_1_matmul_f32(float*, int64_t, const float*, int64_t, int64_t, const uint8_t*,
                        int64_t, int64_t);
void pw_q4_1_matmul_bf16(bf16*, int64_t, const bf16*, int64_t, int64_t, const uint8_t*,
                         int64_t, int64_t);
void pw_q8_0_matmul_f32(float*, int64_t, const float*, int64_t, int64_t, const uint8_t*,
                        int64_t, int64_t);
void pw_q8_0_matmul_bf16(bf16*, int64_t, const bf16*, int64_t, int64_t, const uint8_t*,
                         int64_t, int64_t);
}

namespace {

// One layer's parameters as the Python side lays them out (int64 each, pointers as integers).
enum Field {
  kInputNorm, kPostNorm, kQkv, kQkvType, kOProj, kOProjType, kGateUp, kGateUpType, kDown,
  kDownType, kKCache, kVCache, kWindow, kRopeTable, kFields
};

// The model's sizes: hidden, query heads, KV heads, head dim, intermediate, block size.
struct Shape { int64_t H, Hq, Hkv, D, I, bs; };

// The kernels for one activation type, by name suffix (f32, bf16).
template <typename T> struct Kernels;
#define PW_KERNELS(type, sfx)                                                                \
  template <> struct Kernels<type> {                                                         \
    static constexpr auto norm = pw_add_rms_norm_##sfx;                                      \
    static constexpr auto rope = pw_rope_##sfx;                                              \
    static constexpr auto silu = pw_silu_and_mul_##sfx;                                      \
    static constexpr auto attend = pw_decode_attention_##sfx;                                \
    static constexpr auto q4_1 = pw_q4_1_matmul_##sfx;                                       \
    static constexpr auto q8_0 = pw_q8_0_matmul_##sfx;                                       \
  };
PW_KERNELS(float, f32)
PW_KERNELS(bf16, bf16)

template <typename T>
const T* ptr(const int64_t* layer, Field f) { return reinterpret_cast<const T*>(layer[f]); }

// out [tokens, N] = x [tokens, K] @ W^T with the layer's quantized weight in field `f`.
template <typename T>
void matmul(T* out, const T* x, int64_t tokens, const int64_t* layer, Field f, int64_t N,
            int64_t K) {
  const auto* tiles = ptr<uint8_t>(layer, f);
  if (layer[f + 1] == 3)
    Kernels<T>::q4_1(out, N, x, K, tokens, tiles, N, K);
  else
    Kernels<T>::q8_0(out, N, x, K, tokens, tiles, N, K);
}

template <typename T>
void decode_stack(T* x, T* residual, const int64_t* layers, int64_t num_layers, Shape s,
                  const int64_t* positions, const int64_t* slots, const int64_t* tables,
                  const int64_t* lens, int64_t tokens, int64_t table_stride, float eps,
                  float scale) {
  using K = Kernels<T>;
  const int64_t qkv_width = (s.Hq + 2 * s.Hkv) * s.D, q_width = s.Hq * s.D;
  std::vector<T> normed(tokens * s.H), qkv(tokens * qkv_width), attn(tokens * q_width),
      gate_up(tokens * 2 * s.I), act(tokens * s.I);
  const int64_t kv_row = s.Hkv * s.D * sizeof(T), qkv_row = qkv_width * sizeof(T);
  for (int64_t i = 0; i < num_layers; ++i) {
    const int64_t* layer = layers + i * kFields;
    if (i == 0) {       // the residual stream starts as the embeddings themselves
      std::memcpy(residual, x, tokens * s.H * sizeof(T));
      K::norm(normed.data(), nullptr, x, ptr<T>(layer, kInputNorm), tokens, s.H, s.H, eps);
    } else {
      K::norm(normed.data(), residual, x, ptr<T>(layer, kInputNorm), tokens, s.H, s.H, eps);
    }
    matmul<T>(qkv.data(), normed.data(), tokens, layer, kQkv, qkv_width, s.H);
    K::rope(qkv.data(), qkv_width, ptr<float>(layer, kRopeTable), positions, tokens,
            s.Hq + s.Hkv, s.D);
    char* k = reinterpret_cast<char*>(qkv.data() + q_width);
    pw_write_kv(reinterpret_cast<char*>(layer[kKCache]), reinterpret_cast<char*>(layer[kVCache]),
                k, k + kv_row, slots, tokens, kv_row, qkv_row, qkv_row);
    K::attend(attn.data(), qkv.data(), ptr<T>(layer, kKCache), ptr<T>(layer, kVCache), tables,
              lens, tokens, s.Hq, s.Hkv, s.D, s.bs, table_stride, qkv_width, q_width, scale,
              layer[kWindow], 0.f);
    matmul<T>(x, attn.data(), tokens, layer, kOProj, s.H, q_width);
    K::norm(normed.data(), residual, x, ptr<T>(layer, kPostNorm), tokens, s.H, s.H, eps);
    matmul<T>(gate_up.data(), normed.data(), tokens, layer, kGateUp, 2 * s.I, s.H);
    K::silu(act.data(), gate_up.data(), tokens, s.I);
    matmul<T>(x, act.data(), tokens, layer, kDown, s.H, s.I);
  }
}

}  // namespace

extern "C" {

// x [T, H] (contiguous): the embeddings in, the last layer's MLP output out; residual [T, H]:
// the residual stream out (the final norm adds x to it). layers: num_layers x 14 int64 (Field).
// shape: H, Hq, Hkv, D, I, block size. One decode token per sequence: positions, slots,
// lens [T]; tables [T, table_stride].
#define PW_DECODE_STACK(name, type)                                                          \
  void name(type* x, type* residual, const int64_t* layers, int64_t num_layers,             \
            const int64_t* shape, const int64_t* positions, const int64_t* slots,            \
            const int64_t* tables, const int64_t* lens, int64_t tokens,                      \
            int64_t table_stride, float eps, float scale) {                                  \
    decode_stack(x, residual, layers, num_layers,                                            \
                 Shape{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5]},          \
                 positions, slots, tables, lens, tokens, table_stride, eps, scale);          \
  }
PW_DECODE_STACK(pw_decode_stack_f32, float)
PW_DECODE_STACK(pw_decode_stack_bf16, bf16)

int64_t pw_decode_stack_fields() { return kFields; }

}  // extern "C"
