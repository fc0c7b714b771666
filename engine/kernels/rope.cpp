// Rotary position embedding (NeoX layout) in place, float32 or bf16: for each row t and each of
// the first `heads` heads of head_dim D in that row, x1 = x[:D/2], x2 = x[D/2:] become
// x1 * cos_t - x2 * sin_t and x2 * cos_t + x1 * sin_t (engine/models/rope.py's apply_rotary,
// the same products and sums; bf16 rounds each product and each sum to bf16 as torch's bf16
// ops in apply_rotary and transformers do). Called on a layer's fused q|k|v matmul output with
// heads = num_heads + num_kv_heads, so q and k rotate in one pass with no temporaries. Rows
// are split over threads; the arithmetic runs on the current_isa() path (isa.h, simd.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace {

using namespace simd;

// One value or one vector of values of x1 and x2 rotated on path P (bf16: every product and
// sum rounded to bf16, c10's rounding).
template <typename P, typename T>
inline void rotate_step(T* x1, T* x2, const T* c, const T* s) {
  const auto a = P::load(x1), b = P::load(x2), cv = P::load(c), sv = P::load(s);
  if constexpr (std::is_same_v<T, bf16>) {
    auto r = [](typename P::V v) { return P::round_bf16(v); };
    P::store_bf16(x1, P::sub(r(P::mul(a, cv)), r(P::mul(b, sv))));
    P::store_bf16(x2, P::add(r(P::mul(b, cv)), r(P::mul(a, sv))));
  } else {
    P::storef(x1, P::sub(P::mul(a, cv), P::mul(b, sv)));
    P::storef(x2, P::add(P::mul(b, cv), P::mul(a, sv)));
  }
}

template <typename P, typename T>
void rotate_rows(T* x, int64_t ldx, const T* cos, const T* sin, int64_t ldc, int64_t begin,
                 int64_t end, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t t = begin; t < end; ++t) {
    const T* c = cos + t * ldc;
    const T* s = sin + t * ldc;
    for (int64_t h = 0; h < heads; ++h) {
      T* x1 = x + t * ldx + h * dim;
      T* x2 = x1 + half;
      int64_t i = 0;
      for (; i + P::kStep <= half; i += P::kStep) rotate_step<P>(x1 + i, x2 + i, c + i, s + i);
      for (; i < half; ++i) rotate_step<Scalar>(x1 + i, x2 + i, c + i, s + i);
    }
  }
}

template <typename T>
void rope_all(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
              int64_t heads) {
  T* xp = reinterpret_cast<T*>(x.data_ptr());
  const T* cp = reinterpret_cast<const T*>(cos.data_ptr());
  const T* sp = reinterpret_cast<const T*>(sin.data_ptr());
  const int64_t ldx = x.stride(0), ldc = cos.stride(0), dim = 2 * cos.size(2);
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
    on_float_path([&](auto path) {
      rotate_rows<decltype(path)>(xp, ldx, cp, sp, ldc, b, e, heads, dim);
    });
  });
}

}  // namespace

// x: float32 or bf16 [T, W] with unit column stride (any row stride), W >= heads * head_dim;
// cos, sin: x's dtype, [T, 1, head_dim / 2] with unit last stride (views of the model's cos|sin
// cache).
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads) {
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == torch::kFloat || dt == torch::kBFloat16) && cos.scalar_type() == dt &&
                  sin.scalar_type() == dt,
              "rope_: float32 or bf16 only, x, cos and sin of one dtype");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && cos.dim() == 3 && cos.sizes() == sin.sizes() &&
                  cos.stride(2) == 1 && sin.stride(2) == 1 && cos.stride(0) == sin.stride(0),
              "rope_: x must be [T, W] with unit column stride, cos and sin [T, 1, D/2] alike");
  const int64_t t = x.size(0), half = cos.size(2), dim = 2 * half;
  TORCH_CHECK(cos.size(0) == t && heads * dim <= x.size(1), "rope_: shapes differ");
  if (dt == torch::kFloat)
    rope_all<float>(x, cos, sin, heads);
  else
    rope_all<bf16>(x, cos, sin, heads);
}
