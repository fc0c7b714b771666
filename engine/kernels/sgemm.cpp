// y = x @ w^T in float32 for many rows of x (a prefill's matmuls): a BLIS-style AVX2+FMA gemm.
//
// The register tile is 6 rows of x by 16 outputs (12 ymm accumulators, 2 for the 16 weights of
// a step, 1 for the broadcast x value: 15 of AVX2's 16 registers), 12 FMAs per step of k for 2
// vector loads and 6 broadcasts, which keeps a Zen 3 core's two FMA pipes busy. w [N, K] is
// packed per call into panels of 16 outputs x kc steps (k-major, 64 bytes a step, zero-padded
// past N), kc <= kMaxKc so that one panel (<= 16 KiB) stays in L1 beside the x rows of a tile
// while those of a kMc-row block (<= 96 KiB, read in place from their row stride) stay in L2
// (kc 384 measured 0.88x of 256 on a Zen 3 EPYC: its panel and x rows overflow the 32 KiB
// L1). The output is cut into kMc x kNc blocks split over threads with at::parallel_for; the
// packing too.
//
// Every output sums its products in one fixed order, whatever M, the block it falls in, the
// thread that computes it or the row tail: k ascending within a kc block (one FMA chain), the
// kc blocks' partial sums added to the output in ascending order. So a row's result does not
// depend on its batch, and runs repeat bit for bit. The rounding differs from MKL/oneDNN (they
// split k differently): within float32 tolerance of F.linear, not equal to it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "isa.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int kMr = 6;       // rows of x per register tile
constexpr int kNr = 16;      // outputs per register tile (two ymm)
constexpr int64_t kMaxKc = 256;  // k steps per packed panel: 16 x 256 x 4 B = 16 KiB (L1)
constexpr int64_t kMc = 96;  // rows of x per block (16 tiles)
constexpr int64_t kNc = 256; // outputs per block (16 panels)

// acc[MR] rows x 16 outputs over kc steps: a (row stride lda) against one packed panel b;
// c (row stride ldc) = acc, or += acc with `add`; only the first nr (<= 16) outputs stored.
template <int MR>
inline void tile(int64_t kc, const float* a, int64_t lda, const float* b, float* c, int64_t ldc,
                 bool add, int nr) {
  // Named accumulators (no arrays: GCC kept an array's copy in memory, a store per FMA).
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float* a0 = a;
  const float* a1 = a + lda;
  const float* a2 = a + 2 * lda;
  const float* a3 = a + 3 * lda;
  const float* a4 = a + 4 * lda;
  const float* a5 = a + 5 * lda;
#define PDS_ROW(i)                                      \
  if (MR > i) {                                         \
    const __m256 ai = _mm256_broadcast_ss(a##i + k);    \
    c##i##0 = _mm256_fmadd_ps(ai, b0, c##i##0);         \
    c##i##1 = _mm256_fmadd_ps(ai, b1, c##i##1);         \
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(b + k * kNr), b1 = _mm256_load_ps(b + k * kNr + 8);
    PDS_ROW(0) PDS_ROW(1) PDS_ROW(2) PDS_ROW(3) PDS_ROW(4) PDS_ROW(5)
  }
#undef PDS_ROW
  const __m256 acc[2 * kMr] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  alignas(32) float tmp[kNr];
  for (int i = 0; i < MR; ++i) {
    float* ci = c + i * ldc;
    __m256 v0 = acc[2 * i], v1 = acc[2 * i + 1];
    if (nr == kNr) {
      if (add) {
        v0 = _mm256_add_ps(_mm256_loadu_ps(ci), v0);
        v1 = _mm256_add_ps(_mm256_loadu_ps(ci + 8), v1);
      }
      _mm256_storeu_ps(ci, v0);
      _mm256_storeu_ps(ci + 8, v1);
    } else {
      _mm256_store_ps(tmp, v0);
      _mm256_store_ps(tmp + 8, v1);
      for (int j = 0; j < nr; ++j) ci[j] = add ? ci[j] + tmp[j] : tmp[j];
    }
  }
}

using TileFn = void (*)(int64_t, const float*, int64_t, const float*, float*, int64_t, bool, int);
constexpr TileFn kTiles[kMr + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// Panel s of k block [p0, p0 + kc): out[k * 16 + j] = w[(16 s + j) * K + p0 + k], 0 past N.
void pack_panel(const float* w, int64_t N, int64_t K, int64_t p0, int64_t kc, int64_t s,
                float* out) {
  const int64_t n0 = s * kNr, nr = std::min<int64_t>(kNr, N - n0);
  if (nr < kNr) std::fill(out, out + kc * kNr, 0.f);
  for (int64_t j = 0; j < nr; ++j) {
    const float* src = w + (n0 + j) * K + p0;
    for (int64_t k = 0; k < kc; ++k) out[k * kNr + j] = src[k];
  }
}

// The packed weight of the current call, reused across calls of the same Python thread (no
// page faults for a fresh multi-MiB buffer on every matmul).
float* pack_buffer(int64_t floats) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < floats + 16) buf.resize(floats + 16);
  auto p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
}

}  // namespace

torch::Tensor sgemm(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(current_isa() >= Isa::kAvx2, "sgemm: needs the avx2 path (now ",
              static_cast<int>(current_isa()), ")");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "sgemm: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "sgemm: float32 only");
  TORCH_CHECK(!x.is_cuda() && !w.is_cuda(), "sgemm: CPU tensors only");
  if (x.stride(1) != 1) x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), lda = x.stride(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const float* a = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* c = y.data_ptr<float>();
  // k blocks of equal length (a multiple of 4 but the last), at most kMaxKc each.
  const int64_t nk = (K + kMaxKc - 1) / kMaxKc;
  const int64_t kc0 = std::min<int64_t>(K, ((K + nk - 1) / nk + 3) / 4 * 4);
  const int64_t panels = (N + kNr - 1) / kNr;
  float* packed = pack_buffer(panels * kNr * K);  // block p at panels*16*p0, panel s after
  const int64_t nkb = (K + kc0 - 1) / kc0;
  at::parallel_for(0, panels * nkb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = i / panels, s = i % panels, p0 = p * kc0;
      const int64_t kc = std::min(kc0, K - p0);
      pack_panel(wp, N, K, p0, kc, s, packed + panels * kNr * p0 + s * kc * kNr);
    }
  });
  const int64_t mb = (M + kMc - 1) / kMc, nb = (N + kNc - 1) / kNc;
  at::parallel_for(0, mb * nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t i0 = (blk / nb) * kMc, j0 = (blk % nb) * kNc;
      const int64_t i1 = std::min(M, i0 + kMc), j1 = std::min(N, j0 + kNc);
      for (int64_t p0 = 0; p0 < K; p0 += kc0) {
        const int64_t kc = std::min(kc0, K - p0);
        const float* bp = packed + panels * kNr * p0;
        for (int64_t j = j0; j < j1; j += kNr) {
          const float* panel = bp + (j / kNr) * kc * kNr;
          const int nr = static_cast<int>(std::min<int64_t>(kNr, j1 - j));
          for (int64_t i = i0; i < i1; i += kMr) {
            const int mr = static_cast<int>(std::min<int64_t>(kMr, i1 - i));
            kTiles[mr](kc, a + i * lda + p0, lda, panel, c + i * N + j, N, p0 > 0, nr);
          }
        }
      }
    }
  });
  return y;
}

#else

torch::Tensor sgemm(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(false, "sgemm: this build has no AVX2+FMA path");
}

#endif
