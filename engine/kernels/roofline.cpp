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

#include "simd.h"

namespace {

using namespace simd;
using Clock = std::chrono::steady_clock;

// The streaming read's vectors: the widest this build has, whatever path the kernels run.
#if defined(__AVX512F__) && defined(__AVX512BW__)
using Widest = Avx512;
#elif defined(__AVX2__) && defined(__FMA__)
using Widest = Avx2;
#else
using Widest = Scalar;
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

// The FMA loop of one path (simd.h's P): acc = acc * a + b on Chains accumulators.
template <typename P, int Chains>
struct Peak {
  static constexpr int chains = Chains;
  static double seconds(int threads, int64_t iters) {
    return timed_parallel(threads, [&](int t) {
      typename P::V acc[Chains];
      for (int c = 0; c < Chains; ++c) acc[c] = P::set1(1.f + 1e-3f * (c + t));
      const auto a = P::set1(0.999999f), b = P::set1(1e-7f);
      for (int64_t i = 0; i < iters; ++i)
        for (int c = 0; c < Chains; ++c) acc[c] = P::template madd<float>(b, acc[c], a);
      auto s = acc[0];
      for (int c = 1; c < Chains; ++c) s = P::add(s, acc[c]);
      g_sink = P::hsum(s);
    });
  }
};

// Chains and lanes of the path current_isa() allows (the widest this build has unless
// PDSERVE_ISA forces a lower one), and its FMA loop.
struct PeakPath {
  const char* isa;
  int64_t lanes, chains;
  double (*seconds)(int, int64_t);
};

PeakPath peak_path() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (current_isa() >= Isa::kAvx512)
    return {"avx512", Avx512::kStep, 16, &Peak<Avx512, 16>::seconds};
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (current_isa() >= Isa::kAvx2) return {"avx2", Avx2::kStep, 12, &Peak<Avx2, 12>::seconds};
#endif
  return {"scalar", 1, 8, &Peak<Scalar, 8>::seconds};
}

}  // namespace

int64_t fma_lanes() { return peak_path().lanes; }
std::string fma_isa() { return peak_path().isa; }
int64_t fma_chains() { return peak_path().chains; }

// Seconds for iters * fma_chains() vector FMAs on each of `threads` threads.
double fma_seconds(int64_t threads, int64_t iters) {
  return peak_path().seconds(static_cast<int>(threads), iters);
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
  constexpr int64_t kLanes = Widest::kStep, step = 4 * kLanes;
  const int64_t per = (n / threads) / step * step;
  return timed_parallel(static_cast<int>(threads), [&](int t) {
    const float* q = p + t * per;
    auto s0 = Widest::zero(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < per; i += step) {
      s0 = Widest::add(s0, Widest::loadf(q + i));
      s1 = Widest::add(s1, Widest::loadf(q + i + kLanes));
      s2 = Widest::add(s2, Widest::loadf(q + i + 2 * kLanes));
      s3 = Widest::add(s3, Widest::loadf(q + i + 3 * kLanes));
    }
    g_sink = Widest::hsum(Widest::add(Widest::add(s0, s1), Widest::add(s2, s3)));
  });
}
