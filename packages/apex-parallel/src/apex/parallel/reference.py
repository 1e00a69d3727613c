"""Plain-torch references of every ``apex_parallel`` op.

Each is the CPU path, the fallback when no compiler is available, and the oracle the CUDA kernels
are tested against. Every op takes its input in one of two canonical layouts, both contiguous:

- ``(N, C, L)``: channels-first (NCHW and friends, flattened behind the channel dimension);
- ``(M, C)``: channels-last (NHWC and friends flattened in front of the channel dimension, and
  plain ``(N, C)`` input).

Statistics are float32 whatever the input dtype; elementwise outputs have the input's dtype.
"""

from __future__ import annotations

import torch


def _dims(x: torch.Tensor) -> tuple[int, ...]:
    return (0, 2) if x.dim() == 3 else (0,)


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A [C] vector shaped to broadcast against ``x`` in its canonical layout."""
    return v.view(1, -1, 1) if x.dim() == 3 else v.view(1, -1)


def welford_mean_var(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance (float32 [C]); zeros for an empty input."""
    c = input.shape[1]
    if input.numel() == 0:
        zeros = torch.zeros(c, dtype=torch.float32, device=input.device)
        return zeros, zeros.clone()
    var, mean = torch.var_mean(input.float(), dim=_dims(input), correction=0)
    return mean, var


def welford_parallel(
    mean: torch.Tensor, var_biased: torch.Tensor, count: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge per-rank statistics ``[W, C]`` with element counts ``[W]`` (Chan's formula).

    Returns the global mean, the global unbiased variance (for the running estimate) and
    ``1 / sqrt(biased variance + eps)`` (for normalising), all float32 [C]. Ranks with count 0
    contribute nothing.
    """
    n = count.to(torch.float32).view(-1, 1)
    total = n.sum(0)
    safe = total.clamp_min(1.0)
    mean_f = mean.float()
    gmean = (n * mean_f).sum(0) / safe
    m2 = (n * (var_biased.float() + (mean_f - gmean).square())).sum(0)
    var_b = m2 / safe
    var_u = m2 / (total - 1.0)
    return gmean, var_u, torch.rsqrt(var_b + eps)


def batchnorm_forward(
    input: torch.Tensor,
    mean: torch.Tensor,
    inv_std: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    fuse_relu: bool = False,
) -> torch.Tensor:
    """``y = (x - mean) * inv_std * weight + bias (+ z)``, then ReLU when ``fuse_relu``.

    ``x - mean`` first, not ``x * scale - mean * scale``: a channel of near-constant values
    (one element, say, where the variance is 0 and inv_std is 1/sqrt(eps)) would otherwise
    come out as the rounding error of two large products, not as the bias."""
    scale = inv_std.float() if weight is None else inv_std.float() * weight.float()
    y = (input.float() - _per_channel(mean.float(), input)) * _per_channel(scale, input)
    if bias is not None:
        y = y + _per_channel(bias.float(), input)
    if z is not None:
        y = y + z.float()
    if fuse_relu:
        y = y.clamp_min(0.0)
    return y.to(input.dtype)


def batchnorm_backward_reduce(
    grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel ``sum(dy)``, ``sum(dy * (x - mean))``, and the local weight and bias
    gradients ``sum(dy * (x - mean)) * inv_std`` and ``sum(dy)``; float32 [C] each."""
    c = input.shape[1]
    if input.numel() == 0:
        z = torch.zeros(c, dtype=torch.float32, device=input.device)
        return z, z.clone(), z.clone(), z.clone()
    dy = grad_out.float()
    xmu = input.float() - _per_channel(mean.float(), input)
    sum_dy = dy.sum(_dims(input))
    sum_dy_xmu = (dy * xmu).sum(_dims(input))
    return sum_dy, sum_dy_xmu, sum_dy_xmu * inv_std.float(), sum_dy.clone()


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
    """The input gradient from the all-reduced sums over ``count`` elements in total (a device
    tensor, summed if it has several elements): ``(dy - sum_dy / n - (x - mean) * inv_std**2 *
    sum_dy_xmu / n) * inv_std * weight``, in the input's dtype."""
    n = count.to(torch.float32).sum().clamp_min(1.0)
    inv = inv_std.float()
    scale = inv if weight is None else inv * weight.float()
    mean_dy = sum_dy.float() / n
    mean_dy_xmu = sum_dy_xmu.float() / n
    xmu = input.float() - _per_channel(mean.float(), input)
    g = grad_out.float() - _per_channel(mean_dy, input)
    g = g - xmu * _per_channel(inv * inv * mean_dy_xmu, input)
    return (g * _per_channel(scale, input)).to(input.dtype)
