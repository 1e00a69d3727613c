"""The extension library of apex-parallel (read by the builder's AOT mode)."""

from apex.multi_tensor_apply.build.spec import KernelSpec

PARALLEL = KernelSpec(
    name="apex_parallel_C",
    package="apex.parallel",
    sources=("csrc/welford.cu",),
)

KERNELS = [PARALLEL]
