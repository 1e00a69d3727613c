"""apex's fused LayerNorm and RMSNorm: modules, functional forms and autograd Functions.

Signatures and defaults are apex's (note: functional eps defaults to 1e-6, modules' to 1e-5).
Every form runs the ``apex_norm`` ops (ops.py): the CUDA kernels on a GPU, the plain-torch
reference elsewhere, so the same code runs on CPU, under ``torch.compile(fullgraph=True)`` and in
CUDA graphs; eager CPU calls take torch's own norms where that keeps no more for backward (the
plain math: see _eager_cpu).

dtypes (``ops.output_dtype``): any combination of input and weight dtypes among float32, float16,
bfloat16 and float64 is accepted and computed in float32 (float64 for float64 input). The output
has the input's dtype, except float32 input with a float16/bfloat16 weight, which gives the
weight's dtype; the Mixed* forms always give the weight's dtype. Gradients have the dtype of the
tensor they belong to.

Autocast: inside ``torch.autocast`` enabled for the input's device type, input, weight and bias
(floating, not float64) are first cast to the autocast dtype, so the output has the autocast
dtype, as apex does (torch's own ``F.layer_norm`` would return float32 there).
"""

from __future__ import annotations

import contextlib
import importlib
import numbers
import warnings

import torch
from torch.nn import init

from . import ops, reference

__all__ = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "FusedLayerNormAffineFunction",
    "FusedLayerNormFunction",
    "FusedRMSNormAffineFunction",
    "FusedRMSNormFunction",
    "FusedLayerNormAffineMixedDtypesFunction",
    "FusedRMSNormAffineMixedDtypesFunction",
    "fused_layer_norm_affine",
    "fused_layer_norm",
    "mixed_dtype_fused_layer_norm_affine",
    "fused_rms_norm_affine",
    "fused_rms_norm",
    "mixed_dtype_fused_rms_norm_affine",
    "manual_rms_norm",
    "supports_custom_op",
]

# apex's module global: None until the first module is built, then the ``fused_layer_norm_cuda``
# module (here the top-level Python module over the apex_norm ops). Megatron forks import it by
# this name and load it themselves while it is None.
fused_layer_norm_cuda = None


def _load_legacy_module() -> None:
    global fused_layer_norm_cuda
    if fused_layer_norm_cuda is None:
        fused_layer_norm_cuda = importlib.import_module("fused_layer_norm_cuda")


def supports_custom_op() -> bool:
    """As apex: whether this torch has ``torch.library.custom_op`` (torch >= 2.4)."""
    return hasattr(torch.library, "custom_op")


# -- autocast ------------------------------------------------------------------------------------


# torch >= 2.4 (where present): whether autocast knows the device type at all; asking
# is_autocast_enabled about one it does not know (meta) raises.
_autocast_available = getattr(torch.amp, "is_autocast_available", None)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype when autocast is on for ``device_type``, else None."""
    # torch >= 2.4: is_autocast_enabled(device_type) and get_autocast_dtype(device_type). Detected
    # by attribute, not by catching the TypeError of 2.3's argument-less is_autocast_enabled():
    # under torch.compile, dynamo 2.3 raises that error as an InternalTorchDynamoError instead.
    if hasattr(torch, "get_autocast_dtype"):
        # Not while dynamo traces (torch 2.11's cannot trace the query; a compiled graph's
        # tensors are on a device autocast knows).
        if (
            _autocast_available is not None
            and not torch.compiler.is_compiling()
            and not _autocast_available(device_type)
        ):
            return None
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    # torch 2.3: CUDA and CPU each have their own functions (other devices: no autocast here).
    if device_type == "cuda":
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
    return None


def _autocast(input, *params):
    """``(input, *params)`` cast to the autocast dtype when autocast is on for input's device."""
    if not isinstance(input, torch.Tensor):
        return (input, *params)
    dtype = _autocast_dtype(input.device.type)
    if dtype is None:
        return (input, *params)

    def cast(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
            return t.to(dtype)
        return t

    return tuple(cast(t) for t in (input, *params))


# -- autograd Functions (apex's forward argument lists; clients inspect them) ------------------


def _direct():
    """Inside the autograd Functions, the ops dispatch below the Autograd key: their own autograd
    wrapper (a Python function) would only redispatch, about 10 us a call. Not while dynamo
    traces: it does not know that context, and compiled code has no such cost. Nor in a
    backward under create_graph=True (grad mode on there): its gradients are differentiable
    (ops.grads_with_graph), which needs autograd."""
    if torch.compiler.is_compiling() or torch.is_grad_enabled():
        return contextlib.nullcontext()
    return torch._C._AutoDispatchBelowAutograd()


def _checked(input, normalized_shape, weight, bias, mixed):
    """(normalized_shape as a list, the output dtype) of a norm call, its arguments checked."""
    shape = ops.validate(input, normalized_shape, weight, bias)
    out_dtype = ops.output_dtype(input.dtype, weight.dtype if weight is not None else None, mixed)
    return shape, out_dtype


# The helpers below return the tensors to save, and each Function's ``forward`` passes them to
# ``ctx.save_for_backward`` itself. torch 2.3: where torch.compile breaks the graph at ``apply``
# (2.3 cannot trace an autograd.Function that takes a torch.Size), dynamo compiles ``forward`` as
# a frame of its own, and replaying a ``ctx.save_for_backward`` made in a helper it inlined fails
# (InternalTorchDynamoError: save_for_backward) unless that frame names ``save_for_backward``.


def _ln_forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient, mixed):
    shape, out_dtype = _checked(input, normalized_shape, weight, bias, mixed)
    input_, weight_, bias_ = ops.contiguous(input), ops.contiguous(weight), ops.contiguous(bias)
    with _direct():
        out, mean, invvar = ops.layer_norm_fwd(
            input_, weight_, bias_, shape, eps, memory_efficient, out_dtype
        )
    ctx.normalized_shape = shape
    ctx.eps = eps
    ctx.memory_efficient = memory_efficient
    ctx.input_dtype, ctx.out_dtype = input.dtype, out_dtype
    ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
    # The tensors as given, not their contiguous copies: the backward makes them contiguous
    # again (a no-op for the usual contiguous ones), and a double backward differentiates
    # through them, which needs the caller's tensors.
    if memory_efficient:
        return out, (out, None, invvar, weight, bias)
    return out, (input, mean, invvar, weight, bias)


def _ln_backward(ctx, grad_output):
    with _direct():
        gi, gw, gb = ops.layer_norm_grads(ctx, grad_output)
    return gi, (gw if ctx.has_weight else None), (gb if ctx.has_bias else None)


def _rms_forward(ctx, input, weight, normalized_shape, eps, memory_efficient, mixed):
    shape, out_dtype = _checked(input, normalized_shape, weight, None, mixed)
    input_, weight_ = ops.contiguous(input), ops.contiguous(weight)
    with _direct():
        out, invvar = ops.rms_norm_fwd(input_, weight_, shape, eps, memory_efficient, out_dtype)
    ctx.normalized_shape = shape
    ctx.eps = eps
    ctx.memory_efficient = memory_efficient
    ctx.input_dtype, ctx.out_dtype = input.dtype, out_dtype
    ctx.has_weight = weight is not None
    return out, (out if memory_efficient else input, invvar, weight)  # as given: see _ln_forward


def _rms_backward(ctx, grad_output):
    with _direct():
        gi, gw = ops.rms_norm_grads(ctx, grad_output)
    return gi, (gw if ctx.has_weight else None)


class FusedLayerNormAffineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        out, saved = _ln_forward(
            ctx, input, weight, bias, normalized_shape, eps, memory_efficient, False
        )
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        gi, gw, gb = _ln_backward(ctx, grad_output)
        return gi, gw, gb, None, None, None


class FusedLayerNormAffineMixedDtypesFunction(FusedLayerNormAffineFunction):
    """Output in the weight's dtype (Megatron's mixed rule)."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        out, saved = _ln_forward(
            ctx, input, weight, bias, normalized_shape, eps, memory_efficient, True
        )
        ctx.save_for_backward(*saved)
        return out


class FusedLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, normalized_shape, eps, memory_efficient=False):
        out, saved = _ln_forward(
            ctx, input, None, None, normalized_shape, eps, memory_efficient, False
        )
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        gi, _, _ = _ln_backward(ctx, grad_output)
        return gi, None, None, None


class FusedRMSNormAffineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False):
        out, saved = _rms_forward(
            ctx, input, weight, normalized_shape, eps, memory_efficient, False
        )
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        gi, gw = _rms_backward(ctx, grad_output)
        return gi, gw, None, None, None


class FusedRMSNormAffineMixedDtypesFunction(FusedRMSNormAffineFunction):
    """Output in the weight's dtype (Megatron's mixed rule)."""

    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False):
        out, saved = _rms_forward(ctx, input, weight, normalized_shape, eps, memory_efficient, True)
        ctx.save_for_backward(*saved)
        return out


class FusedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, normalized_shape, eps, memory_efficient=False):
        out, saved = _rms_forward(ctx, input, None, normalized_shape, eps, memory_efficient, False)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        gi, _ = _rms_backward(ctx, grad_output)
        return gi, None, None, None


# -- the plain-torch math: ONNX export, tracing, torch.func transforms, forward-mode AD ---------
# The exporter has no ONNX function for the apex_norm ops, a traced graph holding the autograd
# Functions cannot be saved, and the Functions have no vmap or jvp rule: there the forms below
# run the plain-torch math (reference.layer_norm_out / rms_norm_out), which exports as standard
# ONNX operators, saves, and which torch batches and differentiates in both modes (as apex's
# CPU path, torch's own layer_norm, did).

_dual_level = torch.autograd.forward_ad  # _current_level: -1 outside a forward-AD dual level


def _exporting() -> bool:
    # Both exporters trace (TorchScript) or compile (dynamo); the cheap checks come first.
    if not (torch.jit.is_tracing() or torch.compiler.is_compiling()):
        return False
    return torch.onnx.is_in_onnx_export()


def _plain_math() -> bool:
    """In eager code under a torch.func transform (vmap, grad, jacrev, jvp, ...) or inside a
    forward-mode AD dual level, while tracing (torch.jit.trace: the traced graph then holds
    torch's own operators, which torch.jit.save can write, as apex's traced modules held
    F.layer_norm), or while exporting to ONNX."""
    if torch.compiler.is_compiling():
        return _exporting()
    return _functorch_active() or _dual_level._current_level >= 0 or torch.jit.is_tracing()


def _plain_ln(input, weight, bias, normalized_shape, eps, mixed):
    shape, out_dtype = _checked(input, normalized_shape, weight, bias, mixed)
    return reference.layer_norm_out(input, weight, bias, shape, eps, out_dtype)


def _plain_rms(input, weight, normalized_shape, eps, mixed, math=reference.rms_norm_out):
    """``math``: rms_norm_out, or rms_norm_eager (F.rms_norm) on the eager CPU path."""
    shape, out_dtype = _checked(input, normalized_shape, weight, None, mixed)
    return math(input, weight, shape, eps, out_dtype)


# -- the eager CUDA path -------------------------------------------------------------------------
# On a CUDA tensor, once the compiled kernels are loaded, the functional forms (and so the modules)
# call the forward op straight away: on CUDA its autograd is then the compiled library's C++ one
# (csrc/autograd.cpp), the same math as the autograd Functions above without a Python
# autograd.Function per call (about 30 us of host time a forward+backward on an H200's host, which
# at small rows was longer than the kernels). Everything else keeps the Functions: the CPU, float64
# (the reference), torch.compile, tensor subclasses, a bias whose dtype is not the weight's;
# tracing, torch.func transforms and forward-mode AD take the plain-torch math (above).

_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _eager_cuda(input, *params) -> bool:
    if type(input) is not torch.Tensor or not input.is_cuda or input.dtype == torch.float64:
        return False
    for p in params:
        if p is not None and (type(p) not in _PLAIN or p.dtype == torch.float64):
            return False
    # is_compiling first: under dynamo the rest is never traced (no guard on the loader's state).
    return (
        not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and not _functorch_active()
        and _dual_level._current_level < 0
        and ops.kernels_loaded()
    )


# -- the eager CPU path --------------------------------------------------------------------------
# On the CPU, eager and without memory_efficient, the functional forms take the plain-torch math
# where it costs no memory: torch's own norms on the operands in the statistics' dtype
# (reference.layer_norm_out, rms_norm_eager), differentiated by torch's autograd, as apex's CPU
# path was (F.layer_norm, manual_rms_norm), rather than an autograd Function over the ops (same
# results and dtypes; a [4, 1024] float32 LayerNorm module's forward 28 us against 65, torch's 8,
# on the 2-core CI machine). That is every call that records nothing for backward, and
# LayerNorm's with float32 or float64 input and parameters of its dtype, whose backward then keeps
# what the Function keeps.
# Recording otherwise, the plain math would keep more for backward than the Functions: a float32
# copy of 16-bit input (twice its bytes), RMSNorm's composite autograd its intermediates (2-4x).
# memory_efficient keeps the Functions (they save the output, not the input), as do tensor
# subclasses and torch.compile (which traces the ops).

_WIDE = (torch.float32, torch.float64)


def _eager_cpu(input, memory_efficient, rms, *params) -> bool:
    if memory_efficient or type(input) is not torch.Tensor or input.device.type != "cpu":
        return False
    records, mixed = input.requires_grad, False
    for p in params:
        if p is not None:
            if type(p) not in _PLAIN:
                return False
            records = records or p.requires_grad
            mixed = mixed or p.dtype != input.dtype  # the plain math would keep a cast copy
    if records and torch.is_grad_enabled() and (rms or mixed or input.dtype not in _WIDE):
        return False
    return not torch.compiler.is_compiling()


def _layer_norm(input, weight, bias, normalized_shape, eps, memory_efficient, mixed, fn, args):
    """A functional LayerNorm form after autocast: the forward op straight away (eager CUDA; a
    bias of another dtype than the weight takes the Function, which casts it), the plain-torch
    math (_plain_math: ONNX export, torch.func transforms, forward-mode AD; eager CPU), else
    ``fn.apply(*args)``, the autograd Function."""
    if _eager_cuda(input, weight, bias) and (
        weight is None or bias is None or weight.dtype == bias.dtype
    ):
        shape, out_dtype = _checked(input, normalized_shape, weight, bias, mixed)
        return torch.ops.apex_norm.layer_norm_fwd.default(
            input, weight, bias, shape, eps, memory_efficient, out_dtype
        )[0]
    if _plain_math() or _eager_cpu(input, memory_efficient, False, weight, bias):
        return _plain_ln(input, weight, bias, normalized_shape, eps, mixed)
    return fn.apply(*args)


def _rms_norm(input, weight, normalized_shape, eps, memory_efficient, mixed, fn, args):
    """A functional RMSNorm form after autocast, as _layer_norm."""
    if _eager_cuda(input, weight):
        shape, out_dtype = _checked(input, normalized_shape, weight, None, mixed)
        return torch.ops.apex_norm.rms_norm_fwd.default(
            input, weight, shape, eps, memory_efficient, out_dtype
        )[0]
    if _plain_math():
        return _plain_rms(input, weight, normalized_shape, eps, mixed)
    if _eager_cpu(input, memory_efficient, True, weight):
        return _plain_rms(input, weight, normalized_shape, eps, mixed, reference.rms_norm_eager)
    return fn.apply(*args)


# -- functional forms (apex's names and defaults) -----------------------------------------------


def fused_layer_norm_affine(
    input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False
):
    """LayerNorm with weight and bias (either may be None). Output dtype: see the module doc."""
    input, weight, bias = _autocast(input, weight, bias)
    args = (input, weight, bias, normalized_shape, eps, memory_efficient)
    return _layer_norm(*args, False, FusedLayerNormAffineFunction, args)


def fused_layer_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    """LayerNorm without weight and bias; output in the input's dtype."""
    (input,) = _autocast(input)
    args = (input, normalized_shape, eps, memory_efficient)
    return _layer_norm(input, None, None, *args[1:], False, FusedLayerNormFunction, args)


def mixed_dtype_fused_layer_norm_affine(
    input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False
):
    """LayerNorm with the output in the weight's dtype."""
    input, weight, bias = _autocast(input, weight, bias)
    args = (input, weight, bias, normalized_shape, eps, memory_efficient)
    return _layer_norm(*args, True, FusedLayerNormAffineMixedDtypesFunction, args)


def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    """RMSNorm with a weight (may be None). Output dtype: see the module doc."""
    input, weight = _autocast(input, weight)
    args = (input, weight, normalized_shape, eps, memory_efficient)
    return _rms_norm(*args, False, FusedRMSNormAffineFunction, args)


def fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    """RMSNorm without a weight; output in the input's dtype."""
    (input,) = _autocast(input)
    args = (input, normalized_shape, eps, memory_efficient)
    return _rms_norm(input, None, *args[1:], False, FusedRMSNormFunction, args)


def mixed_dtype_fused_rms_norm_affine(
    input, weight, normalized_shape, eps=1e-6, memory_efficient=False
):
    """RMSNorm with the output in the weight's dtype."""
    input, weight = _autocast(input, weight)
    args = (input, weight, normalized_shape, eps, memory_efficient)
    return _rms_norm(*args, True, FusedRMSNormAffineMixedDtypesFunction, args)


def manual_rms_norm(input, normalized_shape, weight, eps):
    """apex's plain-torch RMSNorm (its CPU fallback): variance in float32; with a float16 or
    bfloat16 weight the normalised input is cast to the weight's dtype before the product."""
    dims = tuple(range(-1, -len(ops.as_normalized_shape(normalized_shape)) - 1, -1))
    variance = input.to(torch.float32).pow(2).mean(dims, keepdim=True)
    input = input * torch.rsqrt(variance + eps)
    if weight is None:
        return input
    if weight.dtype in (torch.float16, torch.bfloat16):
        input = input.to(weight.dtype)
    return weight * input


# -- TorchScript ---------------------------------------------------------------------------------
# torch.jit.script of a module compiles only this (apex's modules fell back to torch's own norms
# when scripted): the reference math in TorchScript, with the argument checks and the dtype rule
# of the other forms, but not the eager forms' autocast casts: under torch.autocast a scripted
# module's output has the dtype it would have outside it (eager: the autocast dtype).


def _script_norm(
    input: torch.Tensor,
    normalized_shape: list[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    mixed: bool,
) -> torch.Tensor:
    k = len(normalized_shape)
    if not input.is_floating_point():
        raise TypeError(
            f"input has dtype {input.dtype}; supported: float32, float16, bfloat16, float64"
        )
    if input.dim() < k or list(input.shape[input.dim() - k :]) != normalized_shape:
        raise ValueError(
            f"normalized_shape {normalized_shape} does not match the trailing dimensions of input "
            f"with shape {list(input.shape)}"
        )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and list(p.shape) != normalized_shape:
            raise ValueError(
                f"{name} has shape {list(p.shape)} but normalized_shape is {normalized_shape}"
            )
    acc = torch.float64 if input.dtype == torch.float64 else torch.float32
    out_dtype = ops.output_dtype(input.dtype, weight.dtype if weight is not None else None, mixed)
    dims: list[int] = []
    for i in range(k):
        dims.append(i - k)
    x = input.to(acc)
    if not rms:
        x = x - x.mean(dims, keepdim=True)
    y = x * torch.rsqrt((x * x).mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(out_dtype)


# -- modules -------------------------------------------------------------------------------------


def _as_size(normalized_shape) -> torch.Size:
    if not (isinstance(normalized_shape, numbers.Integral) or ops._is_int_tensor(normalized_shape)):
        normalized_shape = tuple(normalized_shape)
    return torch.Size(ops.as_normalized_shape(normalized_shape))


class FusedLayerNorm(torch.nn.Module):
    """LayerNorm over the last ``len(normalized_shape)`` dimensions, as ``torch.nn.LayerNorm``.

    apex's arguments, plus torch's keyword-only ``bias`` (False: weight only), ``device`` and
    ``dtype``. Attributes ``normalized_shape`` (torch.Size), ``eps``, ``elementwise_affine``,
    ``memory_efficient``, ``weight`` and ``bias`` (None when not affine); state_dict keys as
    nn.LayerNorm's. ``memory_efficient=True`` saves the output instead of the input for
    backward and recovers x-hat from it (weight clamped by magnitude to eps, as apex).
    """

    def __init__(
        self,
        normalized_shape,
        eps=1e-5,
        elementwise_affine=True,
        memory_efficient=False,
        *,
        bias=True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        _load_legacy_module()  # as apex: the module global set once a module is built
        self.normalized_shape = _as_size(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
            if bias:
                self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        if self.weight is not None:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, input):
        if torch.jit.is_scripting():
            return _script_norm(
                input, list(self.normalized_shape), self.weight, self.bias, self.eps, False, False
            )
        if self.elementwise_affine:
            return fused_layer_norm_affine(
                input,
                self.weight,
                self.bias,
                self.normalized_shape,
                self.eps,
                self.memory_efficient,
            )
        return fused_layer_norm(input, self.normalized_shape, self.eps, self.memory_efficient)

    def extra_repr(self):
        return "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(
            **self.__dict__
        )


class FusedRMSNorm(torch.nn.Module):
    """RMSNorm over the last ``len(normalized_shape)`` dimensions (``torch.nn.RMSNorm``'s math
    with apex's arguments, plus keyword-only ``device`` and ``dtype``). Attribute ``weight`` (None
    when not affine); state_dict key ``weight`` as nn.RMSNorm and HF T5LayerNorm."""

    def __init__(
        self,
        normalized_shape,
        eps=1e-5,
        elementwise_affine=True,
        memory_efficient=False,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        _load_legacy_module()  # as apex: the module global set once a module is built
        self.normalized_shape = _as_size(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if elementwise_affine:
            self.weight = torch.nn.Parameter(
                torch.empty(self.normalized_shape, device=device, dtype=dtype)
            )
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self):
        if self.weight is not None:
            init.ones_(self.weight)

    def forward(self, input):
        if torch.jit.is_scripting():
            return _script_norm(
                input, list(self.normalized_shape), self.weight, None, self.eps, True, False
            )
        if self.elementwise_affine:
            return fused_rms_norm_affine(
                input, self.weight, self.normalized_shape, self.eps, self.memory_efficient
            )
        return fused_rms_norm(input, self.normalized_shape, self.eps, self.memory_efficient)

    def extra_repr(self):
        return "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(
            **self.__dict__
        )


def _mixed_kwargs(cls_name: str, kwargs: dict) -> dict:
    """apex's Mixed* keyword handling: ``elementwise_affine`` warns (False raises); every other
    unknown keyword (NeMo passes ``sequence_parallel_enbaled``) is ignored. ``device`` and
    ``dtype`` are kept as factory keywords."""
    if "elementwise_affine" in kwargs:
        warnings.warn(
            f"{cls_name} does not support elementwise_affine; it is always affine",
            stacklevel=3,
        )
        if not kwargs["elementwise_affine"]:
            raise RuntimeError(f"{cls_name} does not support elementwise_affine=False")
    return {k: kwargs[k] for k in ("device", "dtype") if k in kwargs}


class MixedFusedLayerNorm(FusedLayerNorm):
    """FusedLayerNorm whose output has the weight's dtype (fp32 input + bf16 weight -> bf16)."""

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        factory = _mixed_kwargs(type(self).__name__, kwargs)
        super().__init__(normalized_shape, eps, True, memory_efficient, **factory)

    def forward(self, input):
        if torch.jit.is_scripting():
            return _script_norm(
                input, list(self.normalized_shape), self.weight, self.bias, self.eps, False, True
            )
        return mixed_dtype_fused_layer_norm_affine(
            input, self.weight, self.bias, self.normalized_shape, self.eps, self.memory_efficient
        )


class MixedFusedRMSNorm(FusedRMSNorm):
    """FusedRMSNorm whose output has the weight's dtype (fp32 input + bf16 weight -> bf16)."""

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        factory = _mixed_kwargs(type(self).__name__, kwargs)
        super().__init__(normalized_shape, eps, True, memory_efficient, **factory)

    def forward(self, input):
        if torch.jit.is_scripting():
            return _script_norm(
                input, list(self.normalized_shape), self.weight, None, self.eps, True, True
            )
        return mixed_dtype_fused_rms_norm_affine(
            input, self.weight, self.normalized_shape, self.eps, self.memory_efficient
        )
