"""Plain-torch LayerNorm and RMSNorm: the CPU path, the fallback without compiled kernels, and
the plain math of torch.func, forward-mode AD, tracing and ONNX export. (The tests hold the CUDA
kernels and this against torch's norms in float64.)

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


def _stats_shape(t: torch.Tensor, normalized_shape) -> list[int]:
    """The shape torch's native layer norm gives its statistics: the leading dims, then ones."""
    k = len(normalized_shape)
    return [*t.shape[: t.dim() - k], *([1] * k)]


def _native(rows: int, cols: int) -> bool:
    """Whether the LayerNorm here runs torch's own (aten's native_layer_norm and its backward,
    in the statistics' dtype): rows and columns to normalise (else the plain math below, whose
    empty reductions give the NaN statistics the kernels give)."""
    return rows > 0 and cols > 0


def layer_norm_out(input, weight, bias, normalized_shape, eps, out_dtype=None) -> torch.Tensor:
    """LayerNorm's output alone (the plain math of torch.func, forward-mode AD, tracing and ONNX
    export, and the forward that create_graph differentiates): torch's ``F.layer_norm`` on the
    operands cast to the statistics' dtype, then the output dtype. No branch on the sizes (a
    traced size would warn) and standard operators only (ONNX LayerNormalization)."""
    acc = _stat_dtype(input.dtype)
    # A bias without a weight is added after: torch's double backward of layer_norm gets that
    # case wrong (torch 2.13: gradgradcheck of F.layer_norm(x, shape, None, bias) fails).
    late_bias = weight is None and bias is not None
    y = torch.nn.functional.layer_norm(
        input.to(acc),
        list(normalized_shape),
        weight.to(acc) if weight is not None else None,
        bias.to(acc) if bias is not None and not late_bias else None,
        eps,
    )
    if late_bias:
        y = y + bias.to(acc)
    return y.to(out_dtype or input.dtype)


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
    input's dtype), ``mean`` and ``invvar`` are 1-D of length rows. Every output is a tensor of
    its own, not a view (an in-place op on the output, as after torch's norms, must work).

    torch's own LayerNorm (aten's native_layer_norm) on the input, weight and bias cast to the
    statistics' dtype: as fast as torch's on the CPU (this is apex's CPU path, which was
    ``F.layer_norm``). The plain math (torch.func, forward-mode AD, tracing, ONNX, double
    backward) is layer_norm_out."""
    acc = _stat_dtype(input.dtype)
    rows, cols = _rows(input, normalized_shape)
    if not _native(rows, cols):  # nothing to normalise: an empty output, NaN statistics
        x = input.reshape(rows, cols).to(acc)
        mean = x.mean(dim=1)
        invvar = torch.rsqrt((x - mean[:, None]).square().mean(dim=1) + eps)
        return input.new_empty(input.shape, dtype=out_dtype or input.dtype), mean, invvar
    # Every operand in the statistics' dtype: torch's mixed-dtype kernels (16-bit input with a
    # float32 weight) are faster, but on the CPU they normalise a constant 16-bit row of a large
    # value (1000 in float16) to up to 1.5 instead of 0 (test_16bit_constant_and_large_mean_rows).
    y, mean, invvar = torch.native_layer_norm(
        input.to(acc),
        list(normalized_shape),
        weight.to(acc) if weight is not None else None,
        bias.to(acc) if bias is not None else None,
        eps,
    )
    # The statistics come as [leading dims, 1, ...]: flattened into tensors of their own.
    return y.to(out_dtype or input.dtype), mean.reshape(rows).clone(), invvar.reshape(rows).clone()


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
    if not memory_efficient and _native(rows, cols):
        # torch's own backward, from the input and the forward's statistics.
        stats = _stats_shape(input_or_output, normalized_shape)
        gi, gw, gb = torch.ops.aten.native_layer_norm_backward(
            grad_output.to(acc),
            input_or_output.to(acc),
            list(normalized_shape),
            mean.to(acc).reshape(stats),
            invvar.to(acc).reshape(stats),
            weight.to(acc) if weight is not None else None,
            bias.to(acc) if bias is not None else None,
            [True, weight is not None, bias is not None],
        )
        empty = grad_output.new_empty((0,), dtype=acc)
        return (
            gi.to(grad_input_dtype or input_or_output.dtype),
            gw.to(weight.dtype) if weight is not None else empty,
            gb.to(bias.dtype) if bias is not None else empty.clone(),
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
    y, invvar = _rms(input, weight, normalized_shape, eps, out_dtype)
    return y, invvar.reshape(_rows(input, normalized_shape)[0]).clone()


def rms_norm_out(input, weight, normalized_shape, eps, out_dtype=None) -> torch.Tensor:
    """RMSNorm's output alone (as layer_norm_out)."""
    return _rms(input, weight, normalized_shape, eps, out_dtype)[0]


_F_RMS = getattr(torch.nn.functional, "rms_norm", None)  # torch >= 2.4


def rms_norm_eager(input, weight, normalized_shape, eps, out_dtype=None) -> torch.Tensor:
    """rms_norm_out through torch's ``F.rms_norm`` where torch has it (the eager CPU path: a fused
    kernel without grad, the same composite math as here with it), on the operands in the
    statistics' dtype. Not for tracing or ONNX export: the traced graph would hold aten::rms_norm,
    which older ONNX opsets lack."""
    if _F_RMS is None:
        return rms_norm_out(input, weight, normalized_shape, eps, out_dtype)
    if eps is None:  # F.rms_norm's own default, which no other route takes
        raise TypeError("rms_norm: eps must be a float, got None")
    acc = _stat_dtype(input.dtype)
    w = weight.to(acc) if weight is not None else None
    # Contiguous, as every other route's output (F.rms_norm keeps a strided input's layout).
    x = input.to(acc).contiguous()
    return _F_RMS(x, list(normalized_shape), w, eps).to(out_dtype or input.dtype)


def _rms(input, weight, normalized_shape, eps, out_dtype):
    # In the input's own shape (the sums over its trailing dims, kept), so that the output is a
    # tensor of its own, not a view of a [rows, cols] one.
    acc = _stat_dtype(input.dtype)
    x = input.to(acc)
    dims = list(range(-len(normalized_shape), 0))
    invvar = torch.rsqrt((x * x).mean(dim=dims, keepdim=True) + eps)
    y = x * invvar
    if weight is not None:
        y = y * weight.to(acc)
    return y.to(out_dtype or input.dtype), invvar


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
