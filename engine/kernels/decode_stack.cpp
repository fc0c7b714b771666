// The decoder layers of a step that holds only decodes, run by one compiled object instead of
// ~40 Python-level calls a layer. engine/models/layers.py runs a layer as add_rms_norm,
// skinny_linear (q|k|v), rope_, write_kv, paged_decode, skinny_linear (o), add_rms_norm,
// skinny_linear (gate|up), silu_mul and skinny_linear (down), each a call from Python with the
// checks, views and casts around it: on an Intel Xeon (Emerald Rapids, 1 thread) 1.3-1.4 ms of
// a 20.8 ms batch-8 fp32 step and ~0.7 ms of a 4.0 ms bf16 batch-1 step went to that Python
// (the model's forward less its kernels' time). Here the same kernels run in the same order on
// the same operands, so the results are bit-identical to the Python layers'
// (tests/unit/test_decode_stack.py), and engine/models/causal_lm.py takes this path only
// where those layers would call exactly these kernels. With tensor parallelism the
// all-reduces stay in Python between the two halves of each layer (`attention`, `mlp`); at
// TP = 1 `run` loops over every layer in one call. scripts/decode_stack_ab.py measures it.
#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x,
                                                      c10::optional<torch::Tensor> residual,
                                                      torch::Tensor weight, double eps);
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads);
void write_kv(torch::Tensor rows, torch::Tensor slots, int64_t offset, int64_t bs,
              torch::Tensor k, torch::Tensor v);
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor chunks, torch::Tensor table,
                  torch::Tensor rows, torch::Tensor ctx_lens, int64_t layer, double scale);
torch::Tensor silu_mul(torch::Tensor x, int64_t inter);

namespace {

using Pair = std::tuple<torch::Tensor, torch::Tensor>;

// One tensor per layer for each weight; the bias lists are empty where the model has none.
struct Weights {
  std::vector<torch::Tensor> input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, down;
};

// What every layer of one step shares (PagedAttention.decode_only, engine/runner/attention.py).
struct Step {
  torch::Tensor cos, sin, kv_rows, write_rows, chunks, table, rows, ctx;
  int64_t layer_stride = 0, block_size = 0;
  double scale = 0;
  bool set = false;
};

class DecodeStack {
 public:
  DecodeStack(std::vector<torch::Tensor> input_norm, std::vector<torch::Tensor> qkv,
              std::vector<torch::Tensor> qkv_bias, std::vector<torch::Tensor> o,
              std::vector<torch::Tensor> o_bias, std::vector<torch::Tensor> post_norm,
              std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down,
              int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, double eps)
      : w_{std::move(input_norm), std::move(qkv), std::move(qkv_bias), std::move(o),
           std::move(o_bias), std::move(post_norm), std::move(gate_up), std::move(down)},
        heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), inter_(inter), eps_(eps) {
    const size_t n = w_.qkv.size();
    TORCH_CHECK(w_.input_norm.size() == n && w_.o.size() == n && w_.post_norm.size() == n &&
                    w_.gate_up.size() == n && w_.down.size() == n &&
                    (w_.qkv_bias.empty() || w_.qkv_bias.size() == n) &&
                    (w_.o_bias.empty() || w_.o_bias.size() == n),
                "DecodeStack: one weight of each kind per layer");
  }

  void set_step(torch::Tensor cos, torch::Tensor sin, torch::Tensor kv_rows,
                torch::Tensor write_rows, int64_t layer_stride, int64_t block_size,
                torch::Tensor chunks, torch::Tensor table, torch::Tensor rows,
                torch::Tensor ctx, double scale) {
    s_ = Step{std::move(cos), std::move(sin), std::move(kv_rows), std::move(write_rows),
              std::move(chunks), std::move(table), std::move(rows), std::move(ctx),
              layer_stride, block_size, scale, true};
  }

  // Layer i up to its o projection: (o_proj output before any all-reduce, residual).
  Pair attention(int64_t i, torch::Tensor x, c10::optional<torch::Tensor> residual) {
    TORCH_CHECK(s_.set, "DecodeStack: set_step first");
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(w_.qkv.size()), "DecodeStack: no layer ", i);
    auto [h, res] = add_rms_norm(x, residual, w_.input_norm[i], eps_);
    torch::Tensor qkv = linear(h, w_.qkv[i], w_.qkv_bias, i);
    rope_(qkv, s_.cos, s_.sin, heads_ + kv_heads_);
    const int64_t n = qkv.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const auto kv_dtype = s_.kv_rows.scalar_type();
    write_kv(s_.kv_rows, s_.write_rows, i * s_.layer_stride, s_.block_size,
             qkv.narrow(1, q_size, kv_size).to(kv_dtype),
             qkv.narrow(1, q_size + kv_size, kv_size).to(kv_dtype));
    torch::Tensor q =
        qkv.narrow(1, 0, q_size).view({n, heads_, head_dim_}).to(torch::kFloat).contiguous();
    torch::Tensor out = torch::empty({n, heads_, head_dim_}, q.options());
    paged_decode(out, q, s_.chunks, s_.table, s_.rows, s_.ctx, i, s_.scale);
    return {skinny_linear(out.to(x.scalar_type()).reshape({n, q_size}), w_.o[i]), res};
  }

  // The rest of layer i from its (all-reduced) o projection: (MLP output before any
  // all-reduce, residual).
  Pair mlp(int64_t i, torch::Tensor o, torch::Tensor residual) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(w_.qkv.size()), "DecodeStack: no layer ", i);
    if (!w_.o_bias.empty()) o = o + w_.o_bias[i];
    auto [h, res] = add_rms_norm(o, residual, w_.post_norm[i], eps_);
    torch::Tensor act = silu_mul(skinny_linear(h, w_.gate_up[i]), inter_);
    return {skinny_linear(act, w_.down[i]), res};
  }

  // Every layer (no tensor parallelism): (last MLP output, residual before it).
  Pair run(torch::Tensor x) {
    c10::optional<torch::Tensor> residual;
    for (int64_t i = 0; i < static_cast<int64_t>(w_.qkv.size()); ++i) {
      auto [o, res] = attention(i, x, residual);
      auto [y, res2] = mlp(i, o, res);
      x = y;
      residual = res2;
    }
    return {x, residual.value_or(x)};
  }

 private:
  static torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w,
                              const std::vector<torch::Tensor>& bias, int64_t i) {
    torch::Tensor y = skinny_linear(x.contiguous(), w);
    return bias.empty() ? y : y.add_(bias[i]);
  }

  Weights w_;
  Step s_;
  int64_t heads_, kv_heads_, head_dim_, inter_;
  double eps_;
};

}  // namespace

void bind_decode_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecodeStack>(m, "DecodeStack",
                          "a decode-only step's decoder layers in compiled calls (CPU)")
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, std::vector<torch::Tensor>, int64_t, int64_t,
                    int64_t, int64_t, double>())
      .def("set_step", &DecodeStack::set_step, py::call_guard<py::gil_scoped_release>())
      .def("attention", &DecodeStack::attention, py::call_guard<py::gil_scoped_release>())
      .def("mlp", &DecodeStack::mlp, py::call_guard<py::gil_scoped_release>())
      .def("run", &DecodeStack::run, py::call_guard<py::gil_scoped_release>());
}
