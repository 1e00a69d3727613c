// multi_tensor_scale: outputs[i] = inputs[i] * scale; noop_flag = 1 if any input is not finite.
#include "checks.h"
#include "multi_tensor_apply.cuh"

#include <torch/library.h>

namespace apex_mta {
namespace {

constexpr int kUnroll = 4;  // independent 16-byte loads in flight per thread

template <typename Tin, typename Tout>
struct ScaleFunctor {
  __device__ __forceinline__ void operator()(const TensorListMeta<2>& m, int t, int64_t /*chunk*/,
                                             int64_t start, int64_t end, float scale, int* noop) const {
    const Tin* in = static_cast<const Tin*>(m.ptr[0][t]);
    Tout* out = static_cast<Tout*>(m.ptr[1][t]);
    constexpr int E = vec_elems<Tin, Tout>();
    bool finite = true;
    int64_t i = start;
    if (aligned16(in) && aligned16(out)) {
      const int64_t vec_end = start + (end - start) / E * E;
      const int64_t stride = int64_t(blockDim.x) * E;
      for (int64_t base = start + threadIdx.x * E; base < vec_end; base += stride * kUnroll) {
        float v[kUnroll][E];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t j = base + u * stride;
          if (j < vec_end) load_vec<E>(in + j, v[u]);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t j = base + u * stride;
          if (j < vec_end) {
#pragma unroll
            for (int k = 0; k < E; ++k) {
              finite &= isfinite(v[u][k]);
              v[u][k] *= scale;
            }
            store_vec<E>(out + j, v[u]);
          }
        }
      }
      i = vec_end;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += blockDim.x) {
      const float x = to_float(in[j]);
      finite &= isfinite(x);
      out[j] = from_float<Tout>(x * scale);
    }
    if (!finite) *noop = 1;  // racy but idempotent, as in apex
  }
};

void multi_tensor_scale_cuda(at::TensorList inputs_, at::TensorList outputs_, const at::Tensor& noop_flag,
                             double scale) {
  const std::vector<at::Tensor> inputs = inputs_.vec(), outputs = outputs_.vec();
  const std::vector<ListArg> lists{{"inputs", &inputs}, {"outputs", &outputs}};
  check_lists("multi_tensor_scale", lists, noop_flag);
  int* noop = noop_flag.data_ptr<int>();
  for (const auto& [dtypes, idx] : group_by_dtype(lists)) {
    APEX_DISPATCH_FLOAT(dtypes[0], Tin, [&] {
      APEX_DISPATCH_FLOAT(dtypes[1], Tout, [&] {
        launch<2>({&inputs, &outputs}, idx, ScaleFunctor<Tin, Tout>{}, static_cast<float>(scale), noop);
      });
    });
  }
}

}  // namespace
}  // namespace apex_mta

TORCH_LIBRARY_IMPL(apex_mta, CUDA, m) {
  m.impl("multi_tensor_scale", &apex_mta::multi_tensor_scale_cuda);
}
