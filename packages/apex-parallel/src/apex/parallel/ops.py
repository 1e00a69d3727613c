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
    # SyncBatchNorm's own path: one op per phase, per-channel results packed in one buffer so
    # one collective carries them (reference.py describes the packing).
    "syncbn_stats": "syncbn_stats(Tensor input) -> Tensor",
    "syncbn_forward": (
        "syncbn_forward(Tensor input, Tensor? stats, Tensor? z, Tensor? weight, Tensor? bias, "
        "Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked, "
        "float eps, float? momentum, bool fuse_relu) -> (Tensor, Tensor)"
    ),
    "syncbn_backward_reduce": (
        "syncbn_backward_reduce(Tensor grad_out, Tensor input, Tensor saved, Tensor? weight, "
        "Tensor? relu_out) -> (Tensor, Tensor, Tensor)"
    ),
    "syncbn_backward": (
        "syncbn_backward(Tensor grad_out, Tensor input, Tensor saved, Tensor? weight, "
        "Tensor sums, Tensor? relu_out) -> Tensor"
    ),
    # One rank's whole backward (no all_reduce between the reduction and the input gradient):
    # (grad_input, grad_weight, grad_bias) in one call.
    "syncbn_backward_local": (
        "syncbn_backward_local(Tensor grad_out, Tensor input, Tensor saved, Tensor? weight, "
        "Tensor? relu_out) -> (Tensor, Tensor, Tensor)"
    ),
}


def _stats_like(input: torch.Tensor, k: int = 1, extra: int = 0):
    return input.new_empty((k * input.shape[1] + extra,), dtype=torch.float32)


def _param_grad_like(input: torch.Tensor, weight: torch.Tensor | None):
    dtype = torch.float32 if weight is None else weight.dtype
    return input.new_empty((input.shape[1],), dtype=dtype)


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
    "syncbn_stats": lambda input: _stats_like(input, 2, 1),
    "syncbn_forward": lambda input, stats, z, weight, bias, rm, rv, nbt, eps, momentum, relu: (
        torch.empty_like(input),
        _stats_like(input, 2, 1),
    ),
    "syncbn_backward_reduce": lambda grad_out, input, saved, weight, relu_out: (
        _stats_like(input, 2),
        _param_grad_like(input, weight),
        _param_grad_like(input, weight),
    ),
    "syncbn_backward": lambda grad_out, input, saved, weight, sums, relu_out: torch.empty_like(
        input
    ),
    "syncbn_backward_local": lambda grad_out, input, saved, weight, relu_out: (
        torch.empty_like(input),
        _param_grad_like(input, weight),
        _param_grad_like(input, weight),
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


# ---- SyncBatchNorm's own path (see reference.py for the packed buffers) --------------------------


def _check_nd(op: str, name: str, t: torch.Tensor, input: torch.Tensor | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dim() < 2:
        raise ValueError(f"{op}: {name} must be (N, C, *), got shape {tuple(t.shape)}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
    if input is not None:
        if t.shape != input.shape:
            raise ValueError(
                f"{op}: {name} has shape {tuple(t.shape)} but input has {tuple(input.shape)}"
            )
        if t.dtype != input.dtype:
            raise TypeError(f"{op}: {name} has dtype {t.dtype} but input has {input.dtype}")
        if t.device != input.device:
            raise ValueError(f"{op}: {name} is on {t.device} but input is on {input.device}")


def _check_packed(
    op: str, name: str, t: torch.Tensor, input: torch.Tensor, per_rank: int, exact: bool = True
) -> None:
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise TypeError(f"{op}: {name} must be a contiguous float32 tensor, got {t.dtype}")
    if t.device != input.device:
        raise ValueError(f"{op}: {name} is on {t.device} but input is on {input.device}")
    if t.numel() != per_rank if exact else (t.numel() == 0 or t.numel() % per_rank):
        raise ValueError(
            f"{op}: {name} must hold {'' if exact else 'a multiple of '}{per_rank} values "
            f"(C = {input.shape[1]}), got shape {tuple(t.shape)}"
        )


def syncbn_stats(input: torch.Tensor) -> torch.Tensor:
    """This rank's ``[mean (C), biased var (C), count]``, float32 [2C + 1], for all_gather."""
    _check_nd("syncbn_stats", "input", input)
    return torch.ops.apex_parallel.syncbn_stats(input)


def syncbn_forward(
    input, stats, z=None, weight=None, bias=None, running_mean=None, running_var=None,
    num_batches_tracked=None, eps=1e-5, momentum=0.1, fuse_relu=False,
):  # fmt: skip
    """Merge the gathered ``stats`` of every rank, update the running estimates in place and
    normalise; returns ``(out, saved)`` (``saved``: global mean, inv_std, count). ``stats``
    None: this rank alone, whose statistics the op takes itself (one call instead of
    ``syncbn_stats`` then ``syncbn_forward``)."""
    op = "syncbn_forward"
    _check_nd(op, "input", input)
    c = input.shape[1]
    if stats is not None:
        _check_packed(op, "stats", stats, input, 2 * c + 1, exact=False)
    if z is not None:
        _check_nd(op, "z", z, input)
    for name, t in (("weight", weight), ("bias", bias), ("running_mean", running_mean),
                    ("running_var", running_var)):  # fmt: skip
        _check_vec(op, name, t, input, False)
    if num_batches_tracked is not None and (
        num_batches_tracked.numel() != 1 or num_batches_tracked.dtype != torch.int64
    ):
        raise TypeError(f"{op}: num_batches_tracked must be one int64 value")
    return torch.ops.apex_parallel.syncbn_forward(
        input, stats, z, weight, bias, running_mean, running_var, num_batches_tracked,
        float(eps), None if momentum is None else float(momentum), bool(fuse_relu),
    )  # fmt: skip


def _check_backward(op, grad_out, input, saved, weight, relu_out, sums=None):
    """The checks of the backward ops' arguments; ``sums``: syncbn_backward's."""
    _check_nd(op, "input", input)
    _check_nd(op, "grad_out", grad_out, input)
    _check_packed(op, "saved", saved, input, 2 * input.shape[1] + 1)
    if sums is not None:
        _check_packed(op, "sums", sums, input, 2 * input.shape[1])
    _check_vec(op, "weight", weight, input, False)
    if relu_out is not None:
        _check_nd(op, "relu_out", relu_out, input)


def syncbn_backward_reduce(grad_out, input, saved, weight=None, relu_out=None):
    """``(sums, grad_weight, grad_bias)``: float32 [2C] ``sum(dy), sum(dy * (x - mean))`` for
    the all_reduce, and this rank's parameter gradients in ``weight``'s dtype."""
    _check_backward("syncbn_backward_reduce", grad_out, input, saved, weight, relu_out)
    return torch.ops.apex_parallel.syncbn_backward_reduce(grad_out, input, saved, weight, relu_out)


def syncbn_backward(grad_out, input, saved, weight, sums, relu_out=None):
    """The input gradient from the all-reduced ``sums``."""
    _check_backward("syncbn_backward", grad_out, input, saved, weight, relu_out, sums)
    return torch.ops.apex_parallel.syncbn_backward(grad_out, input, saved, weight, sums, relu_out)


def syncbn_backward_local(grad_out, input, saved, weight=None, relu_out=None):
    """``(grad_input, grad_weight, grad_bias)`` of one rank alone: ``syncbn_backward_reduce``
    then ``syncbn_backward`` in one call, with nothing to all-reduce between them."""
    _check_backward("syncbn_backward_local", grad_out, input, saved, weight, relu_out)
    return torch.ops.apex_parallel.syncbn_backward_local(grad_out, input, saved, weight, relu_out)
