"""Plain-torch LayerNorm and RMSNorm: the CPU path, the fallback without compiled kernels, and the
oracle the CUDA kernels are tested against.

Each function has the signature of the ``apex_norm`` op of the same name (ops.py). Rows are the
input's leading dimensions flattened; statistics are float32 (float64 for float64 input), one per
row, in 1-D tensors of length ``rows`` as apex returns them. Arguments are assumed valid: the
public functions validate before they get here.
"""

from __future__ import annotations

import math

import torch

from ._errors import NormValueError


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(t: torch.Tensor, normalized_shape) -> tuple[int, int]:
    k = len(normalized_shape)
    return math.prod(t.shape[: t.dim() - k]), math.prod(t.shape[t.dim() - k :])


def clamp_by_magnitude(w: torch.Tensor, eps: float) -> torch.Tensor:
    """``w`` with every element of magnitude below ``eps`` moved to ``+-eps`` (sign kept, 0 ->
    +eps): the divisor memory_efficient backward uses to recover x-hat from the output."""
    return torch.where(w >= 0, w.clamp(min=eps), w.clamp(max=-eps))


def layer_norm_fwd(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    normalized_shape: list[int],
    eps: float,
    memory_efficient: bool = False,
    out_dtype: torch.dtype | None = None,
):
    """Returns ``(out, mean, invvar)``; ``out`` has ``input``'s shape and ``out_dtype`` (default:
    input's dtype), ``mean`` and ``invvar`` are 1-D of length rows."""
    acc = _stat_dtype(input.dtype)
    rows, cols = _rows(input, normalized_shape)
    x = input.reshape(rows, cols).to(acc)
    mean = x.mean(dim=1)
    centred = x - mean[:, None]
    invvar = torch.rsqrt((centred * centred).mean(dim=1) + eps)
    y = centred * invvar[:, None]
    if weight is not None:
        y = y * weight.reshape(1, cols).to(acc)
    if bias is not None:
        y = y + bias.reshape(1, cols).to(acc)
    out = y.to(out_dtype or input.dtype).reshape(input.shape)
    return out, mean, invvar


def _xhat(
    input_or_output, mean, invvar, weight, bias, eps, memory_efficient, rows, cols, acc
) -> torch.Tensor:
    v = input_or_output.reshape(rows, cols).to(acc)
    if memory_efficient:
        if bias is not None:
            v = v - bias.reshape(1, cols).to(acc)
        if weight is not None:
            v = v / clamp_by_magnitude(weight.reshape(1, cols).to(acc), eps)
        return v
    if mean is not None:
        v = v - mean.to(acc)[:, None]
    return v * invvar.to(acc)[:, None]


def _weight_grads(dy, xhat, weight, bias, acc):
    if weight is not None:
        gw = (dy * xhat).sum(dim=0).to(weight.dtype).reshape(weight.shape)
    else:
        gw = dy.new_empty((0,), dtype=acc)
    if bias is not None:
        gb = dy.sum(dim=0).to(bias.dtype).reshape(bias.shape)
    else:
        gb = dy.new_empty((0,), dtype=acc)
    return gw, gb


def layer_norm_bwd(
    grad_output: torch.Tensor,
    mean: torch.Tensor | None,
    invvar: torch.Tensor,
    input_or_output: torch.Tensor,
    normalized_shape: list[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    memory_efficient: bool = False,
    grad_input_dtype: torch.dtype | None = None,
):
    """Returns ``(grad_input, grad_weight, grad_bias)``. With ``memory_efficient``,
    ``input_or_output`` is the forward's output and x-hat is recovered as (y - bias) / weight
    (weight clamped by magnitude to eps); otherwise it is the input and ``mean`` is needed.
    grad_weight and grad_bias are empty (shape [0]) when there is no weight or bias."""
    acc = _stat_dtype(input_or_output.dtype)
    rows, cols = _rows(input_or_output, normalized_shape)
    if mean is None and not memory_efficient:
        # Without it x-hat would silently lose the centring (the CUDA kernel refuses too).
        raise NormValueError(
            f"layer_norm_bwd: mean must hold one value per row ({rows}) unless memory_efficient"
        )
    xhat = _xhat(
        input_or_output, mean, invvar, weight, bias, eps, memory_efficient, rows, cols, acc
    )
    dy = grad_output.reshape(rows, cols).to(acc)
    g = dy * weight.reshape(1, cols).to(acc) if weight is not None else dy
    r = invvar.to(acc)[:, None]
    gi = r * (g - g.mean(dim=1, keepdim=True) - xhat * (g * xhat).mean(dim=1, keepdim=True))
    gi = gi.to(grad_input_dtype or input_or_output.dtype).reshape(input_or_output.shape)
    gw, gb = _weight_grads(dy, xhat, weight, bias, acc)
    return gi, gw, gb


def rms_norm_fwd(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    normalized_shape: list[int],
    eps: float,
    memory_efficient: bool = False,
    out_dtype: torch.dtype | None = None,
):
    """Returns ``(out, invvar)`` with invvar = 1 / sqrt(mean(x^2) + eps) per row."""
    acc = _stat_dtype(input.dtype)
    rows, cols = _rows(input, normalized_shape)
    x = input.reshape(rows, cols).to(acc)
    invvar = torch.rsqrt((x * x).mean(dim=1) + eps)
    y = x * invvar[:, None]
    if weight is not None:
        y = y * weight.reshape(1, cols).to(acc)
    return y.to(out_dtype or input.dtype).reshape(input.shape), invvar


def rms_norm_bwd(
    grad_output: torch.Tensor,
    invvar: torch.Tensor,
    input_or_output: torch.Tensor,
    normalized_shape: list[int],
    weight: torch.Tensor | None,
    eps: float,
    memory_efficient: bool = False,
    grad_input_dtype: torch.dtype | None = None,
):
    """Returns ``(grad_input, grad_weight)``; grad_weight is empty (shape [0]) without weight."""
    acc = _stat_dtype(input_or_output.dtype)
    rows, cols = _rows(input_or_output, normalized_shape)
    xhat = _xhat(
        input_or_output, None, invvar, weight, None, eps, memory_efficient, rows, cols, acc
    )
    dy = grad_output.reshape(rows, cols).to(acc)
    g = dy * weight.reshape(1, cols).to(acc) if weight is not None else dy
    r = invvar.to(acc)[:, None]
    gi = r * (g - xhat * (g * xhat).mean(dim=1, keepdim=True))
    gi = gi.to(grad_input_dtype or input_or_output.dtype).reshape(input_or_output.shape)
    gw, _ = _weight_grads(dy, xhat, weight, None, acc)
    return gi, gw
