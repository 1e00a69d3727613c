"""apex's ``fused_layer_norm_cuda`` extension module, on the ``apex_norm`` ops (apex-norm).

Code that imports it by name (Megatron-DeepSpeed, gpt-neox, fast-llm, older BLOOM-era copies)
keeps working; the tensors may be on any device (CPU runs the plain-torch reference). Return
values are lists, as apex's pybind functions return them. ``memory_efficient`` defaults to False,
so the 8-argument ``backward_affine`` of pre-2023 callers works again. Output dtypes follow
``apex.normalization.ops.output_dtype``; the ``*_mixed_dtypes`` variants give the weight's dtype.
"""

from __future__ import annotations

from apex.normalization import ops

__all__ = [
    "forward_affine",
    "forward",
    "backward_affine",
    "backward",
    "forward_affine_mixed_dtypes",
    "rms_forward_affine",
    "rms_forward",
    "rms_backward_affine",
    "rms_backward",
    "rms_forward_affine_mixed_dtypes",
]


def _contig(t):
    return t.contiguous() if t is not None else None


def _ln(input, normalized_shape, gamma, beta, epsilon, mixed):
    shape = ops.validate(input, normalized_shape, gamma, beta)
    dtype = ops.output_dtype(input.dtype, gamma.dtype if gamma is not None else None, mixed)
    out, mean, invvar = ops.layer_norm_fwd(
        _contig(input), _contig(gamma), _contig(beta), shape, epsilon, False, dtype
    )
    return [out, mean, invvar]


def _rms(input, normalized_shape, gamma, epsilon, mixed):
    shape = ops.validate(input, normalized_shape, gamma)
    dtype = ops.output_dtype(input.dtype, gamma.dtype if gamma is not None else None, mixed)
    out, invvar = ops.rms_norm_fwd(_contig(input), _contig(gamma), shape, epsilon, False, dtype)
    return [out, invvar]


def forward_affine(input, normalized_shape, gamma, beta, epsilon):
    """-> [output, mean, invvar]"""
    return _ln(input, normalized_shape, gamma, beta, epsilon, False)


def forward_affine_mixed_dtypes(input, normalized_shape, gamma, beta, epsilon):
    """-> [output (gamma's dtype), mean, invvar]"""
    return _ln(input, normalized_shape, gamma, beta, epsilon, True)


def forward(input, normalized_shape, epsilon):
    """-> [output, mean, invvar]"""
    return _ln(input, normalized_shape, None, None, epsilon, False)


def backward_affine(
    dout,
    mean,
    invvar,
    input_or_output,
    normalized_shape,
    gamma,
    beta,
    epsilon,
    memory_efficient=False,
):
    """-> [grad_input, grad_gamma, grad_beta]; ``mean`` may be None with memory_efficient."""
    shape = ops.validate(input_or_output, normalized_shape, gamma, beta)
    gi, gg, gb = ops.layer_norm_bwd(
        dout.contiguous(),
        mean,
        invvar,
        _contig(input_or_output),
        shape,
        _contig(gamma),
        _contig(beta),
        epsilon,
        memory_efficient,
        None,
    )
    return [gi, gg, gb]


def backward(
    dout, mean, invvar, input_or_output, normalized_shape, epsilon, memory_efficient=False
):
    """-> grad_input"""
    shape = ops.validate(input_or_output, normalized_shape)
    gi, _, _ = ops.layer_norm_bwd(
        dout.contiguous(),
        mean,
        invvar,
        _contig(input_or_output),
        shape,
        None,
        None,
        epsilon,
        memory_efficient,
        None,
    )
    return gi


def rms_forward_affine(input, normalized_shape, gamma, epsilon):
    """-> [output, invvar]"""
    return _rms(input, normalized_shape, gamma, epsilon, False)


def rms_forward_affine_mixed_dtypes(input, normalized_shape, gamma, epsilon):
    """-> [output (gamma's dtype), invvar]"""
    return _rms(input, normalized_shape, gamma, epsilon, True)


def rms_forward(input, normalized_shape, epsilon):
    """-> [output, invvar]"""
    return _rms(input, normalized_shape, None, epsilon, False)


def rms_backward_affine(
    dout, invvar, input_or_output, normalized_shape, gamma, epsilon, memory_efficient=False
):
    """-> [grad_input, grad_gamma]"""
    shape = ops.validate(input_or_output, normalized_shape, gamma)
    gi, gg = ops.rms_norm_bwd(
        dout.contiguous(),
        invvar,
        _contig(input_or_output),
        shape,
        _contig(gamma),
        epsilon,
        memory_efficient,
        None,
    )
    return [gi, gg]


def rms_backward(dout, invvar, input_or_output, normalized_shape, epsilon, memory_efficient=False):
    """-> grad_input"""
    shape = ops.validate(input_or_output, normalized_shape)
    gi, _ = ops.rms_norm_bwd(
        dout.contiguous(),
        invvar,
        _contig(input_or_output),
        shape,
        None,
        epsilon,
        memory_efficient,
        None,
    )
    return gi
