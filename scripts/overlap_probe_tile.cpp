// Does this CPU overlap compute with a DRAM stream? (the skinny kernel's access pattern; docs/performance.md, session 20)
// usage: g++ -O3 -march=native -o /tmp/probe scripts/overlap_probe_tile.cpp && /tmp/probe   (AVX-512 CPUs)
// Skinny-pattern overlap probe: tiles of 3 contiguous rows of ROW bytes; per step one 64-byte
// line of each row (3 loads), F FMAs per line on 8 accumulators; prefetch AHEAD tiles on.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sys/mman.h>
#include <initializer_list>
template <int F, int AHEAD, int LOC>
__attribute__((noinline)) float run(const float* p, size_t n, size_t row) {
  __m512 a[8]; for (auto& x : a) x = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(1.0001f);
  const size_t tile = 3 * row;
  for (size_t t = 0; t + tile <= n; t += tile) {
    const float* r = p + t;
    const char* nx = (const char*)(p + t + AHEAD * tile);
    for (size_t k = 0; k < row; k += 16) {
      if (AHEAD) for (int j = 0; j < 3; ++j) __builtin_prefetch(nx + (j * row + k) * 4, 0, LOC);
      for (int j = 0; j < 3; ++j) {
        __m512 v = _mm512_loadu_ps(r + j * row + k);
#pragma GCC unroll 64
        for (int f = 0; f < F; ++f) a[f % 8] = _mm512_fmadd_ps(a[f % 8], m, v);
        if (F == 0) a[j] = _mm512_add_ps(a[j], v);
      }
    }
  }
  __m512 s = a[0]; for (int i = 1; i < 8; ++i) s = _mm512_add_ps(s, a[i]);
  return _mm512_reduce_add_ps(s);
}
template <int F, int AHEAD, int LOC>
void row(const float* big, size_t nb, const float* small, size_t ns, size_t rowl) {
  auto time = [&](const float* p, size_t n, int inner) { double best = 1e30; for (int r = 0; r < 5; ++r) { auto t0 = std::chrono::steady_clock::now(); volatile float s = 0; for (int k = 0; k < inner; ++k) s += run<F, AHEAD, LOC>(p, n, rowl); double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); if (t < best) best = t; } return n * 4.0 * inner / best / 1e9; };
  printf("row %5zu B  FMA/line %3d  ahead %d loc %d  DRAM %6.1f GB/s  in L2 %6.1f GB/s\n", rowl * 4, F, AHEAD, LOC, time(big, nb, 1), time(small, ns, 200));
}
int main() {
  size_t nb = (size_t)512 << 20 >> 2, ns = (size_t)192 << 10 >> 2;
  float* big = (float*)aligned_alloc(2 << 20, nb * 4); madvise(big, nb * 4, MADV_HUGEPAGE);
  float* small = (float*)aligned_alloc(64, ns * 4);
  for (size_t i = 0; i < nb; ++i) big[i] = 1e-3f; for (size_t i = 0; i < ns; ++i) small[i] = 1e-3f;
  for (size_t rl : {(size_t)512, (size_t)1408}) {
    row<0, 0, 3>(big, nb, small, ns, rl);
    row<8, 0, 3>(big, nb, small, ns, rl);
    row<8, 1, 2>(big, nb, small, ns, rl);
    row<8, 1, 0>(big, nb, small, ns, rl);
    row<8, 2, 0>(big, nb, small, ns, rl);
    row<12, 0, 3>(big, nb, small, ns, rl);
    row<12, 1, 0>(big, nb, small, ns, rl);
    row<12, 2, 0>(big, nb, small, ns, rl);
    row<12, 1, 3>(big, nb, small, ns, rl);
  }
}
