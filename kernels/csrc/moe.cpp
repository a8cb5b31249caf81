// A mixture-of-experts MLP over a step's tokens in one call (models/moe.py, kernels/moe.py):
// the router's float32 logits, their softmax, the top k (ties: the lower expert first), each
// chosen expert run once over the tokens that chose it (its gate/up and down weights as
// packed tiles, kernels/quant.py), their outputs weighted and summed in float32 in expert
// order, then the gated shared expert, rounded once. An expert no token chose is never read.
// gpt-oss's block: a bias on the router's logits, the top k of them then their softmax,
// biases on the experts' products (added in the activations' dtype, as the torch path's
// Linear adds them) and its clamped SwiGLU. LoRA adapters of the experts: each token's
// adapter's delta added to its experts' products (lora.cpp), as torch's grouping adds them.
//
// CpuOps.moe calls this for every step and the fused decode's MOE op (decode_stack.cpp) for
// decode steps, so both paths give the same bits. The block is described by int64 words
// (pagewire_api.h PwMoe, laid out by kernels/moe.py native_spec).
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "pagewire_api.h"
#include "quant_tiles.h"

using bf16 = uint16_t;

namespace {

template <typename T> const T* ptr(int64_t word) { return reinterpret_cast<const T*>(word); }

// Rows [r0, r1) of out [tokens, n] (rows out_stride apart) = x [tokens, k] @ W^T, for a
// weight's table (kernels/quant.py QuantWeight: count, column order (0 here), then tiles,
// kind, rows a segment): each segment where it meets them (r0, r1 multiples of 16).
template <typename T>
void table_rows(T* out, int64_t out_stride, const T* x, int64_t k, int64_t tokens,
                const int64_t* table, int64_t r0, int64_t r1) {
  for (int64_t s = 0, row = 0; s < table[0]; row += table[2 + 3 * s + 2], ++s) {
    const int64_t* seg = table + 2 + 3 * s;
    const int64_t lo = std::max(r0, row), hi = std::min(r1, row + seg[2]);
    if (lo >= hi) continue;
    const uint8_t* tiles = ptr<uint8_t>(seg[0]) + (lo - row) / 16 *
                           pw::quant_group_bytes(seg[1], k);
    pw::quant_matmul<T>(seg[1])(out + lo, out_stride, x, k, tokens, tiles, hi - lo, k);
  }
}

// x [tokens, h] . w [rows, h] in float32: out [tokens, rows].
template <typename T>
void float_product(float* out, const T* x, int64_t tokens, const T* w, int64_t rows,
                   int64_t h) {
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> xf(h);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < h; ++j) xf[j] = pw::to_float(x[t * h + j]);
      for (int64_t r = 0; r < rows; ++r) {
        float acc = 0.f;
        for (int64_t j = 0; j < h; ++j) acc += xf[j] * pw::to_float(w[r * h + j]);
        out[t * rows + r] = acc;
      }
    }
  });
}

// Softmax of one token's logits, its top k experts (descending, ties to the lower index)
// and their weights, renormalised to sum to one where asked. p, order: scratch the caller
// reuses over its tokens.
void route(const float* logits, int64_t experts, int64_t k, bool normalize, int64_t* ids,
           float* weights, std::vector<float>& p, std::vector<int64_t>& order) {
  p.assign(logits, logits + experts);
  const float top = *std::max_element(p.begin(), p.end());
  float sum = 0.f;
  for (float& v : p) sum += (v = std::exp(v - top));
  for (float& v : p) v /= sum;
  order.resize(experts);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    return p[a] > p[b] || (p[a] == p[b] && a < b);
  });
  float chosen = 0.f;
  for (int64_t j = 0; j < k; ++j) chosen += (weights[j] = p[order[j]]), ids[j] = order[j];
  if (normalize)
    for (int64_t j = 0; j < k; ++j) weights[j] /= chosen;
}

// gpt-oss: the top k logits (descending, ties to the lower index) and their softmax.
void route_top_first(const float* logits, int64_t experts, int64_t k, int64_t* ids,
                     float* weights, std::vector<int64_t>& order) {
  order.resize(experts);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  float sum = 0.f;
  for (int64_t j = 0; j < k; ++j)
    ids[j] = order[j], sum += (weights[j] = std::exp(logits[order[j]] - logits[order[0]]));
  for (int64_t j = 0; j < k; ++j) weights[j] /= sum;
}

template <typename T> struct Silu;
template <> struct Silu<float> { static constexpr auto fn = pw_silu_and_mul_f32; };
template <> struct Silu<bf16> { static constexpr auto fn = pw_silu_and_mul_bf16; };

// The experts' activation: SiLU-and-mul, or (swiglu) gpt-oss's over [gate; up] rows:
// g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha g).
struct Activation {
  bool swiglu;
  float alpha, limit;
};

template <typename T>
void activate(T* out, const T* gate_up, int64_t rows, int64_t inter, const Activation& a) {
  if (!a.swiglu) return Silu<T>::fn(out, gate_up, rows, inter);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < inter; ++j) {
      const float g = std::min(pw::to_float(gate_up[r * 2 * inter + j]), a.limit);
      const float u = std::clamp(pw::to_float(gate_up[r * 2 * inter + inter + j]), -a.limit,
                                 a.limit);
      pw::from_float((u + 1.f) * (g / (1.f + std::exp(-a.alpha * g))), &out[r * inter + j]);
    }
}

// rows [rows, n] (row stride n) += bias [n] of type B, in T (0: no bias).
template <typename T, typename B = T>
void add_bias(T* rows, int64_t count, int64_t n, int64_t bias) {
  if (bias == 0) return;
  const B* b = ptr<B>(bias);
  for (int64_t r = 0; r < count; ++r)
    for (int64_t j = 0; j < n; ++j)
      pw::from_float(pw::to_float(rows[r * n + j]) + pw::to_float(b[j]), &rows[r * n + j]);
}

// One expert's share of a call: its `count` rows (tokens) from `first` in the gathered rows,
// their output scales, its width, weights' tables, biases (0: none) and LoRA slots (-1:
// none), and where its values lie in scratch.
struct Work {
  int64_t first, count, inter;
  const int64_t *gate_up, *down;
  int64_t gate_up_bias, down_bias;
  int64_t gate_up_slot, down_slot;
  int64_t gate_up_at, act_at;     // offsets into the gate/up and activation scratch
};

// The call's adapters (pw_lora_delta's table and slots) and each gathered row's adapter;
// table null: none.
struct Lora {
  const int64_t* table;
  int64_t slots;
  std::vector<int64_t> of_row;
};

template <typename T> struct Delta;      // lora.cpp's entry for T, as Silu's
template <> struct Delta<float> { static constexpr auto fn = pw_lora_delta_f32; };
template <> struct Delta<bf16> { static constexpr auto fn = pw_lora_delta_bf16; };

// y [w.count, n] += the adapter deltas of x [w.count, k] (rows k apart) through `slot`, each
// of the work item's rows with its token's adapter.
template <typename T>
void add_deltas(T* y, int64_t n, const T* x, int64_t k, const Work& w, int64_t slot,
                const Lora& lora) {
  if (lora.table == nullptr || slot < 0) return;
  Delta<T>::fn(y, n, x, k, w.count, n, k, lora.of_row.data() + w.first, lora.table, slot,
               lora.slots);
}

// Rows a task of a phase multiplies where the experts are too few to give every thread two
// of them whole: small enough to share them out, large enough that a task's call (which
// prepares its activations anew) costs little beside its bytes.
constexpr int64_t kTaskRows = 256;

// A task's cost in rows times tokens: reading and turning its tiles into operands costs
// about kTaskFixed tokens' products whatever its count.
constexpr int64_t kTaskFixed = 4;

// Runs `rows_of(w)` output rows of every work item's product in one parallel region: the
// threads share all of a phase's experts, not each expert's rows in turn; whole experts a
// task where there are enough of them. The tasks go out largest first to whichever thread is
// free (a decode step's experts hold 1 to ~8 tokens each: an even split of the list left
// one thread waiting ~10 % of a 16-sequence step). Each task writes its own rows with the
// same arithmetic whichever thread runs it, so the outputs do not depend on the order.
template <typename Fn, typename Rows>
void each_task(const std::vector<Work>& work, Rows rows_of, Fn fn) {
  const int64_t items = work.size();
  const bool whole = items >= 2 * at::get_num_threads();
  struct Task { int64_t item, r0, r1, cost; };
  std::vector<Task> tasks;
  for (int64_t i = 0; i < items; ++i) {
    const int64_t rows = rows_of(work[i]), step = whole ? rows : kTaskRows;
    for (int64_t r = 0; r < rows; r += step) {
      const int64_t r1 = std::min(r + step, rows);
      tasks.push_back({i, r, r1, (r1 - r) * (work[i].count + kTaskFixed)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n = tasks.size();
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t t = next++; t < n; t = next++)
      fn(work[tasks[t].item], tasks[t].r0, tasks[t].r1);
  });
}

// y [rows, hidden] (D) = every work item's down product of act (its rows; D), plus its bias
// (T, the activations') and its rows' adapter deltas.
template <typename D, typename T>
void down_products(std::vector<D>& y, const D* act, const std::vector<Work>& work,
                   int64_t hidden, const Lora& lora) {
  each_task(work, [&](const Work&) { return hidden; }, [&](const Work& w, int64_t r0,
                                                          int64_t r1) {
    table_rows<D>(&y[w.first * hidden], hidden, act + w.act_at, w.inter, w.count, w.down, r0,
                  r1);
  });
  for (const Work& w : work) {
    add_bias<D, T>(&y[w.first * hidden], w.count, hidden, w.down_bias);
    add_deltas<D>(&y[w.first * hidden], hidden, act + w.act_at, w.inter, w, w.down_slot, lora);
  }
}

// acc [token] += scale * expert(x [token]) for every work item, in order: gate/up of all of
// them in one parallel region, SiLU, then down likewise, then the weighted sums. D: the down
// products' type: float for a bfloat16 rank's float32 partial (its down row-parallel, as a
// float partial Linear multiplies float32 activations), else T.
template <typename T, typename D>
void run_experts(float* acc, const T* x, const std::vector<Work>& work,
                 const std::vector<int64_t>& rows, const std::vector<float>& scale,
                 int64_t hidden, const Activation& activation, const Lora& lora) {
  // the calling thread's scratch, named by reference: the lambdas below run on the pool's
  // threads, where a thread_local's name would mean their own (empty) copies
  thread_local std::vector<T> scratch[3];
  thread_local std::vector<D> down_scratch[2];
  auto &xs = scratch[0], &gate_up = scratch[1], &act = scratch[2];
  auto &act_d = down_scratch[0], &y = down_scratch[1];
  const int64_t total = rows.size();
  const Work& last = work.back();
  xs.resize(total * hidden), y.resize(total * hidden);
  gate_up.resize(last.gate_up_at + last.count * 2 * last.inter);
  act.resize(last.act_at + last.count * last.inter);
  for (int64_t i = 0; i < total; ++i)
    std::memcpy(&xs[i * hidden], x + rows[i] * hidden, hidden * sizeof(T));
  each_task(work, [](const Work& w) { return 2 * w.inter; }, [&](const Work& w, int64_t r0,
                                                                 int64_t r1) {
    table_rows<T>(&gate_up[w.gate_up_at], 2 * w.inter, &xs[w.first * hidden], hidden, w.count,
                  w.gate_up, r0, r1);
  });
  for (const Work& w : work) {   // bias, then the delta: torch's grouping's order
    add_bias<T>(&gate_up[w.gate_up_at], w.count, 2 * w.inter, w.gate_up_bias);
    add_deltas<T>(&gate_up[w.gate_up_at], 2 * w.inter, &xs[w.first * hidden], hidden, w,
                  w.gate_up_slot, lora);
    activate<T>(&act[w.act_at], &gate_up[w.gate_up_at], w.count, w.inter, activation);
  }
  if constexpr (std::is_same_v<D, T>) {
    down_products<D, T>(y, act.data(), work, hidden, lora);
  } else {
    act_d.resize(act.size());
    for (size_t i = 0; i < act.size(); ++i) act_d[i] = pw::to_float(act[i]);
    down_products<D, T>(y, act_d.data(), work, hidden, lora);
  }
  for (int64_t i = 0; i < total; ++i) {
    float* a = acc + rows[i] * hidden;
    for (int64_t j = 0; j < hidden; ++j) a[j] += scale[i] * pw::to_float(y[i * hidden + j]);
  }
}

// Appends a work item of `n` rows (already in rows) with its tables and biases.
// words: gate/up's and down's tables, biases and LoRA slots (PW_MOE_EXPERT_WORDS's order).
void add_work(std::vector<Work>& work, int64_t n, int64_t inter, const int64_t* words) {
  const Work* prev = work.empty() ? nullptr : &work.back();
  const int64_t first = prev ? prev->first + prev->count : 0;
  const int64_t gu = prev ? prev->gate_up_at + prev->count * 2 * prev->inter : 0;
  const int64_t act = prev ? prev->act_at + prev->count * prev->inter : 0;
  work.push_back(Work{first, n, inter, ptr<int64_t>(words[0]), ptr<int64_t>(words[1]),
                      words[2], words[3], words[4], words[5], gu, act});
}

double real(int64_t word) {      // a float operand: a double's bits
  double v;
  std::memcpy(&v, &word, sizeof v);
  return v;
}

// Every token's k experts and weights from the router's float32 logits (plus its bias).
template <typename T>
void route_tokens(const T* x, int64_t tokens, const int64_t* spec, int64_t* ids,
                  float* weights) {
  const int64_t experts = spec[PW_MOE_EXPERTS], k = spec[PW_MOE_TOP_K];
  const int64_t hidden = spec[PW_MOE_HIDDEN];
  std::vector<float> logits(tokens * experts);
  float_product<T>(logits.data(), x, tokens, ptr<T>(spec[PW_MOE_ROUTER]), experts, hidden);
  if (spec[PW_MOE_ROUTER_BIAS])
    for (int64_t i = 0; i < tokens * experts; ++i)
      logits[i] += pw::to_float(ptr<T>(spec[PW_MOE_ROUTER_BIAS])[i % experts]);
  std::vector<float> probs;
  std::vector<int64_t> order;
  for (int64_t t = 0; t < tokens; ++t) {
    if (spec[PW_MOE_TOPK_SOFTMAX])
      route_top_first(&logits[t * experts], experts, k, &ids[t * k], &weights[t * k], order);
    else
      route(&logits[t * experts], experts, k, spec[PW_MOE_NORMALIZE] != 0, &ids[t * k],
            &weights[t * k], probs, order);
  }
}

// out: T, or float for a rank's float32 partial (O = float).
template <typename T, typename O = T>
void moe(O* out, const T* x, int64_t tokens, const int64_t* spec, const int64_t* lora_rows,
         const int64_t* lora_table, int64_t lora_slots) {
  const int64_t experts = spec[PW_MOE_EXPERTS], k = spec[PW_MOE_TOP_K];
  const int64_t hidden = spec[PW_MOE_HIDDEN], inter = spec[PW_MOE_INTER];
  const int64_t* tables = spec + PW_MOE_EXPERT_TABLES;   // [experts][PW_MOE_EXPERT_WORDS]
  std::vector<float> weights(tokens * k), acc(tokens * hidden, 0.f);
  std::vector<int64_t> ids(tokens * k);
  route_tokens<T>(x, tokens, spec, ids.data(), weights.data());
  const Activation activation{spec[PW_MOE_SWIGLU_OAI] != 0,
                              static_cast<float>(real(spec[PW_MOE_SWIGLU_ALPHA])),
                              static_cast<float>(real(spec[PW_MOE_SWIGLU_LIMIT]))};
  std::vector<Work> work;
  std::vector<int64_t> rows;
  std::vector<float> scale;
  std::vector<char> chosen(experts, 0);
  for (int64_t i = 0; i < tokens * k; ++i) chosen[ids[i]] = 1;
  if (spec[PW_MOE_READS])
    *reinterpret_cast<int64_t*>(spec[PW_MOE_READS]) +=
        std::count(chosen.begin(), chosen.end(), 1);
  for (int64_t e = 0; e < experts; ++e) {     // each chosen expert once, its tokens ascending
    const int64_t* words = tables + PW_MOE_EXPERT_WORDS * e;
    if (!chosen[e] || words[0] == 0) continue;        // unchosen, or another rank's
    const size_t before = rows.size();
    for (int64_t i = 0; i < tokens * k; ++i)
      if (ids[i] == e) rows.push_back(i / k), scale.push_back(weights[i]);
    add_work(work, rows.size() - before, inter, words);
  }
  if (spec[PW_MOE_SHARED_GATE_UP]) {          // Qwen2-MoE: sigmoid(x . g) * shared(x)
    std::vector<float> gate(tokens);
    float_product<T>(gate.data(), x, tokens, ptr<T>(spec[PW_MOE_SHARED_GATE]), 1, hidden);
    for (int64_t t = 0; t < tokens; ++t)
      rows.push_back(t), scale.push_back(1.f / (1.f + std::exp(-gate[t])));
    const int64_t words[] = {spec[PW_MOE_SHARED_GATE_UP], spec[PW_MOE_SHARED_DOWN], 0, 0,
                             spec[PW_MOE_SHARED_GATE_UP_SLOT], spec[PW_MOE_SHARED_DOWN_SLOT]};
    add_work(work, tokens, spec[PW_MOE_SHARED_INTER], words);
  }
  Lora lora{lora_rows ? lora_table : nullptr, lora_slots, {}};
  if (lora.table)
    for (int64_t row : rows) lora.of_row.push_back(lora_rows[row]);
  if (!work.empty())
    run_experts<T, O>(acc.data(), x, work, rows, scale, hidden, activation, lora);
  for (int64_t i = 0; i < tokens * hidden; ++i) pw::from_float(acc[i], &out[i]);
}

}  // namespace

extern "C" {   // pagewire_api.h

void pw_moe_f32(float* out, const float* x, int64_t tokens, const int64_t* spec,
                const int64_t* lora_rows, const int64_t* lora_table, int64_t lora_slots) {
  moe<float>(out, x, tokens, spec, lora_rows, lora_table, lora_slots);
}
void pw_moe_bf16(bf16* out, const bf16* x, int64_t tokens, const int64_t* spec,
                 const int64_t* lora_rows, const int64_t* lora_table, int64_t lora_slots) {
  moe<bf16>(out, x, tokens, spec, lora_rows, lora_table, lora_slots);
}
void pw_moe_partial_f32(float* out, const float* x, int64_t tokens, const int64_t* spec,
                        const int64_t* lora_rows, const int64_t* lora_table,
                        int64_t lora_slots) {
  moe<float, float>(out, x, tokens, spec, lora_rows, lora_table, lora_slots);
}
void pw_moe_partial_bf16(float* out, const bf16* x, int64_t tokens, const int64_t* spec,
                         const int64_t* lora_rows, const int64_t* lora_table,
                         int64_t lora_slots) {
  moe<bf16, float>(out, x, tokens, spec, lora_rows, lora_table, lora_slots);
}

}  // extern "C"
