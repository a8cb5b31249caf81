// How many multiply-adds a second this core does with 256-bit int16 products (vpmaddwd +
// vpaddd) against float32 FMAs (vfmadd231ps): kernels/quant.py blocks_serve_large_steps asks
// it once per library (native.Library.int16_mac_ratio), since whether the int16 GEMM
// (quant_gemm_avx2.h) beats oneDNN's float32 one on the avx2 tier depends on it. A vpmaddwd
// is 16 multiply-adds and an FMA 8, but cores issue them at different rates: where vpmaddwd
// runs on two pipes beside vpaddd (Zen 3, Zen 4, Skylake) the ratio is well above 1, where it
// has one pipe or half-width units (Haswell, Zen 1, Zen 2) about 1 or below (bench/NOTES.md
// "int16 GEMM on AVX2").
//
// Written in assembly so that what is timed is exactly the instructions named: compilers
// hoist, share or spill such loops (GCC turned one into stack round trips). Both loops hold
// 2 weight x 4 activation registers and 8 independent accumulators, enough to hide an FMA's
// latency of 4 at two a cycle.
#include <algorithm>
#include <chrono>
#include <cstdint>

#include "pagewire_api.h"

namespace {

#define PW_RATE_CLOBBERS "memory", "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", \
    "ymm7", "ymm8", "ymm9", "ymm10", "ymm11", "ymm12", "ymm13", "ymm14", "ymm15"
#define PW_MADD(x, w, acc, tmp) \
  "vpmaddwd %%ymm" #x ", %%ymm" #w ", %%ymm" #tmp "\n vpaddd %%ymm" #tmp ", %%ymm" #acc \
  ", %%ymm" #acc "\n"
#define PW_FMA(x, w, acc) "vfmadd231ps %%ymm" #x ", %%ymm" #w ", %%ymm" #acc "\n"
#define PW_MADD_PASS                                                                      \
  PW_MADD(10, 8, 0, 14) PW_MADD(10, 9, 1, 15) PW_MADD(11, 8, 2, 14) PW_MADD(11, 9, 3, 15) \
  PW_MADD(12, 8, 4, 14) PW_MADD(12, 9, 5, 15) PW_MADD(13, 8, 6, 14) PW_MADD(13, 9, 7, 15)
#define PW_ZERO(r) "vxorps %%ymm" #r ", %%ymm" #r ", %%ymm" #r "\n"
#define PW_FMA_PASS                                                                       \
  PW_FMA(10, 8, 0) PW_FMA(10, 9, 1) PW_FMA(11, 8, 2) PW_FMA(11, 9, 3)                     \
  PW_FMA(12, 8, 4) PW_FMA(12, 9, 5) PW_FMA(13, 8, 6) PW_FMA(13, 9, 7)

constexpr int64_t kPasses = 10000;     // ~25 us a loop on a 3.7 GHz core

// Multiply-adds a second of `kPasses` iterations of two passes (16 instructions of each).
template <bool kInt16>
double rate() {
  int64_t n = kPasses;
  const auto start = std::chrono::steady_clock::now();
  if (kInt16)   // integer products take as long whatever the registers hold
    asm volatile(
        "1:\n" PW_MADD_PASS PW_MADD_PASS "dec %0\n jnz 1b\n vzeroupper\n"
        : "+r"(n) : : PW_RATE_CLOBBERS);
  else          // zeros: a denormal sum would take microcode assists on some cores
    asm volatile(
        PW_ZERO(0) PW_ZERO(1) PW_ZERO(2) PW_ZERO(3) PW_ZERO(4) PW_ZERO(5) PW_ZERO(6)
        PW_ZERO(7) PW_ZERO(8) PW_ZERO(9) PW_ZERO(10) PW_ZERO(11) PW_ZERO(12) PW_ZERO(13)
        "1:\n" PW_FMA_PASS PW_FMA_PASS "dec %0\n jnz 1b\n vzeroupper\n"
        : "+r"(n) : : PW_RATE_CLOBBERS);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return kPasses * 16.0 * (kInt16 ? 16 : 8) / seconds;
}

}  // namespace

extern "C" {   // the entry point's contract: pagewire_api.h

// The ratio of the best of `rounds` timings of each loop, alternated so that a clock change
// or an interruption spoils one round of one kind, not the answer.
double pw_int16_mac_ratio(int64_t rounds) {
  double int16 = 0, fma = 0;
  for (int64_t r = 0; r < rounds; ++r) {
    int16 = std::max(int16, rate<true>());
    fma = std::max(fma, rate<false>());
  }
  return int16 / fma;
}

}  // extern "C"
