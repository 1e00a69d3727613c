"""The extension libraries of apex-mta-kernels (read by the builder's AOT mode)."""

from apex.multi_tensor_apply.build.spec import KernelSpec

MTA = KernelSpec(
    name="apex_mta_C",
    package="apex.multi_tensor_apply",
    sources=(
        "csrc/scale.cu",
        "csrc/l2norm.cu",
        "csrc/axpby.cu",
        "csrc/adam.cu",
        "csrc/update_scale.cu",
        "csrc/sgd.cu",
        "csrc/novograd.cu",
        "csrc/adagrad.cu",
        "csrc/lamb.cu",
        "csrc/amp_plan.cpp",
    ),
)

KERNELS = [MTA]
