// A C++-only extension for builder tests: small enough to compile in seconds without CUDA
// (ATen/core/Tensor.h, not ATen/ATen.h: a third of the compile time with torch 2.13).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

at::Tensor add_one(const at::Tensor& x) { return x.add(1); }

TORCH_LIBRARY(apex_test_tiny, m) {
  m.def("add_one(Tensor x) -> Tensor");
  m.impl("add_one", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(add_one));
}
