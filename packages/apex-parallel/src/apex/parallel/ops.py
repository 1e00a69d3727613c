"""The ``apex_parallel`` ops: schemas, fakes, and the checked Python entry points.

Every op is defined here, in Python, so that it exists on any machine: its reference
(reference.py) is the kernel for every device, and on CUDA the compiled library
``apex_parallel_C`` (csrc/welford.cu) registers the Welford kernels the first time an op runs.
When the library cannot be had, CUDA falls back to the reference after one warning.

Inputs are in one of two canonical layouts, both contiguous: ``(N, C, L)`` (channels first) or
``(M, C)`` (channels last); see reference.py. The functions below validate their arguments and
raise before any kernel launches; ``torch.ops.apex_parallel.<name>`` skips those checks.
"""

from __future__ import annotations

import torch

from apex.multi_tensor_apply.build.oplib import define_ops

from . import reference
from ._kernels import PARALLEL

SCHEMAS = {
    "welford_mean_var": "welford_mean_var(Tensor input) -> (Tensor, Tensor)",
    "welford_parallel": (
        "welford_parallel(Tensor mean, Tensor var_biased, Tensor count, float eps) "
        "-> (Tensor, Tensor, Tensor)"
    ),
    "batchnorm_forward": (
        "batchnorm_forward(Tensor input, Tensor mean, Tensor inv_std, Tensor? weight, "
        "Tensor? bias, Tensor? z, bool fuse_relu) -> Tensor"
    ),
    "batchnorm_backward_reduce": (
        "batchnorm_backward_reduce(Tensor grad_out, Tensor input, Tensor mean, Tensor inv_std) "
        "-> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "batchnorm_backward": (
        "batchnorm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor inv_std, "
        "Tensor? weight, Tensor sum_dy, Tensor sum_dy_xmu, Tensor count) -> Tensor"
    ),
}


def _stats_like(input: torch.Tensor):
    return input.new_empty((input.shape[1],), dtype=torch.float32)


_FAKES = {
    "welford_mean_var": lambda input: (_stats_like(input), _stats_like(input)),
    "welford_parallel": lambda mean, var_biased, count, eps: (
        mean.new_empty((mean.shape[1],), dtype=torch.float32),
        mean.new_empty((mean.shape[1],), dtype=torch.float32),
        mean.new_empty((mean.shape[1],), dtype=torch.float32),
    ),
    "batchnorm_forward": lambda input, mean, inv_std, weight, bias, z, fuse_relu: torch.empty_like(
        input
    ),
    "batchnorm_backward_reduce": lambda grad_out, input, mean, inv_std: tuple(
        _stats_like(input) for _ in range(4)
    ),
    "batchnorm_backward": (
        lambda grad_out, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, count: torch.empty_like(
            input
        )
    ),
}

OPS = define_ops(
    "apex_parallel", PARALLEL, SCHEMAS, {n: getattr(reference, n) for n in SCHEMAS}, _FAKES
)

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check_input(op: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dim() not in (2, 3):
        raise ValueError(
            f"{op}: {name} must be (N, C, L) or (M, C), got {t.dim()} dimensions {tuple(t.shape)}"
        )
    if t.dtype not in _FLOATS:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (strides {t.stride()})")


def _check_like(op: str, name: str, t: torch.Tensor, input: torch.Tensor) -> None:
    _check_input(op, name, t)
    if t.shape != input.shape:
        raise ValueError(
            f"{op}: {name} has shape {tuple(t.shape)} but input has {tuple(input.shape)}"
        )
    if t.device != input.device:
        raise ValueError(f"{op}: {name} is on {t.device} but input is on {input.device}")


def _check_vec(op: str, name: str, t: torch.Tensor | None, input: torch.Tensor, fp32: bool) -> None:
    if t is None:
        return
    c = input.shape[1]
    if t.dim() != 1 or t.numel() != c:
        raise ValueError(
            f"{op}: {name} must have shape [{c}] (one value per channel), got {tuple(t.shape)}"
        )
    if t.device != input.device:
        raise ValueError(f"{op}: {name} is on {t.device} but input is on {input.device}")
    if fp32 and t.dtype != torch.float32:
        raise TypeError(f"{op}: {name} must be float32, got {t.dtype}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")


def welford_mean_var(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of ``input`` (float32 [C]; zeros when empty)."""
    _check_input("welford_mean_var", "input", input)
    return torch.ops.apex_parallel.welford_mean_var(input)


def welford_parallel(
    mean: torch.Tensor, var_biased: torch.Tensor, count: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge ``[W, C]`` per-rank means and biased variances with ``[W]`` counts into the global
    ``(mean, unbiased var, inv_std)``, float32 [C] each."""
    op = "welford_parallel"
    if mean.dim() != 2 or var_biased.shape != mean.shape:
        raise ValueError(
            f"{op}: mean and var_biased must both be [W, C], got {tuple(mean.shape)} and "
            f"{tuple(var_biased.shape)}"
        )
    if count.numel() != mean.shape[0]:
        raise ValueError(
            f"{op}: count must have {mean.shape[0]} elements (one per rank), got {count.numel()}"
        )
    for name, t in (("mean", mean), ("var_biased", var_biased)):
        if t.dtype != torch.float32:
            raise TypeError(f"{op}: {name} must be float32, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
    if count.device != mean.device or var_biased.device != mean.device:
        raise ValueError(f"{op}: mean, var_biased and count must be on one device")
    if count.dtype not in (torch.float32, torch.int32, torch.int64, torch.float64):
        raise TypeError(f"{op}: count has dtype {count.dtype}; supported: float32/64, int32/64")
    if count.dtype != torch.float32:
        count = count.to(torch.float32)
    return torch.ops.apex_parallel.welford_parallel(
        mean, var_biased, count.contiguous().view(-1), float(eps)
    )


def batchnorm_forward(
    input: torch.Tensor,
    mean: torch.Tensor,
    inv_std: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    fuse_relu: bool = False,
) -> torch.Tensor:
    """``(x - mean) * inv_std * weight + bias (+ z)``, then ReLU when ``fuse_relu``."""
    op = "batchnorm_forward"
    _check_input(op, "input", input)
    _check_vec(op, "mean", mean, input, True)
    _check_vec(op, "inv_std", inv_std, input, True)
    _check_vec(op, "weight", weight, input, False)
    _check_vec(op, "bias", bias, input, False)
    if z is not None:
        _check_like(op, "z", z, input)
    return torch.ops.apex_parallel.batchnorm_forward(
        input, mean, inv_std, weight, bias, z, bool(fuse_relu)
    )


def batchnorm_backward_reduce(
    grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel ``(sum_dy, sum_dy_xmu, grad_weight, grad_bias)``, float32 [C] each."""
    op = "batchnorm_backward_reduce"
    _check_input(op, "input", input)
    _check_like(op, "grad_out", grad_out, input)
    _check_vec(op, "mean", mean, input, True)
    _check_vec(op, "inv_std", inv_std, input, True)
    return torch.ops.apex_parallel.batchnorm_backward_reduce(grad_out, input, mean, inv_std)


def batchnorm_backward(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    inv_std: torch.Tensor,
    weight: torch.Tensor | None,
    sum_dy: torch.Tensor,
    sum_dy_xmu: torch.Tensor,
    count: torch.Tensor,
) -> torch.Tensor:
    """The input gradient from all-reduced ``sum_dy``/``sum_dy_xmu`` over ``count`` elements
    (a device tensor; summed when it holds one count per rank)."""
    op = "batchnorm_backward"
    _check_input(op, "input", input)
    _check_like(op, "grad_out", grad_out, input)
    for name, t in (
        ("mean", mean),
        ("inv_std", inv_std),
        ("sum_dy", sum_dy),
        ("sum_dy_xmu", sum_dy_xmu),
    ):
        _check_vec(op, name, t, input, True)
    _check_vec(op, "weight", weight, input, False)
    if count.device != input.device:
        raise ValueError(f"{op}: count is on {count.device} but input is on {input.device}")
    if count.dtype != torch.float32 or count.dim() != 1:
        count = count.to(torch.float32).reshape(-1)
    return torch.ops.apex_parallel.batchnorm_backward(
        grad_out, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, count.contiguous()
    )
