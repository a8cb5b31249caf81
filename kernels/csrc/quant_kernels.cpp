// Matrix-vector products with GGUF-quantized weights (Q4_1, Q8_0) for small batches,
// reading the weights in their quantized form: at batch 1 a step is bound by the bytes of
// weights read, and Q4_1 is 0.625 bytes a weight against bfloat16's 2.
//
// The values are exactly the file's: each weight is d * q + m (Q4_1) or d * q (Q8_0) with
// its fp16 d and m, as dequantization gives; only the order of the float32 sums differs.
//
// Layout (kernels/quant.py packs it once at load): output rows in groups of 16, one tile per
// (group, 32-column block). A SIMD lane owns an output row, so a tile's products land in the
// 16 lanes of one register and no horizontal sums are needed.
//   Q4_1 tile, 320 bytes: nibbles[8][16][2] (byte [j][l][p] = the file's qs[2j + p] of row l:
//     low nibble column 2j + p, high nibble column 2j + 16 + p), d[16] fp16, m[16] fp16.
//   Q8_0 tile, 544 bytes: q[32][16] int8 (byte [k][l] = column k of row l), d[16] fp16.
// Built into the same library as cpu_kernels.cpp (kernels/native.py). Tiers without
// AVX512-BF16 multiply the same tiles with quant_avx2.h's kernels.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#if defined(__AVX2__)
#include "quant_avx2.h"    // the exact kernels below AVX512-BF16; int8 and int16 on every tier
#endif

namespace {

using pw::bf16;
using pw::from_float;
using pw::to_float;
constexpr int64_t kRows = 16;     // output rows per group (one zmm of float32 lanes)
constexpr int64_t kQ4Tile = 320;
constexpr int64_t kQ8Tile = 544;
constexpr int kMaxBatch = 8;

#if defined(__AVX512BF16__)

inline __m512 bcast_pair(const bf16* x) {    // (x[0], x[1]) in every 32-bit lane
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_castsi512_ps(_mm512_set1_epi32(v));
}

inline void store_rows(bf16* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(v));
}

// bfloat16 of i & 15 for word i of 32: vpermw reads an index's low 5 bits, so a byte's low
// nibble indexes it directly.
inline __m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    float f = static_cast<float>(i & 15);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    t[i] = static_cast<uint16_t>(bits >> 16);   // small integers are exact in bfloat16
  }
  return _mm512_load_si512(t);
}

inline void store_rows(float* out, __m512 v) { _mm512_storeu_ps(out, v); }

inline bf16 to_bf16(float x) {
  bf16 out;
  from_float(x, &out);
  return out;
}

// The activations as the kernels read them, for T tokens of K columns; each kernel has only
// its own form built (`use`):
//   kParts (Q4_1): parts[p][t][k], bfloat16 x split into P parts whose sum is x (P = 1 for
//     bfloat16 input; 3 for float32, each part the bfloat16 of what the earlier ones left: 24
//     bits in all, float32's precision, so a float32 engine multiplies float32 activations),
//     and sums[t][b], the float32 sum of x over block b (Q4_1's minimum multiplies it);
//   kFloat (Q8_0): xf[t][k], x in float32 (Q8_0 converts its weights to float32 instead).
enum Use { kParts, kFloat };

struct Activations {
  int64_t T, K, P;
  std::vector<bf16> parts;
  std::vector<float> sums, xf;

  template <typename In>
  Activations(const In* x, int64_t x_stride, int64_t T_, int64_t K_, Use use)
      : T(T_), K(K_), P(std::is_same<In, float>::value ? 3 : 1) {
    if (use == kFloat) {
      xf.resize(T * K);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t k = 0; k < K; ++k) xf[t * K + k] = to_float(x[t * x_stride + k]);
      return;
    }
    parts.resize(P * T * K);
    sums.assign(T * (K / 32), 0.f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        float rest = to_float(x[t * x_stride + k]);
        sums[t * (K / 32) + k / 32] += rest;
        for (int64_t p = 0; p < P; ++p) {
          const bf16 part = to_bf16(rest);
          parts[(p * T + t) * K + k] = part;
          rest -= to_float(part);
        }
      }
  }
};

// Output groups [g0, g1) for M tokens (rows `stride` apart in parts, sums, out) with P parts.
template <int M, int P, typename Out>
void q4_1_groups(Out* out, int64_t out_stride, const bf16* parts, int64_t part_stride,
                 int64_t x_stride, const float* sums, const uint8_t* packed, int64_t nb,
                 int64_t g0, int64_t g1) {
  const __m512i table = nibble_table();
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* tile = packed + g * nb * kQ4Tile;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, tile += kQ4Tile) {
      __m512 lo_sum[M], hi_sum[M];
      for (int m = 0; m < M; ++m) lo_sum[m] = hi_sum[m] = _mm512_setzero_ps();
      for (int j = 0; j < 8; ++j) {
        const __m512i w = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * j)));
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(w, table);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
        for (int p = 0; p < P; ++p)
          for (int m = 0; m < M; ++m) {
            const bf16* xb = parts + p * part_stride + m * x_stride + b * 32 + 2 * j;
            lo_sum[m] = _mm512_dpbf16_ps(lo_sum[m], lo, (__m512bh)bcast_pair(xb));
            hi_sum[m] = _mm512_dpbf16_ps(hi_sum[m], hi, (__m512bh)bcast_pair(xb + 16));
          }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(tile + 256)));
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(tile + 288)));
      for (int m = 0; m < M; ++m) {   // sum of x * (d q + m) = d * sum(x q) + m * sum(x)
        acc[m] = _mm512_fmadd_ps(_mm512_add_ps(lo_sum[m], hi_sum[m]), d, acc[m]);
        acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sums[m * nb + b]), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) store_rows(out + m * out_stride + g * kRows, acc[m]);
  }
}

template <int M, typename Out>
void q8_0_groups(Out* out, int64_t out_stride, const float* xf, int64_t K,
                 const uint8_t* packed, int64_t nb, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* tile = packed + g * nb * kQ8Tile;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, tile += kQ8Tile) {
      __m512 even[M], odd[M];     // two chains: FMA latency, not throughput, would bound one
      for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
      for (int k = 0; k < 32; k += 2) {
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 16 * k))));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 16 * k + 16))));
        for (int m = 0; m < M; ++m) {
          const float* xb = xf + m * K + b * 32 + k;
          even[m] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xb[0]), even[m]);
          odd[m] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xb[1]), odd[m]);
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(tile + 512)));
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_add_ps(even[m], odd[m]), d, acc[m]);
    }
    for (int m = 0; m < M; ++m) store_rows(out + m * out_stride + g * kRows, acc[m]);
  }
}

// One chunk of up to kMaxBatch tokens: its weights are unpacked once for all of them.
template <int M, typename Out>
struct Q4_1 {
  static void run(Out* out, int64_t os, const Activations& a, int64_t t, const uint8_t* packed,
                  int64_t groups) {
    const int64_t nb = a.K / 32;
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      const bf16* x = a.parts.data() + t * a.K;
      const float* sums = a.sums.data() + t * nb;
      if (a.P == 1)
        q4_1_groups<M, 1>(out, os, x, a.T * a.K, a.K, sums, packed, nb, g0, g1);
      else
        q4_1_groups<M, 3>(out, os, x, a.T * a.K, a.K, sums, packed, nb, g0, g1);
    });
  }
};

template <int M, typename Out>
struct Q8_0 {
  static void run(Out* out, int64_t os, const Activations& a, int64_t t, const uint8_t* packed,
                  int64_t groups) {
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      q8_0_groups<M>(out, os, a.xf.data() + t * a.K, a.K, packed, a.K / 32, g0, g1);
    });
  }
};

template <template <int, typename> class Kernel, typename Out>
void matmul(Out* out, int64_t out_stride, const Activations& a, const uint8_t* packed,
            int64_t N) {
  for (int64_t t = 0; t < a.T; t += kMaxBatch) {
    Out* o = out + t * out_stride;
    switch (std::min<int64_t>(kMaxBatch, a.T - t)) {
      case 1: Kernel<1, Out>::run(o, out_stride, a, t, packed, N / kRows); break;
      case 2: Kernel<2, Out>::run(o, out_stride, a, t, packed, N / kRows); break;
      case 3: Kernel<3, Out>::run(o, out_stride, a, t, packed, N / kRows); break;
      case 4: Kernel<4, Out>::run(o, out_stride, a, t, packed, N / kRows); break;
      case 5: Kernel<5, Out>::run(o, out_stride, a, t, packed, N / kRows); break;
      case 6: Kernel<6, Out>::run(o, out_stride, a, t, packed, N / kRows); break;
      case 7: Kernel<7, Out>::run(o, out_stride, a, t, packed, N / kRows); break;
      default: Kernel<8, Out>::run(o, out_stride, a, t, packed, N / kRows); break;
    }
  }
}

#endif  // __AVX512BF16__

}  // namespace

extern "C" {

// out [T, N] = x [T, K] @ W^T, x and out both bfloat16 or both float32 (rows x_stride and
// out_stride apart); W [N, K] packed as above (N a multiple of 16, K of 32).
#if defined(__AVX512BF16__)
#define PW_QUANT_MATMUL(name, kernel, type, use, q4)                                        \
  void name(type* out, int64_t out_stride, const type* x, int64_t x_stride, int64_t T,        \
            const uint8_t* packed, int64_t N, int64_t K) {                                    \
    matmul<kernel>(out, out_stride, Activations(x, x_stride, T, K, use), packed, N);          \
  }
#elif defined(__AVX2__)
#define PW_QUANT_MATMUL(name, kernel, type, use, q4)                                        \
  void name(type* out, int64_t out_stride, const type* x, int64_t x_stride, int64_t T,        \
            const uint8_t* packed, int64_t N, int64_t K) {                                    \
    pw::avx2::matmul(out, out_stride, x, x_stride, T, packed, N, K, q4);                     \
  }
#else
#define PW_QUANT_MATMUL(name, kernel, type, use, q4)                                        \
  void name(type*, int64_t, const type*, int64_t, int64_t, const uint8_t*, int64_t, int64_t) {}
#endif
PW_QUANT_MATMUL(pw_q4_1_matmul_bf16, Q4_1, bf16, kParts, true)
PW_QUANT_MATMUL(pw_q4_1_matmul_f32, Q4_1, float, kParts, true)
PW_QUANT_MATMUL(pw_q8_0_matmul_bf16, Q8_0, bf16, kFloat, false)
PW_QUANT_MATMUL(pw_q8_0_matmul_f32, Q8_0, float, kFloat, false)

// Q4_1 and Q8_0 tiles times activations rounded to P int8 planes (quant_avx2.h): int8
// (P = 1) and int16 (P = 2), on every tier.
#if defined(__AVX2__)
#define PW_INT_MATMUL(name, kernel, planes, type)                                          \
  void name(type* out, int64_t out_stride, const type* x, int64_t x_stride, int64_t T,       \
            const uint8_t* packed, int64_t N, int64_t K) {                                   \
    pw::avx2::matmul_int<planes, pw::avx2::kernel>(out, out_stride, x, x_stride, T, packed,  \
                                                   N, K);                                    \
  }
#else
#define PW_INT_MATMUL(name, kernel, planes, type)                                          \
  void name(type*, int64_t, const type*, int64_t, int64_t, const uint8_t*, int64_t, int64_t) {}
#endif
PW_INT_MATMUL(pw_q4_1_i8_matmul_bf16, Q4_1_Int, 1, bf16)
PW_INT_MATMUL(pw_q4_1_i8_matmul_f32, Q4_1_Int, 1, float)
PW_INT_MATMUL(pw_q8_0_i8_matmul_bf16, Q8_0_Int, 1, bf16)
PW_INT_MATMUL(pw_q8_0_i8_matmul_f32, Q8_0_Int, 1, float)
PW_INT_MATMUL(pw_q4_1_i16_matmul_bf16, Q4_1_Int, 2, bf16)
PW_INT_MATMUL(pw_q4_1_i16_matmul_f32, Q4_1_Int, 2, float)
PW_INT_MATMUL(pw_q8_0_i16_matmul_bf16, Q8_0_Int, 2, bf16)
PW_INT_MATMUL(pw_q8_0_i16_matmul_f32, Q8_0_Int, 2, float)

// Whether this build has the quantized matmuls (every tier from AVX2 up).
int64_t pw_quant_matmuls() {
#if defined(__AVX512BF16__) || defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
