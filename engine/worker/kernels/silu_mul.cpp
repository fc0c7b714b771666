// SwiGLU's activation in place, float32: for each row of a gate|up matmul output [T, 2 * I],
// gate[i] = silu(gate[i]) * up[i] (silu(x) = x * sigmoid(x), sigmoid from e = exp(-|x|) so
// the exp never overflows: 1 / (1 + e) for x >= 0, e / (1 + e) below). One pass instead of
// torch's in-place silu_ and mul_ on a strided half (two passes, the exp not vectorized
// there). Rows split over threads; the current_isa() path (isa.h, simd.h) runs the exp.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace {

using namespace simd;

inline float silu_one(float x) {
  const float e = exp_nonpos(-std::fabs(x));
  return x * (x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e));
}

template <typename P>
void silu_rows(float* x, int64_t begin, int64_t end, int64_t inter) {
  for (int64_t t = begin; t < end; ++t) {
    float* g = x + t * 2 * inter;
    const float* u = g + inter;
    int64_t i = 0;
    if constexpr (P::kStep > 1) {
      // Vector lanes: silu(x) = x * (x >= 0 ? 1 : e) / (1 + e), e = exp(-|x|).
      for (; i + P::kStep <= inter; i += P::kStep) {
        float xs[P::kStep], es[P::kStep];
        const auto xv = P::loadf(g + i);
        P::storef(xs, xv);
        for (int j = 0; j < P::kStep; ++j) es[j] = -std::fabs(xs[j]);
        const auto e = P::exp(P::loadf(es));
        P::storef(es, e);
        for (int j = 0; j < P::kStep; ++j) es[j] = (xs[j] >= 0.f ? 1.f : es[j]) / (1.f + es[j]);
        P::storef(g + i, P::mul(P::mul(xv, P::loadf(es)), P::loadf(u + i)));
      }
    }
    for (; i < inter; ++i) g[i] = silu_one(g[i]) * u[i];
  }
}

}  // namespace

// x: float32 [T, 2 * inter] contiguous (gate | up); gate becomes silu(gate) * up.
void silu_mul_(torch::Tensor x, int64_t inter) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) == 2 * inter,
              "silu_mul_: x must be contiguous float32 [T, 2 * inter]");
  float* p = x.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (current_isa() >= Isa::kAvx512) return silu_rows<Avx512>(p, b, e, inter);
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (current_isa() >= Isa::kAvx2) return silu_rows<Avx2>(p, b, e, inter);
#endif
    silu_rows<Scalar>(p, b, e, inter);
  });
}
