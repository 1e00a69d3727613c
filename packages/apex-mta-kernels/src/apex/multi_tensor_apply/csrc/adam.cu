// Adam / AdamW over lists by role, math in fp32:
//   multi_tensor_adam                    [g, p, m, v]; lr, step and bias corrections on the host
//   multi_tensor_adam_capturable         [g, p, m, v]; lr, step, inv_scale device tensors, skips
//                                        the step when noop_flag is set, writes g*inv_scale to g
//   multi_tensor_adam_capturable_master  [g, p, m, v, p_master]; as above, the step is taken on
//                                        p_master and p = p_master rounded to p's dtype
//
// Per element (adam_w_mode 0 = Adam with L2 weight decay, 1 = decoupled, AdamW):
//   g *= inv_scale;  if mode 0: g += wd * p
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   p = p * decay - step_size * m / (sqrt(v) / sqrt(bc2) + eps)
// with step_size = lr / bc1 and decay = 1 - lr * wd in mode 1 (1 in mode 0): apex's
// p -= lr * (m/bc1 / (sqrt(v/bc2) + eps) + wd * p), in the order torch.optim.AdamW rounds it.
#include "checks.h"
#include "grad_plan.h"
#include "multi_tensor_apply.cuh"

#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <type_traits>

namespace apex_mta {
namespace {

struct AdamArgs {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  bool l2;              // mode 0: g += wd * p
  float l2_wd;
  double decoupled_wd;  // mode 1: p *= 1 - lr * wd (0 in mode 0)
  // Host-resolved step (multi_tensor_adam).
  float step_size, rsqrt_bc2, decay;
  // Capturable: device scalars, read once per thread; lr == nullptr for multi_tensor_adam.
  const void* lr;
  const void* step;
  const void* inv_scale;
  const int* noop;
  int lr_kind, step_kind, inv_scale_kind;
  bool bias_correction;
  // bc = 1 - beta^step as -expm1(step * log(beta)): no cancellation while beta^step is near 1
  float log_beta1, log_beta2;
};

// What one thread needs for every element it updates.
struct StepScalars {
  float step_size, rsqrt_bc2, decay, inv_scale;
  bool write_g;
};

// False when the capturable step is to be skipped (noop flag set).
__device__ __forceinline__ bool resolve(const AdamArgs& a, StepScalars& s) {
  if (a.lr == nullptr) {
    s = {a.step_size, a.rsqrt_bc2, a.decay, 1.0f, false};
    return true;
  }
  if (*a.noop != 0) return false;
  const float lr = read_scalar(a.lr, a.lr_kind);
  float bc1 = 1.0f, bc2 = 1.0f;
  if (a.bias_correction) {
    const float step = read_scalar(a.step, a.step_kind);
    bc1 = -expm1f(step * a.log_beta1);
    bc2 = -expm1f(step * a.log_beta2);
  }
  s.step_size = lr / bc1;
  s.rsqrt_bc2 = __frsqrt_rn(bc2);
  s.decay = static_cast<float>(1.0 - static_cast<double>(lr) * a.decoupled_wd);
  s.inv_scale = read_scalar(a.inv_scale, a.inv_scale_kind);
  // g * 1 == g: with no scale to undo there is nothing to write back, and no bytes to move.
  s.write_g = s.inv_scale != 1.0f;
  return true;
}

// One element: g is already unscaled; p, m and v are updated in place. L2 (mode 0) is a template
// argument: a run-time select here costs ~26 registers (and half the blocks per SM), and a
// multiply by a zero decay in mode 1 would turn m and v into nan wherever p is not finite.
template <bool L2>
__device__ __forceinline__ void adam_math(float g, float& p, float& m, float& v, const AdamArgs& a,
                                          const StepScalars& s) {
  if constexpr (L2) g = fmaf(a.l2_wd, p, g);
  m = fmaf(a.beta1, m, a.one_minus_beta1 * g);
  v = fmaf(a.beta2, v, a.one_minus_beta2 * g * g);
  const float denom = fmaf(sqrtf(v), s.rsqrt_bc2, a.eps);
  p = fmaf(p, s.decay, -s.step_size * (m / denom));
}

// The fast path: every role's dtype known at compile time, 8- or 16-byte vector access.
// DEPTH 4: [g, p, m, v]. DEPTH 5: [g, p, m, v, p_master(float)], p is written, never read.
template <int DEPTH, typename Tg, typename Tp, typename Tm, typename Tv>
struct AdamFunctor {
  static constexpr bool kMaster = DEPTH == 5;

  __device__ __forceinline__ void operator()(const TensorListMeta<DEPTH>& meta, int t,
                                             int64_t /*chunk*/, int64_t start, int64_t end,
                                             AdamArgs a) const {
    StepScalars s;
    if (!resolve(a, s)) return;
    if (a.l2) {
      run<true>(meta, t, start, end, a, s);
    } else {
      run<false>(meta, t, start, end, a, s);
    }
  }

  template <bool L2>
  __device__ __forceinline__ void run(const TensorListMeta<DEPTH>& meta, int t, int64_t start,
                                      int64_t end, const AdamArgs& a, const StepScalars& s) const {
    Tg* __restrict__ gp = static_cast<Tg*>(meta.ptr[0][t]);
    Tp* __restrict__ pp = static_cast<Tp*>(meta.ptr[1][t]);
    Tm* __restrict__ mp = static_cast<Tm*>(meta.ptr[2][t]);
    Tv* __restrict__ vp = static_cast<Tv*>(meta.ptr[3][t]);
    float* __restrict__ wp = kMaster ? static_cast<float*>(meta.ptr[DEPTH - 1][t]) : nullptr;

    // E elements per role per vector: the widest role moves one 16-byte word, a 16-bit role
    // beside a 32-bit one moves 8 bytes. Every warp access is then one contiguous run (a 16-byte
    // word of bf16 beside two of fp32 per thread measured 85-89% of copy bandwidth on an H200,
    // against 95% for all-fp32 and all-bf16 lists). U vectors per iteration: 8 elements of every
    // role per thread in flight; more costs registers, and so blocks per SM, without adding
    // bandwidth.
    constexpr int E = 16 / max_size<Tg, Tp, Tm, Tv, std::conditional_t<kMaster, float, Tg>>();
    constexpr int U = 8 / E;
    constexpr int64_t kStride = int64_t(kThreads) * E;

    int64_t i = start;
    bool aligned = aligned16(gp) && aligned16(pp) && aligned16(mp) && aligned16(vp);
    if constexpr (kMaster) aligned = aligned && aligned16(wp);
    if (aligned) {
      const int64_t vec_end = start + (end - start) / E * E;
      for (int64_t base = start + int64_t(threadIdx.x) * E; base < vec_end; base += kStride * U) {
        float g[U][E], p[U][E], m[U][E], v[U][E];
#pragma unroll
        for (int u = 0; u < U; ++u) {  // every load of the iteration before any math
          const int64_t j = base + u * kStride;
          if (j < vec_end) {
            load_elems<E>(gp + j, g[u]);
            if constexpr (kMaster) load_elems<E>(wp + j, p[u]);
            else load_elems<E>(pp + j, p[u]);
            load_elems<E>(mp + j, m[u]);
            load_elems<E>(vp + j, v[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = base + u * kStride;
          if (j < vec_end) {
#pragma unroll
            for (int k = 0; k < E; ++k) {
              g[u][k] *= s.inv_scale;
              adam_math<L2>(g[u][k], p[u][k], m[u][k], v[u][k], a, s);
            }
            if (s.write_g) store_elems<E>(gp + j, g[u]);
            if constexpr (kMaster) store_elems<E>(wp + j, p[u]);
            store_elems<E>(pp + j, p[u]);
            store_elems<E>(mp + j, m[u]);
            store_elems<E>(vp + j, v[u]);
          }
        }
      }
      i = vec_end;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += kThreads) {
      const float g = to_float(gp[j]) * s.inv_scale;
      float p = kMaster ? wp[j] : to_float(pp[j]);
      float m = to_float(mp[j]), v = to_float(vp[j]);
      if (s.write_g) gp[j] = from_float<Tg>(g);
      adam_math<L2>(g, p, m, v, a, s);
      if constexpr (kMaster) wp[j] = p;
      pp[j] = from_float<Tp>(p);
      mp[j] = from_float<Tm>(m);
      vp[j] = from_float<Tv>(v);
    }
  }
};

// Any other dtype mix (m and v of different dtypes, or a 16-bit master): dtypes read at run time,
// one element at a time (load_any/store_any). Correct for every combination, not tuned; see
// fast_path() below.
template <int DEPTH>
struct AdamAnyFunctor {
  int kinds[DEPTH];

  __device__ __forceinline__ void operator()(const TensorListMeta<DEPTH>& meta, int t,
                                             int64_t /*chunk*/, int64_t start, int64_t end,
                                             AdamArgs a) const {
    StepScalars s;
    if (!resolve(a, s)) return;
    void* ptr[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) ptr[d] = meta.ptr[d][t];
    constexpr int src = DEPTH == 5 ? 4 : 1;  // where p is read from
    for (int64_t j = start + threadIdx.x; j < end; j += kThreads) {
      const float g = load_any(ptr[0], kinds[0], j) * s.inv_scale;
      float p = load_any(ptr[src], kinds[src], j);
      float m = load_any(ptr[2], kinds[2], j), v = load_any(ptr[3], kinds[3], j);
      if (s.write_g) store_any(ptr[0], kinds[0], j, g);
      if (a.l2) {
        adam_math<true>(g, p, m, v, a, s);
      } else {
        adam_math<false>(g, p, m, v, a, s);
      }
      if constexpr (DEPTH == 5) store_any(ptr[4], kinds[4], j, p);
      store_any(ptr[1], kinds[1], j, p);
      store_any(ptr[2], kinds[2], j, m);
      store_any(ptr[3], kinds[3], j, v);
    }
  }
};

// ---- host side ----------------------------------------------------------------------------------

AdamArgs common_args(const char* op, double beta1, double beta2, double eps, int64_t mode,
                     bool bias_correction, double weight_decay) {
  APEX_CHECK_VALUE(mode == 0 || mode == 1, op,
                   ": adam_w_mode must be 0 (L2 weight decay) or 1 (decoupled, AdamW), got ", mode);
  APEX_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, op, ": beta1 must be in [0, 1), got ", beta1);
  APEX_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, op, ": beta2 must be in [0, 1), got ", beta2);
  AdamArgs a{};
  a.beta1 = static_cast<float>(beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.eps = static_cast<float>(eps);
  a.l2 = mode == 0;
  a.l2_wd = static_cast<float>(weight_decay);
  a.decoupled_wd = mode == 1 ? weight_decay : 0.0;
  a.bias_correction = bias_correction;
  a.log_beta1 = static_cast<float>(std::log(beta1));
  a.log_beta2 = static_cast<float>(std::log(beta2));
  return a;
}

// The fast path covers the mixes optimizers use: any g and p, m and v both fp32 or both p's
// dtype, and (master) an fp32 master. 15 instantiations per depth instead of 81 or 243.
template <int DEPTH>
bool fast_path(const std::vector<at::ScalarType>& dt) {
  const bool mv = dt[2] == dt[3] && (dt[2] == at::kFloat || dt[2] == dt[1]);
  return mv && (DEPTH == 4 || dt[4] == at::kFloat);
}

template <int DEPTH>
void run_group(const std::vector<at::ScalarType>& dt,
               const std::array<const std::vector<at::Tensor>*, DEPTH>& ptrs,
               const std::vector<int64_t>& idx, const AdamArgs& a) {
  if (!fast_path<DEPTH>(dt)) {
    AdamAnyFunctor<DEPTH> f{};
    for (int d = 0; d < DEPTH; ++d) f.kinds[d] = kind_of(dt[d]);
    launch<DEPTH>(ptrs, idx, f, a);
    return;
  }
  APEX_DISPATCH_FLOAT(dt[0], Tg, [&] {
    APEX_DISPATCH_FLOAT(dt[1], Tp, [&] {
      if (dt[2] == at::kFloat) {
        launch<DEPTH>(ptrs, idx, AdamFunctor<DEPTH, Tg, Tp, float, float>{}, a);
      } else {
        launch<DEPTH>(ptrs, idx, AdamFunctor<DEPTH, Tg, Tp, Tp, Tp>{}, a);
      }
    });
  });
}

template <int DEPTH>
void run_groups(const std::vector<ListArg>& lists, const AdamArgs& a) {
  std::array<const std::vector<at::Tensor>*, DEPTH> ptrs;
  for (int d = 0; d < DEPTH; ++d) ptrs[d] = lists[d].list;
  for (const auto& [dt, idx] : group_by_dtype(lists)) run_group<DEPTH>(dt, ptrs, idx, a);
}

std::vector<ListArg> adam_lists(const std::vector<at::Tensor>& g, const std::vector<at::Tensor>& p,
                                const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& v) {
  return {{"grads", &g}, {"params", &p}, {"exp_avgs", &m}, {"exp_avg_sqs", &v}};
}

void multi_tensor_adam_cuda(at::TensorList grads_, at::TensorList params_, at::TensorList exp_avgs_,
                            at::TensorList exp_avg_sqs_, const at::Tensor& noop_flag, double lr,
                            double beta1, double beta2, double eps, int64_t step, int64_t mode,
                            bool bias_correction, double weight_decay) {
  const char* op = "multi_tensor_adam";
  const auto g = grads_.vec(), p = params_.vec(), m = exp_avgs_.vec(), v = exp_avg_sqs_.vec();
  const auto lists = adam_lists(g, p, m, v);
  check_lists(op, lists, noop_flag);
  AdamArgs a = common_args(op, beta1, beta2, eps, mode, bias_correction, weight_decay);
  APEX_CHECK_VALUE(!bias_correction || step >= 1, op,
                   ": step must be >= 1 when bias_correction is set, got ", step);
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  a.step_size = static_cast<float>(lr / bc1);
  a.rsqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  a.decay = static_cast<float>(1.0 - lr * a.decoupled_wd);
  run_groups<4>(lists, a);
}

AdamArgs capturable_args(const char* op, const at::Tensor& noop_flag, const at::Tensor& lr,
                         double beta1, double beta2, double eps, const at::Tensor& step,
                         int64_t mode, bool bias_correction, double weight_decay,
                         const at::Tensor& inv_scale) {
  check_scalar(op, "lr", lr, noop_flag, false);
  check_scalar(op, "step", step, noop_flag, true);
  check_scalar(op, "inv_scale", inv_scale, noop_flag, false);
  AdamArgs a = common_args(op, beta1, beta2, eps, mode, bias_correction, weight_decay);
  a.lr = lr.data_ptr();
  a.step = step.data_ptr();
  a.inv_scale = inv_scale.data_ptr();
  a.noop = noop_flag.data_ptr<int>();
  a.lr_kind = kind_of(lr.scalar_type());
  a.step_kind = kind_of(step.scalar_type());
  a.inv_scale_kind = kind_of(inv_scale.scalar_type());
  return a;
}

void multi_tensor_adam_capturable_cuda(at::TensorList grads_, at::TensorList params_,
                                       at::TensorList exp_avgs_, at::TensorList exp_avg_sqs_,
                                       const at::Tensor& noop_flag, const at::Tensor& lr,
                                       double beta1, double beta2, double eps,
                                       const at::Tensor& step, int64_t mode, bool bias_correction,
                                       double weight_decay, const at::Tensor& inv_scale) {
  const char* op = "multi_tensor_adam_capturable";
  const auto g = grads_.vec(), p = params_.vec(), m = exp_avgs_.vec(), v = exp_avg_sqs_.vec();
  const auto lists = adam_lists(g, p, m, v);
  check_lists(op, lists, noop_flag);
  const AdamArgs a = capturable_args(op, noop_flag, lr, beta1, beta2, eps, step, mode,
                                     bias_correction, weight_decay, inv_scale);
  run_groups<4>(lists, a);
}

void multi_tensor_adam_capturable_master_cuda(
    at::TensorList grads_, at::TensorList params_, at::TensorList exp_avgs_,
    at::TensorList exp_avg_sqs_, at::TensorList master_params_, const at::Tensor& noop_flag,
    const at::Tensor& lr, double beta1, double beta2, double eps, const at::Tensor& step,
    int64_t mode, bool bias_correction, double weight_decay, const at::Tensor& inv_scale) {
  const char* op = "multi_tensor_adam_capturable_master";
  const auto g = grads_.vec(), p = params_.vec(), m = exp_avgs_.vec(), v = exp_avg_sqs_.vec();
  const auto w = master_params_.vec();
  auto lists = adam_lists(g, p, m, v);
  lists.push_back({"master_params", &w});
  check_lists(op, lists, noop_flag);
  const AdamArgs a = capturable_args(op, noop_flag, lr, beta1, beta2, eps, step, mode,
                                     bias_correction, weight_decay, inv_scale);
  run_groups<5>(lists, a);
}

}  // namespace

// ---- the cached plan ----------------------------------------------------------------------------
//
// A FusedAdam bucket's lists on the C++ side (GradPlan says how a step is checked and run).
class AdamPlan : public GradPlan {
 public:
  AdamPlan(std::vector<at::Tensor> params, std::vector<at::Tensor> work,
           std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
           std::vector<at::Tensor> masters)
      : GradPlan(std::move(params)), work_(std::move(work)), m_(std::move(exp_avgs)),
        v_(std::move(exp_avg_sqs)), w_(std::move(masters)) {
    const size_t n = params_.size();
    APEX_CHECK_VALUE(work_.size() == n && m_.size() == n && v_.size() == n, "AdamPlan: params has ",
                     n, " tensors but work, exp_avgs and exp_avg_sqs have ", work_.size(), ", ",
                     m_.size(), " and ", v_.size());
    APEX_CHECK_VALUE(w_.empty() || w_.size() == n, "AdamPlan: masters has ", w_.size(),
                     " tensors; expected 0 or ", n);
  }

  // multi_tensor_adam on [grads, work, exp_avgs, exp_avg_sqs].
  bool step(at::Tensor noop_flag, double lr, double beta1, double beta2, double eps, int64_t step,
            int64_t adam_w_mode, bool bias_correction, double weight_decay) {
    const char* op = "multi_tensor_adam";
    const Release release{this};
    AdamArgs a = common_args(op, beta1, beta2, eps, adam_w_mode, bias_correction, weight_decay);
    APEX_CHECK_VALUE(!bias_correction || step >= 1, op,
                     ": step must be >= 1 when bias_correction is set, got ", step);
    const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
    const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
    a.step_size = static_cast<float>(lr / bc1);
    a.rsqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
    a.decay = static_cast<float>(1.0 - lr * a.decoupled_wd);
    return run<4>(op, noop_flag, {&grads_, &work_, &m_, &v_}, a);
  }

  // multi_tensor_adam_capturable(_master): lr, step and inv_scale read on the device.
  bool step_capturable(at::Tensor noop_flag, at::Tensor lr, double beta1, double beta2, double eps,
                       at::Tensor step, int64_t adam_w_mode, bool bias_correction,
                       double weight_decay, at::Tensor inv_scale) {
    const Release release{this};
    const bool master = !w_.empty();
    const char* op = master ? "multi_tensor_adam_capturable_master" : "multi_tensor_adam_capturable";
    const AdamArgs a = capturable_args(op, noop_flag, lr, beta1, beta2, eps, step, adam_w_mode,
                                       bias_correction, weight_decay, inv_scale);
    if (master) return run<5>(op, noop_flag, {&grads_, &params_, &m_, &v_, &w_}, a);
    return run<4>(op, noop_flag, {&grads_, &work_, &m_, &v_}, a);
  }

 private:
  template <int DEPTH>
  bool run(const char* op, const at::Tensor& noop_flag,
           std::array<const std::vector<at::Tensor>*, DEPTH> ptrs, const AdamArgs& a) {
    static const char* kNames[] = {"grads", "params", "exp_avgs", "exp_avg_sqs", "master_params"};
    std::vector<ListArg> lists;
    for (int d = 0; d < DEPTH; ++d) lists.push_back({kNames[d], ptrs[d]});
    if (!prepare(op, noop_flag, DEPTH, lists)) return false;
    for (const auto& [dt, idx] : groups_) run_group<DEPTH>(dt, ptrs, idx, a);
    return true;
  }

  std::vector<at::Tensor> work_, m_, v_, w_;
};

}  // namespace apex_mta

TORCH_LIBRARY_FRAGMENT(apex_mta, m) {
  auto c = m.class_<apex_mta::AdamPlan>("AdamPlan")
               .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>,
                                std::vector<at::Tensor>, std::vector<at::Tensor>,
                                std::vector<at::Tensor>>())
               .def("step", &apex_mta::AdamPlan::step)
               .def("step_capturable", &apex_mta::AdamPlan::step_capturable);
  apex_mta::def_grad_plan_methods(c);
}

TORCH_LIBRARY_IMPL(apex_mta, CUDA, m) {
  m.impl("multi_tensor_adam", &apex_mta::multi_tensor_adam_cuda);
  m.impl("multi_tensor_adam_capturable", &apex_mta::multi_tensor_adam_capturable_cuda);
  m.impl("multi_tensor_adam_capturable_master", &apex_mta::multi_tensor_adam_capturable_master_cuda);
}
