// y = x @ w^T for a few rows of x: the matmuls of a decode step with a small batch.
//
// With few rows the work is bound by reading the weight once from memory, and MKL's sgemm
// spends up to twice that (it packs the weight for every call). This kernel streams w
// straight from its [N, K] row-major layout: a tile of 4 weight rows (one 8-float slice of
// each per step, so 4 sequential streams) against up to 3 rows of x, 12 AVX2 accumulators, a
// horizontal sum at the end. Each output element sums its K products in the same order
// whatever the number of rows, so a sequence's result does not depend on its batch.
// The weight rows are split over threads with at::parallel_for.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// MB rows of x (stride K) against NB rows of w (stride K) into y (row stride N).
template <int MB, int NB>
inline void tile(const float* x, const float* w, float* y, int64_t K, int64_t N) {
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t t = k; t < K; ++t) s += x[i * K + t] * w[j * K + t];
      y[i * N + j] = s;
    }
}

// Every row of x against NB rows of w.
template <int NB>
inline void all_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile<3, NB>(x + m * K, w, y + m * N, K, N);
  if (M - m == 2) tile<2, NB>(x + m * K, w, y + m * N, K, N);
  if (M - m == 1) tile<1, NB>(x + m * K, w, y + m * N, K, N);
}

}  // namespace

// x: float32 [M, K], w: float32 [N, K], both contiguous. Returns float32 [M, N].
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat,
              "skinny_linear: x and w must be float32");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "skinny_linear: shapes must be [M, K] and [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "skinny_linear: tensors must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + 3) / 4;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * 4, nb = std::min<int64_t>(4, N - n);
      if (nb == 4) {
        all_rows<4>(xp, wp + n * K, yp + n, M, K, N);
      } else {
        for (int64_t j = 0; j < nb; ++j) all_rows<1>(xp, wp + (n + j) * K, yp + n + j, M, K, N);
      }
    }
  });
  return y;
}

bool has_skinny_linear() { return true; }

#else  // no AVX2/FMA: the caller keeps F.linear

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(false, "skinny_linear: built without AVX2/FMA");
}

bool has_skinny_linear() { return false; }

#endif
