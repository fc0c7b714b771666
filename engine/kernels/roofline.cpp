// The machine's own limits, for `pdserve bench roofline`: fp32 FMA peak, bf16 dot-product peak
// and streaming-read bandwidth, each on `threads` OpenMP threads, returning the seconds the
// slowest thread took (the caller turns them into GFLOP/s and GB/s).
//
// FMA peak: per thread `chains` independent accumulators each updated `iters` times with one
// fused multiply-add of a full vector register: iters * chains * lanes * 2 FLOP. Enough chains
// to cover latency x issue width (2 FMA pipes x 4-5 cycles = 8-10 in flight) and few enough to
// stay in registers with the two constants: 16 of the 32 zmm registers with AVX-512, 12 of the
// 16 ymm registers with AVX2 (16 chains there spilled to the stack: the loop then measured
// 58 GFLOP/s a thread on a Zen 3 EPYC whose sgemm reached 86, against ~100 with 12). The
// vectors are those of the path the kernels run on (current_isa(), isa.h: the widest this
// CPU has unless PDSERVE_ISA forces a lower one), so the peak is the one those kernels can
// reach: with PDSERVE_ISA=avx2 an AVX-512 CPU stands in for an AVX2 one (256-bit FMAs).
// The streaming read always uses the widest vectors (the memory, not the path, bounds it).
// bf16 peak: 16 chains of vdpbf16ps (2 bf16 products per fp32 lane): iters * 16 * 16 * 4 FLOP.
// Clock: a chain of dependent register-register integer adds (one a cycle on every x86 core),
// 8 per loop pass, so the FMA rate can be checked against issue width x clock
// (`fma_per_cycle`). Not `add $1`: Intel's Golden Cove cores (Sapphire / Emerald Rapids)
// fold dependent adds of an immediate at rename, several a cycle (that chain read 11.9 GHz
// on a 2.96 GHz Xeon, whose register adds and 3-cycle imul chains both read 2.96).
// Streaming read: each thread sums its contiguous share of a buffer with 4 independent vector
// accumulators, so the loads are the only limit.
#include <torch/extension.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "isa.h"

namespace {

using Clock = std::chrono::steady_clock;

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum256(__m256 v) {
  float t[8];
  _mm256_storeu_ps(t, v);
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
#endif

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float vsum(Vec v) { return hsum256(v); }
#else
using Vec = float;
constexpr int kLanes = 1;
inline Vec vset(float x) { return x; }
inline Vec vload(const float* p) { return *p; }
inline Vec vadd(Vec a, Vec b) { return a + b; }
inline float vsum(Vec v) { return v; }
#endif

// Runs body(thread index) on `threads` threads at once; returns the slowest thread's seconds.
template <typename F>
double timed_parallel(int threads, F body) {
  std::vector<double> secs(threads, 0.0);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
#pragma omp barrier
    const auto start = Clock::now();
    body(t);
    secs[t] = std::chrono::duration<double>(Clock::now() - start).count();
  }
  double worst = 0.0;
  for (double s : secs) worst = std::max(worst, s);
  return worst;
}

volatile float g_sink;  // keeps the results alive so the loops are not optimised away

}  // namespace

namespace {

// The FMA loop of one path: its vector, lanes and chains (see the top of this file).
template <typename V, int Lanes, int Chains>
struct Peak {
  static constexpr int lanes = Lanes, chains = Chains;
  template <typename Set, typename Fma, typename Add, typename Sum>
  static double seconds(int threads, int64_t iters, Set set, Fma fma, Add add, Sum sum) {
    return timed_parallel(threads, [&](int t) {
      V acc[Chains];
      for (int c = 0; c < Chains; ++c) acc[c] = set(1.f + 1e-3f * (c + t));
      const V a = set(0.999999f), b = set(1e-7f);
      for (int64_t i = 0; i < iters; ++i)
        for (int c = 0; c < Chains; ++c) acc[c] = fma(acc[c], a, b);
      V s = acc[0];
      for (int c = 1; c < Chains; ++c) s = add(s, acc[c]);
      g_sink = sum(s);
    });
  }
};

using ScalarPeak = Peak<float, 1, 8>;
#if defined(__AVX2__) && defined(__FMA__)
using Avx2Peak = Peak<__m256, 8, 12>;
#endif
#if defined(__AVX512F__)
using Avx512Peak = Peak<__m512, 16, 16>;
#endif

// 2 = AVX-512, 1 = AVX2, 0 = scalar: the widest this build has that current_isa() allows.
int peak_path() {
#if defined(__AVX512F__)
  if (current_isa() >= Isa::kAvx512) return 2;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (current_isa() >= Isa::kAvx2) return 1;
#endif
  return 0;
}

}  // namespace

int64_t fma_lanes() {
  static constexpr int64_t lanes[] = {1, 8, 16};
  return lanes[peak_path()];
}
std::string fma_isa() {
  static const char* names[] = {"scalar", "avx2", "avx512"};
  return names[peak_path()];
}
int64_t fma_chains() {
  static constexpr int64_t chains[] = {ScalarPeak::chains, 12, 16};
  return chains[peak_path()];
}

// Seconds for iters * fma_chains() vector FMAs on each of `threads` threads.
double fma_seconds(int64_t threads, int64_t iters) {
  const int n = static_cast<int>(threads);
  switch (peak_path()) {
#if defined(__AVX512F__)
    case 2:
      return Avx512Peak::seconds(
          n, iters, [](float x) { return _mm512_set1_ps(x); },
          [](__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); },
          [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); },
          [](__m512 v) { return _mm512_reduce_add_ps(v); });
#endif
#if defined(__AVX2__) && defined(__FMA__)
    case 1:
      return Avx2Peak::seconds(
          n, iters, [](float x) { return _mm256_set1_ps(x); },
          [](__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); },
          [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); },
          [](__m256 v) { return hsum256(v); });
#endif
    default:
      return ScalarPeak::seconds(
          n, iters, [](float x) { return x; }, [](float a, float b, float c) { return a * b + c; },
          [](float a, float b) { return a + b; }, [](float v) { return v; });
  }
}

bool has_bf16_dot() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Seconds for iters * 16 vdpbf16ps (512-bit) on each thread; -1 without AVX512-BF16.
double bf16_dot_seconds(int64_t threads, int64_t iters) {
#if defined(__AVX512BF16__)
  return timed_parallel(static_cast<int>(threads), [&](int t) {
    constexpr int kDotChains = 16;
    __m512 acc[kDotChains];
    for (int c = 0; c < kDotChains; ++c) acc[c] = _mm512_set1_ps(1.f + 1e-3f * (c + t));
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
    const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3380);  // bf16 ~6e-8
    for (int64_t i = 0; i < iters; ++i)
      for (int c = 0; c < kDotChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
    __m512 s = acc[0];
    for (int c = 1; c < kDotChains; ++c) s = _mm512_add_ps(s, acc[c]);
    g_sink = _mm512_reduce_add_ps(s);
  });
#else
  (void)threads;
  (void)iters;
  return -1.0;
#endif
}

// Seconds for iters * 8 dependent integer adds on each of `threads` threads (8 * iters / s =
// the clock in Hz); -1 off x86-64.
double clock_seconds(int64_t threads, int64_t iters) {
#if defined(__x86_64__)
  return timed_parallel(static_cast<int>(threads), [&](int t) {
    uint64_t x = static_cast<uint64_t>(t), one = 1;
    for (int64_t i = 0; i < iters; ++i)
      asm volatile(
          "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
          "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0"
          : "+r"(x)
          : "r"(one));
    g_sink = static_cast<float>(x);
  });
#else
  (void)threads;
  (void)iters;
  return -1.0;
#endif
}

// Seconds for `threads` threads to read all of buf (float32, contiguous) once, each its share.
double read_seconds(torch::Tensor buf, int64_t threads) {
  TORCH_CHECK(buf.scalar_type() == torch::kFloat && buf.is_contiguous(),
              "read_seconds: buf must be contiguous float32");
  const float* p = buf.data_ptr<float>();
  const int64_t n = buf.numel();
  const int64_t step = 4 * kLanes;
  const int64_t per = (n / threads) / step * step;
  return timed_parallel(static_cast<int>(threads), [&](int t) {
    const float* q = p + t * per;
    Vec s0 = vset(0.f), s1 = vset(0.f), s2 = vset(0.f), s3 = vset(0.f);
    for (int64_t i = 0; i < per; i += step) {
      s0 = vadd(s0, vload(q + i));
      s1 = vadd(s1, vload(q + i + kLanes));
      s2 = vadd(s2, vload(q + i + 2 * kLanes));
      s3 = vadd(s3, vload(q + i + 3 * kLanes));
    }
    g_sink = vsum(vadd(vadd(s0, s1), vadd(s2, s3)));
  });
}
