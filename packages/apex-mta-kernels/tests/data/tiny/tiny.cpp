// A C++-only extension for builder tests: small enough to compile in seconds without CUDA.
#include <ATen/ATen.h>
#include <torch/library.h>

at::Tensor add_one(const at::Tensor& x) { return x + 1; }

TORCH_LIBRARY(apex_test_tiny, m) {
  m.def("add_one(Tensor x) -> Tensor");
  m.impl("add_one", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(add_one));
}
