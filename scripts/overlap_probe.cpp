// Does this CPU overlap compute with a DRAM stream? (a sequential stream; docs/performance.md, session 20)
// usage: g++ -O3 -march=native -o /tmp/probe scripts/overlap_probe.cpp && /tmp/probe   (AVX-512 CPUs)
// Overlap probe: stream a buffer much larger than L3 once, doing F dependent-chain-free FMAs
// (on 8 independent zmm accumulators) per 64-byte line. Compare achieved GB/s against
// the pure stream (F=0) and the in-core rate (same loop over an L2-resident buffer).
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
template <int F, int PF>
__attribute__((noinline)) float run(const float* p, size_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  const __m512 m = _mm512_set1_ps(1.0001f);
  for (size_t i = 0; i < n; i += 16) {
    if (PF) __builtin_prefetch(p + i + PF / 4, 0, 0);
    __m512 v = _mm512_loadu_ps(p + i);
    a0 = _mm512_add_ps(a0, v);
#pragma GCC unroll 64
    for (int f = 0; f < F; f += 8) {
      a0 = _mm512_fmadd_ps(a0, m, v); a1 = _mm512_fmadd_ps(a1, m, v);
      a2 = _mm512_fmadd_ps(a2, m, v); a3 = _mm512_fmadd_ps(a3, m, v);
      a4 = _mm512_fmadd_ps(a4, m, v); a5 = _mm512_fmadd_ps(a5, m, v);
      a6 = _mm512_fmadd_ps(a6, m, v); a7 = _mm512_fmadd_ps(a7, m, v);
    }
  }
  __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                           _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
  return _mm512_reduce_add_ps(s);
}
template <int F, int PF>
double gbps(const float* p, size_t n, int reps) {
  double best = 1e30; volatile float sink = 0;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    sink += run<F, PF>(p, n);
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (t < best) best = t;
  }
  return n * 4.0 / best / 1e9;
}
template <int F, int PF>
void row(const float* big, size_t nb, const float* small, size_t ns) {
  double mem = gbps<F, PF>(big, nb, 5);
  double core = 0;
  { double best = 1e30; for (int r = 0; r < 5; ++r) { auto t0 = std::chrono::steady_clock::now(); volatile float s = 0; for (int k = 0; k < 200; ++k) s += run<F, PF>(small, ns); double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); if (t < best) best = t; } core = ns * 4.0 * 200 / best / 1e9; }
  printf("FMA/line %3d  prefetch %5d B  DRAM %6.1f GB/s  in L2 %6.1f GB/s\n", F, PF, mem, core);
}
int main() {
  size_t nb = (size_t)512 << 20 >> 2, ns = (size_t)256 << 10 >> 2;
  float* big = (float*)aligned_alloc(2 << 20, nb * 4); madvise(big, nb * 4, MADV_HUGEPAGE);
  float* small = (float*)aligned_alloc(64, ns * 4);
  for (size_t i = 0; i < nb; ++i) big[i] = 1e-3f; for (size_t i = 0; i < ns; ++i) small[i] = 1e-3f;
  row<0, 0>(big, nb, small, ns);
  row<8, 0>(big, nb, small, ns); row<16, 0>(big, nb, small, ns); row<24, 0>(big, nb, small, ns);
  row<32, 0>(big, nb, small, ns); row<48, 0>(big, nb, small, ns); row<64, 0>(big, nb, small, ns);
  row<16, 4096>(big, nb, small, ns); row<32, 4096>(big, nb, small, ns); row<48, 4096>(big, nb, small, ns);
  row<32, 16384>(big, nb, small, ns);
}
