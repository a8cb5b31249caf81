// Every decoder layer of a small decode step in one call, by interpreting the layer's declared
// program (actors/executor/models/program.py): the Python side encodes each op as its opcode
// followed by its operands (pointers, sizes and float bits, int64 each), and the loop below
// dispatches each opcode to the kernel the per-op path calls for it (kernels/ops.py CpuOps),
// in the same order, so the results are bit-identical; only the Python/ctypes round trips of
// a step are gone. There is no second copy of the decoder here: an op this file does not
// implement makes the Python side keep the per-op path (pw_decode_stack_arity says -1).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "lora.h"
#include "pagewire_api.h"
#include "quant_tiles.h"

using bf16 = uint16_t;

namespace {

// The operands each opcode (pagewire_api.h PwOp, which lists them) takes here.
int64_t arity(int64_t op) {
  switch (op) {
    case PW_OP_ADD_NORM: case PW_OP_NORM: return 2;
    case PW_OP_ADD_LAYER_NORM: case PW_OP_BRANCH_LAYER_NORM: return 3;
    case PW_OP_JOIN: case PW_OP_GELU: case PW_OP_GELU_TANH: return 0;
    case PW_OP_LINEAR: return 5;
    case PW_OP_ROPE: return 4;
    case PW_OP_ATTEND: return 12;
    case PW_OP_SILU_MUL: return 0;
    case PW_OP_MOE: return 1;
    case PW_OP_QK_NORM_FLAT: return 5;
    case PW_OP_QK_NORM: return 6;
    default: return -1;   // GELU_MUL, ALL_REDUCE: the per-op path runs those layers
  }
}

// The kernels for one activation type, by name suffix (f32, bf16).
template <typename T> struct Kernels;
#define PW_KERNELS(type, sfx)                                                                \
  template <> struct Kernels<type> {                                                         \
    static constexpr auto norm = pw_add_rms_norm_##sfx;                                      \
    static constexpr auto layer_norm = pw_add_layer_norm_##sfx;                              \
    static constexpr auto gelu = pw_gelu_##sfx;                                              \
    static constexpr auto rope = pw_rope_partial_##sfx;                                      \
    static constexpr auto silu = pw_silu_and_mul_##sfx;                                      \
    static constexpr auto attend = pw_decode_attention_##sfx;                                \
    static constexpr auto attend_q8 = pw_decode_attention_q8_##sfx;                          \
    static constexpr auto write_q8 = pw_write_kv_q8_##sfx;                                   \
    static constexpr auto moe = pw_moe_##sfx;                                                \
    static constexpr auto sinks = pw_apply_sinks_##sfx;                                      \
  };
PW_KERNELS(float, f32)
PW_KERNELS(bf16, bf16)

// A float operand: Python writes a double's bits; ctypes would round it to float the same way.
float real(int64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return static_cast<float>(d);
}

template <typename T> const T* ptr(int64_t word) { return reinterpret_cast<const T*>(word); }

// The step's inputs (one decode token per sequence) and what flows between ops: the current
// value [tokens, width] and the residual stream, as program.State holds them in Python.
template <typename T>
struct Machine {
  const int64_t *positions, *slots, *tables, *lens;
  int64_t tokens, table_stride, hidden;
  T* residual;
  const int64_t *lora_rows, *lora_table;   // the step's adapters (lora.cpp); null: none
  int64_t lora_slots;
  bool residual_started = false;   // the first ADD_NORM starts it as x itself
  T* cur;
  int64_t width;
  std::vector<T> a, b;             // ops write into whichever the current value is not in
  std::vector<T> ordered;          // a linear's input in its weight's column order
  std::vector<T> queries;          // head rows: q of every token, contiguous
  std::vector<float> lse;          // ATTEND with sinks: each row's log-sum-exp
  std::vector<T> branch;           // parallel residual: the attention's output set aside
  int64_t layer = 0;               // attends so far (head rows: the layer's slots and tables)

  T* next() { return cur == a.data() ? b.data() : a.data(); }

  // RMSNorm (o: weight, eps) or LayerNorm (o: weight, bias, eps) of cur, `add`: after the
  // residual stream takes cur (the first layer's: cur itself)
  void add_norm(const int64_t* o, bool add, bool layer_norm = false) {
    T* out = next();
    T* res = nullptr;
    if (add && residual_started) {
      res = residual;
    } else if (add) {
      std::memcpy(residual, cur, tokens * hidden * sizeof(T));
      residual_started = true;
    }
    if (layer_norm)
      Kernels<T>::layer_norm(out, res, cur, ptr<T>(o[0]), ptr<T>(o[1]), tokens, hidden, width,
                             real(o[2]));
    else
      Kernels<T>::norm(out, res, cur, ptr<T>(o[0]), tokens, hidden, width, real(o[1]));
    cur = out;
  }

  // parallel residual: cur (the attention's output) set aside, cur = layer_norm(residual)
  void branch_layer_norm(const int64_t* o) {
    branch.assign(cur, cur + tokens * hidden);
    T* out = next();
    Kernels<T>::layer_norm(out, nullptr, residual, ptr<T>(o[0]), ptr<T>(o[1]), tokens, hidden,
                           hidden, real(o[2]));
    cur = out, width = hidden;
  }

  // cur += the branch set aside, each sum rounded once (torch's x + branch)
  void join() {
    for (int64_t i = 0; i < tokens * hidden; ++i)
      pw::from_float(pw::to_float(cur[i]) + pw::to_float(branch[i]), &cur[i]);
  }

  void gelu(bool tanh_form) {
    T* out = next();
    Kernels<T>::gelu(out, cur, tokens * width, tanh_form);
    cur = out;
  }

  void linear(const int64_t* o) {
    T* out = next();
    const int64_t* table = ptr<int64_t>(o[0]);   // kernels/quant.py QuantWeight.table
    const int64_t n = o[1], k = o[2];
    const T* x = table[1] ? in_order(ptr<int64_t>(table[1]), k) : cur;
    const T* bias = ptr<T>(o[3]);
    // out's columns [16 g0, 16 g1): each segment (tiles, kind, rows) where it meets them,
    // as quant.matmul multiplies the whole; its kind is one of kernels/quant.py KINDS
    // (fused_decode.py encodes no other). Then the bias, as Linear.forward's out.add_(bias).
    auto product = [&](int64_t g0, int64_t g1) {
      for (int64_t s = 0, col = 0; s < table[0]; col += table[2 + 3 * s + 2], ++s) {
        const int64_t* seg = table + 2 + 3 * s;
        const int64_t lo = std::max(16 * g0, col), hi = std::min(16 * g1, col + seg[2]);
        if (lo >= hi) continue;
        const uint8_t* tiles = ptr<uint8_t>(seg[0]) + (lo - col) / 16 *
                               pw::quant_group_bytes(seg[1], k);
        pw::quant_matmul<T>(seg[1])(out + lo, n, x, k, tokens, tiles, hi - lo, k);
      }
      if (bias) add_bias(out, bias, n, 16 * g0, std::min(16 * g1, n));
    };
    if (lora_table && o[4] >= 0)   // the adapters' deltas beside it (of cur: column order)
      pw::linear_with_lora<T>(out, n, cur, k, tokens, lora_rows, lora_table, o[4], lora_slots,
                              pw::BaseProduct::of(product, n / 16));
    else
      product(0, n / 16);
    cur = out, width = n;
  }

  // cur's k columns taken in `order` (a GPTQ act-order weight's), as quant.matmul does.
  const T* in_order(const int64_t* order, int64_t k) {
    ordered.resize(tokens * k);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t j = 0; j < k; ++j) ordered[t * k + j] = cur[t * k + order[j]];
    return ordered.data();
  }

  // As Linear.forward's out.add_(bias), columns [j0, j1): each sum in float32, rounded once.
  void add_bias(T* out, const T* bias, int64_t n, int64_t j0, int64_t j1) {
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t j = j0; j < j1; ++j)
        pw::from_float(pw::to_float(out[t * n + j]) + pw::to_float(bias[j]), &out[t * n + j]);
  }

  void rope(const int64_t* o) {
    if (o[3] > 0)
      Kernels<T>::rope(cur, width, ptr<float>(o[0]), positions, tokens, o[1], o[2], o[3]);
  }

  // cur: qkv [tokens, (Hq + 2 Hkv) D]; k and v go to the cache, then q attends.
  void attend(const int64_t* o) {
    const int64_t hq = o[2], hkv = o[3], d = o[4], q_width = hq * d, kind = o[9];
    if (o[10]) return attend_head_rows(o);
    T* out = next();
    if (o[11]) lse.resize(tokens * hq);       // sinks: the rows' log-sum-exp, then their share
    float* sums = o[11] ? lse.data() : nullptr;
    if (kind != PW_KV_CACHE_PLAIN) {          // quantized as written (kv_cache.cpp)
      auto* kc = reinterpret_cast<uint8_t*>(o[0]);
      auto* vc = reinterpret_cast<uint8_t*>(o[1]);
      Kernels<T>::write_q8(kc, vc, cur + q_width, cur + q_width + hkv * d, slots, tokens, hkv, d,
                           width, width, kind);
      Kernels<T>::attend_q8(out, cur, kc, vc, tables, lens, tokens, hq, hkv, d, o[5],
                            table_stride, width, q_width, real(o[7]), o[6], real(o[8]), kind,
                            sums);
    } else {
      const int64_t kv_row = hkv * d * sizeof(T), qkv_row = width * sizeof(T);
      char* k = reinterpret_cast<char*>(cur + q_width);
      pw_write_kv(reinterpret_cast<char*>(o[0]), reinterpret_cast<char*>(o[1]), k, k + kv_row,
                  slots, tokens, kv_row, qkv_row, qkv_row);
      Kernels<T>::attend(out, cur, ptr<T>(o[0]), ptr<T>(o[1]), tables, lens, tokens, hq, hkv, d,
                         o[5], table_stride, width, q_width, real(o[7]), o[6], real(o[8]),
                         sums);
    }
    if (sums) Kernels<T>::sinks(out, sums, ptr<float>(o[11]), tokens, hq, d);   // gpt-oss
    cur = out, width = q_width;
  }

  // KV-Compress (kernels/kv_compress.py): token t's KV head h is row t Hkv + h of this layer's
  // slots [rows], tables [rows, table_stride] and lens [rows] (each input [layers, ...]), a
  // sequence of one KV head attended by its G = Hq / Hkv query heads.
  void attend_head_rows(const int64_t* o) {
    const int64_t hq = o[2], hkv = o[3], d = o[4], q_width = hq * d, kind = o[9];
    const int64_t rows = tokens * hkv, g = hq / hkv;
    const int64_t* row_slots = slots + layer * rows;
    const int64_t* row_tables = tables + layer * rows * table_stride;
    const int64_t* row_lens = lens + layer * rows;
    T* out = next();
    queries.resize(tokens * q_width);
    for (int64_t t = 0; t < tokens; ++t) {
      const T* k = cur + t * width + q_width;
      std::memcpy(&queries[t * q_width], cur + t * width, q_width * sizeof(T));
      if (kind != PW_KV_CACHE_PLAIN) {
        Kernels<T>::write_q8(reinterpret_cast<uint8_t*>(o[0]), reinterpret_cast<uint8_t*>(o[1]),
                             k, k + hkv * d, row_slots + t * hkv, hkv, 1, d, d, d, kind);
      } else {
        const int64_t row = d * sizeof(T);
        pw_write_kv(reinterpret_cast<char*>(o[0]), reinterpret_cast<char*>(o[1]),
                    reinterpret_cast<const char*>(k), reinterpret_cast<const char*>(k + hkv * d),
                    row_slots + t * hkv, hkv, row, row, row);
      }
    }
    if (kind != PW_KV_CACHE_PLAIN) {
      Kernels<T>::attend_q8(out, queries.data(), reinterpret_cast<uint8_t*>(o[0]),
                            reinterpret_cast<uint8_t*>(o[1]), row_tables, row_lens, rows, g, 1,
                            d, o[5], table_stride, g * d, g * d, real(o[7]), o[6], real(o[8]),
                            kind, nullptr);
    } else {
      Kernels<T>::attend(out, queries.data(), ptr<T>(o[0]), ptr<T>(o[1]), row_tables, row_lens,
                         rows, g, 1, d, o[5], table_stride, g * d, g * d, real(o[7]), o[6],
                         real(o[8]), nullptr);
    }
    cur = out, width = q_width, ++layer;
  }

  void silu_mul() {
    T* out = next();
    Kernels<T>::silu(out, cur, tokens, width / 2);
    cur = out, width /= 2;
  }

  // cur: qkv; each of its query heads normed, then each key head, a token's heads as rows
  // (CpuOps.rms_norm_heads_)
  void qk_norm(const int64_t* o) {
    const int64_t hq = o[2], hkv = o[3], d = o[4];
    T* out = next();
    for (int part = 0; part < 2; ++part) {
      const int64_t heads = part ? hkv : hq, start = part ? hq * d : 0;
      for (int64_t t = 0; t < tokens; ++t) {
        T* row = cur + t * width + start;
        Kernels<T>::norm(out, nullptr, row, ptr<T>(o[part]), heads, d, d, real(o[5]));
        std::memcpy(row, out, heads * d * sizeof(T));
      }
    }
  }

  // cur: qkv; its q columns normed as one vector, then its k columns (CpuOps.rms_norm_flat_qk_)
  void qk_norm_flat(const int64_t* o) {
    T* out = next();
    for (int part = 0; part < 2; ++part) {
      const int64_t start = part ? o[2] : 0, size = o[2 + part];
      Kernels<T>::norm(out, nullptr, cur + start, ptr<T>(o[part]), tokens, size, width,
                       real(o[4]));
      for (int64_t t = 0; t < tokens; ++t)
        std::memcpy(cur + t * width + start, out + t * size, size * sizeof(T));
    }
  }

  // cur: [tokens, hidden] -> the mixture-of-experts block's output (moe.cpp); o[0]: its spec
  void moe(const int64_t* o) {
    T* out = next();
    Kernels<T>::moe(out, cur, tokens, ptr<int64_t>(o[0]), lora_rows, lora_table, lora_slots);
    cur = out;
  }

  void step(int64_t op, const int64_t* o) {
    switch (op) {
      case PW_OP_ADD_NORM: add_norm(o, true); break;
      case PW_OP_NORM: add_norm(o, false); break;
      case PW_OP_ADD_LAYER_NORM: add_norm(o, true, true); break;
      case PW_OP_BRANCH_LAYER_NORM: branch_layer_norm(o); break;
      case PW_OP_JOIN: join(); break;
      case PW_OP_GELU: gelu(false); break;
      case PW_OP_GELU_TANH: gelu(true); break;
      case PW_OP_LINEAR: linear(o); break;
      case PW_OP_ROPE: rope(o); break;
      case PW_OP_ATTEND: attend(o); break;
      case PW_OP_SILU_MUL: silu_mul(); break;
      case PW_OP_MOE: moe(o); break;
      case PW_OP_QK_NORM_FLAT: qk_norm_flat(o); break;
      case PW_OP_QK_NORM: qk_norm(o); break;
    }
  }
};

template <typename T>
void decode_stack(T* x, T* residual, const int64_t* program, int64_t length, int64_t hidden,
                  int64_t scratch, const int64_t* positions, const int64_t* slots,
                  const int64_t* tables, const int64_t* lens, int64_t tokens,
                  int64_t table_stride, const int64_t* lora_rows, const int64_t* lora_table,
                  int64_t lora_slots) {
  Machine<T> m{positions, slots, tables, lens, tokens, table_stride, hidden, residual,
               lora_rows, lora_table, lora_slots};
  m.cur = x, m.width = hidden;
  m.a.resize(tokens * scratch), m.b.resize(tokens * scratch);
  // The Python side encodes only ops with an arity here; an unknown one still must not loop.
  for (int64_t i = 0; i < length && arity(program[i]) >= 0; i += 1 + arity(program[i]))
    m.step(program[i], program + i + 1);
  if (m.cur != x) std::memcpy(x, m.cur, tokens * hidden * sizeof(T));
}

}  // namespace

extern "C" {

// pagewire_api.h documents both entry points.
#define PW_DECODE_STACK(name, type)                                                          \
  void name(type* x, type* residual, const int64_t* program, int64_t length, int64_t hidden, \
            int64_t scratch, const int64_t* positions, const int64_t* slots,                 \
            const int64_t* tables, const int64_t* lens, int64_t tokens,                      \
            int64_t table_stride, const int64_t* lora_rows, const int64_t* lora_table,       \
            int64_t lora_slots) {                                                            \
    decode_stack(x, residual, program, length, hidden, scratch, positions, slots, tables,   \
                 lens, tokens, table_stride, lora_rows, lora_table, lora_slots);             \
  }
PW_DECODE_STACK(pw_decode_stack_f32, float)
PW_DECODE_STACK(pw_decode_stack_bf16, bf16)

int64_t pw_decode_stack_arity(int64_t op) { return arity(op); }

}  // extern "C"
