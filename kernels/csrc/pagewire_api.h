// The native library's contract with Python, declared once: every exported entry point and
// every integer code the two sides exchange. Each .cpp that defines or calls an entry point
// includes this, so the compiler rejects a definition that differs from its declaration;
// kernels/native_api.py reads this file to build the ctypes prototypes and the Python enums
// (program.Op, the tile kinds of kernels/quant.py, kv_quant's and lora's codes), and checks
// at load that the library's table (api_table.cpp, compiled from these same lines) agrees.
//
// Its format is kept simple for that reader (which rejects anything else):
//   - `enum PwName : int64_t {` members `PW_NAME_MEMBER = <integer>,` one a line `};`
//     (Python names the member MEMBER: the enum's name in capitals is each member's prefix);
//   - `PW_API(return type, name, (parameters))`, one per entry point, on one or more lines,
//     each parameter `type name` with type int64_t, float, double or a pointer (T*, const T*),
//     the return type void, int64_t, double or const char*;
//   - // comments, preprocessor lines and the pw_bf16 typedef.
#ifndef PAGEWIRE_API_H
#define PAGEWIRE_API_H
#include <cstdint>

typedef uint16_t pw_bf16;   // bfloat16 as the kernels store it (bf16.h)

// Opcodes of a decoder layer's program (actors/executor/models/program.py Op): what each op
// does, then the operands the fused decode interpreter (decode_stack.cpp) reads after it
// (int64 words; "bits": a double's), or "per-op" where only the per-op path runs it.
enum PwOp : int64_t {
  // residual += x (x alone in the first layer), x = rms_norm(residual); weight, eps bits
  PW_OP_ADD_NORM = 1,
  // x = rms_norm(x), the residual untouched (sandwich norms); weight, eps bits
  PW_OP_NORM = 2,
  // x = x @ W^T (+ bias) (+ the rows' LoRA deltas); kernels/quant.py QuantWeight.table, N, K,
  // bias (0: none), LoRA slot (-1: none)
  PW_OP_LINEAR = 3,
  // rms_norm of each query and key head of qkv, in place; q weight, k weight, Hq, Hkv, D,
  // eps bits
  PW_OP_QK_NORM = 4,
  // rotate q and k of qkv by position, x becomes (q, k, v); cos|sin table, heads, head dim,
  // the columns of a head rotated (the GPT family: a part, or 0: none)
  PW_OP_ROPE = 5,
  // write k, v to the paged cache, x = paged attention of q; k cache, v cache, Hq, Hkv, D,
  // block size, window, scale bits, softcap bits, PwKvCache, head rows (0: a paged cache of
  // Hkv heads; 1: KV-Compress's rows of one head), sinks (float32 [Hq], pw_apply_sinks;
  // 0: none)
  PW_OP_ATTEND = 6,
  // x = silu(gate) * up; no operands
  PW_OP_SILU_MUL = 7,
  // x = gelu_tanh(gate) * up; per-op
  PW_OP_GELU_MUL = 8,
  // x = sum of x over the tensor-parallel ranks (the row-parallel linear before it leaves
  // float32 partials, summed in float32 and rounded once); per-op
  PW_OP_ALL_REDUCE = 9,
  // rms_norm of all query heads of qkv as one vector, and of all key heads (OLMoE), in
  // place; q weight, k weight, q width, k width, eps bits
  PW_OP_QK_NORM_FLAT = 10,
  // x = the routed experts' weighted sum (models/moe.py): moe.cpp's pw_moe; its spec (PwMoe)
  PW_OP_MOE = 11,
  // ADD_NORM with a LayerNorm (mean, variance, weight, bias: the GPT family); weight, bias,
  // eps bits
  PW_OP_ADD_LAYER_NORM = 12,
  // parallel residual: the attention's output set aside, x = layer_norm(residual); weight,
  // bias, eps bits
  PW_OP_BRANCH_LAYER_NORM = 13,
  // x += what BRANCH_LAYER_NORM set aside
  PW_OP_JOIN = 14,
  // x = gelu(x), exact (erf)
  PW_OP_GELU = 15,
  // x = gelu(x), tanh's approximation
  PW_OP_GELU_TANH = 16,
};

// A mixture-of-experts block as moe.cpp reads it: int64 words at these indices, then per
// expert (PW_MOE_EXPERT_WORDS words) its gate/up and down weights' tables
// (kernels/quant.py QuantWeight.table; 0 and 0: an expert another rank holds), their
// biases (0: none) and their LoRA slots (models/lora_slots.py; -1: never adapted). The
// router's and the shared gate's weights, and every bias, are the activations' dtype,
// [experts, hidden] and [hidden]; no shared expert: its three words 0.
// gpt-oss: the router's bias, top k then softmax, and its clamped SwiGLU (alpha and limit
// as a double's bits).
enum PwMoe : int64_t {
  PW_MOE_EXPERTS = 0,
  PW_MOE_TOP_K = 1,
  PW_MOE_NORMALIZE = 2,         // 1: the top k's weights rescaled to sum to one
  PW_MOE_HIDDEN = 3,
  PW_MOE_INTER = 4,             // an expert's intermediate rows
  PW_MOE_ROUTER = 5,
  PW_MOE_SHARED_GATE_UP = 6,
  PW_MOE_SHARED_DOWN = 7,
  PW_MOE_SHARED_GATE = 8,
  PW_MOE_SHARED_INTER = 9,
  PW_MOE_READS = 10,            // an int64 counter's address (0: none): += the experts the
                                // call's tokens chose (held here or not), each once
  PW_MOE_ROUTER_BIAS = 11,      // 0: none
  PW_MOE_TOPK_SOFTMAX = 12,     // 1: the top k of the logits, then their softmax
  PW_MOE_SWIGLU_OAI = 13,       // 1: (up + 1) * g * sigmoid(alpha g), g and up clamped
  PW_MOE_SWIGLU_ALPHA = 14,
  PW_MOE_SWIGLU_LIMIT = 15,
  PW_MOE_SHARED_GATE_UP_SLOT = 16,   // the shared expert's LoRA slots (-1: none)
  PW_MOE_SHARED_DOWN_SLOT = 17,
  PW_MOE_EXPERT_TABLES = 18,
  PW_MOE_EXPERT_WORDS = 6,      // gate/up table, down table, gate/up bias, down bias, and
                                // gate/up's and down's LoRA slots
};

// A packed weight's tile type (quant_tiles.h; kernels/quant.py packs them): the GGML type id
// of the blocks its tiles hold (kernels/gguf_blocks.py), or pagewire's own (FP8).
enum PwTile : int64_t {
  PW_TILE_Q4_1 = 3,
  PW_TILE_Q8_0 = 8,
  PW_TILE_Q2_K = 10,
  PW_TILE_Q4_K = 12,
  PW_TILE_Q5_K = 13,
  PW_TILE_Q6_K = 14,
  PW_TILE_IQ4_NL = 20,    // level tiles (quant_tiles.h Levels): nibbles indexing a codebook
  PW_TILE_MXFP4 = 39,
  PW_TILE_BF16 = 30,      // plain bfloat16 tiles (bf16_matmul.cpp)
  PW_TILE_Q2_KS = 60,     // superblock tiles (quant_tiles.h SuperTile): the K-quant's id + 50
  PW_TILE_Q4_KS = 62,
  PW_TILE_Q5_KS = 63,
  PW_TILE_Q6_KS = 64,
  PW_TILE_IQ4_XSS = 73,
  PW_TILE_IQ4_XSL = 74,   // IQ4_XS's superblocks as level tiles (nibbles: 4.31 bits a weight)
  PW_TILE_Q6_KP = 75,     // Q6_K's superblocks as bit planes (nibbles, crumbs: the file's 6.56)
  PW_TILE_Q5_KP = 76,     // Q5_K's superblocks as bit planes (nibbles, a bit: the file's 5.5)
  PW_TILE_FP8 = 90,       // an FP8 checkpoint's e4m3 codes
};

// A packed weight's kind is its PwTile plus one of these: how the activations meet the tiles
// (as they are, or rounded per 32-column block to int8 or int16; quant_int_avx2.h; or, Q4
// tiles only, rounded to int8 in steps of 8 tokens and more and exact below). Every PwTile is
// below PW_ROUNDING_INT8, so kind % PW_ROUNDING_INT8 is the tile type.
enum PwRounding : int64_t {
  PW_ROUNDING_EXACT = 0,
  PW_ROUNDING_INT8 = 100,
  PW_ROUNDING_INT16 = 200,
  PW_ROUNDING_INT8_LARGE = 300,
};

// A KV cache's codes (kv_quant.h; kernels/kv_quant.py).
enum PwKvCache : int64_t {
  PW_KV_CACHE_PLAIN = -1,   // the activations' own dtype (decode_stack.cpp's ATTEND only)
  PW_KV_CACHE_INT8 = 0,
  PW_KV_CACHE_E4M3 = 1,
  PW_KV_CACHE_E5M2 = 2,
};

// LoRA weights' dtype in the adapters' table (lora.cpp; kernels/lora.py).
enum PwLoraWeights : int64_t {
  PW_LORA_WEIGHTS_F32 = 0,
  PW_LORA_WEIGHTS_BF16 = 1,
  PW_LORA_WEIGHTS_F16 = 2,
};

// Words of the adapters' table: int64 per (adapter, slot) entry (lora.cpp Entry).
enum PwLoraTable : int64_t {
  PW_LORA_TABLE_ENTRY = 6,
};
#endif  // PAGEWIRE_API_H

// The entry points. api_table.cpp includes this part a second time with PW_API defined as a
// row of its table, so what follows must stay PW_API lines (and comments) only.
#ifndef PW_API
#define PW_API(ret, name, params) extern "C" ret name params;
#endif

// --- cpu_kernels.cpp
// 1 when this build has the AVX512-BF16 kernels (prefill attention, decode attention's tiles,
// the quantized matmuls' bfloat16 products); without them (0) those do nothing.
PW_API(int64_t, pw_avx512_bf16, ())
// out [T, H]; residual [T, H] (updated in place) or null; x rows x_stride apart.
PW_API(void, pw_add_rms_norm_f32, (float* out, float* residual, const float* x,
                                   const float* w, int64_t tokens, int64_t hidden,
                                   int64_t x_stride, float eps))
PW_API(void, pw_add_rms_norm_bf16, (pw_bf16* out, pw_bf16* residual, const pw_bf16* x,
                                    const pw_bf16* w, int64_t tokens, int64_t hidden,
                                    int64_t x_stride, float eps))
// As pw_add_rms_norm with the GPT family's LayerNorm: weight w and bias b [H].
PW_API(void, pw_add_layer_norm_f32, (float* out, float* residual, const float* x,
                                     const float* w, const float* b, int64_t tokens,
                                     int64_t hidden, int64_t x_stride, float eps))
PW_API(void, pw_add_layer_norm_bf16, (pw_bf16* out, pw_bf16* residual, const pw_bf16* x,
                                      const pw_bf16* w, const pw_bf16* b, int64_t tokens,
                                      int64_t hidden, int64_t x_stride, float eps))
// out = gelu(x), `count` values: exact (erf), or tanh's approximation where tanh_form is 1.
PW_API(void, pw_gelu_f32, (float* out, const float* x, int64_t count, int64_t tanh_form))
PW_API(void, pw_gelu_bf16, (pw_bf16* out, const pw_bf16* x, int64_t count, int64_t tanh_form))
// qkv [T, row_stride]: the first `heads` heads of each row (queries then keys) are rotated.
PW_API(void, pw_rope_f32, (float* qkv, int64_t row_stride, const float* cos_sin,
                           const int64_t* positions, int64_t tokens, int64_t heads, int64_t D))
PW_API(void, pw_rope_bf16, (pw_bf16* qkv, int64_t row_stride, const float* cos_sin,
                            const int64_t* positions, int64_t tokens, int64_t heads, int64_t D))
// The same on the first `rotary` columns of each head (cos_sin rows `rotary` wide).
PW_API(void, pw_rope_partial_f32, (float* qkv, int64_t row_stride, const float* cos_sin,
                                   const int64_t* positions, int64_t tokens, int64_t heads,
                                   int64_t D, int64_t rotary))
PW_API(void, pw_rope_partial_bf16, (pw_bf16* qkv, int64_t row_stride, const float* cos_sin,
                                    const int64_t* positions, int64_t tokens, int64_t heads,
                                    int64_t D, int64_t rotary))
// gate_up [T, 2I] (gate first) -> out [T, I].
PW_API(void, pw_silu_and_mul_f32, (float* out, const float* gate_up, int64_t tokens,
                                   int64_t inter))
PW_API(void, pw_silu_and_mul_bf16, (pw_bf16* out, const pw_bf16* gate_up, int64_t tokens,
                                    int64_t inter))
// out, q: [B, Hq, D] (token stride q_stride / out_stride, heads contiguous);
// block_tables: [B, table_stride] int64; context_lens: [B] int64 (tokens to attend, >= 1);
// window > 0: a sliding window; softcap > 0: capped scores; lse (if not null): [B, Hq]
// each row's log-sum-exp of scores, for cascade attention's merge.
PW_API(void, pw_decode_attention_f32, (float* out, const float* q, const float* k_cache,
                                       const float* v_cache, const int64_t* block_tables,
                                       const int64_t* context_lens, int64_t B, int64_t Hq,
                                       int64_t Hkv, int64_t D, int64_t bs,
                                       int64_t table_stride, int64_t q_stride,
                                       int64_t out_stride, float scale, int64_t window,
                                       float softcap, float* lse))
PW_API(void, pw_decode_attention_bf16, (pw_bf16* out, const pw_bf16* q, const pw_bf16* k_cache,
                                        const pw_bf16* v_cache, const int64_t* block_tables,
                                        const int64_t* context_lens, int64_t B, int64_t Hq,
                                        int64_t Hkv, int64_t D, int64_t bs,
                                        int64_t table_stride, int64_t q_stride,
                                        int64_t out_stride, float scale, int64_t window,
                                        float softcap, float* lse))
// Attention sinks (gpt-oss) after a decode: out [B, Hq, D] (contiguous) rows, computed
// without them, times sigmoid(lse - sink[h]), lse [B, Hq] their log-sum-exp; sinks float32
// [Hq]. The softmax over the scores and the sink, which the kernels need not know.
PW_API(void, pw_apply_sinks_f32, (float* out, const float* lse, const float* sinks, int64_t B,
                                  int64_t Hq, int64_t D))
PW_API(void, pw_apply_sinks_bf16, (pw_bf16* out, const float* lse, const float* sinks,
                                   int64_t B, int64_t Hq, int64_t D))

// --- decode_attention.cpp: tried first by pw_decode_attention_bf16 / _q8_bf16; 0 (having
// done nothing) for what they do not take (D not 64 or 128, bs % 16, a soft-cap, no
// AVX512-BF16). `kind`: PwKvCache.
PW_API(int64_t, pw_decode_attention_tiled_bf16, (pw_bf16* out, const pw_bf16* q,
                                                 const pw_bf16* k_cache,
                                                 const pw_bf16* v_cache,
                                                 const int64_t* block_tables,
                                                 const int64_t* context_lens, int64_t B,
                                                 int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                                                 int64_t table_stride, int64_t q_stride,
                                                 int64_t out_stride, float scale,
                                                 int64_t window, float softcap, float* lse))
PW_API(int64_t, pw_decode_attention_tiled_q8, (pw_bf16* out, const pw_bf16* q,
                                               const uint8_t* k_cache, const uint8_t* v_cache,
                                               const int64_t* block_tables,
                                               const int64_t* context_lens, int64_t B,
                                               int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                                               int64_t table_stride, int64_t q_stride,
                                               int64_t out_stride, float scale, int64_t window,
                                               float softcap, int64_t kind, float* lse))

// --- prefill_attention.cpp
// out, q: [T, Hq, D] bf16 (rows out_stride / q_stride apart, heads contiguous); caches
// [num_blocks, bs, Hkv, D] bf16 contiguous, bs % 16 == 0; chunks [num_chunks, 4] int64 (first
// row, queries, context, offset of its block table in `tables`). D is 64 or 128. sinks
// (gpt-oss; null: none): float32 [Hq], a logit per query head in each row's softmax.
// key_ends (null: causal): int64 [T], per row of q the end (exclusive) of the keys it sees,
// at least its position + 1 and at most its chunk's context (Gemma 3's image tokens).
PW_API(void, pw_prefill_attention_bf16, (pw_bf16* out, const pw_bf16* q,
                                         const pw_bf16* k_cache, const pw_bf16* v_cache,
                                         const int64_t* tables, const int64_t* chunks,
                                         int64_t num_chunks, int64_t Hq, int64_t Hkv, int64_t D,
                                         int64_t bs, int64_t q_stride, int64_t out_stride,
                                         float scale, int64_t window, const float* sinks,
                                         const int64_t* key_ends))

// --- kv_cache.cpp
// Copy each token's keys and values (row_bytes each, rows `k_stride` / `v_stride` bytes apart)
// into cache slot slots[t] (rows row_bytes apart). Slots are distinct.
PW_API(void, pw_write_kv, (char* k_cache, char* v_cache, const char* k, const char* v,
                           const int64_t* slots, int64_t T, int64_t row_bytes,
                           int64_t k_stride, int64_t v_stride))
// As pw_write_kv into a quantized cache of `kind` (PwKvCache): k, v [T, Hkv, D] with token
// rows `k_stride` / `v_stride` elements apart, each head's D values contiguous.
PW_API(void, pw_write_kv_q8_f32, (uint8_t* k_cache, uint8_t* v_cache, const float* k,
                                  const float* v, const int64_t* slots, int64_t tokens,
                                  int64_t Hkv, int64_t D, int64_t k_stride, int64_t v_stride,
                                  int64_t kind))
PW_API(void, pw_write_kv_q8_bf16, (uint8_t* k_cache, uint8_t* v_cache, const pw_bf16* k,
                                   const pw_bf16* v, const int64_t* slots, int64_t tokens,
                                   int64_t Hkv, int64_t D, int64_t k_stride, int64_t v_stride,
                                   int64_t kind))
// As pw_decode_attention_* over a quantized cache of `kind` (PwKvCache).
PW_API(void, pw_decode_attention_q8_f32, (float* out, const float* q, const uint8_t* k_cache,
                                          const uint8_t* v_cache, const int64_t* block_tables,
                                          const int64_t* context_lens, int64_t B, int64_t Hq,
                                          int64_t Hkv, int64_t D, int64_t bs,
                                          int64_t table_stride, int64_t q_stride,
                                          int64_t out_stride, float scale, int64_t window,
                                          float softcap, int64_t kind, float* lse))
PW_API(void, pw_decode_attention_q8_bf16, (pw_bf16* out, const pw_bf16* q,
                                           const uint8_t* k_cache, const uint8_t* v_cache,
                                           const int64_t* block_tables,
                                           const int64_t* context_lens, int64_t B, int64_t Hq,
                                           int64_t Hkv, int64_t D, int64_t bs,
                                           int64_t table_stride, int64_t q_stride,
                                           int64_t out_stride, float scale, int64_t window,
                                           float softcap, int64_t kind, float* lse))

// --- sampling.cpp
// logits [rows, V] float32, rows `stride` apart; u [rows] in (0, 1]; out [rows] int64.
PW_API(void, pw_sample_rows, (const float* logits, int64_t rows, int64_t V, int64_t stride,
                              const float* u, int64_t* out))

// --- quant_kernels.cpp
// out [T, N] = x [T, K] @ W^T, x and out both bfloat16 or both float32 (rows x_stride and
// out_stride apart); W [N, K] packed as `kind` (PwTile + PwRounding; N a multiple of 16, K of
// 32), one this build has (kernels/quant.py checks).
PW_API(void, pw_quant_matmul_f32, (int64_t kind, float* out, int64_t out_stride,
                                   const float* x, int64_t x_stride, int64_t T,
                                   const uint8_t* packed, int64_t N, int64_t K))
PW_API(void, pw_quant_matmul_bf16, (int64_t kind, pw_bf16* out, int64_t out_stride,
                                    const pw_bf16* x, int64_t x_stride, int64_t T,
                                    const uint8_t* packed, int64_t N, int64_t K))
// Whether this build has the quantized matmuls (every tier from AVX2 up).
PW_API(int64_t, pw_quant_matmuls, ())
// Whether it multiplies weights packed as `kind` (1) or not (0).
PW_API(int64_t, pw_quant_kind, (int64_t kind))

// --- moe.cpp
// out [tokens, H] = the mixture-of-experts block `spec` (PwMoe) of x [tokens, H], both
// contiguous, bfloat16 or float32 as the block's router weight is. lora_rows [tokens],
// lora_table [adapters, lora_slots, PW_LORA_TABLE_ENTRY] (as pw_lora_delta's): each token's
// adapter, whose deltas its experts' products add (after their biases); null: none.
PW_API(void, pw_moe_f32, (float* out, const float* x, int64_t tokens, const int64_t* spec,
                          const int64_t* lora_rows, const int64_t* lora_table,
                          int64_t lora_slots))
PW_API(void, pw_moe_bf16, (pw_bf16* out, const pw_bf16* x, int64_t tokens,
                           const int64_t* spec, const int64_t* lora_rows,
                           const int64_t* lora_table, int64_t lora_slots))
// The same block as a tensor-parallel rank's share (its experts' rows, or whole experts):
// out float32 [tokens, H], the partial the layer's all-reduce sums (bfloat16 activations:
// the down products of float32 activations, as a float partial Linear's).
PW_API(void, pw_moe_partial_f32, (float* out, const float* x, int64_t tokens,
                                  const int64_t* spec, const int64_t* lora_rows,
                                  const int64_t* lora_table, int64_t lora_slots))
PW_API(void, pw_moe_partial_bf16, (float* out, const pw_bf16* x, int64_t tokens,
                                   const int64_t* spec, const int64_t* lora_rows,
                                   const int64_t* lora_table, int64_t lora_slots))

// --- decode_stack.cpp
// x [T, H] (contiguous): the embeddings in, the last layer's output out; residual [T, H]: the
// residual stream out. program: `length` int64 words, every layer's ops in turn (PwOp, then
// its operands). scratch: the widest value an op makes (elements a token). One decode token
// per sequence: positions, slots, lens [T]; tables [T, table_stride] (KV-Compress's head
// rows: slots, lens [layers, T Hkv]; tables [layers, T Hkv, table_stride]). lora_rows [T],
// lora_table [adapters, lora_slots, PW_LORA_TABLE_ENTRY]: each row's adapter, or null.
PW_API(void, pw_decode_stack_f32, (float* x, float* residual, const int64_t* program,
                                   int64_t length, int64_t hidden, int64_t scratch,
                                   const int64_t* positions, const int64_t* slots,
                                   const int64_t* tables, const int64_t* lens, int64_t tokens,
                                   int64_t table_stride, const int64_t* lora_rows,
                                   const int64_t* lora_table, int64_t lora_slots))
PW_API(void, pw_decode_stack_bf16, (pw_bf16* x, pw_bf16* residual, const int64_t* program,
                                    int64_t length, int64_t hidden, int64_t scratch,
                                    const int64_t* positions, const int64_t* slots,
                                    const int64_t* tables, const int64_t* lens, int64_t tokens,
                                    int64_t table_stride, const int64_t* lora_rows,
                                    const int64_t* lora_table, int64_t lora_slots))
// The operands `op` (a PwOp) takes, or -1 where the interpreter does not implement it.
PW_API(int64_t, pw_decode_stack_arity, (int64_t op))

// --- lora.cpp
// y [tokens, n] += each row's adapter delta of x [tokens, k] for linear `slot` (rows of
// adapter -1 untouched); table [adapters, num_slots, PW_LORA_TABLE_ENTRY].
PW_API(void, pw_lora_delta_f32, (float* y, int64_t y_stride, const float* x, int64_t x_stride,
                                 int64_t tokens, int64_t n, int64_t k,
                                 const int64_t* adapter_of_row, const int64_t* table,
                                 int64_t slot, int64_t num_slots))
PW_API(void, pw_lora_delta_bf16, (pw_bf16* y, int64_t y_stride, const pw_bf16* x,
                                  int64_t x_stride, int64_t tokens, int64_t n, int64_t k,
                                  const int64_t* adapter_of_row, const int64_t* table,
                                  int64_t slot, int64_t num_slots))

// --- core_rates.cpp
// Multiply-adds a second of 256-bit int16 products over float32 FMAs' on the calling core,
// the best of `rounds` timings of each.
PW_API(double, pw_int16_mac_ratio, (int64_t rounds))

// --- api_table.cpp
// Row i of the library's table of its entry points, "name signature" (a code a type: v void,
// i int64_t, f float, d double, p a pointer; the return type's first), or null past the end.
PW_API(const char*, pw_api_entry, (int64_t i))

#undef PW_API
