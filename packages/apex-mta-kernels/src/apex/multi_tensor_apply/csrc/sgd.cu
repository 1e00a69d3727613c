// multi_tensor_sgd: apex's fused SGD step (momentum, dampening, nesterov, weight decay before or
// after momentum, a gradient scale), optionally writing a reduced-precision copy of the updated
// weights (the 4-list form amp O2 uses). Skips everything when noop_flag[0] is set.
//
// Per element, in float32 (apex's order of operations):
//   g = grad * scale
//   g += wd * w                        (unless wd_after_momentum)
//   if momentum != 0:
//     m = first_run ? g : momentum * m + (1 - dampening) * g
//     g = nesterov ? g + momentum * m : m
//   g += wd * w                        (if wd_after_momentum)
//   w -= lr * g; copy = w
// Momenta are neither read on the first run nor touched at all without momentum, so those
// steps move fewer bytes.
#include "checks.h"
#include "grad_plan.h"
#include "multi_tensor_apply.cuh"

#include <torch/library.h>

namespace apex_mta {
namespace {

enum CopyKind : int { kCopyFloat, kCopyHalf, kCopyBFloat16 };

struct SgdArgs {
  float wd, momentum, one_minus_dampening, lr, scale;
  bool nesterov, first_run, wd_after_momentum;
  int copy;  // CopyKind of the model_weights list (4-list form only)
  const int* noop;
};

__device__ __forceinline__ float sgd_step(float g, float w, float& m, const SgdArgs& a) {
  g *= a.scale;
  if (a.wd != 0.f && !a.wd_after_momentum) g = fmaf(a.wd, w, g);
  if (a.momentum != 0.f) {
    m = a.first_run ? g : fmaf(a.momentum, m, a.one_minus_dampening * g);
    g = a.nesterov ? fmaf(a.momentum, m, g) : m;
  }
  if (a.wd != 0.f && a.wd_after_momentum) g = fmaf(a.wd, w, g);
  return fmaf(-a.lr, g, w);
}

// The copy holds the weight as stored, so round to W first (a no-op when W is float).
template <typename W>
__device__ __forceinline__ float stored(float v) {
  return to_float(from_float<W>(v));
}

template <int E>
__device__ __forceinline__ void store_copy(void* base, int64_t j, int kind, const float (&v)[E]) {
  switch (kind) {
    case kCopyHalf: store_vec<E>(static_cast<at::Half*>(base) + j, v); break;
    case kCopyBFloat16: store_vec<E>(static_cast<at::BFloat16*>(base) + j, v); break;
    default: store_vec<E>(static_cast<float*>(base) + j, v); break;
  }
}

__device__ __forceinline__ void store_copy1(void* base, int64_t j, int kind, float v) {
  switch (kind) {
    case kCopyHalf: static_cast<at::Half*>(base)[j] = from_float<at::Half>(v); break;
    case kCopyBFloat16: static_cast<at::BFloat16*>(base)[j] = from_float<at::BFloat16>(v); break;
    default: static_cast<float*>(base)[j] = v; break;
  }
}

// G grads, W weights, M momenta; kCopy: a 4th list receives the updated weights in its own dtype,
// chosen at run time (a branch per store, uniform across the grid) to keep the number of
// instantiations at 2 x 27 rather than 27 + 81.
template <typename G, typename W, typename M, bool kCopy, int kU = 0>
struct SgdFunctor {
  static constexpr int D = kCopy ? 4 : 3;
  // 16 bytes per access for the narrowest role (the copy is at most 2 bytes wide, as the
  // vector width must not depend on its run-time dtype).
  static constexpr int E = kCopy ? vec_elems<G, W, M, at::Half>() : vec_elems<G, W, M>();
  // Vectors in flight per thread per role (U = 2 x 16-byte fp32 loads, 1 when E = 8).
  static constexpr int U = kU > 0 ? kU : (E >= 8 ? 1 : 2);

  __device__ __forceinline__ void operator()(const TensorListMeta<D>& meta, int t, int64_t /*chunk*/,
                                             int64_t start, int64_t end, SgdArgs a) const {
    if (*a.noop) return;  // the caller found an overflow: leave every tensor as it is
    const G* gp = static_cast<const G*>(meta.ptr[0][t]);
    W* wp = static_cast<W*>(meta.ptr[1][t]);
    M* mp = static_cast<M*>(meta.ptr[2][t]);
    void* cp = kCopy ? meta.ptr[D - 1][t] : nullptr;
    const bool read_m = a.momentum != 0.f && !a.first_run;
    const bool write_m = a.momentum != 0.f;

    int64_t i = start;
    if (aligned16(gp) && aligned16(wp) && aligned16(mp) && (!kCopy || aligned16(cp))) {
      const int64_t vec_end = start + (end - start) / E * E;
      const int64_t stride = int64_t(blockDim.x) * E;
      for (int64_t base = start + threadIdx.x * E; base < vec_end; base += stride * U) {
        float g[U][E], w[U][E], m[U][E];
        // every load of the iteration is issued before any math
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = base + u * stride;
          if (j < vec_end) {
            load_vec<E>(gp + j, g[u]);
            load_vec<E>(wp + j, w[u]);
            if (read_m) {
              load_vec<E>(mp + j, m[u]);
            } else {
#pragma unroll
              for (int k = 0; k < E; ++k) m[u][k] = 0.f;
            }
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = base + u * stride;
          if (j < vec_end) {
#pragma unroll
            for (int k = 0; k < E; ++k) w[u][k] = sgd_step(g[u][k], w[u][k], m[u][k], a);
            store_vec<E>(wp + j, w[u]);
            if (write_m) store_vec<E>(mp + j, m[u]);
            if constexpr (kCopy) {
#pragma unroll
              for (int k = 0; k < E; ++k) w[u][k] = stored<W>(w[u][k]);
              store_copy<E>(cp, j, a.copy, w[u]);
            }
          }
        }
      }
      i = vec_end;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += blockDim.x) {
      float m = read_m ? to_float(mp[j]) : 0.f;
      const float w = sgd_step(to_float(gp[j]), to_float(wp[j]), m, a);
      wp[j] = from_float<W>(w);
      if (write_m) mp[j] = from_float<M>(m);
      if constexpr (kCopy) store_copy1(cp, j, a.copy, stored<W>(w));
    }
  }
};

int copy_kind(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return kCopyHalf;
    case at::kBFloat16: return kCopyBFloat16;
    default: return kCopyFloat;
  }
}

SgdArgs sgd_args(const at::Tensor& noop_flag, double wd, double momentum, double dampening, double lr,
                 bool nesterov, bool first_run, bool wd_after_momentum, double scale) {
  SgdArgs a;
  a.wd = static_cast<float>(wd);
  a.momentum = static_cast<float>(momentum);
  a.one_minus_dampening = static_cast<float>(1.0 - dampening);
  a.lr = static_cast<float>(lr);
  a.scale = static_cast<float>(scale);
  a.nesterov = nesterov;
  a.first_run = first_run;
  a.wd_after_momentum = wd_after_momentum;
  a.copy = kCopyFloat;
  a.noop = noop_flag.data_ptr<int>();
  return a;
}

// One dtype group of checked lists; an empty `model_weights` is the 3-list form.
void run_sgd_group(const std::vector<at::ScalarType>& dtypes, const std::vector<int64_t>& idx,
                   const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& weights,
                   const std::vector<at::Tensor>& momenta,
                   const std::vector<at::Tensor>& model_weights, SgdArgs a) {
  APEX_DISPATCH_FLOAT(dtypes[0], G, [&] {
    APEX_DISPATCH_FLOAT(dtypes[1], W, [&] {
      APEX_DISPATCH_FLOAT(dtypes[2], M, [&] {
        if (!model_weights.empty()) {
          a.copy = copy_kind(dtypes[3]);
          launch<4>({&grads, &weights, &momenta, &model_weights}, idx, SgdFunctor<G, W, M, true>{},
                    a);
        } else {
          launch<3>({&grads, &weights, &momenta}, idx, SgdFunctor<G, W, M, false>{}, a);
        }
      });
    });
  });
}

std::vector<ListArg> sgd_lists(const std::vector<at::Tensor>& grads,
                               const std::vector<at::Tensor>& weights,
                               const std::vector<at::Tensor>& momenta,
                               const std::vector<at::Tensor>& model_weights) {
  std::vector<ListArg> lists{{"grads", &grads}, {"weights", &weights}, {"momenta", &momenta}};
  if (!model_weights.empty()) lists.push_back({"model_weights", &model_weights});
  return lists;
}

void multi_tensor_sgd_cuda(at::TensorList grads_, at::TensorList weights_, at::TensorList momenta_,
                           at::TensorList model_weights_, const at::Tensor& noop_flag, double wd,
                           double momentum, double dampening, double lr, bool nesterov,
                           bool first_run, bool wd_after_momentum, double scale) {
  const std::vector<at::Tensor> grads = grads_.vec(), weights = weights_.vec(),
                                momenta = momenta_.vec(), model_weights = model_weights_.vec();
  const auto lists = sgd_lists(grads, weights, momenta, model_weights);
  check_lists("multi_tensor_sgd", lists, noop_flag);
  const SgdArgs a = sgd_args(noop_flag, wd, momentum, dampening, lr, nesterov, first_run,
                             wd_after_momentum, scale);
  for (const auto& [dtypes, idx] : group_by_dtype(lists)) {
    run_sgd_group(dtypes, idx, grads, weights, momenta, model_weights, a);
  }
}

}  // namespace

// ---- the cached plan ----------------------------------------------------------------------------
//
// A FusedSGD bucket's lists on the C++ side (GradPlan says how a step is checked and run):
// multi_tensor_sgd on [grads, work, momenta(, copies)]. Without momentum the plan holds no
// buffers and the grads stand in for them, as FusedSGD passes them (the kernel then neither
// reads nor writes that list).
class SgdPlan : public GradPlan {
 public:
  SgdPlan(std::vector<at::Tensor> params, std::vector<at::Tensor> work,
          std::vector<at::Tensor> momenta, std::vector<at::Tensor> copies)
      : GradPlan(std::move(params)), work_(std::move(work)), m_(std::move(momenta)),
        copies_(std::move(copies)) {
    const size_t n = params_.size();
    APEX_CHECK_VALUE(work_.size() == n, "SgdPlan: params has ", n, " tensors but work has ",
                     work_.size());
    APEX_CHECK_VALUE(m_.empty() || m_.size() == n, "SgdPlan: momenta has ", m_.size(),
                     " tensors; expected 0 or ", n);
    APEX_CHECK_VALUE(copies_.empty() || copies_.size() == n, "SgdPlan: copies has ",
                     copies_.size(), " tensors; expected 0 or ", n);
  }

  bool step(at::Tensor noop_flag, double wd, double momentum, double dampening, double lr,
            bool nesterov, bool first_run, bool wd_after_momentum, double scale) {
    const char* op = "multi_tensor_sgd";
    const Release release{this};
    APEX_CHECK_VALUE(!m_.empty() || momentum == 0.0, "SgdPlan: momentum ", momentum,
                     " needs momentum buffers; this plan was made without");
    const std::vector<at::Tensor>& momenta = m_.empty() ? grads_ : m_;
    const auto lists = sgd_lists(grads_, work_, momenta, copies_);
    if (!prepare(op, noop_flag, copies_.empty() ? 3 : 4, lists)) return false;
    const SgdArgs a = sgd_args(noop_flag, wd, momentum, dampening, lr, nesterov, first_run,
                               wd_after_momentum, scale);
    for (const auto& [dtypes, idx] : groups_) {
      run_sgd_group(dtypes, idx, grads_, work_, momenta, copies_, a);
    }
    return true;
  }

 private:
  std::vector<at::Tensor> work_, m_, copies_;
};

}  // namespace apex_mta

TORCH_LIBRARY_FRAGMENT(apex_mta, m) {
  auto c = m.class_<apex_mta::SgdPlan>("SgdPlan")
               .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>,
                                std::vector<at::Tensor>, std::vector<at::Tensor>>())
               .def("step", &apex_mta::SgdPlan::step);
  apex_mta::def_grad_plan_methods(c);
}

TORCH_LIBRARY_IMPL(apex_mta, CUDA, m) {
  m.impl("multi_tensor_sgd", &apex_mta::multi_tensor_sgd_cuda);
}
