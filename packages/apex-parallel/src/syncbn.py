"""The legacy top-level ``syncbn`` extension of NVIDIA apex, on apex.parallel's Welford ops.

Same function names and argument lists as apex's ``syncbn`` module. Channels-first functions
take ``(N, C, *)`` input; the ``_c_last`` ones take ``(..., C)`` input with the channels last.
Statistics are float32; elementwise results have the input's dtype. ``count`` arguments are a
tensor of per-rank element counts (or one total), summed on the device.
"""

from __future__ import annotations

import math

import torch

from apex.parallel import ops as _ops

__all__ = [
    "welford_mean_var",
    "welford_parallel",
    "batchnorm_forward",
    "reduce_bn",
    "batchnorm_backward",
    "welford_mean_var_c_last",
    "batchnorm_forward_c_last",
    "reduce_bn_c_last",
    "batchnorm_backward_c_last",
    "relu_bw_c_last",
]


def _first(x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 2:
        raise ValueError(f"syncbn: input must be (N, C, *), got shape {tuple(x.shape)}")
    return x.contiguous().view(x.shape[0], x.shape[1], math.prod(x.shape[2:]))


def _last(x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 2:
        raise ValueError(f"syncbn: input must be (..., C), got shape {tuple(x.shape)}")
    return x.contiguous().view(math.prod(x.shape[:-1]), x.shape[-1])


def welford_mean_var(input):
    """``[mean, biased var]`` per channel (dimension 1), float32."""
    return list(_ops.welford_mean_var(_first(input)))


def welford_mean_var_c_last(input):
    """``[mean, biased var]`` per channel (last dimension), float32."""
    return list(_ops.welford_mean_var(_last(input)))


def welford_parallel(mean_feature_nodes, var_biased_feature_nodes, numel, eps):
    """Merge ``[W, C]`` per-rank statistics with ``[W]`` counts: ``[mean, var, inv_std]``,
    var unbiased."""
    return list(
        _ops.welford_parallel(
            mean_feature_nodes.float().contiguous(),
            var_biased_feature_nodes.float().contiguous(),
            numel,
            eps,
        )
    )


def _vec(t):
    return None if t is None else t.contiguous()


def batchnorm_forward(input, mean, inv_std, weight=None, shift=None):
    y = _ops.batchnorm_forward(
        _first(input), mean.float(), inv_std.float(), _vec(weight), _vec(shift)
    )
    return y.view(input.shape)


def batchnorm_forward_c_last(input, z, mean, inv_std, weight=None, shift=None, fuse_relu=False):
    z2 = None if z is None else _last(z)
    y = _ops.batchnorm_forward(
        _last(input), mean.float(), inv_std.float(), _vec(weight), _vec(shift), z2, fuse_relu
    )
    return y.view(input.shape)


def _reduce(grad_out, input, mean, inv_std, weight):
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = _ops.batchnorm_backward_reduce(
        grad_out, input, mean.float(), inv_std.float()
    )
    if weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
        grad_bias = grad_bias.to(weight.dtype)
    return [sum_dy, sum_dy_xmu, grad_weight, grad_bias]


def reduce_bn(grad_output, input, mean, inv_std, weight=None):
    """``[sum_dy, sum_dy_xmu, grad_weight, grad_bias]`` per channel (dimension 1)."""
    return _reduce(_first(grad_output), _first(input), mean, inv_std, weight)


def reduce_bn_c_last(grad_output, input, mean, inv_std, weight=None):
    """``[sum_dy, sum_dy_xmu, grad_weight, grad_bias]`` per channel (last dimension)."""
    return _reduce(_last(grad_output), _last(input), mean, inv_std, weight)


def _count(count, device):
    if not torch.is_tensor(count):
        count = torch.tensor([float(count)], device=device)
    return count.to(device)


def batchnorm_backward(grad_output, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, count):
    g = _ops.batchnorm_backward(
        _first(grad_output),
        _first(input),
        mean.float(),
        inv_std.float(),
        _vec(weight),
        sum_dy.float(),
        sum_dy_xmu.float(),
        _count(count, input.device),
    )
    return g.view(input.shape)


def batchnorm_backward_c_last(grad_output, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, count):
    g = _ops.batchnorm_backward(
        _last(grad_output),
        _last(input),
        mean.float(),
        inv_std.float(),
        _vec(weight),
        sum_dy.float(),
        sum_dy_xmu.float(),
        _count(count, input.device),
    )
    return g.view(input.shape)


def relu_bw_c_last(grad_output, input, z, mean, inv_std, weight=None, shift=None):
    """``grad_output`` with zeros where the fused forward's output (ReLU input) was <= 0."""
    y = batchnorm_forward_c_last(input, z, mean, inv_std, weight, shift, False)
    return grad_output.masked_fill(y <= 0, 0)
