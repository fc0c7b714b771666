// Rotary position embedding (NeoX layout) in place, float32: for each row t and each of the
// first `heads` heads of head_dim D in that row, x1 = x[:D/2], x2 = x[D/2:] become
// x1 * cos_t - x2 * sin_t and x2 * cos_t + x1 * sin_t (engine/models/rope.py's apply_rotary,
// the same products and sums). Called on a layer's fused q|k|v matmul output with heads =
// num_heads + num_kv_heads, so q and k rotate in one pass with no temporaries. Rows are split
// over threads; the arithmetic runs on the current_isa() path (isa.h, simd.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#include "simd.h"

namespace {

using namespace simd;

template <typename P>
void rotate_rows(float* x, int64_t ldx, const float* cos, const float* sin, int64_t ldc,
                 int64_t begin, int64_t end, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t t = begin; t < end; ++t) {
    const float* c = cos + t * ldc;
    const float* s = sin + t * ldc;
    for (int64_t h = 0; h < heads; ++h) {
      float* x1 = x + t * ldx + h * dim;
      float* x2 = x1 + half;
      int64_t i = 0;
      for (; i + P::kStep <= half; i += P::kStep) {
        const auto a = P::loadf(x1 + i), b = P::loadf(x2 + i);
        const auto cv = P::loadf(c + i), sv = P::loadf(s + i);
        P::storef(x1 + i, P::sub(P::mul(a, cv), P::mul(b, sv)));
        P::storef(x2 + i, P::add(P::mul(b, cv), P::mul(a, sv)));
      }
      for (; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
  }
}

}  // namespace

// x: float32 [T, W] with unit column stride (any row stride), W >= heads * head_dim; cos, sin:
// float32 [T, 1, head_dim / 2] with unit last stride (views of the model's cos|sin cache).
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && cos.scalar_type() == torch::kFloat &&
                  sin.scalar_type() == torch::kFloat,
              "rope_: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && cos.dim() == 3 && cos.sizes() == sin.sizes() &&
                  cos.stride(2) == 1 && sin.stride(2) == 1 && cos.stride(0) == sin.stride(0),
              "rope_: x must be [T, W] with unit column stride, cos and sin [T, 1, D/2] alike");
  const int64_t t = x.size(0), half = cos.size(2), dim = 2 * half;
  TORCH_CHECK(cos.size(0) == t && heads * dim <= x.size(1), "rope_: shapes differ");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldc = cos.stride(0);
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
    on_float_path([&](auto path) {
      rotate_rows<decltype(path)>(xp, ldx, cp, sp, ldc, b, e, heads, dim);
    });
  });
}
