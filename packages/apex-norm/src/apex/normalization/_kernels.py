"""The extension library of apex-norm (read by the builder's AOT mode)."""

from apex.multi_tensor_apply.build.spec import KernelSpec

NORM = KernelSpec(
    name="apex_norm_C",
    package="apex.normalization",
    sources=("csrc/layer_norm.cu", "csrc/autograd.cpp"),
)

KERNELS = [NORM]
