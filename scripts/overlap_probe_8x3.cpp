// The skinny kernel's float32 8x3 AVX-512 tile alone, weights from DRAM or L2 (docs/performance.md, session 20)
// usage: g++ -O3 -march=native -o /tmp/probe scripts/overlap_probe_8x3.cpp && /tmp/probe
// The real 8x3 tile in isolation: 3 weight rows of K floats (contiguous rows), 8 rows of x
// (L1), 24 accumulators, hsum + store at the tile's end; next tile prefetched (NTA) or not.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sys/mman.h>
constexpr int K = 512;
template <int PF, bool HSUM>
__attribute__((noinline)) void run(const float* w, size_t n_rows, const float* x, float* y) {
  for (size_t r = 0; r + 3 <= n_rows; r += 3) {
    const float* wr = w + r * K;
    const char* nx = (const char*)(wr + PF * 3 * K);
    __m512 acc[8][3];
    for (int i = 0; i < 8; ++i) for (int j = 0; j < 3; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
      if (PF) for (int j = 0; j < 3; ++j) __builtin_prefetch(nx + (k * 3 + j * 16) * 4, 0, 0);
      __m512 wv[3];
      for (int j = 0; j < 3; ++j) { wv[j] = _mm512_loadu_ps(wr + j * K + k); asm("" : "+v"(wv[j])); }
      for (int i = 0; i < 8; ++i) {
        __m512 xv = _mm512_loadu_ps(x + i * K + k); asm("" : "+v"(xv));
        for (int j = 0; j < 3; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
    if (HSUM) {
      for (int i = 0; i < 8; ++i) for (int j = 0; j < 3; ++j) y[i * 4096 + r + j] = _mm512_reduce_add_ps(acc[i][j]);
    } else {
      __m512 s = acc[0][0];
      for (int i = 0; i < 8; ++i) for (int j = 0; j < 3; ++j) s = _mm512_add_ps(s, acc[i][j]);
      _mm512_storeu_ps(y + (r % 4096), s);
    }
  }
}
template <int PF, bool HSUM>
void row(const float* big, size_t nb, const float* small, size_t ns, const float* x, float* y) {
  auto time = [&](const float* p, size_t n, int inner) { double best = 1e30; for (int rr = 0; rr < 5; ++rr) { auto t0 = std::chrono::steady_clock::now(); for (int k = 0; k < inner; ++k) run<PF, HSUM>(p, n / K, x, y); double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); if (t < best) best = t; } return (n / K / 3 * 3) * K * 4.0 * inner / best / 1e9; };
  printf("8x3 tile  prefetch %d tile(s) ahead  hsum %d  DRAM %6.1f GB/s  in L2 %6.1f GB/s\n", PF, HSUM, time(big, nb, 1), time(small, ns, 200));
}
int main() {
  size_t nb = (size_t)384 << 20 >> 2, ns = (size_t)(3 * 64) * K;
  float* big = (float*)aligned_alloc(2 << 20, nb * 4); madvise(big, nb * 4, MADV_HUGEPAGE);
  float* small = (float*)aligned_alloc(64, ns * 4);
  float* x = (float*)aligned_alloc(64, 8 * K * 4); float* y = (float*)aligned_alloc(64, 8 * 4096 * 4 * 64);
  for (size_t i = 0; i < nb; ++i) big[i] = 1e-3f; for (size_t i = 0; i < ns; ++i) small[i] = 1e-3f;
  for (int i = 0; i < 8 * K; ++i) x[i] = 1.f;
  row<0, true>(big, nb, small, ns, x, y); row<1, true>(big, nb, small, ns, x, y);
  row<2, true>(big, nb, small, ns, x, y); row<1, false>(big, nb, small, ns, x, y);
  row<0, false>(big, nb, small, ns, x, y);
}
