// SwiGLU's activation, float32 or bf16: for each row of a gate|up matmul output [T, 2 * I],
// out[i] = silu(gate[i]) * up[i] (silu(x) = x * sigmoid(x), sigmoid from e = exp(-|x|) so
// the exp never overflows: 1 / (1 + e) for x >= 0, e / (1 + e) below), into a new contiguous
// [T, I] tensor: one vectorized pass instead of torch's silu and mul, and a down projection
// input oneDNN takes as it is (a strided half it would copy first). Rows split over threads;
// the current_isa() path (isa.h, simd.h) runs it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace {

using namespace simd;

template <typename P>
void silu_rows(const float* x, float* out, int64_t begin, int64_t end, int64_t inter) {
  const auto one = P::set1(1.f);
  for (int64_t t = begin; t < end; ++t) {
    const float* g = x + t * 2 * inter;
    const float* u = g + inter;
    float* o = out + t * inter;
    int64_t i = 0;
    for (; i + P::kStep <= inter; i += P::kStep) {
      const auto xv = P::loadf(g + i);
      const auto e = P::exp(P::sub(P::zero(), P::abs(xv)));
      const auto r = P::div(one, P::add(one, e));  // sigmoid(|x|)
      const auto sig = P::nonneg_select(xv, r, P::mul(e, r));
      P::storef(o + i, P::mul(P::mul(xv, sig), P::loadf(u + i)));
    }
    for (; i < inter; ++i) {
      const float e = exp_nonpos(-std::fabs(g[i])), r = 1.f / (1.f + e);
      o[i] = g[i] * (g[i] >= 0.f ? r : e * r) * u[i];
    }
  }
}

// bf16 rows with the roundings of torch's `F.silu(gate) * up` on bf16 tensors (which
// transformers runs): silu in float32, rounded to bf16, times up in float32, rounded to bf16.
// kStep values at a time through float32 buffers (the conversions vectorize).
template <typename P>
void silu_rows_bf16(const bf16* x, bf16* out, int64_t begin, int64_t end, int64_t inter) {
  constexpr int64_t n = P::kStep;
  const auto one = P::set1(1.f);
  float g[n], u[n];
  for (int64_t t = begin; t < end; ++t) {
    const bf16* gr = x + t * 2 * inter;
    const bf16* ur = gr + inter;
    bf16* o = out + t * inter;
    int64_t i = 0;
    for (; i + n <= inter; i += n) {
      for (int64_t j = 0; j < n; ++j) g[j] = static_cast<float>(gr[i + j]);
      for (int64_t j = 0; j < n; ++j) u[j] = static_cast<float>(ur[i + j]);
      const auto xv = P::loadf(g);
      const auto e = P::exp(P::sub(P::zero(), P::abs(xv)));
      const auto r = P::div(one, P::add(one, e));
      P::storef(g, P::mul(xv, P::nonneg_select(xv, r, P::mul(e, r))));
      for (int64_t j = 0; j < n; ++j)
        o[i + j] = static_cast<bf16>(static_cast<float>(static_cast<bf16>(g[j])) * u[j]);
    }
    for (; i < inter; ++i) {
      const float gi = static_cast<float>(gr[i]);
      const float e = exp_nonpos(-std::fabs(gi)), r = 1.f / (1.f + e);
      const float si = static_cast<float>(static_cast<bf16>(gi * (gi >= 0.f ? r : e * r)));
      o[i] = static_cast<bf16>(si * static_cast<float>(ur[i]));
    }
  }
}

}  // namespace

// x: float32 or bf16 [T, 2 * inter] contiguous (gate | up); returns silu(gate) * up,
// [T, inter], x's dtype.
torch::Tensor silu_mul(torch::Tensor x, int64_t inter) {
  TORCH_CHECK((x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) &&
                  x.dim() == 2 && x.is_contiguous() && x.size(1) == 2 * inter,
              "silu_mul: x must be contiguous float32 or bf16 [T, 2 * inter]");
  auto out = torch::empty({x.size(0), inter}, x.options());
  if (x.scalar_type() == torch::kBFloat16) {
    const bf16* p = reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>());
    bf16* o = reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>());
    at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if (current_isa() >= Isa::kAvx512) return silu_rows_bf16<Avx512>(p, o, b, e, inter);
#endif
#if defined(__AVX2__) && defined(__FMA__)
      if (current_isa() >= Isa::kAvx2) return silu_rows_bf16<Avx2>(p, o, b, e, inter);
#endif
      silu_rows_bf16<Scalar>(p, o, b, e, inter);
    });
    return out;
  }
  const float* p = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (current_isa() >= Isa::kAvx512) return silu_rows<Avx512>(p, o, b, e, inter);
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (current_isa() >= Isa::kAvx2) return silu_rows<Avx2>(p, o, b, e, inter);
#endif
    silu_rows<Scalar>(p, o, b, e, inter);
  });
  return out;
}
