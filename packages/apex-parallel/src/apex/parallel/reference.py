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
    """Every dimension but the channels (dimension 1)."""
    return (0, *range(2, x.dim()))


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A [C] vector shaped to broadcast against ``x`` (channels in dimension 1)."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


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


# ---- the fused ops of SyncBatchNorm's own path ---------------------------------------------------
#
# These take ``(N, C, *)`` tensors as they are (channels in dimension 1, any memory format: the
# CUDA kernels read contiguous and channels_last tensors in place) and pack their per-channel
# results into one float32 buffer, so that one collective carries them:
#
#   stats  [2C + 1]: local mean, local biased variance, local element count;
#   saved  [2C + 1]: global mean, inv_std, global element count (what backward needs);
#   sums   [2C]:     sum(dy), sum(dy * (x - mean)) (all-reduced between the two backward ops).


def _like_input(y: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``y`` with the strides of ``torch.empty_like(input)`` (what the CUDA ops return)."""
    e = torch.empty_like(input)
    return y if y.stride() == e.stride() else e.copy_(y)


def _relu_masked(grad_out: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    dy = grad_out.float()
    return dy if out is None else dy.masked_fill(out <= 0, 0.0)


def syncbn_stats(input: torch.Tensor) -> torch.Tensor:
    """``[mean (C), biased var (C), count (1)]`` of this rank's input, float32."""
    c = input.shape[1]
    count = input.numel() // c if c else 0
    if input.numel() == 0:
        return torch.zeros(2 * c + 1, dtype=torch.float32, device=input.device)
    var, mean = torch.var_mean(input.float(), dim=_dims(input), correction=0)
    return torch.cat([mean, var, mean.new_full((1,), float(count))])


def syncbn_forward(
    input: torch.Tensor,
    stats: torch.Tensor | None,
    z: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    eps: float,
    momentum: float | None,
    fuse_relu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every rank's ``stats`` (``[W, 2C + 1]`` or flat), update the running estimates
    (``num_batches_tracked += 1``; factor ``momentum``, or ``1 / num_batches_tracked`` when
    ``momentum`` is None), and normalise. Returns ``(out, saved)``. ``stats`` None: this
    rank's own (``syncbn_stats(input)``), the whole world."""
    c = input.shape[1]
    if stats is None:
        stats = syncbn_stats(input)
    s = stats.reshape(-1, 2 * c + 1).float()
    counts = s[:, 2 * c]
    mean, var_u, inv_std = welford_parallel(s[:, :c], s[:, c : 2 * c], counts, eps)
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
    if running_mean is not None or running_var is not None:
        if momentum is not None:
            factor = torch.tensor(float(momentum), device=mean.device)
        elif num_batches_tracked is not None:
            factor = 1.0 / num_batches_tracked.to(device=mean.device, dtype=torch.float32)
        else:
            factor = torch.tensor(0.0, device=mean.device)
        # No rows anywhere (an empty batch on every rank): the estimates stay, as torch's
        # BatchNorm leaves them (num_batches_tracked still counts the step).
        seen = counts.sum() > 0
        for buf, new in ((running_mean, mean), (running_var, var_u)):
            if buf is not None:
                old = buf.float()
                buf.copy_(torch.where(seen, torch.lerp(old, new, factor), old).to(buf.dtype))
    out = _like_input(batchnorm_forward(input, mean, inv_std, weight, bias, z, fuse_relu), input)
    return out, torch.cat([mean, inv_std, counts.sum().view(1)])


def syncbn_backward_reduce(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    saved: torch.Tensor,
    weight: torch.Tensor | None,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sums = [sum(dy), sum(dy * (x - mean))]`` over this rank (float32 [2C]) and the local
    weight and bias gradients (in ``weight``'s dtype, float32 without one). ``out`` given (the
    forward's output under ``fuse_relu``): dy is zero where ``out <= 0``."""
    c = input.shape[1]
    dy = _relu_masked(grad_out, out)
    xmu = input.float() - _per_channel(saved[:c].float(), input)
    sum_dy = dy.sum(_dims(input))
    sum_dy_xmu = (dy * xmu).sum(_dims(input))
    dtype = torch.float32 if weight is None else weight.dtype
    grad_weight = (sum_dy_xmu * saved[c : 2 * c].float()).to(dtype)
    return torch.cat([sum_dy, sum_dy_xmu]), grad_weight, sum_dy.to(dtype)


def syncbn_backward(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    saved: torch.Tensor,
    weight: torch.Tensor | None,
    sums: torch.Tensor,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """The input gradient from the all-reduced ``sums`` (see batchnorm_backward)."""
    c = input.shape[1]
    n = saved[2 * c].float().clamp_min(1.0)
    mean, inv = saved[:c].float(), saved[c : 2 * c].float()
    scale = inv if weight is None else inv * weight.float()
    mean_dy = sums[:c].float() / n
    mean_dy_xmu = sums[c:].float() / n
    xmu = input.float() - _per_channel(mean, input)
    g = _relu_masked(grad_out, out) - _per_channel(mean_dy, input)
    g = g - xmu * _per_channel(inv * inv * mean_dy_xmu, input)
    return _like_input((g * _per_channel(scale, input)).to(input.dtype), input)


def syncbn_backward_local(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    saved: torch.Tensor,
    weight: torch.Tensor | None,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_input, grad_weight, grad_bias)`` of one rank alone: ``syncbn_backward_reduce``
    then ``syncbn_backward`` on its sums."""
    sums, grad_weight, grad_bias = syncbn_backward_reduce(grad_out, input, saved, weight, out)
    return syncbn_backward(grad_out, input, saved, weight, sums, out), grad_weight, grad_bias
