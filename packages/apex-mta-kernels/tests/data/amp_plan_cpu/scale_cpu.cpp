// scale.h's two halves for a CPU-only build of amp_plan.cpp (tests/test_amp_plan.py): the plan's
// C++ logic runs on CPU tensors, each launch being apex_mta::multi_tensor_scale called through the
// dispatcher on the group's positions (on CPU: the reference, so the bits the general path gets).
#include "checks.h"
#include "scale.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace apex_mta {

DtypeGroups scale_groups(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                         const at::Tensor& noop_flag) {
  APEX_CHECK_TYPE(noop_flag.scalar_type() == at::kInt, "multi_tensor_scale: noop_flag must be an int32 tensor");
  APEX_CHECK_VALUE(inputs.size() == outputs.size(), "multi_tensor_scale: inputs has ", inputs.size(),
                   " tensors but outputs has ", outputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    APEX_CHECK_VALUE(inputs[i].numel() == outputs[i].numel(), "multi_tensor_scale: outputs[", i, "] has ",
                     outputs[i].numel(), " elements but inputs[", i, "] has ", inputs[i].numel());
  }
  const std::vector<ListArg> lists{{"inputs", &inputs}, {"outputs", &outputs}};
  DtypeGroups groups;
  for (auto& [dtypes, idx] : group_by_dtype(lists)) groups.emplace_back(dtypes, std::move(idx));
  return groups;
}

void scale_launch(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                  const DtypeGroups& groups, const at::Tensor& noop_flag, double scale) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("apex_mta::multi_tensor_scale", "")
                             .typed<void(at::TensorList, at::TensorList, const at::Tensor&, double)>();
  const at::NoGradGuard no_grad;  // the general path's unscale and copy run under no_grad too
  for (const auto& group : groups) {
    std::vector<at::Tensor> in, out;
    for (int64_t i : group.second) {
      in.push_back(inputs[i]);
      out.push_back(outputs[i]);
    }
    op.call(in, out, noop_flag, scale);
  }
}

}  // namespace apex_mta
