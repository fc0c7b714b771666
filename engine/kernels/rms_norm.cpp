// RMSNorm with the residual add before it, float32, one pass per row: r = residual + x (or x
// when there is no residual yet), h = r / sqrt(mean(r^2) + eps) * weight, as the decoder
// layers' `residual = residual + x; h = rms_norm(residual)` (engine/models/layers.py), in one
// call instead of a torch add and a composite rms_norm (~7 ops, each a dispatch: most of the
// cost at a decode step's one row). Rows are split over threads; the sums of squares run on
// the current_isa() path (isa.h, simd.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "simd.h"

namespace {

using namespace simd;

template <typename P>
void norm_rows(const float* x, const float* res, const float* w, float* h, float* r,
               int64_t begin, int64_t end, int64_t n, float eps) {
  for (int64_t t = begin; t < end; ++t) {
    const float* xt = x + t * n;
    float* rt = r + t * n;
    float* ht = h + t * n;
    auto ss = P::zero();
    int64_t i = 0;
    for (; i + P::kStep <= n; i += P::kStep) {
      auto v = P::loadf(xt + i);
      if (res != nullptr) v = P::add(v, P::loadf(res + t * n + i));
      P::storef(rt + i, v);
      ss = P::template madd<float>(ss, v, v);
    }
    float sum = P::hsum(ss);
    for (; i < n; ++i) {
      const float v = res != nullptr ? xt[i] + res[t * n + i] : xt[i];
      rt[i] = v;
      sum += v * v;
    }
    const auto inv = P::set1(1.f / std::sqrt(sum / static_cast<float>(n) + eps));
    i = 0;
    for (; i + P::kStep <= n; i += P::kStep)
      P::storef(ht + i, P::mul(P::mul(P::loadf(rt + i), inv), P::loadf(w + i)));
    const float inv_s = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (; i < n; ++i) ht[i] = rt[i] * inv_s * w[i];
  }
}

}  // namespace

// x, residual: float32 [T, n] contiguous (residual may be None); weight: float32 [n].
// Returns (h, r): the normed rows and residual + x (x itself, a copy, without a residual).
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x,
                                                      c10::optional<torch::Tensor> residual,
                                                      torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat,
              "add_rms_norm: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "add_rms_norm: x must be contiguous [T, n] and weight [n]");
  const float* res = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == torch::kFloat && residual->is_contiguous() &&
                    residual->sizes() == x.sizes(),
                "add_rms_norm: residual must be a contiguous float32 tensor shaped like x");
    res = residual->data_ptr<float>();
  }
  const int64_t t = x.size(0), n = x.size(1);
  auto h = torch::empty_like(x), r = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* rp = r.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t end) {
    on_float_path([&](auto path) {
      norm_rows<decltype(path)>(xp, res, wp, hp, rp, b, end, n, e);
    });
  });
  return {h, r};
}
