// What a matmul tile of the skinny_linear kind reaches on one core with its operands in L1:
// MB rows of x against NB weight rows, one vector of each a step, MB * NB accumulators, every
// vector loaded (x and w both stream from L1), against the same FMAs on registers only (the
// roofline's FMA peak). AVX-512 (F, BF16) only. A core's L1 holds 32-48 KiB.
// build: g++ -O3 -march=native -o /tmp/tile_ceiling_probe scripts/tile_ceiling_probe.cpp
// run:   taskset -c 1 /tmp/tile_ceiling_probe
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

using Clock = std::chrono::steady_clock;

template <int MB, int NB>
__attribute__((noinline)) void tile32(const float* x, const float* w, float* y, long K) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (long k = 0; k < K; k += 16) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = _mm512_loadu_ps(w + j * K + k);
      asm("" : "+v"(wv[j]));
    }
    for (int i = 0; i < MB; ++i) {
      __m512 xv = _mm512_loadu_ps(x + i * K + k);
      asm("" : "+v"(xv));
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * NB + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int MB, int NB>
__attribute__((noinline)) void tile16(const uint16_t* x, const uint16_t* w, float* y, long K) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (long k = 0; k < K; k += 32) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
      asm("" : "+v"(wv[j]));
    }
    for (int i = 0; i < MB; ++i) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + k);
      asm("" : "+v"(xv));
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * NB + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <typename T, typename F>
double best_gflops(F&& call, double flop) {
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    const auto s = Clock::now();
    call();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - s).count());
  }
  return flop / best / 1e9;
}

template <int MB, int NB, bool Bf16>
void tile(long K) {
  using T = std::conditional_t<Bf16, uint16_t, float>;
  T* x = static_cast<T*>(aligned_alloc(64, MB * K * sizeof(T)));
  T* w = static_cast<T*>(aligned_alloc(64, NB * K * sizeof(T)));
  for (long i = 0; i < MB * K; ++i) x[i] = Bf16 ? T(0x3c00 + i % 7) : T(1e-3f * (i % 7));
  for (long i = 0; i < NB * K; ++i) w[i] = Bf16 ? T(0x3c00 + i % 5) : T(1e-3f * (i % 5));
  static float y[64];
  const long reps = 2000000000L / (2L * MB * NB * K) + 1;
  const double g = best_gflops<T>([&] {
    for (long q = 0; q < reps; ++q) {
      if constexpr (Bf16) tile16<MB, NB>(x, w, y, K);
      else tile32<MB, NB>(x, w, y, K);
    }
  }, 2.0 * MB * NB * K * reps);
  std::printf("%s %dx%d K=%ld (x %ld KiB + w %ld KiB): %.0f GFLOP/s\n",
              Bf16 ? "bf16 dot" : "fp32 FMA", MB, NB, K, MB * K * long(sizeof(T)) >> 10,
              NB * K * long(sizeof(T)) >> 10, g);
  free(x);
  free(w);
}

// Chains independent accumulators, acc = acc * a + b: the roofline's FMA peak loop.
template <int Chains>
void registers() {
  __m512 acc[Chains];
  for (int c = 0; c < Chains; ++c) acc[c] = _mm512_set1_ps(1.f + 1e-3f * c);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  const long iters = 50000000;
  const double g = best_gflops<float>([&] {
    for (long i = 0; i < iters; ++i)
      for (int c = 0; c < Chains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  }, 32.0 * Chains * iters);
  float s = 0;
  for (int c = 0; c < Chains; ++c) s += _mm512_reduce_add_ps(acc[c]);
  std::printf("fp32 FMA, %d chains on registers: %.0f GFLOP/s (%g)\n", Chains, g, s);
}

int main() {
  registers<16>();
  tile<8, 3, false>(512);
  tile<8, 3, false>(2048);
  tile<8, 2, false>(512);
  tile<4, 4, false>(512);
  tile<6, 4, false>(512);
  tile<4, 6, false>(512);
  tile<2, 8, false>(512);
  tile<8, 3, true>(512);
  tile<8, 3, true>(2048);
}
