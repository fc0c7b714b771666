// The machine's own limits, for `pdserve bench roofline`: fp32 FMA peak, bf16 dot-product peak
// and streaming-read bandwidth, each on `threads` OpenMP threads, returning the seconds the
// slowest thread took (the caller turns them into GFLOP/s and GB/s).
//
// FMA peak: per thread kChains independent accumulators each updated `iters` times with one
// fused multiply-add of a full vector register: iters * kChains * lanes * 2 FLOP. Enough chains
// to cover latency x issue width (2 FMA pipes x 4-5 cycles = 8-10 in flight) and few enough to
// stay in registers with the two constants: 16 of the 32 zmm registers with AVX-512, 12 of the
// 16 ymm registers with AVX2 (16 chains there spilled to the stack: the loop then measured
// 58 GFLOP/s a thread on a Zen 3 EPYC whose sgemm reached 86, against ~100 with 12). The
// widest vectors present are used (AVX-512, else AVX2+FMA, else scalar floats: the build is
// -march=native, so "present" is this CPU).
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

namespace {

using Clock = std::chrono::steady_clock;

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
const char* kIsa = "avx512";
constexpr int kChains = 16;
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float vsum(Vec v) {
  float t[8];
  _mm256_storeu_ps(t, v);
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
const char* kIsa = "avx2";
constexpr int kChains = 12;
#else
using Vec = float;
constexpr int kLanes = 1;
inline Vec vset(float x) { return x; }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec vload(const float* p) { return *p; }
inline Vec vadd(Vec a, Vec b) { return a + b; }
inline float vsum(Vec v) { return v; }
const char* kIsa = "scalar";
constexpr int kChains = 8;
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

int64_t fma_lanes() { return kLanes; }
std::string fma_isa() { return kIsa; }
int64_t fma_chains() { return kChains; }

// Seconds for iters * fma_chains() vector FMAs on each of `threads` threads.
double fma_seconds(int64_t threads, int64_t iters) {
  return timed_parallel(static_cast<int>(threads), [&](int t) {
    Vec acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = vset(1.f + 1e-3f * (c + t));
    const Vec a = vset(0.999999f), b = vset(1e-7f);
    for (int64_t i = 0; i < iters; ++i)
      for (int c = 0; c < kChains; ++c) acc[c] = vfma(acc[c], a, b);
    Vec s = acc[0];
    for (int c = 1; c < kChains; ++c) s = vadd(s, acc[c]);
    g_sink = vsum(s);
  });
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
