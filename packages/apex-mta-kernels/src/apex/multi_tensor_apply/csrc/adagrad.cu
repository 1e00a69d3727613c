// multi_tensor_adagrad: apex's fused Adagrad step. Per element, in float32:
//   adagrad_w_mode 0 (L2):        g += wd * p; h += g * g; p -= lr * g / (sqrt(h) + eps)
//   adagrad_w_mode 1 (decoupled): h += g * g;             p -= lr * (g / (sqrt(h) + eps) + wd * p)
// Like apex it ignores noop_flag (infs and nans propagate).
#include "checks.h"
#include "multi_tensor_apply.cuh"

#include <torch/library.h>

namespace apex_mta {
namespace {

struct AdagradArgs {
  float lr, eps, wd;
  int mode;
};

__device__ __forceinline__ float adagrad_step(float g, float p, float& h, const AdagradArgs& a) {
  if (a.mode == 0) {
    g = fmaf(a.wd, p, g);
    h = fmaf(g, g, h);
    return p - a.lr * (g / (sqrtf(h) + a.eps));
  }
  h = fmaf(g, g, h);
  return p - a.lr * (g / (sqrtf(h) + a.eps) + a.wd * p);
}

// G grads, P params, H state sums.
template <typename G, typename P, typename H>
struct AdagradFunctor {
  static constexpr int E = vec_elems<G, P, H>();
  static constexpr int U = E >= 8 ? 1 : 2;  // vectors in flight per thread per role

  __device__ __forceinline__ void operator()(const TensorListMeta<3>& meta, int t, int64_t /*chunk*/,
                                             int64_t start, int64_t end, AdagradArgs a) const {
    const G* gp = static_cast<const G*>(meta.ptr[0][t]);
    P* pp = static_cast<P*>(meta.ptr[1][t]);
    H* hp = static_cast<H*>(meta.ptr[2][t]);
    int64_t i = start;
    if (aligned16(gp) && aligned16(pp) && aligned16(hp)) {
      const int64_t vec_end = start + (end - start) / E * E;
      const int64_t stride = int64_t(blockDim.x) * E;
      for (int64_t base = start + threadIdx.x * E; base < vec_end; base += stride * U) {
        float g[U][E], p[U][E], h[U][E];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = base + u * stride;
          if (j < vec_end) {
            load_vec<E>(gp + j, g[u]);
            load_vec<E>(pp + j, p[u]);
            load_vec<E>(hp + j, h[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = base + u * stride;
          if (j < vec_end) {
#pragma unroll
            for (int k = 0; k < E; ++k) p[u][k] = adagrad_step(g[u][k], p[u][k], h[u][k], a);
            store_vec<E>(pp + j, p[u]);
            store_vec<E>(hp + j, h[u]);
          }
        }
      }
      i = vec_end;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += blockDim.x) {
      float h = to_float(hp[j]);
      pp[j] = from_float<P>(adagrad_step(to_float(gp[j]), to_float(pp[j]), h, a));
      hp[j] = from_float<H>(h);
    }
  }
};

void multi_tensor_adagrad_cuda(at::TensorList grads_, at::TensorList params_,
                               at::TensorList state_sums_, const at::Tensor& noop_flag, double lr,
                               double eps, int64_t adagrad_w_mode, double weight_decay) {
  const std::vector<at::Tensor> grads = grads_.vec(), params = params_.vec(),
                                state_sums = state_sums_.vec();
  const std::vector<ListArg> lists{{"grads", &grads}, {"params", &params}, {"state_sums", &state_sums}};
  check_lists("multi_tensor_adagrad", lists, noop_flag);
  APEX_CHECK_VALUE(adagrad_w_mode == 0 || adagrad_w_mode == 1, "multi_tensor_adagrad: ",
                    "adagrad_w_mode must be 0 (L2) or 1 (decoupled weight decay), got ", adagrad_w_mode);
  const AdagradArgs a{static_cast<float>(lr), static_cast<float>(eps),
                      static_cast<float>(weight_decay), static_cast<int>(adagrad_w_mode)};
  for (const auto& group : group_by_dtype(lists)) {
    const std::vector<at::ScalarType>& dtypes = group.first;
    const std::vector<int64_t>& idx = group.second;
    APEX_DISPATCH_FLOAT(dtypes[0], G, [&] {
      APEX_DISPATCH_FLOAT(dtypes[1], P, [&] {
        APEX_DISPATCH_FLOAT(dtypes[2], H, [&] {
          launch<3>({&grads, &params, &state_sums}, idx, AdagradFunctor<G, P, H>{}, a);
        });
      });
    });
  }
}

}  // namespace
}  // namespace apex_mta

TORCH_LIBRARY_IMPL(apex_mta, CUDA, m) {
  m.impl("multi_tensor_adagrad", &apex_mta::multi_tensor_adagrad_cuda);
}
