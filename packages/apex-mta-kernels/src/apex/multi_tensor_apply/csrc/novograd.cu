// multi_tensor_novograd: apex's fused NovoGrad step, in two launches per dtype group.
//
// 1. Per-tensor gradient norms, blended into grad_norms[i] in place (float32):
//      L2 (norm_type 2):   gn = sqrt(beta2 * gn^2 + (1 - beta2) * sum(g^2))
//      Linf (norm_type 0): gn = beta2 * gn + (1 - beta2) * max|g|
//    Each block reduces its chunk to one partial; the last block of a tensor to finish (counted
//    with an atomic per tensor) reduces that tensor's partials in a fixed order, so the result is
//    deterministic and no third launch is needed. A norm that is not finite sets noop_flag, as
//    apex's norm kernels do; the update still runs (apex propagates infs and nans here).
// 2. The elementwise update, reading grad_norms at the tensor's position in the caller's lists:
//      denom = gn / bc2 + eps, with bc1 = 1 - beta1^step, bc2 = sqrt(1 - beta2^step)
//      (both 1 without bias correction), beta3 = grad_averaging ? 1 - beta1 : 1
//      moment_mode 0: g = g / denom + wd * p; m = beta1 * m + beta3 * g; p -= lr * m / bc1
//      moment_mode 1: m = beta1 * m + beta3 * g; p -= lr * (m / bc1 / denom + wd * p)
#include "checks.h"
#include "multi_tensor_apply.cuh"

#include <torch/library.h>

#include <cmath>

namespace apex_mta {
namespace {

// ---- 1. per-tensor norms -------------------------------------------------------------------------

template <bool kMax>
__device__ __forceinline__ float combine(float a, float b) {
  if constexpr (kMax) {
    return (a > b || isnan(a)) ? a : b;  // a max that keeps nans, like torch's
  } else {
    return a + b;
  }
}

// The block's combined value of v, in thread 0. Fixed order, so bitwise reproducible. Safe to
// call repeatedly with the same scratch (it synchronises before reusing it).
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = combine<kMax>(v, __shfl_down_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < int(blockDim.x >> 5) ? scratch[lane] : 0.f;  // 0 is the identity of both
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = combine<kMax>(v, __shfl_down_sync(0xffffffffu, v, o));
  }
  return v;
}

struct NormArgs {
  float* partials;  // one per block of this dtype group's launches
  int* arrivals;    // one per position, zeroed: blocks of that tensor done so far
  float* grad_norms;
  int* noop;
  float alpha, beta;  // beta2 and 1 - beta2
};

template <typename G, bool kMax>
struct GradNormFunctor {
  static constexpr int E = vec_elems<G>();
  static constexpr int U = E >= 8 ? 2 : 4;  // 4 x 8 halves in flight spill on sm_80

  __device__ __forceinline__ void operator()(const TensorListMeta<1>& meta, int t, int64_t /*chunk*/,
                                             int64_t start, int64_t end, NormArgs a) const {
    const G* gp = static_cast<const G*>(meta.ptr[0][t]);
    float acc[E];
#pragma unroll
    for (int k = 0; k < E; ++k) acc[k] = 0.f;
    int64_t i = start;
    if (aligned16(gp)) {
      const int64_t vec_end = start + (end - start) / E * E;
      const int64_t stride = int64_t(blockDim.x) * E;
      for (int64_t base = start + threadIdx.x * E; base < vec_end; base += stride * U) {
        float x[U][E];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = base + u * stride;
          if (j < vec_end) {
            load_vec<E>(gp + j, x[u]);
          } else {
#pragma unroll
            for (int k = 0; k < E; ++k) x[u][k] = 0.f;
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
          for (int k = 0; k < E; ++k) {
            acc[k] = kMax ? combine<true>(acc[k], fabsf(x[u][k])) : fmaf(x[u][k], x[u][k], acc[k]);
          }
        }
      }
      i = vec_end;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += blockDim.x) {
      const float x = to_float(gp[j]);
      acc[0] = kMax ? combine<true>(acc[0], fabsf(x)) : fmaf(x, x, acc[0]);
    }
    float v = acc[0];
#pragma unroll
    for (int k = 1; k < E; ++k) v = combine<kMax>(v, acc[k]);

    __shared__ float scratch[32];
    __shared__ bool last;
    v = block_reduce<kMax>(v, scratch);
    const int pos = meta.position[t];
    const int32_t first = meta.block_offset + meta.block_start[t];
    const int nchunks = meta.block_start[t + 1] - meta.block_start[t];
    if (threadIdx.x == 0) {
      a.partials[meta.block_offset + blockIdx.x] = v;
      __threadfence();  // the partial is visible device-wide before the arrival is counted
      last = atomicAdd(a.arrivals + pos, 1) == nchunks - 1;
    }
    __syncthreads();
    if (!last) return;

    // The last block of tensor t: every partial of t is written. __ldcg reads them from L2,
    // past this SM's L1, which never saw those writes.
    v = 0.f;
    for (int c = threadIdx.x; c < nchunks; c += blockDim.x) v = combine<kMax>(v, __ldcg(a.partials + first + c));
    v = block_reduce<kMax>(v, scratch);
    if (threadIdx.x == 0) {
      const float gn = a.grad_norms[pos];
      a.grad_norms[pos] = kMax ? a.alpha * gn + a.beta * v : sqrtf(a.alpha * gn * gn + a.beta * v);
      if (!isfinite(v)) *a.noop = 1;
    }
  }
};

// ---- 2. the update -------------------------------------------------------------------------------

struct NovogradArgs {
  const float* grad_norms;
  float lr, beta1, beta3, bc1, bc2, eps, wd;
  int mode;
};

__device__ __forceinline__ float novograd_step(float g, float p, float& m, float denom,
                                               const NovogradArgs& a) {
  if (a.mode == 0) {
    g = g / denom + a.wd * p;
    m = fmaf(a.beta1, m, a.beta3 * g);
    return p - a.lr * (m / a.bc1);
  }
  m = fmaf(a.beta1, m, a.beta3 * g);
  return p - a.lr * ((m / a.bc1) / denom + a.wd * p);
}

// G grads, P params, M first moments.
template <typename G, typename P, typename M>
struct NovogradFunctor {
  static constexpr int E = vec_elems<G, P, M>();
  static constexpr int U = E >= 8 ? 1 : 2;

  __device__ __forceinline__ void operator()(const TensorListMeta<3>& meta, int t, int64_t /*chunk*/,
                                             int64_t start, int64_t end, NovogradArgs a) const {
    const G* gp = static_cast<const G*>(meta.ptr[0][t]);
    P* pp = static_cast<P*>(meta.ptr[1][t]);
    M* mp = static_cast<M*>(meta.ptr[2][t]);
    const float denom = a.grad_norms[meta.position[t]] / a.bc2 + a.eps;
    int64_t i = start;
    if (aligned16(gp) && aligned16(pp) && aligned16(mp)) {
      const int64_t vec_end = start + (end - start) / E * E;
      const int64_t stride = int64_t(blockDim.x) * E;
      for (int64_t base = start + threadIdx.x * E; base < vec_end; base += stride * U) {
        float g[U][E], p[U][E], m[U][E];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = base + u * stride;
          if (j < vec_end) {
            load_vec<E>(gp + j, g[u]);
            load_vec<E>(pp + j, p[u]);
            load_vec<E>(mp + j, m[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = base + u * stride;
          if (j < vec_end) {
#pragma unroll
            for (int k = 0; k < E; ++k) p[u][k] = novograd_step(g[u][k], p[u][k], m[u][k], denom, a);
            store_vec<E>(pp + j, p[u]);
            store_vec<E>(mp + j, m[u]);
          }
        }
      }
      i = vec_end;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += blockDim.x) {
      float m = to_float(mp[j]);
      pp[j] = from_float<P>(novograd_step(to_float(gp[j]), to_float(pp[j]), m, denom, a));
      mp[j] = from_float<M>(m);
    }
  }
};

// ---- host ---------------------------------------------------------------------------------------

constexpr const char* kOp = "multi_tensor_novograd";

void check_novograd_args(const std::vector<at::Tensor>& grads, const at::Tensor& noop_flag,
                         const at::Tensor& grad_norms, int64_t step, bool bias_correction,
                         int64_t moment_mode, int64_t norm_type) {
  APEX_CHECK_TYPE(grad_norms.scalar_type() == at::kFloat, kOp,
                   ": grad_norms must be a float32 tensor, got ", dtype_str(grad_norms.scalar_type()));
  APEX_CHECK_VALUE(grad_norms.device() == noop_flag.device(), kOp, ": grad_norms is on ",
                    grad_norms.device(), " but noop_flag is on ", noop_flag.device(),
                    "; every tensor must be on one CUDA device");
  APEX_CHECK_VALUE(grad_norms.numel() == static_cast<int64_t>(grads.size()), kOp, ": grad_norms has ",
                    grad_norms.numel(), " elements but grads has ", grads.size(),
                    " tensors; one norm per tensor is required");
  APEX_CHECK_VALUE(grad_norms.is_contiguous(), kOp, ": grad_norms is not contiguous");
  APEX_CHECK_VALUE(moment_mode == 0 || moment_mode == 1, kOp,
                    ": moment_mode must be 0 (weight decay inside the moment) or 1 (decoupled), got ",
                    moment_mode);
  APEX_CHECK_VALUE(norm_type == 0 || norm_type == 2, kOp,
                    ": norm_type must be 2 (L2) or 0 (Linf), got ", norm_type);
  APEX_CHECK_VALUE(!bias_correction || step >= 1, kOp,
                    ": step must be >= 1 when bias_correction is set, got ", step);
}

void multi_tensor_novograd_cuda(at::TensorList grads_, at::TensorList params_, at::TensorList exp_avgs_,
                                const at::Tensor& noop_flag, const at::Tensor& grad_norms, double lr,
                                double beta1, double beta2, double eps, int64_t step,
                                bool bias_correction, double weight_decay, bool grad_averaging,
                                int64_t moment_mode, int64_t norm_type) {
  const std::vector<at::Tensor> grads = grads_.vec(), params = params_.vec(),
                                exp_avgs = exp_avgs_.vec();
  const std::vector<ListArg> lists{{"grads", &grads}, {"params", &params}, {"exp_avgs", &exp_avgs}};
  check_lists(kOp, lists, noop_flag);
  check_novograd_args(grads, noop_flag, grad_norms, step, bias_correction, moment_mode, norm_type);
  if (grads.empty()) return;
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  const bool linf = norm_type == 0;

  // 1. norms, one launch group per grad dtype.
  const std::vector<ListArg> grad_list{{"grads", &grads}};
  const auto by_grad = group_by_dtype(grad_list);
  int64_t blocks = 0;
  for (const at::Tensor& g : grads) blocks += (g.numel() + kChunk - 1) / kChunk;
  const auto f32 = grad_norms.options();
  const at::Tensor partials = at::empty({blocks > 0 ? blocks : 1}, f32);
  const at::Tensor arrivals = at::zeros({static_cast<int64_t>(grads.size())}, f32.dtype(at::kInt));
  NormArgs na{partials.data_ptr<float>(), arrivals.data_ptr<int>(), grad_norms.data_ptr<float>(),
              noop_flag.data_ptr<int>(), static_cast<float>(beta2), static_cast<float>(1.0 - beta2)};
  for (const auto& group : by_grad) {
    const std::vector<int64_t>& idx = group.second;
    APEX_DISPATCH_FLOAT(group.first[0], G, [&] {
      if (linf) {
        launch<1>({&grads}, idx, GradNormFunctor<G, true>{}, na);
      } else {
        launch<1>({&grads}, idx, GradNormFunctor<G, false>{}, na);
      }
    });
    for (int64_t i : idx) na.partials += (grads[i].numel() + kChunk - 1) / kChunk;
  }
  // Zero-size grads launch nothing; their norm blends with 0, as in apex.
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].numel() != 0) continue;
    at::Tensor gn = grad_norms.view({-1}).narrow(0, static_cast<int64_t>(i), 1);
    if (linf) {
      gn.mul_(beta2);
    } else {
      gn.copy_(at::sqrt(gn * beta2 * gn));
    }
  }

  // 2. the update.
  NovogradArgs ua;
  ua.grad_norms = grad_norms.data_ptr<float>();
  ua.lr = static_cast<float>(lr);
  ua.beta1 = static_cast<float>(beta1);
  ua.beta3 = static_cast<float>(grad_averaging ? 1.0 - beta1 : 1.0);
  ua.bc1 = static_cast<float>(bias_correction ? 1.0 - std::pow(beta1, double(step)) : 1.0);
  ua.bc2 = static_cast<float>(bias_correction ? std::sqrt(1.0 - std::pow(beta2, double(step))) : 1.0);
  ua.eps = static_cast<float>(eps);
  ua.wd = static_cast<float>(weight_decay);
  ua.mode = static_cast<int>(moment_mode);
  for (const auto& group : group_by_dtype(lists)) {
    const std::vector<at::ScalarType>& dtypes = group.first;
    const std::vector<int64_t>& idx = group.second;
    APEX_DISPATCH_FLOAT(dtypes[0], G, [&] {
      APEX_DISPATCH_FLOAT(dtypes[1], P, [&] {
        APEX_DISPATCH_FLOAT(dtypes[2], M, [&] {
          launch<3>({&grads, &params, &exp_avgs}, idx, NovogradFunctor<G, P, M>{}, ua);
        });
      });
    });
  }
}

}  // namespace
}  // namespace apex_mta

TORCH_LIBRARY_IMPL(apex_mta, CUDA, m) {
  m.impl("multi_tensor_novograd", &apex_mta::multi_tensor_novograd_cuda);
}
