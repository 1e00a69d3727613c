"""The ``apex_norm`` ops: schemas, fakes, autograd, and their kernels.

Every op is defined here, in Python, so that it exists on any machine: the reference
(reference.py) is its kernel for every device, and on CUDA the compiled library ``apex_norm_C``
registers the real kernels the first time an op runs (compiled then if nothing prebuilt or cached
fits). When the library cannot be had, CUDA falls back to the reference after one warning.

    torch.ops.apex_norm.layer_norm_fwd(input, weight, bias, normalized_shape, eps,
                                       memory_efficient=False, out_dtype=None) -> (out, mean, invvar)
    torch.ops.apex_norm.layer_norm_bwd(grad_output, mean, invvar, input_or_output, normalized_shape,
                                       weight, bias, eps, memory_efficient=False,
                                       grad_input_dtype=None) -> (grad_input, grad_weight, grad_bias)
    torch.ops.apex_norm.rms_norm_fwd(input, weight, normalized_shape, eps, memory_efficient=False,
                                     out_dtype=None) -> (out, invvar)
    torch.ops.apex_norm.rms_norm_bwd(grad_output, invvar, input_or_output, normalized_shape, weight,
                                     eps, memory_efficient=False,
                                     grad_input_dtype=None) -> (grad_input, grad_weight)

``mean`` and ``invvar`` are float32 (float64 for float64 input), 1-D, one per row (the input's
leading dimensions flattened). A missing weight or bias gives an empty (shape [0]) gradient. The
forward ops are differentiable themselves (``OpLibrary.register_autograd``, which also serves
torch 2.3; on CUDA, once apex_norm_C is loaded, its C++ autograd in csrc/autograd.cpp takes over,
the same math with less host time); the apex autograd Functions in fused_layer_norm.py call them
too, below autograd. The ops expect valid
arguments: the functions in this module and in fused_layer_norm.py check them first
(``validate``).
"""

from __future__ import annotations

import inspect
import math
import numbers
import operator
import types
import warnings
from collections.abc import Sequence

import torch

from apex.multi_tensor_apply.build import loader as _loader

from . import reference
from ._errors import NormTypeError, NormValueError
from ._kernels import NORM

SCHEMAS = {
    "layer_norm_fwd": (
        "layer_norm_fwd(Tensor input, Tensor? weight, Tensor? bias, int[] normalized_shape, "
        "float eps, bool memory_efficient=False, ScalarType? out_dtype=None) "
        "-> (Tensor, Tensor, Tensor)"
    ),
    "layer_norm_bwd": (
        "layer_norm_bwd(Tensor grad_output, Tensor? mean, Tensor invvar, Tensor input_or_output, "
        "int[] normalized_shape, Tensor? weight, Tensor? bias, float eps, "
        "bool memory_efficient=False, ScalarType? grad_input_dtype=None) "
        "-> (Tensor, Tensor, Tensor)"
    ),
    "rms_norm_fwd": (
        "rms_norm_fwd(Tensor input, Tensor? weight, int[] normalized_shape, float eps, "
        "bool memory_efficient=False, ScalarType? out_dtype=None) -> (Tensor, Tensor)"
    ),
    "rms_norm_bwd": (
        "rms_norm_bwd(Tensor grad_output, Tensor invvar, Tensor input_or_output, "
        "int[] normalized_shape, Tensor? weight, float eps, bool memory_efficient=False, "
        "ScalarType? grad_input_dtype=None) -> (Tensor, Tensor)"
    ),
}

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_NAMES = "float32, float16, bfloat16, float64"


def _rows(t: torch.Tensor, normalized_shape) -> int:
    return math.prod(t.shape[: t.dim() - len(normalized_shape)])


def _stat(t: torch.Tensor, rows) -> torch.Tensor:
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    return t.new_empty((rows,), dtype=dtype)


def _grad_of(param: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if param is None:
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        return like.new_empty((0,), dtype=dtype)
    return param.new_empty(param.shape)


def _fake_ln_fwd(
    input, weight, bias, normalized_shape, eps, memory_efficient=False, out_dtype=None
):
    rows = _rows(input, normalized_shape)
    out = input.new_empty(input.shape, dtype=out_dtype or input.dtype)
    return out, _stat(input, rows), _stat(input, rows)


def _fake_ln_bwd(
    grad_output,
    mean,
    invvar,
    input_or_output,
    normalized_shape,
    weight,
    bias,
    eps,
    memory_efficient=False,
    grad_input_dtype=None,
):
    gi = input_or_output.new_empty(
        input_or_output.shape, dtype=grad_input_dtype or input_or_output.dtype
    )
    return gi, _grad_of(weight, input_or_output), _grad_of(bias, input_or_output)


def _fake_rms_fwd(input, weight, normalized_shape, eps, memory_efficient=False, out_dtype=None):
    out = input.new_empty(input.shape, dtype=out_dtype or input.dtype)
    return out, _stat(input, _rows(input, normalized_shape))


def _fake_rms_bwd(
    grad_output,
    invvar,
    input_or_output,
    normalized_shape,
    weight,
    eps,
    memory_efficient=False,
    grad_input_dtype=None,
):
    gi = input_or_output.new_empty(
        input_or_output.shape, dtype=grad_input_dtype or input_or_output.dtype
    )
    return gi, _grad_of(weight, input_or_output)


_FAKES = {
    "layer_norm_fwd": _fake_ln_fwd,
    "layer_norm_bwd": _fake_ln_bwd,
    "rms_norm_fwd": _fake_rms_fwd,
    "rms_norm_bwd": _fake_rms_bwd,
}


def _checked_reference(name: str):
    """The reference as the ops' kernel for every device but CUDA's compiled one (the CPU, and
    CUDA without the library): the arguments checked first, as the CUDA kernels check them
    (csrc/layer_norm.cu), with NormValueError / NormTypeError naming the argument. The Python
    entry points check before they call it; these checks are for the raw ops and the legacy
    module's backward functions."""
    ref = getattr(reference, name)
    params = inspect.signature(ref).parameters
    names = tuple(params)
    defaults = {n: p.default for n, p in params.items() if p.default is not p.empty}

    def kernel(*args, **kwargs):
        # The dispatcher leaves out trailing arguments equal to their defaults. (A dict, not
        # Signature.bind: that alone cost ~5 us a call, twice the checks.)
        a = {**defaults, **dict(zip(names, args)), **kwargs}
        _check_op_arguments(name, a)
        return ref(*args, **kwargs)

    kernel.__name__ = f"{name}_reference"
    return kernel


def _check_op_arguments(name: str, a: dict) -> None:
    if name.endswith("_fwd"):
        validate(a["input"], a["normalized_shape"], a["weight"], a.get("bias"))
        return
    x = a["input_or_output"]
    shape = validate(x, a["normalized_shape"], a["weight"], a.get("bias"))
    g = a["grad_output"]
    if not isinstance(g, torch.Tensor) or g.dtype not in SUPPORTED_DTYPES:
        raise NormTypeError(f"{name}: grad_output must be a floating tensor ({_NAMES})")
    if g.shape != x.shape or g.device != x.device:
        raise NormValueError(
            f"{name}: grad_output has shape {list(g.shape)} on {g.device} but input_or_output "
            f"has shape {list(x.shape)} on {x.device}; they must match"
        )
    rows = _rows(x, shape)
    stats = [("invvar", a["invvar"])]
    if name == "layer_norm_bwd" and not a["memory_efficient"]:
        stats.append(("mean", a["mean"]))  # the reference names its absence itself
    for stat, t in stats:
        if t is not None and (t.numel() != rows or t.device != x.device):
            raise NormValueError(
                f"{name}: {stat} must hold one value per row ({rows}) on {x.device}, got "
                f"{t.numel()} on {t.device}"
            )


def _define(references):
    from apex.multi_tensor_apply.build.oplib import define_ops

    return define_ops("apex_norm", NORM, SCHEMAS, references, _FAKES)


# The checked references: the ops' kernel for every device but CUDA's compiled one, and what
# _ops gives float64 on a GPU.
_CHECKED_REFERENCE = types.SimpleNamespace(**{n: _checked_reference(n) for n in SCHEMAS})
# Schemas, references, fakes, and the CUDA loaders that fetch apex_norm_C on first use.
OPS = _define(vars(_CHECKED_REFERENCE))


def kernels_loaded() -> bool:
    """Whether apex_norm_C is loaded (its CUDA kernels and their C++ autograd registered)."""
    return _loader.loaded(NORM) is not None


def _warn_tune_notes(extension) -> None:
    """APEX_NORM_TUNE's entries the library did not take (an unknown knob, a value that is not an
    integer or is out of range), one warning each, once the library is loaded. The library reads
    the variable; it does not warn itself (csrc/layer_norm.cu, apex_norm_tune_notes)."""
    import ctypes

    try:
        notes = ctypes.CDLL(str(extension.path)).apex_norm_tune_notes
    except (OSError, AttributeError):  # a library built before it had them
        return
    notes.restype = ctypes.c_char_p
    for line in notes().decode(errors="replace").splitlines():
        warnings.warn(line, UserWarning, stacklevel=2)


_loader.register_post_load(NORM.name, _warn_tune_notes)


# -- autograd of the forward ops -------------------------------------------------------------


def _ln_setup(ctx, inputs, output):
    input, weight, bias, normalized_shape, eps, memory_efficient, _ = inputs
    out, mean, invvar = output
    ctx.normalized_shape = list(normalized_shape)
    ctx.eps = eps
    ctx.memory_efficient = memory_efficient
    ctx.input_dtype, ctx.out_dtype = input.dtype, out.dtype
    ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
    saved = (out, None) if memory_efficient else (input, mean)
    ctx.save_for_backward(*saved, invvar, weight, bias)


def contiguous(t):
    """``t.contiguous()``, None kept (the ops take contiguous tensors)."""
    return t.contiguous() if t is not None else None


def layer_norm_grads(ctx, grad_out):
    """(grad_input, grad_weight, grad_bias) from an autograd context that saved (input or
    output, mean, invvar, weight, bias) and set normalized_shape, eps, memory_efficient,
    input_dtype and out_dtype: the op's own autograd and the apex Functions (fused_layer_norm.py)
    both. Under create_graph=True, differentiable ones (``grads_with_graph``)."""
    x_or_y, mean, invvar, weight, bias = ctx.saved_tensors
    if torch.is_grad_enabled():
        forward = lambda: reference.layer_norm_out(  # noqa: E731
            x_or_y, weight, bias, ctx.normalized_shape, ctx.eps, ctx.out_dtype
        )
        return grads_with_graph(ctx, grad_out, forward, (x_or_y, weight, bias))
    return layer_norm_bwd(
        grad_out.contiguous(),
        mean,
        invvar,
        contiguous(x_or_y),
        ctx.normalized_shape,
        contiguous(weight),
        contiguous(bias),
        ctx.eps,
        ctx.memory_efficient,
        ctx.input_dtype,
    )


def rms_norm_grads(ctx, grad_out):
    """(grad_input, grad_weight) from a context that saved (input or output, invvar, weight),
    as layer_norm_grads."""
    x_or_y, invvar, weight = ctx.saved_tensors
    if torch.is_grad_enabled():
        forward = lambda: reference.rms_norm_out(  # noqa: E731
            x_or_y, weight, ctx.normalized_shape, ctx.eps, ctx.out_dtype
        )
        return grads_with_graph(ctx, grad_out, forward, (x_or_y, weight))
    return rms_norm_bwd(
        grad_out.contiguous(),
        invvar,
        contiguous(x_or_y),
        ctx.normalized_shape,
        contiguous(weight),
        ctx.eps,
        ctx.memory_efficient,
        ctx.input_dtype,
    )


def grads_with_graph(ctx, grad_out, forward, inputs) -> tuple:
    """The gradients under create_graph=True (a double backward: a gradient penalty, a
    Hessian-vector product), as torch.nn.LayerNorm gives them: differentiable functions of the
    inputs and grad_out, by autograd through ``forward()``, the plain-torch forward recomputed
    from the saved input (no kernel has a derivative). None for an input that needs no gradient.
    memory_efficient saved the output instead, from which the input cannot be had: an error
    rather than second-order terms that would silently be missing."""
    if ctx.memory_efficient:
        raise RuntimeError(
            "apex.normalization: memory_efficient=True keeps the norm's output instead of its "
            "input, so its gradient cannot be differentiated again (backward with "
            "create_graph=True, torch.autograd.grad(..., create_graph=True)); use "
            "memory_efficient=False for double backward"
        )
    need = [t for t in inputs if t is not None and t.requires_grad]
    got = iter(
        torch.autograd.grad(forward(), need, grad_out, create_graph=True, allow_unused=True)
        if need
        else ()
    )
    return tuple(next(got) if t is not None and t.requires_grad else None for t in inputs)


def _ln_backward(ctx, grad_out, _grad_mean, _grad_invvar):
    gi, gw, gb = layer_norm_grads(ctx, grad_out)
    return (
        gi,
        gw if ctx.has_weight else None,
        gb if ctx.has_bias else None,
        None,
        None,
        None,
        None,
    )


def _rms_setup(ctx, inputs, output):
    input, weight, normalized_shape, eps, memory_efficient, _ = inputs
    out, invvar = output
    ctx.normalized_shape = list(normalized_shape)
    ctx.eps = eps
    ctx.memory_efficient = memory_efficient
    ctx.input_dtype, ctx.out_dtype = input.dtype, out.dtype
    ctx.has_weight = weight is not None
    ctx.save_for_backward(out if memory_efficient else input, invvar, weight)


def _rms_backward(ctx, grad_out, _grad_invvar):
    gi, gw = rms_norm_grads(ctx, grad_out)
    return gi, gw if ctx.has_weight else None, None, None, None, None


OPS.register_autograd("layer_norm_fwd", _ln_backward, _ln_setup)
OPS.register_autograd("rms_norm_fwd", _rms_backward, _rms_setup)


# -- argument checks ---------------------------------------------------------------------------
# NormTypeError / NormValueError (_errors.py): TypeError / ValueError that are RuntimeErrors too.


def _is_int_tensor(t) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and not t.is_floating_point()
        and not t.is_complex()
        and (t.dtype != torch.bool)
    )


def _is_dim(d) -> bool:
    # numbers.Integral: numpy's ints too (apex, through torch.Size, takes them), and 0-dim
    # integer tensors (torch.Size takes those too); never a bool.
    if _is_int_tensor(d):
        return d.dim() == 0
    return isinstance(d, (numbers.Integral, torch.SymInt)) and not isinstance(d, bool)


def _dim(d):
    return d if isinstance(d, (int, torch.SymInt)) else operator.index(d)


def as_normalized_shape(normalized_shape) -> list[int]:
    """An int, or a sequence of ints (torch.Size, tuple, list), as a list of ints."""
    kind = type(normalized_shape)
    if kind is int:
        shape = [normalized_shape]
    elif (kind is torch.Size or kind is tuple or kind is list) and all(
        type(d) is int for d in normalized_shape
    ):
        shape = list(normalized_shape)  # the common case, kept cheap: it runs on every call
    elif _is_dim(normalized_shape):
        shape = [_dim(normalized_shape)]
    elif _is_int_tensor(normalized_shape) and normalized_shape.dim() == 1:
        shape = [int(d) for d in normalized_shape.tolist()]  # as torch.Size(tensor) in apex
    elif isinstance(normalized_shape, Sequence) and all(_is_dim(d) for d in normalized_shape):
        shape = [_dim(d) for d in normalized_shape]
    else:
        raise NormTypeError(
            f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
        )
    if not shape or any(d < 0 for d in shape):
        raise NormValueError(
            f"normalized_shape must be non-empty with no negative size, got {normalized_shape!r}"
        )
    return shape


def _check_param(name: str, param, input: torch.Tensor, shape: list[int]) -> None:
    if param is None:
        return
    if not isinstance(param, torch.Tensor):
        raise NormTypeError(f"{name} must be a torch.Tensor or None, got {type(param).__name__}")
    if param.dtype not in SUPPORTED_DTYPES:
        raise NormTypeError(f"{name} has dtype {param.dtype}; supported: {_NAMES}")
    if list(param.shape) != shape:
        raise NormValueError(
            f"{name} has shape {list(param.shape)} but normalized_shape is {shape}; "
            f"{name} must have shape normalized_shape"
        )
    if param.device != input.device:
        raise NormValueError(
            f"{name} is on {param.device} but input is on {input.device}; "
            "they must be on one device"
        )


def validate(input, normalized_shape, weight=None, bias=None) -> list[int]:
    """Checks the arguments of a norm; returns normalized_shape as a list of ints.

    Under torch.jit.trace the sizes are traced tensors, and each comparison warns that a tensor
    became a Python bool. The checks hold for the traced call and the trace keeps none of them
    (nor does it keep torch's own), so those warnings are silenced there.
    """
    if torch.jit.is_tracing():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            return _validate(input, normalized_shape, weight, bias)
    return _validate(input, normalized_shape, weight, bias)


def _validate(input, normalized_shape, weight, bias) -> list[int]:
    """validate's checks.

    NormTypeError (a TypeError) for a non-tensor or an unsupported dtype, NormValueError (a
    ValueError) for shapes and devices, both RuntimeErrors too; each message names the argument.
    """
    if not isinstance(input, torch.Tensor):
        raise NormTypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.dtype not in SUPPORTED_DTYPES:
        raise NormTypeError(f"input has dtype {input.dtype}; supported: {_NAMES}")
    shape = as_normalized_shape(normalized_shape)
    k = len(shape)
    if input.dim() < k or list(input.shape[input.dim() - k :]) != shape:
        raise NormValueError(
            f"normalized_shape {shape} does not match the trailing dimensions of input with "
            f"shape {list(input.shape)}: expected input.shape[-{k}:] == {shape}"
        )
    _check_param("weight", weight, input, shape)
    _check_param("bias", bias, input, shape)
    return shape


def output_dtype(
    input_dtype: torch.dtype, weight_dtype: torch.dtype | None, mixed: bool = False
) -> torch.dtype:
    """The dtype of a norm's output (see README, "dtypes").

    - the Mixed* forms (Megatron's rule): the weight's dtype;
    - the others: the input's dtype, except float32 input with a float16 or bfloat16 weight,
      which gives the weight's dtype (what HF T5LayerNorm and apex's own ``manual_rms_norm``
      do in that case, so a half model with a float32 residual stream keeps working; for half
      input with a float32 weight they promote to float32, this keeps the input's dtype).
    Without a weight: the input's dtype. Any input/weight combination is accepted.
    """
    if weight_dtype is None:
        return input_dtype
    if mixed:
        return weight_dtype
    if input_dtype == torch.float32 and weight_dtype in (torch.float16, torch.bfloat16):
        return weight_dtype
    return input_dtype


# -- entry points used by the Python API -------------------------------------------------------
# The CUDA kernels take float32, float16 and bfloat16; float64 on a GPU runs the reference.


def _ops(t: torch.Tensor, *others, dtype=None):
    """The reference for float64 on a GPU (any of the tensors, or the requested output dtype;
    with the ops' argument checks, as the raw ops take them), else the ops."""
    f64 = torch.float64
    if t.is_cuda and (
        t.dtype == f64 or dtype == f64 or any(o is not None and o.dtype == f64 for o in others)
    ):
        return _CHECKED_REFERENCE
    return torch.ops.apex_norm


def _one_dtype(weight, bias):
    """weight and bias in one dtype, as the kernels read them: the wider of the two (a bias
    rounded to a 16-bit weight's dtype would lose its own precision, and its gradient could
    overflow there)."""
    if weight is not None and bias is not None and bias.dtype != weight.dtype:
        common = torch.promote_types(weight.dtype, bias.dtype)
        return weight.to(common), bias.to(common)
    return weight, bias


def layer_norm_fwd(
    input, weight, bias, normalized_shape, eps, memory_efficient=False, out_dtype=None
):
    weight, bias = _one_dtype(weight, bias)
    return _ops(input, weight, bias, dtype=out_dtype).layer_norm_fwd(
        input, weight, bias, normalized_shape, eps, memory_efficient, out_dtype
    )


def layer_norm_bwd(
    grad_output,
    mean,
    invvar,
    input_or_output,
    normalized_shape,
    weight,
    bias,
    eps,
    memory_efficient=False,
    grad_input_dtype=None,
):
    own = [t.dtype if t is not None else None for t in (weight, bias)]
    weight, bias = _one_dtype(weight, bias)
    gi, gw, gb = _ops(
        input_or_output, grad_output, weight, bias, dtype=grad_input_dtype
    ).layer_norm_bwd(
        grad_output,
        mean,
        invvar,
        input_or_output,
        normalized_shape,
        weight,
        bias,
        eps,
        memory_efficient,
        grad_input_dtype,
    )
    # Each gradient in its own tensor's dtype.
    gw, gb = (g if d is None or g.dtype == d else g.to(d) for g, d in zip((gw, gb), own))
    return gi, gw, gb


def rms_norm_fwd(input, weight, normalized_shape, eps, memory_efficient=False, out_dtype=None):
    return _ops(input, weight, dtype=out_dtype).rms_norm_fwd(
        input, weight, normalized_shape, eps, memory_efficient, out_dtype
    )


def rms_norm_bwd(
    grad_output,
    invvar,
    input_or_output,
    normalized_shape,
    weight,
    eps,
    memory_efficient=False,
    grad_input_dtype=None,
):
    return _ops(input_or_output, grad_output, weight, dtype=grad_input_dtype).rms_norm_bwd(
        grad_output,
        invvar,
        input_or_output,
        normalized_shape,
        weight,
        eps,
        memory_efficient,
        grad_input_dtype,
    )
