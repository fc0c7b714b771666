// SwiGLU's activation, float32 or bf16: for each row of a gate|up matmul output [T, 2 * I],
// out[i] = silu(gate[i]) * up[i] (silu(x) = x * sigmoid(x), sigmoid from e = exp(-|x|) so
// the exp never overflows: 1 / (1 + e) for x >= 0, e / (1 + e) below), into a new contiguous
// [T, I] tensor: one vectorized pass instead of torch's silu and mul, and a down projection
// input oneDNN takes as it is (a strided half it would copy first). Rows split over threads;
// the current_isa() path (isa.h, simd.h) runs it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace {

using namespace simd;

// silu(x) = x * sigmoid(x), kStep lanes: sigmoid(|x|) = 1 / (1 + e), e = exp(-|x|), and
// e / (1 + e) for x < 0.
template <typename P>
typename P::V silu(typename P::V x) {
  const auto one = P::set1(1.f);
  const auto e = P::exp(P::sub(P::zero(), P::abs(x)));
  const auto r = P::div(one, P::add(one, e));
  return P::mul(x, P::nonneg_select(x, r, P::mul(e, r)));
}

// kStep values of silu(gate) * up on path P; bf16 with the roundings of torch's
// `F.silu(gate) * up` on bf16 tensors (which transformers runs): silu in float32, rounded to
// bf16, times up in float32, rounded to bf16 (round_bf16, store_bf16: c10's rounding).
template <typename P, typename T>
inline void silu_step(const T* g, const T* u, T* o) {
  const auto s = silu<P>(P::load(g));
  if constexpr (std::is_same_v<T, bf16>)
    P::store_bf16(o, P::mul(P::round_bf16(s), P::load(u)));
  else
    P::storef(o, P::mul(s, P::load(u)));
}

template <typename P, typename T>
void silu_rows(const T* x, T* out, int64_t begin, int64_t end, int64_t inter) {
  for (int64_t t = begin; t < end; ++t) {
    const T* g = x + t * 2 * inter;
    const T* u = g + inter;
    T* o = out + t * inter;
    int64_t i = 0;
    for (; i + P::kStep <= inter; i += P::kStep) silu_step<P>(g + i, u + i, o + i);
    for (; i < inter; ++i) silu_step<Scalar>(g + i, u + i, o + i);  // the row's last values
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
  const bool bf = x.scalar_type() == torch::kBFloat16;
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
    on_float_path([&](auto path) {
      using P = decltype(path);
      if (bf)
        silu_rows<P>(reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>()),
                     reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>()), b, e, inter);
      else
        silu_rows<P>(x.data_ptr<float>(), out.data_ptr<float>(), b, e, inter);
    });
  });
  return out;
}
