// AmpPlan: apex-amp's O2 step (apex/amp/_process_optimizer.py) on lists held in C++.
//
// Each step of amp O2 touches every param's .grad two or three times around its two launches
// (the unscale of the model grads into the fp32 master grads, the copy of the masters into the
// model params), and the general path builds Python lists of them for each launch, ~1500 touches
// per step on a 290-tensor model, while the GPU waits. This plan holds the lists and does the
// touches natively. A touch itself costs about as much from here as from Python on torch >= 2.10,
// where a .grad set or clear keeps the tensor's Python object in step (CPU, torch 2.13, 300
// tensors: clearing every grad 64 us from here, 56 us in a Python loop; 290 us and 245 us when
// the clear frees the grads): what the plan saves is the lists, the per-tensor checks and the
// conversions at each launch, not the touches.
//   prepare()                 the enter of scale_loss: when no master (and no fp32 param) has a
//                             grad, clear every model param's grad; else change nothing (false)
//   unscale(noop_flag, s)     the exit: model grads * s into the persistent buffer's views,
//                             overflow into noop_flag (multi_tensor_scale's kernel), the views
//                             become the master grads, the model grads are cleared; fp32 params'
//                             grads are unscaled in place in the same launch
//   copy_back(noop_flag, r)   the step: masters -> model params (multi_tensor_scale, scale 1),
//                             then, with r, every master's grad cleared
// Lists are checked by multi_tensor_scale's own checks the first time and whenever a tensor's
// dtype, size, layout or device differs from what they saw; between those a step costs a few
// loads per tensor. Anything that the general Python path handles differently (a model param
// without a grad, a master that already has one, a master whose shape no longer fits its view)
// makes unscale return false having changed nothing, and the caller takes the general path.
// Whether the views are free (nobody else holds one) is the caller's to check: Python references
// are not visible from here.
#include "checks.h"
#include "scale.h"

#include <torch/custom_class.h>
#include <torch/library.h>

#include <utility>
#include <vector>

namespace apex_mta {

class AmpPlan : public torch::CustomClassHolder {
 public:
  AmpPlan(std::vector<at::Tensor> model_params, std::vector<at::Tensor> masters,
          std::vector<at::Tensor> grad_views, std::vector<at::Tensor> fp32_params)
      : model_(std::move(model_params)), masters_(std::move(masters)), views_(std::move(grad_views)),
        fp32_(std::move(fp32_params)) {
    const size_t n = model_.size();
    APEX_CHECK_VALUE(masters_.size() == n && views_.size() == n, "AmpPlan: model_params has ", n,
                     " tensors but masters and grad_views have ", masters_.size(), " and ", views_.size());
    for (size_t i = 0; i < n; ++i) {
      APEX_CHECK_VALUE(views_[i].defined() && fits(masters_[i], views_[i]), "AmpPlan: grad_views[", i,
                       "] must be a float32 tensor of masters[", i, "]'s shape and device");
    }
    in_.reserve(n + fp32_.size());
    out_.reserve(n + fp32_.size());
  }

  int64_t size() const { return static_cast<int64_t>(model_.size()); }

  bool prepare() {
    for (const auto& m : masters_) {
      if (m.grad().defined()) return false;
    }
    for (const auto& p : fp32_) {
      if (p.grad().defined()) return false;
    }
    for (auto& p : model_) p.mutable_grad().reset();
    return true;
  }

  bool unscale(at::Tensor noop_flag, double scale) {
    const Release release{this};
    const size_t n = model_.size();
    bool same = unscale_checked_ && flag_ok(noop_flag);
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& g = model_[i].grad();
      if (!g.defined() || g.layout() != at::kStrided || masters_[i].grad().defined() ||
          !fits(masters_[i], views_[i])) {
        return false;
      }
      in_.push_back(g);
      out_.push_back(views_[i]);
    }
    for (const auto& p : fp32_) {
      const at::Tensor& g = p.grad();
      if (!g.defined() || g.layout() != at::kStrided) return false;
      in_.push_back(g);
      out_.push_back(g);  // in place, as the general path
    }
    for (size_t i = 0; same && i < in_.size(); ++i) same = as_seen(in_[i], unscale_seen_[i]);
    if (!same) {
      unscale_groups_ = scale_groups(in_, out_, noop_flag);  // throws the op's message on bad input
      see(in_, unscale_seen_, noop_flag);
      unscale_checked_ = true;
    }
    scale_launch(in_, out_, unscale_groups_, noop_flag, scale);
    bump_versions(out_, noop_flag);
    // After the launch, so the host work overlaps the kernel (in_ keeps the model grads alive
    // until the call returns; the caching allocator orders any reuse after the kernel).
    for (size_t i = 0; i < n; ++i) {
      masters_[i].mutable_grad() = views_[i];
      model_[i].mutable_grad().reset();
    }
    return true;
  }

  void copy_back(at::Tensor noop_flag, bool release_grads) {
    bool same = copy_checked_ && flag_ok(noop_flag);
    for (size_t i = 0; same && i < model_.size(); ++i) {
      same = as_seen(masters_[i], copy_seen_[2 * i]) && as_seen(model_[i], copy_seen_[2 * i + 1]);
    }
    if (!same) {
      copy_groups_ = scale_groups(masters_, model_, noop_flag);
      std::vector<at::Tensor> both;
      both.reserve(2 * model_.size());
      for (size_t i = 0; i < model_.size(); ++i) {
        both.push_back(masters_[i]);
        both.push_back(model_[i]);
      }
      see(both, copy_seen_, noop_flag);
      copy_checked_ = true;
    }
    scale_launch(masters_, model_, copy_groups_, noop_flag, 1.0);
    bump_versions(model_, noop_flag);
    if (release_grads) {
      for (auto& m : masters_) m.mutable_grad().reset();
    }
  }

 private:
  // What the last full check saw of one tensor.
  struct Seen {
    at::ScalarType dtype;
    int64_t numel;
  };

  // Drops the grads an unscale fetched, however it ends.
  struct Release {
    AmpPlan* plan;
    ~Release() {
      plan->in_.clear();
      plan->out_.clear();
    }
  };

  // What the .grad setter requires of a master's grad (dtype, device, shape).
  static bool fits(const at::Tensor& master, const at::Tensor& view) {
    return master.scalar_type() == at::kFloat && master.device() == view.device() &&
           master.sizes().equals(view.sizes());
  }

  // What the op's dispatch does for its mutated arguments: autograd then sees the writes.
  static void bump_versions(const std::vector<at::Tensor>& written, const at::Tensor& noop_flag) {
    for (const auto& t : written) t.unsafeGetTensorImpl()->bump_version();
    noop_flag.unsafeGetTensorImpl()->bump_version();
  }

  bool as_seen(const at::Tensor& t, const Seen& s) const {
    return t.scalar_type() == s.dtype && t.numel() == s.numel && t.is_contiguous() && t.device() == device_;
  }

  bool flag_ok(const at::Tensor& noop_flag) const {
    return noop_flag.device() == device_ && noop_flag.scalar_type() == at::kInt && noop_flag.numel() >= 1;
  }

  // Records `ts` as checked (contiguity is required of later calls: checked tensors in another
  // memory format are simply checked again every call).
  void see(const std::vector<at::Tensor>& ts, std::vector<Seen>& seen, const at::Tensor& noop_flag) {
    seen.clear();
    for (const auto& t : ts) seen.push_back({t.scalar_type(), t.numel()});
    device_ = noop_flag.device();
  }

  std::vector<at::Tensor> model_, masters_, views_, fp32_;
  std::vector<at::Tensor> in_, out_;  // this unscale's lists (empty between calls)
  DtypeGroups unscale_groups_, copy_groups_;
  std::vector<Seen> unscale_seen_, copy_seen_;
  at::Device device_{at::kCPU};
  bool unscale_checked_ = false, copy_checked_ = false;
};

}  // namespace apex_mta

TORCH_LIBRARY_FRAGMENT(apex_mta, m) {
  m.class_<apex_mta::AmpPlan>("AmpPlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>>())
      .def("__len__", &apex_mta::AmpPlan::size)
      .def("prepare", &apex_mta::AmpPlan::prepare)
      .def("unscale", &apex_mta::AmpPlan::unscale)
      .def("copy_back", &apex_mta::AmpPlan::copy_back);
}
