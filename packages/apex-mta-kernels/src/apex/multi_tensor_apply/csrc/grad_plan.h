// The cached plan of one optimizer bucket, shared by AdamPlan and SgdPlan.
//
// A bucket's lists, held on the C++ side so that a step costs no Python per tensor and no list
// conversion: each step fetches every param's grad in C++, tests it (a few loads per tensor) and
// launches on the dtype groups found at the last full validation. Every step, each grad must be
// strided, of its param's sizes, dense, and share a memory format with its param (as the ops'
// checks ask); once validated, the params must also be as validated (dtype, sizes, strides) and
// the grads of the dtypes and device seen then; a param's dtype is its dtype at the plan's
// construction even before that. Anything else (a param without a grad, a sparse
// or strided grad, a param changed through .data) makes fetch return false, holding nothing: the
// caller takes the general path, which checks every bucket's grads before any launches and says
// what is wrong. The full checks of the ops run at the launch of a plan's first step (and of the
// first after a change), on grads that passed the test above.
#pragma once

#include "checks.h"

#include <torch/custom_class.h>

#include <utility>
#include <vector>

namespace apex_mta {

class GradPlan : public torch::CustomClassHolder {
 public:
  explicit GradPlan(std::vector<at::Tensor> params) : params_(std::move(params)) {
    built_.reserve(params_.size());
    for (const at::Tensor& p : params_) built_.push_back(p.scalar_type());
  }

  int64_t size() const { return static_cast<int64_t>(params_.size()); }

  // Every param's grad into grads_; false (nothing held) when one fails the tests above. A
  // change since the validation also marks the plan for a full one at its next launch.
  bool fetch() {
    const size_t n = params_.size();
    grads_.resize(n);
    const bool validated = validated_ != 0;
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& p = params_[i];
      const at::Tensor& g = p.grad();
      // A param cast since the plan was built (p.data =, module.double()) before any validation
      // too: its bucket is another one now.
      bool ok = g.defined() && p.scalar_type() == built_[i] && g.layout() == at::kStrided &&
                g.sizes().equals(p.sizes());
      if (ok) {
        const int lay = layouts(g);
        ok = lay != 0 && (g.numel() <= 1 || (lay & layouts(p)) != 0);
      }
      if (ok && validated) {
        ok = g.scalar_type() == gdt_[i] && p.scalar_type() == pdt_[i] && g.device() == device_ &&
             p.sizes().equals(sizes_[i]) && p.strides().equals(strides_[i]);
        if (!ok) validated_ = 0;
      }
      if (!ok) {
        release();
        return false;
      }
      grads_[i] = g;
    }
    fetched_ = true;
    return true;
  }

  void release() {
    for (auto& t : grads_) t.reset();
    fetched_ = false;
  }

 protected:
  // Releases the fetched grads when a step ends, however it ends: the plan never keeps a grad
  // alive past its step (zero_grad(set_to_none=True) is meant to free them).
  struct Release {
    GradPlan* plan;
    ~Release() { plan->release(); }
  };

  // This step's grads are in grads_ (fetched now if the caller has not): false when one is
  // missing.
  bool ensure_fetched() { return fetched_ || fetch(); }

  // Fetches the grads if the caller has not, and runs the op's full checks on `lists` when the
  // plan has not validated this form (`form`: any nonzero code the subclass gives each list
  // layout it launches) against this noop flag. False: a grad is missing, launch nothing.
  bool prepare(const char* op, const at::Tensor& noop_flag, int form,
               const std::vector<ListArg>& lists) {
    if (!ensure_fetched()) return false;
    if (validated_ != form || noop_flag.device() != device_ || noop_flag.scalar_type() != at::kInt ||
        noop_flag.numel() < 1) {
      check_lists(op, lists, noop_flag);
      groups_.clear();
      for (auto& [dt, idx] : group_by_dtype(lists)) groups_.emplace_back(dt, std::move(idx));
      const size_t n = params_.size();
      gdt_.resize(n);
      pdt_.resize(n);
      sizes_.resize(n);
      strides_.resize(n);
      for (size_t i = 0; i < n; ++i) {
        gdt_[i] = grads_[i].scalar_type();
        pdt_[i] = params_[i].scalar_type();
        sizes_[i] = params_[i].sizes().vec();
        strides_[i] = params_[i].strides().vec();
      }
      device_ = noop_flag.device();
      validated_ = form;
    }
    return true;
  }

  std::vector<at::Tensor> params_, grads_;
  std::vector<std::pair<std::vector<at::ScalarType>, std::vector<int64_t>>> groups_;

 private:
  std::vector<at::ScalarType> built_;  // each param's dtype when the plan was built
  std::vector<at::ScalarType> gdt_, pdt_;
  std::vector<std::vector<int64_t>> sizes_, strides_;  // each param's, as validated
  at::Device device_{at::kCPU};
  int validated_ = 0;     // the form last validated; 0: validate on the next step
  bool fetched_ = false;  // grads_ holds this step's grads
};

// Registers the methods every plan class has (GradPlan's, called through the subclass).
template <typename Plan>
torch::class_<Plan>& def_grad_plan_methods(torch::class_<Plan>& c) {
  return c.def("__len__", [](const c10::intrusive_ptr<Plan>& self) { return self->size(); })
      .def("fetch", [](const c10::intrusive_ptr<Plan>& self) { return self->fetch(); })
      .def("release", [](const c10::intrusive_ptr<Plan>& self) { self->release(); });
}

}  // namespace apex_mta
