// The Python bindings of pdserve's compiled CPU kernels (one extension module).
#include <torch/extension.h>

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor chunks, torch::Tensor table,
                  torch::Tensor rows, torch::Tensor ctx_lens, int64_t layer, double scale);
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w);
bool has_skinny_linear();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("skinny_linear", &skinny_linear, "x @ w^T for a few rows of x (CPU, float32)");
  m.def("has_skinny_linear", &has_skinny_linear, "whether skinny_linear was compiled in");
}
