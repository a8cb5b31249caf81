// Drawing one token per row by inverting its cumulative distribution (the sampler's random
// rows, actors/executor/sampler.py): the first token whose running sum of exp(x - max)
// reaches u times the row's total. torch needed a softmax, a cumulative sum and a search,
// four passes over [S, V] float32 with S x V temporaries (~14 ms at 128 x 49152 here); this
// makes three passes over each row while it sits in L2, rows spread over the threads.
// Built with the bf16 kernels (it shares their vector exp, attention_tiles.h).
#include <ATen/Parallel.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <vector>

#include "attention_tiles.h"

namespace {

#if defined(__AVX512BF16__)
constexpr uint32_t kMinusInf = 0xff800000u;   // masked tokens (bans, top-k/top-p, min-p)

// Lanes [0, n) of x[0..15] that hold a logit other than -inf (compared as bits: the library is
// built with -ffast-math, under which comparisons with infinities may be folded away).
inline __mmask16 live_lanes(const float* x, int64_t n, __m512* v) {
  const __mmask16 in = n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
  *v = _mm512_maskz_loadu_ps(in, x);
  return _mm512_mask_cmpneq_epi32_mask(in, _mm512_castps_si512(*v), _mm512_set1_epi32(kMinusInf));
}

// `weights` gets exp(x - max) (0 for -inf and past V), `sums` each 16-token chunk's sum.
int64_t draw_row(const float* x, int64_t V, float u, std::vector<float>& weights,
                 std::vector<float>& sums) {
  const int64_t chunks = (V + 15) / 16;
  weights.resize(chunks * 16);
  sums.resize(chunks);
  __m512 top = _mm512_set1_ps(pw::kNoScore), v;
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask16 live = live_lanes(x + 16 * c, V - 16 * c, &v);
    top = _mm512_mask_max_ps(top, live, top, v);
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  float total = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask16 live = live_lanes(x + 16 * c, V - 16 * c, &v);
    const __m512 e = _mm512_maskz_mov_ps(live, pw::exp_ps(_mm512_sub_ps(v, m)));
    _mm512_storeu_ps(weights.data() + 16 * c, e);
    sums[c] = _mm512_reduce_add_ps(e);
    total += sums[c];
  }
  // The chunk that crosses u * total, then the token inside it. u > 0, so a token of weight
  // 0 is never the first to reach the target; where rounding leaves the target just out of
  // reach (u near 1), the last token of weight is drawn.
  const float target = u * total;
  float cum = 0.f;
  int64_t c = 0, last_chunk = 0;
  for (; c < chunks; ++c) {
    if (sums[c] <= 0.f) continue;
    last_chunk = c;
    if (cum + sums[c] >= target) break;
    cum += sums[c];
  }
  if (c == chunks) c = last_chunk;
  int64_t last = 16 * c;
  for (int64_t i = 16 * c; i < 16 * c + 16; ++i) {   // weights past V are 0
    if (weights[i] <= 0.f) continue;
    last = i;
    cum += weights[i];
    if (cum >= target) return i;
  }
  return last;
}
#endif

}  // namespace

extern "C" {

// logits [rows, V] float32, rows `stride` apart; u [rows] in (0, 1]; out [rows] int64.
void pw_sample_rows(const float* logits, int64_t rows, int64_t V, int64_t stride, const float* u,
                    int64_t* out) {
#if defined(__AVX512BF16__)
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights, sums;
    for (int64_t r = begin; r < end; ++r)
      out[r] = draw_row(logits + r * stride, V, u[r], weights, sums);
  });
#endif
}

}  // extern "C"
