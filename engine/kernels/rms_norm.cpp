// RMSNorm with the residual add before it, float32 or bf16, one pass per row: r = residual + x
// (or x when there is no residual yet), h = r / sqrt(mean(r^2) + eps) * weight, as the decoder
// layers' `residual = residual + x; h = rms_norm(residual)` (engine/models/layers.py), in one
// call instead of a torch add and a composite rms_norm (~7 ops, each a dispatch: most of the
// cost at a decode step's one row). bf16 keeps the roundings of transformers' bf16 layers:
// r rounded to bf16 (torch's bf16 add), the sum of squares of that r in float32, r * inv
// rounded to bf16, times the bf16 weight rounded again (`weight * h.to(bf16)`), each rounding
// c10's (round_bf16, store_bf16). Rows are split over threads; the arithmetic runs on the
// current_isa() path (isa.h, simd.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "simd.h"

namespace {

using namespace simd;

// v as a T holds it: bf16 rounds (c10's rounding), float32 is v.
template <typename P, typename T>
inline typename P::V as_t(typename P::V v) {
  if constexpr (std::is_same_v<T, bf16>)
    return P::round_bf16(v);
  else
    return v;
}

template <typename P, typename T>
inline void store(T* p, typename P::V v) {
  if constexpr (std::is_same_v<T, bf16>)
    P::store_bf16(p, v);
  else
    P::storef(p, v);
}

// One value or one vector of values of a row on path P: r = x (+ res), its square added to ss.
template <typename P, typename T>
inline void add_step(const T* x, const T* res, T* r, typename P::V& ss) {
  auto v = P::load(x);
  if (res != nullptr) v = as_t<P, T>(P::add(v, P::load(res)));
  store<P, T>(r, v);
  ss = P::template madd<float>(ss, v, v);
}

template <typename P, typename T>
inline void scale_step(const T* r, const T* w, T* h, typename P::V inv) {
  store<P, T>(h, P::mul(as_t<P, T>(P::mul(P::load(r), inv)), P::load(w)));
}

template <typename P, typename T>
void norm_rows(const T* x, const T* res, const T* w, T* h, T* r, int64_t begin, int64_t end,
               int64_t n, float eps) {
  for (int64_t t = begin; t < end; ++t) {
    const T* xt = x + t * n;
    const T* rs = res != nullptr ? res + t * n : nullptr;
    T* rt = r + t * n;
    T* ht = h + t * n;
    auto ss = P::zero();
    int64_t i = 0;
    for (; i + P::kStep <= n; i += P::kStep)
      add_step<P>(xt + i, rs != nullptr ? rs + i : nullptr, rt + i, ss);
    float sum = P::hsum(ss);
    for (; i < n; ++i) add_step<Scalar>(xt + i, rs != nullptr ? rs + i : nullptr, rt + i, sum);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
    i = 0;
    for (; i + P::kStep <= n; i += P::kStep) scale_step<P>(rt + i, w + i, ht + i, P::set1(inv));
    for (; i < n; ++i) scale_step<Scalar>(rt + i, w + i, ht + i, inv);
  }
}

template <typename T>
void norm_all(const torch::Tensor& x, const T* res, const torch::Tensor& weight, torch::Tensor& h,
              torch::Tensor& r, float eps) {
  auto ptr = [](const torch::Tensor& a) { return reinterpret_cast<T*>(a.data_ptr()); };
  const T* xp = ptr(x);
  const T* wp = ptr(weight);
  T* hp = ptr(h);
  T* rp = ptr(r);
  const int64_t n = x.size(1);
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t end) {
    on_float_path([&](auto path) {
      norm_rows<decltype(path)>(xp, res, wp, hp, rp, b, end, n, eps);
    });
  });
}

}  // namespace

// x, residual: float32 or bf16 [T, n] contiguous (residual may be None); weight: [n], all of one
// dtype. Returns (h, r): the normed rows and residual + x (x itself, a copy, without a residual).
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x,
                                                      c10::optional<torch::Tensor> residual,
                                                      torch::Tensor weight, double eps) {
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == torch::kFloat || dt == torch::kBFloat16) && weight.scalar_type() == dt,
              "add_rms_norm: float32 or bf16 only, x and weight of one dtype");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "add_rms_norm: x must be contiguous [T, n] and weight [n]");
  const void* res = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == dt && residual->is_contiguous() &&
                    residual->sizes() == x.sizes(),
                "add_rms_norm: residual must be a contiguous tensor shaped like x, of its dtype");
    res = residual->data_ptr();
  }
  auto h = torch::empty_like(x), r = torch::empty_like(x);
  const float e = static_cast<float>(eps);
  if (dt == torch::kFloat)
    norm_all<float>(x, static_cast<const float*>(res), weight, h, r, e);
  else
    norm_all<bf16>(x, static_cast<const bf16*>(res), weight, h, r, e);
  return {h, r};
}
