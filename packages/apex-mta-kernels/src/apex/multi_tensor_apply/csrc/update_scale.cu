// update_scale_hysteresis: the dynamic loss-scale update of GradScaler with hysteresis (apex,
// used by NeMo/Megatron): an overflow backs the scale off only after `hysteresis` consecutive
// overflowing steps. One thread; every value stays on the device, so it can be captured.
#include "checks.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

namespace apex_mta {
namespace {

__global__ void update_scale_hysteresis_kernel(float* scale, int* growth_tracker,
                                               int* hysteresis_tracker, const float* found_inf,
                                               double growth_factor, double backoff_factor,
                                               int64_t growth_interval, int64_t hysteresis) {
  const bool found = *found_inf != 0.0f;  // nan counts as found
  if (found) {
    const int left = *hysteresis_tracker - 1;
    *hysteresis_tracker = left;
    *growth_tracker = 0;
    // Not yet `hysteresis` overflows in a row: keep the scale.
    if (left <= 0) *scale = static_cast<float>(static_cast<double>(*scale) * backoff_factor);
    return;
  }
  const int64_t successful = static_cast<int64_t>(*growth_tracker) + 1;
  if (successful == growth_interval) {
    const float grown = static_cast<float>(static_cast<double>(*scale) * growth_factor);
    if (isfinite(grown)) *scale = grown;  // never grow past fp32's range into inf
    *growth_tracker = 0;
  } else {
    *growth_tracker = static_cast<int>(successful);
  }
  *hysteresis_tracker = static_cast<int>(hysteresis);
}

void check_one(const char* name, const at::Tensor& t, at::ScalarType dtype, const at::Tensor& first) {
  constexpr const char* op = "update_scale_hysteresis";
  APEX_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", name, " must be a ", dtype_str(dtype),
                  " tensor, got ", dtype_str(t.scalar_type()));
  APEX_CHECK_VALUE(t.numel() == 1, op, ": ", name, " must have exactly one element, got ", t.numel());
  APEX_CHECK_VALUE(t.device() == first.device(), op, ": ", name, " is on ", t.device(),
                   " but current_scale is on ", first.device(), "; every tensor must be on one device");
}

void update_scale_hysteresis_cuda(const at::Tensor& current_scale, const at::Tensor& growth_tracker,
                                  const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                                  double growth_factor, double backoff_factor, int64_t growth_interval,
                                  int64_t hysteresis) {
  check_one("current_scale", current_scale, at::kFloat, current_scale);
  check_one("growth_tracker", growth_tracker, at::kInt, current_scale);
  check_one("hysteresis_tracker", hysteresis_tracker, at::kInt, current_scale);
  check_one("found_inf", found_inf, at::kFloat, current_scale);
  const c10::cuda::CUDAGuard guard(current_scale.device());
  update_scale_hysteresis_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      current_scale.data_ptr<float>(), growth_tracker.data_ptr<int>(),
      hysteresis_tracker.data_ptr<int>(), found_inf.data_ptr<float>(), growth_factor,
      backoff_factor, growth_interval, hysteresis);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace apex_mta

TORCH_LIBRARY_IMPL(apex_mta, CUDA, m) {
  m.impl("update_scale_hysteresis", &apex_mta::update_scale_hysteresis_cuda);
}
