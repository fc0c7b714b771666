// The Python bindings of pdserve's compiled CPU kernels (one extension module), and the
// instruction-set path they run on (isa.h).
#include <torch/extension.h>

#include <atomic>
#include <tuple>
#include <string>
#include <vector>

#include "isa.h"

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor chunks, torch::Tensor table,
                  torch::Tensor rows, torch::Tensor ctx_lens, int64_t layer, double scale);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x,
                                                      c10::optional<torch::Tensor> residual,
                                                      torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor x, int64_t inter);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads);
void write_kv(torch::Tensor rows, torch::Tensor slots, int64_t offset, int64_t bs,
              torch::Tensor k, torch::Tensor v);
void prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                       double scale, bool bf16_pairs);
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w);
torch::Tensor sgemm(torch::Tensor x, torch::Tensor w);
torch::Tensor argmax_rows(torch::Tensor logits);
int64_t fma_lanes();
std::string fma_isa();
double fma_seconds(int64_t threads, int64_t iters);
int64_t fma_chains();
double clock_seconds(int64_t threads, int64_t iters);
bool has_bf16_dot();
double bf16_dot_seconds(int64_t threads, int64_t iters);
double read_seconds(torch::Tensor buf, int64_t threads);
void bind_decode_stack(pybind11::module& m);  // decode_stack.cpp

namespace {

const char* const kIsaNames[] = {"scalar", "avx2", "avx512", "avx512_bf16"};
std::atomic<int> g_isa{static_cast<int>(kBestIsa)};

// The paths this build has, best first.
std::vector<std::string> isa_paths() {
  std::vector<std::string> out;
  for (int i = static_cast<int>(kBestIsa); i >= 0; --i) out.emplace_back(kIsaNames[i]);
  return out;
}

std::string get_isa() { return kIsaNames[g_isa.load()]; }

void set_isa(const std::string& name) {
  for (int i = 0; i <= static_cast<int>(kBestIsa); ++i)
    if (name == kIsaNames[i]) {
      g_isa.store(i);
      return;
    }
  TORCH_CHECK(false, "set_isa: '", name, "' is not a path this build has (it has: ",
              c10::Join(", ", isa_paths()), ")");
}

}  // namespace

Isa current_isa() { return static_cast<Isa>(g_isa.load(std::memory_order_relaxed)); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "residual add then RMSNorm, one pass (CPU, fp32)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "SwiGLU activation of a gate|up output, a new tensor (CPU, fp32 or bf16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_", &rope_, "rotary embedding in place on the first heads of each row (CPU, fp32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, "write one step's K and V at their paged-cache slots (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention", &prefill_attention, "causal prefill attention, flash style (CPU)",
        py::arg("out"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"),
        py::arg("bf16_pairs") = true, py::call_guard<py::gil_scoped_release>());
  m.def("skinny_linear", &skinny_linear, "x @ w^T for a few rows of x (CPU, float32 or bf16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("sgemm", &sgemm, "x @ w^T for many rows of x (CPU, float32, AVX2+FMA paths)",
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows,
        "torch.argmax(logits, -1) of float32 [N, V] logits, vectorized (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("isa_paths", &isa_paths, "instruction-set paths this build has, best first");
  m.def("get_isa", &get_isa, "the path the kernels run now");
  m.def("set_isa", &set_isa, "run the kernels on this path (one of isa_paths())");
  m.def("fma_lanes", &fma_lanes, "float32 lanes of the roofline FMA loop's vectors");
  m.def("fma_isa", &fma_isa, "instruction set of the roofline FMA loop");
  m.def("fma_seconds", &fma_seconds, "roofline: seconds for iters x fma_chains() FMAs per thread",
        py::call_guard<py::gil_scoped_release>());
  m.def("fma_chains", &fma_chains, "independent FMA chains per thread of fma_seconds");
  m.def("clock_seconds", &clock_seconds,
        "roofline: seconds for iters x 8 dependent integer adds per thread (the clock)",
        py::call_guard<py::gil_scoped_release>());
  m.def("has_bf16_dot", &has_bf16_dot, "whether the build has vdpbf16ps (AVX512-BF16)");
  m.def("bf16_dot_seconds", &bf16_dot_seconds,
        "roofline: seconds for iters x 16 vdpbf16ps per thread (-1 without AVX512-BF16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("read_seconds", &read_seconds, "roofline: seconds to stream-read a float32 buffer",
        py::call_guard<py::gil_scoped_release>());
  bind_decode_stack(m);
}
