// multi_tensor_scale in two halves, for callers on the C++ side that check a list once and launch
// on it many times (AmpPlan, amp_plan.cpp): the op's checks and dtype grouping, and the launch.
#pragma once

#include <ATen/ATen.h>

#include <utility>
#include <vector>

namespace apex_mta {

// Positions of parallel lists grouped by their dtypes at each position (group_by_dtype's groups).
using DtypeGroups = std::vector<std::pair<std::vector<at::ScalarType>, std::vector<int64_t>>>;

// multi_tensor_scale's checks of [inputs, outputs] and noop_flag (check_lists: the op's
// exceptions and messages), then the positions grouped by dtype pair, one launch each.
DtypeGroups scale_groups(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                         const at::Tensor& noop_flag);

// outputs[i] = inputs[i] * scale, noop_flag = 1 on a non-finite input: multi_tensor_scale's
// kernel on lists that scale_groups has checked and grouped (nothing is checked here).
void scale_launch(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                  const DtypeGroups& groups, const at::Tensor& noop_flag, double scale);

}  // namespace apex_mta
