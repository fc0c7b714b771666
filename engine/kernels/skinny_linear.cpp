// y = x @ w^T for a few rows of x: the matmuls of a decode step with a small batch.
//
// With few rows the work is bound by reading the weight once from memory, and the BLAS gemm
// spends up to twice that (it packs the weight for every call). This kernel streams w
// straight from its [N, K] row-major layout: a tile of 4 weight rows (one vector-wide slice of
// each per step) against up to 3 rows of x, 12 accumulators, a horizontal sum at the end; for
// at most kSequentialRows rows of x one weight row at a time (a single sequential stream,
// software-prefetched ahead on AVX2).
// The weight rows are split over threads with at::parallel_for.
//
// float32 and bfloat16 (x and w of the same dtype; bf16 accumulates in float32 and rounds the
// result to bf16 once). One template, one "path" type per instruction set (isa.h):
// - Avx512Bf16: 32 bf16 per step, vdpbf16ps (two bf16 products per fp32 lane);
// - Avx512 / Avx2: 16 / 8 values per step, bf16 widened to fp32 by a shift, FMA;
// - Scalar: one value per step, plain C++ (a serial float sum: the compiler cannot vectorize
//   it without reassociating, so forcing it really runs scalar code).
// The K tail (K not a multiple of the step) is zero-padded into a vector, so each output sums
// its products in the same order whatever the number of rows: a sequence's result does not
// depend on its batch (per path; different paths round differently).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace {

using namespace simd;

// Up to this many rows of x, w is read one row at a time: one sequential stream, which the
// hardware prefetcher follows at the full streaming bandwidth (4 interleaved streams of one
// row each are too short for it: 0.55-0.65 of the streaming read on an AMD EPYC with
// AVX-512, against 0.95-1.0 for the single stream, `pdserve bench roofline`). Beyond it the
// 4-row tile's reuse of each x load matters more. The per-output sums are the same either way.
constexpr int64_t kSequentialRows = 4;

// How far ahead of its loads the single-row stream prefetches w, in bytes, on paths whose loads
// are narrow (AVX2's 32 bytes): there the hardware prefetcher alone left the single stream at
// 0.73-0.91 of the streaming read on a Zen 3 EPYC, and 2 KB ahead (a few hundred ns of
// DRAM latency at ~20 GB/s) gained 5-15 % (paired runs, thread CPU time). The 64-byte loads
// of AVX-512 already read at 0.95-1.0 and do not prefetch.
template <typename P>
constexpr int64_t kPrefetchBytes = 0;
#if defined(__AVX2__) && defined(__FMA__)
template <>
constexpr int64_t kPrefetchBytes<Avx2> = 2048;
#endif

// MB rows of x (stride K) against NB rows of w (stride K) into y (row stride N).
template <typename P, typename T, int MB, int NB>
inline void tile(const T* x, const T* w, T* y, int64_t K, int64_t N) {
  typename P::V acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = P::zero();
  int64_t k = 0;
  for (; k + P::kStep <= K; k += P::kStep) {
    typename P::template In<T> wv[NB];
    if constexpr (NB == 1 && kPrefetchBytes<P> > 0)  // no fault past the end: only a hint
      __builtin_prefetch(reinterpret_cast<const char*>(w + k) + kPrefetchBytes<P>);
    for (int j = 0; j < NB; ++j) wv[j] = P::load(w + j * K + k);
    for (int i = 0; i < MB; ++i) {
      const auto xv = P::load(x + i * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = P::template madd<T>(acc[i][j], xv, wv[j]);
    }
  }
  if (k < K) {  // the tail, zero-padded to one full step
    T pad[P::kStep];
    for (int i = 0; i < MB; ++i) {
      std::memset(static_cast<void*>(pad), 0, sizeof(pad));
      std::copy(x + i * K + k, x + (i + 1) * K, pad);
      const auto xv = P::load(pad);
      for (int j = 0; j < NB; ++j) {
        std::memset(static_cast<void*>(pad), 0, sizeof(pad));
        std::copy(w + j * K + k, w + (j + 1) * K, pad);
        acc[i][j] = P::template madd<T>(acc[i][j], xv, P::load(pad));
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * N + j] = static_cast<T>(P::hsum(acc[i][j]));
}

// Every row of x against NB rows of w.
template <typename P, typename T, int NB>
inline void all_rows(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile<P, T, 3, NB>(x + m * K, w, y + m * N, K, N);
  if (M - m == 2) tile<P, T, 2, NB>(x + m * K, w, y + m * N, K, N);
  if (M - m == 1) tile<P, T, 1, NB>(x + m * K, w, y + m * N, K, N);
}

template <typename P, typename T>
void run(const T* xp, const T* wp, T* yp, int64_t M, int64_t K, int64_t N) {
  const int64_t tiles = (N + 3) / 4;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * 4, nb = std::min<int64_t>(4, N - n);
      if (nb == 4 && M > kSequentialRows) {
        all_rows<P, T, 4>(xp, wp + n * K, yp + n, M, K, N);
      } else {
        for (int64_t j = 0; j < nb; ++j)
          all_rows<P, T, 1>(xp, wp + (n + j) * K, yp + n + j, M, K, N);
      }
    }
  });
}

template <typename T>
void dispatch(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N) {
  const Isa isa = current_isa();
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>)
    if (isa >= Isa::kAvx512Bf16) return run<Avx512Bf16, T>(x, w, y, M, K, N);
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (isa >= Isa::kAvx512) return run<Avx512, T>(x, w, y, M, K, N);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (isa >= Isa::kAvx2) return run<Avx2, T>(x, w, y, M, K, N);
#endif
  (void)isa;
  run<Scalar, T>(x, w, y, M, K, N);
}

}  // namespace

// x: [M, K], w: [N, K], both float32 or both bfloat16, contiguous. Returns [M, N], same dtype.
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w) {
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == torch::kFloat || dt == torch::kBFloat16) && w.scalar_type() == dt,
              "skinny_linear: x and w must be both float32 or both bfloat16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "skinny_linear: shapes must be [M, K] and [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "skinny_linear: tensors must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (dt == torch::kFloat)
    dispatch<float>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  else
    dispatch<bf16>(x.data_ptr<bf16>(), w.data_ptr<bf16>(), y.data_ptr<bf16>(), M, K, N);
  return y;
}
