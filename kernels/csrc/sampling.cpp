// Drawing one token per row by inverting its cumulative distribution (the sampler's random
// rows, actors/executor/sampler.py): the first token whose running sum of exp(x - max)
// reaches u times the row's total. torch needs a softmax, a cumulative sum and a search:
// four passes over [S, V] float32 with S x V temporaries; this makes three passes over each
// row while it sits in L2, rows spread over the threads, on each tier's widest vectors
// (float_vec.h).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "float_vec.h"
#include "pagewire_api.h"

namespace {

using namespace pw::vec;
constexpr int64_t kChunk = 16;          // tokens a partial sum of the search's first level
static_assert(kChunk % kLanes == 0);
constexpr float kNoScore = -1e30f;      // below any logit; finite under -ffast-math

// Whether a logit weighs anything (-inf: masked by bans, top-k/top-p, min-p, grammars).
inline bool live(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return bits != kMinusInfBits;
}

// `weights` gets exp(x - max) (0 for -inf and past V), `sums` each chunk's sum.
int64_t draw_row(const float* x, int64_t V, float u, std::vector<float>& weights,
                 std::vector<float>& sums) {
  const int64_t chunks = (V + kChunk - 1) / kChunk, whole = V / kLanes * kLanes;
  weights.resize(chunks * kChunk);
  sums.resize(chunks);
  float* w = weights.data();
  Vec top = vset1(kNoScore);
  for (int64_t i = 0; i < whole; i += kLanes) {
    const Vec v = vload(x + i);
    top = vmax(top, vlive_or(v, v, top));
  }
  float max = vmax_lane(top);
  for (int64_t i = whole; i < V; ++i) max = live(x[i]) ? std::max(max, x[i]) : max;
  // The last chunk's logits padded with -inf, so every chunk is read as whole vectors.
  float padded[kChunk], minus_inf;
  std::memcpy(&minus_inf, &kMinusInfBits, 4);
  std::fill(padded, padded + kChunk, minus_inf);
  std::copy(x + (chunks - 1) * kChunk, x + V, padded);
  const Vec minus_max = vset1(-max);
  float total = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* src = c + 1 < chunks ? x + c * kChunk : padded;
    Vec sum = vzero();
    for (int64_t i = 0; i < kChunk; i += kLanes) {
      const Vec v = vload(src + i);
      const Vec e = vlive_or(v, vexp(vadd(v, minus_max)), vzero());
      vstore(w + c * kChunk + i, e);
      sum = vadd(sum, e);
    }
    sums[c] = vsum(sum);
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
  int64_t last = kChunk * c;
  for (int64_t i = kChunk * c; i < kChunk * c + kChunk; ++i) {   // weights past V are 0
    if (w[i] <= 0.f) continue;
    last = i;
    cum += w[i];
    if (cum >= target) return i;
  }
  return last;
}

}  // namespace

extern "C" {   // the entry point's contract: pagewire_api.h

void pw_sample_rows(const float* logits, int64_t rows, int64_t V, int64_t stride, const float* u,
                    int64_t* out) {
  if (V <= 0) return;                   // no token to draw (kernels/native.py never asks)
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights, sums;
    for (int64_t r = begin; r < end; ++r)
      out[r] = draw_row(logits + r * stride, V, u[r], weights, sums);
  });
}

}  // extern "C"
