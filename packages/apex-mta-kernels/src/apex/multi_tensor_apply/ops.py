"""The ``apex_mta`` ops: schemas, fakes, and their kernels.

Every op is defined here, in Python, so that it exists on any machine: the reference
(reference.py) is its kernel for every device, and on CUDA the compiled library ``apex_mta_C``
registers the real kernels the first time an op runs (compiled then if nothing prebuilt or cached
fits; see ``build``). When the library cannot be had, CUDA falls back to the reference after one
warning.

Call them as ``torch.ops.apex_mta.<name>`` or through the functions below.
"""

from __future__ import annotations

import torch

from . import reference
from ._kernels import MTA
from .build.oplib import define_ops

SCHEMAS = {
    "multi_tensor_scale": (
        "multi_tensor_scale(Tensor[] inputs, Tensor(a!)[] outputs, Tensor(b!) noop_flag, "
        "float scale) -> ()"
    ),
    "multi_tensor_l2norm": (
        "multi_tensor_l2norm(Tensor[] tensors, Tensor(a!) noop_flag, bool per_tensor=False) "
        "-> (Tensor, Tensor)"
    ),
    "multi_tensor_l2norm_mp": (
        "multi_tensor_l2norm_mp(Tensor[] tensors, Tensor(a!) noop_flag, bool per_tensor=False) "
        "-> (Tensor, Tensor)"
    ),
    "multi_tensor_l2norm_scale": (
        "multi_tensor_l2norm_scale(Tensor[] inputs, Tensor(a!)[] outputs, Tensor(b!) noop_flag, "
        "float scale, bool per_tensor=False) -> (Tensor, Tensor)"
    ),
    "multi_tensor_unscale_l2norm": (
        "multi_tensor_unscale_l2norm(Tensor[] tensors, Tensor(a!) noop_flag, Tensor inv_scale, "
        "bool per_tensor=False) -> (Tensor, Tensor)"
    ),
    "multi_tensor_axpby": (
        "multi_tensor_axpby(Tensor[] x, Tensor[] y, Tensor(a!)[] outputs, Tensor(b!) noop_flag, "
        "float a, float b, int arg_to_check) -> ()"
    ),
    "multi_tensor_adam": (
        "multi_tensor_adam(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor noop_flag, float lr, float beta1, float beta2, "
        "float eps, int step, int adam_w_mode, bool bias_correction, float weight_decay) -> ()"
    ),
    "multi_tensor_adam_capturable": (
        "multi_tensor_adam_capturable(Tensor(a!)[] grads, Tensor(b!)[] params, "
        "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor noop_flag, Tensor lr, "
        "float beta1, float beta2, float eps, Tensor step, int adam_w_mode, bool bias_correction, "
        "float weight_decay, Tensor inv_scale) -> ()"
    ),
    "multi_tensor_adam_capturable_master": (
        "multi_tensor_adam_capturable_master(Tensor(a!)[] grads, Tensor(b!)[] params, "
        "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] master_params, "
        "Tensor noop_flag, Tensor lr, float beta1, float beta2, float eps, Tensor step, "
        "int adam_w_mode, bool bias_correction, float weight_decay, Tensor inv_scale) -> ()"
    ),
    "update_scale_hysteresis": (
        "update_scale_hysteresis(Tensor(a!) current_scale, Tensor(b!) growth_tracker, "
        "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "
        "float backoff_factor, int growth_interval, int hysteresis) -> ()"
    ),
    "multi_tensor_sgd": (
        "multi_tensor_sgd(Tensor[] grads, Tensor(a!)[] weights, Tensor(b!)[] momenta, "
        "Tensor(c!)[] model_weights, Tensor noop_flag, float weight_decay, float momentum, "
        "float dampening, float lr, bool nesterov, bool first_run, bool wd_after_momentum, "
        "float scale=1.0) -> ()"
    ),
    "multi_tensor_novograd": (
        "multi_tensor_novograd(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, "
        "Tensor(c!) noop_flag, Tensor(d!) grad_norms, float lr, float beta1, float beta2, "
        "float eps, int step, bool bias_correction, float weight_decay, bool grad_averaging, "
        "int moment_mode, int norm_type) -> ()"
    ),
    "multi_tensor_adagrad": (
        "multi_tensor_adagrad(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] state_sums, "
        "Tensor noop_flag, float lr, float eps, int adagrad_w_mode, float weight_decay) -> ()"
    ),
    "multi_tensor_lamb_stage1": (
        "multi_tensor_lamb_stage1(Tensor[] grads, Tensor[] params, Tensor(a!)[] exp_avgs, "
        "Tensor(b!)[] exp_avg_sqs, Tensor(c!)[] updates, Tensor noop_flag, "
        "Tensor per_tensor_decay, int step, float beta1, float beta2, float eps, "
        "Tensor global_grad_norm, float max_global_grad_norm) -> ()"
    ),
    "multi_tensor_lamb_stage2": (
        "multi_tensor_lamb_stage2(Tensor(a!)[] params, Tensor[] updates, Tensor noop_flag, "
        "Tensor per_tensor_param_norm, Tensor per_tensor_update_norm, float lr, "
        "float weight_decay, bool use_nvlamb=False) -> ()"
    ),
    "multi_tensor_lamb": (
        "multi_tensor_lamb(Tensor(a!)[] grads, Tensor(b!)[] params, Tensor(c!)[] exp_avgs, "
        "Tensor(d!)[] exp_avg_sqs, Tensor(e!) noop_flag, float lr, float beta1, float beta2, "
        "float eps, int step, bool bias_correction, float weight_decay, bool grad_averaging, "
        "int adam_w_mode, Tensor global_grad_norm, float max_grad_norm, "
        "bool use_nvlamb=False) -> ()"
    ),
    "multi_tensor_lamb_mp": (
        "multi_tensor_lamb_mp(Tensor(a!)[] grads, Tensor(b!)[] params, Tensor(c!)[] exp_avgs, "
        "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] model_params, Tensor(f!) noop_flag, Tensor lr, "
        "float beta1, float beta2, float eps, Tensor step, bool bias_correction, "
        "float weight_decay, bool grad_averaging, int adam_w_mode, Tensor global_grad_norm, "
        "Tensor max_grad_norm, bool use_nvlamb, Tensor found_inf, Tensor inv_scale) -> ()"
    ),
}


def _fake_norms(noop_flag: torch.Tensor, n: int, per_tensor: bool):
    """The outputs of the l2norm ops: total norm [1] and per-tensor norms [n] (or [0]), float32."""
    total = noop_flag.new_empty((1,), dtype=torch.float32)
    return total, noop_flag.new_empty((n if per_tensor else 0,), dtype=torch.float32)


# Fakes of the ops that return tensors; every other op returns None.
_FAKES = {
    "multi_tensor_l2norm": lambda tensors, noop_flag, per_tensor=False: _fake_norms(
        noop_flag, len(tensors), per_tensor
    ),
    "multi_tensor_l2norm_mp": lambda tensors, noop_flag, per_tensor=False: _fake_norms(
        noop_flag, len(tensors), per_tensor
    ),
    "multi_tensor_l2norm_scale": lambda inputs, outputs, noop_flag, scale, per_tensor=False: (
        _fake_norms(noop_flag, len(inputs), per_tensor)
    ),
    "multi_tensor_unscale_l2norm": lambda tensors, noop_flag, inv_scale, per_tensor=False: (
        _fake_norms(noop_flag, len(tensors), per_tensor)
    ),
}


# Schemas, references, fakes, and the CUDA loaders that fetch apex_mta_C on first use.
OPS = define_ops("apex_mta", MTA, SCHEMAS, {n: getattr(reference, n) for n in SCHEMAS}, _FAKES)


def multi_tensor_scale(inputs, outputs, noop_flag: torch.Tensor, scale: float) -> None:
    """outputs[i] = inputs[i] * scale for every i; sets noop_flag[0] = 1 if any input is inf/nan.

    ``inputs`` and ``outputs`` may be the same tensors (in place). Dtypes float32, float16 and
    bfloat16 in any combination; lists that mix dtypes are grouped, one launch per group.
    """
    torch.ops.apex_mta.multi_tensor_scale(inputs, outputs, noop_flag, scale)


def multi_tensor_l2norm(tensors, noop_flag: torch.Tensor, per_tensor: bool = False):
    """The L2 norm of all ``tensors`` together, and of each when ``per_tensor``.

    Returns ``(total, per_tensor_norms)``: float32 tensors of shape [1] and [len(tensors)] (or [0]
    when ``per_tensor`` is False) on noop_flag's device. Math in float32; the result is the same
    bit for bit on every run. Sets noop_flag[0] = 1 if the float32 sum of squares of any 65536-
    element chunk is not finite (an inf or nan element, or squares that overflow), as apex does.
    """
    return torch.ops.apex_mta.multi_tensor_l2norm(tensors, noop_flag, per_tensor)


def multi_tensor_l2norm_mp(tensors, noop_flag: torch.Tensor, per_tensor: bool = False):
    """multi_tensor_l2norm for mixed-precision LAMB: does nothing if noop_flag is already set.

    When noop_flag is set, on entry or by a non-finite chunk found in this call, every returned
    norm is 0 (apex leaves them unwritten, that is, arbitrary).
    """
    return torch.ops.apex_mta.multi_tensor_l2norm_mp(tensors, noop_flag, per_tensor)


def multi_tensor_l2norm_scale(
    inputs, outputs, noop_flag: torch.Tensor, scale: float, per_tensor: bool = False
):
    """The norms of ``inputs`` (as multi_tensor_l2norm), writing outputs[i] = inputs[i] * scale on
    the same pass. ``inputs`` and ``outputs`` may be the same tensors."""
    return torch.ops.apex_mta.multi_tensor_l2norm_scale(
        inputs, outputs, noop_flag, scale, per_tensor
    )


def multi_tensor_unscale_l2norm(
    tensors, noop_flag: torch.Tensor, inv_scale: torch.Tensor, per_tensor: bool = False
):
    """The norms of ``tensors[i] * inv_scale`` (as multi_tensor_l2norm); the tensors are not
    modified. ``inv_scale`` is a float32 one-element tensor on their device, read on the device,
    so the call can be captured in a CUDA graph and replayed with a new value."""
    return torch.ops.apex_mta.multi_tensor_unscale_l2norm(tensors, noop_flag, inv_scale, per_tensor)


def multi_tensor_axpby(
    x, y, outputs, noop_flag: torch.Tensor, a: float, b: float, arg_to_check: int = -1
) -> None:
    """outputs[i] = a * x[i] + b * y[i] (float32 math); noop_flag[0] = 1 if an element of the
    checked inputs is inf or nan: ``arg_to_check`` -1 checks x and y, 0 only x, 1 only y.

    ``outputs`` may be ``x`` or ``y`` (in place). Dtypes float32, float16 and bfloat16 in any
    combination (apex has no bfloat16 here).
    """
    torch.ops.apex_mta.multi_tensor_axpby(x, y, outputs, noop_flag, a, b, arg_to_check)


def multi_tensor_adam(
    grads,
    params,
    exp_avgs,
    exp_avg_sqs,
    noop_flag: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    adam_w_mode: int,
    bias_correction: bool,
    weight_decay: float,
) -> None:
    """One Adam step over ``params`` in place, with the moments ``exp_avgs``/``exp_avg_sqs``.

    ``adam_w_mode`` 0 is Adam with L2 weight decay (``g += weight_decay * p``,
    torch.optim.Adam), 1 is decoupled weight decay (``p *= 1 - lr * weight_decay``,
    torch.optim.AdamW); apex calls it ``mode``, a name torch.compile reserves. ``step`` counts
    from 1; with ``bias_correction`` the moments are divided by ``1 - beta**step`` (computed on
    the host). ``eps`` is added after the square root. Math in float32; every role may be
    float32, float16 or bfloat16 (apex required float32 moments). As in apex, ``noop_flag`` is
    not read: inf/nan gradients propagate into the parameters (callers skip the step instead).
    """
    torch.ops.apex_mta.multi_tensor_adam(
        grads,
        params,
        exp_avgs,
        exp_avg_sqs,
        noop_flag,
        lr,
        beta1,
        beta2,
        eps,
        step,
        adam_w_mode,
        bias_correction,
        weight_decay,
    )


def multi_tensor_adam_capturable(
    grads,
    params,
    exp_avgs,
    exp_avg_sqs,
    noop_flag: torch.Tensor,
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step: torch.Tensor,
    adam_w_mode: int,
    bias_correction: bool,
    weight_decay: float,
    inv_scale: torch.Tensor,
) -> None:
    """multi_tensor_adam with ``lr``, ``step`` and ``inv_scale`` as one-element device tensors,
    read by the kernel (no host sync), so the step can be captured in a CUDA graph and replayed
    with new values. ``lr`` and ``inv_scale`` float32 or float64; ``step`` int32 (apex), int64,
    float32 or float64, not incremented here.

    Grads are unscaled in place (``g *= inv_scale``, apex semantics) before the step; when
    ``noop_flag[0]`` is nonzero nothing at all is written (grads stay scaled).

    torch's GradScaler protocol (``aten::_fused_adam_(..., grad_scale, found_inf)``) maps onto it
    as ``inv_scale = grad_scale.double().reciprocal().float()`` and
    ``noop_flag.copy_(found_inf)``, both on the device; with no scaler pass ``inv_scale = 1``
    (then the grads are not rewritten) and a zeroed flag.
    """
    torch.ops.apex_mta.multi_tensor_adam_capturable(
        grads,
        params,
        exp_avgs,
        exp_avg_sqs,
        noop_flag,
        lr,
        beta1,
        beta2,
        eps,
        step,
        adam_w_mode,
        bias_correction,
        weight_decay,
        inv_scale,
    )


def multi_tensor_adam_capturable_master(
    grads,
    params,
    exp_avgs,
    exp_avg_sqs,
    master_params,
    noop_flag: torch.Tensor,
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step: torch.Tensor,
    adam_w_mode: int,
    bias_correction: bool,
    weight_decay: float,
    inv_scale: torch.Tensor,
) -> None:
    """multi_tensor_adam_capturable for low-precision ``params`` with float32 ``master_params``:
    the step is taken on the masters, and ``params`` receives the new master rounded to its
    dtype (``params`` is written, never read)."""
    torch.ops.apex_mta.multi_tensor_adam_capturable_master(
        grads,
        params,
        exp_avgs,
        exp_avg_sqs,
        master_params,
        noop_flag,
        lr,
        beta1,
        beta2,
        eps,
        step,
        adam_w_mode,
        bias_correction,
        weight_decay,
        inv_scale,
    )


def multi_tensor_sgd(
    grads,
    weights,
    momenta,
    model_weights,
    noop_flag: torch.Tensor,
    weight_decay: float,
    momentum: float,
    dampening: float,
    lr: float,
    nesterov: bool,
    first_run: bool,
    wd_after_momentum: bool,
    scale: float = 1.0,
) -> None:
    """One SGD step over ``weights`` (and ``momenta``) in place, apex's semantics, float32 math.

    ``g = grads * scale`` (amp passes 1 / loss scale); weight decay ``g += weight_decay * w``
    before the momentum, or after it with ``wd_after_momentum``; with ``momentum != 0`` the
    buffer becomes ``g`` on the ``first_run`` and ``momentum * m + (1 - dampening) * g`` after,
    and ``g`` becomes ``g + momentum * m`` (``nesterov``) or ``m``; then ``w -= lr * g``.
    ``model_weights`` (empty or None for the 3-list form) receives the updated weights, e.g. the
    float16/bfloat16 model copy of float32 master weights. Every role may be float32, float16 or
    bfloat16. Nothing is written while ``noop_flag[0]`` is set (an overflow was found).
    """
    torch.ops.apex_mta.multi_tensor_sgd(
        grads,
        weights,
        momenta,
        [] if model_weights is None else model_weights,
        noop_flag,
        weight_decay,
        momentum,
        dampening,
        lr,
        nesterov,
        first_run,
        wd_after_momentum,
        scale,
    )


def multi_tensor_novograd(
    grads,
    params,
    exp_avgs,
    noop_flag: torch.Tensor,
    grad_norms: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    bias_correction: bool,
    weight_decay: float,
    grad_averaging: bool,
    moment_mode: int,
    norm_type: int,
) -> None:
    """One NovoGrad step over ``params`` (and ``exp_avgs``) in place, apex's semantics.

    First each grad's norm ``n`` is blended into ``grad_norms`` (float32, one per tensor, in
    place): ``gn = sqrt(beta2 * gn**2 + (1 - beta2) * n**2)`` for ``norm_type`` 2 (L2), or
    ``gn = beta2 * gn + (1 - beta2) * n`` for 0 (Linf). Then, with ``denom = gn / bc2 + eps``
    (``bc1 = 1 - beta1**step``, ``bc2 = sqrt(1 - beta2**step)`` with ``bias_correction``, else
    1) and ``beta3 = 1 - beta1`` with ``grad_averaging`` else 1: ``moment_mode`` 0 computes
    ``g = g / denom + weight_decay * p; m = beta1 * m + beta3 * g; p -= lr * m / bc1``; mode 1
    ``m = beta1 * m + beta3 * g; p -= lr * (m / bc1 / denom + weight_decay * p)``. A norm that is
    not finite sets ``noop_flag[0]`` (as apex's norm kernel does), but the step is not skipped.
    Every list role may be float32, float16 or bfloat16; math in float32.
    """
    torch.ops.apex_mta.multi_tensor_novograd(
        grads,
        params,
        exp_avgs,
        noop_flag,
        grad_norms,
        lr,
        beta1,
        beta2,
        eps,
        step,
        bias_correction,
        weight_decay,
        grad_averaging,
        moment_mode,
        norm_type,
    )


def multi_tensor_adagrad(
    grads,
    params,
    state_sums,
    noop_flag: torch.Tensor,
    lr: float,
    eps: float,
    adagrad_w_mode: int,
    weight_decay: float,
) -> None:
    """One Adagrad step over ``params`` and ``state_sums`` in place, apex's semantics.

    ``adagrad_w_mode`` 0 (L2): ``g += weight_decay * p; h += g * g; p -= lr * g / (sqrt(h) + eps)``
    (torch.optim.Adagrad with no lr decay); 1 (decoupled):
    ``h += g * g; p -= lr * (g / (sqrt(h) + eps) + weight_decay * p)``. Every role may be
    float32, float16 or bfloat16; math in float32. As in apex, ``noop_flag`` is not read.
    """
    torch.ops.apex_mta.multi_tensor_adagrad(
        grads, params, state_sums, noop_flag, lr, eps, adagrad_w_mode, weight_decay
    )


def update_scale_hysteresis(
    current_scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> torch.Tensor:
    """The dynamic loss-scale update with hysteresis (apex, NeMo's GradScaler), in place on the
    device: one overflow (``found_inf != 0``) backs the scale off only after ``hysteresis``
    overflowing steps in a row; ``growth_interval`` finite steps in a row grow it. One-element
    tensors: ``current_scale`` and ``found_inf`` float32, the trackers int32. Returns
    ``current_scale``, as apex does."""
    torch.ops.apex_mta.update_scale_hysteresis(
        current_scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
    )
    return current_scale


def multi_tensor_lamb_stage1(
    grads,
    params,
    exp_avgs,
    exp_avg_sqs,
    updates,
    noop_flag: torch.Tensor,
    per_tensor_decay: torch.Tensor,
    step: int,
    beta1: float,
    beta2: float,
    eps: float,
    global_grad_norm: torch.Tensor,
    max_global_grad_norm: float,
) -> None:
    """apex's LAMB stage 1: the Adam-style update of every tensor, written to ``updates``, with
    ``exp_avgs``/``exp_avg_sqs`` advanced in place. ``params`` and ``grads`` are read only.

    Per element, in float32: ``sg = g / clip`` with ``clip = gn / max_global_grad_norm`` when the
    global grad norm ``gn`` exceeds it (else 1); ``m = beta1 * m + (1 - beta1) * sg``,
    ``v = beta2 * v + (1 - beta2) * sg**2``; ``u = (m / bc1) / (sqrt(v / bc2) + eps) + d * p``
    with ``d = per_tensor_decay[i]`` (float32, one per tensor) and, as in apex, the bias
    corrections of ``step + 1``: ``bc = 1 - beta**(step + 1)``. ``global_grad_norm`` is a
    one-element float32/float64 tensor read on the device (apex read it on the host). As in apex,
    ``noop_flag`` is not read. Every role may be float32, float16 or bfloat16.
    """
    torch.ops.apex_mta.multi_tensor_lamb_stage1(
        grads,
        params,
        exp_avgs,
        exp_avg_sqs,
        updates,
        noop_flag,
        per_tensor_decay,
        step,
        beta1,
        beta2,
        eps,
        global_grad_norm,
        max_global_grad_norm,
    )


def multi_tensor_lamb_stage2(
    params,
    updates,
    noop_flag: torch.Tensor,
    per_tensor_param_norm: torch.Tensor,
    per_tensor_update_norm: torch.Tensor,
    lr: float,
    weight_decay: float,
    use_nvlamb: bool = False,
) -> None:
    """apex's LAMB stage 2: ``params[i] -= ratio_i * updates[i]`` with the trust ratio
    ``ratio_i = lr * per_tensor_param_norm[i] / per_tensor_update_norm[i]`` when ``use_nvlamb``
    or ``weight_decay != 0`` and both norms are nonzero, else ``lr``. The norms are float32
    tensors with one element per tensor, read on the device. ``noop_flag`` is not read."""
    torch.ops.apex_mta.multi_tensor_lamb_stage2(
        params,
        updates,
        noop_flag,
        per_tensor_param_norm,
        per_tensor_update_norm,
        lr,
        weight_decay,
        use_nvlamb,
    )


def multi_tensor_lamb(
    grads,
    params,
    exp_avgs,
    exp_avg_sqs,
    noop_flag: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    bias_correction: bool,
    weight_decay: float,
    grad_averaging: bool,
    adam_w_mode: int,
    global_grad_norm: torch.Tensor,
    max_grad_norm: float,
    use_nvlamb: bool = False,
) -> None:
    """One fused LAMB step (apex's ``multi_tensor_lamb``, FusedLAMB's kernel), float32 math.

    Stage 1 per element: ``sg = g / clip`` (``clip = gn / max_grad_norm`` when the one-element
    ``global_grad_norm`` tensor ``gn`` exceeds ``max_grad_norm``, else 1); with ``adam_w_mode`` 0
    ``sg += weight_decay * p``; ``m = beta1 * m + beta3 * sg`` (``beta3 = 1 - beta1`` with
    ``grad_averaging``, else 1), ``v = beta2 * v + (1 - beta2) * sg**2``,
    ``u = (m / bc1) / (sqrt(v / bc2) + eps)`` (``bc = 1 - beta**step`` with
    ``bias_correction``), and with ``adam_w_mode`` 1 ``u += weight_decay * p``. The update
    overwrites the grads (apex does the same), in the grads' dtype.
    Stage 2 per tensor: ``p -= ratio * u`` with ``ratio = lr * ||p|| / ||u||`` when
    ``use_nvlamb`` or ``weight_decay != 0`` and both norms are nonzero, else ``lr``.

    The per-tensor norms are computed during stage 1 (no host sync). noop_flag is not read, but is
    set when a 65536-element chunk's float32 sum of squares of p or of u is not finite, as apex's
    norm kernels do; inf/nan propagate into the params. Params are read in stage 1 only when
    needed (``weight_decay != 0`` or ``use_nvlamb``). Every role may be float32, float16 or
    bfloat16 (apex: float32 or float16, m and v of p's dtype).
    """
    torch.ops.apex_mta.multi_tensor_lamb(
        grads,
        params,
        exp_avgs,
        exp_avg_sqs,
        noop_flag,
        lr,
        beta1,
        beta2,
        eps,
        step,
        bias_correction,
        weight_decay,
        grad_averaging,
        adam_w_mode,
        global_grad_norm,
        max_grad_norm,
        use_nvlamb,
    )


def multi_tensor_lamb_mp(
    grads,
    params,
    exp_avgs,
    exp_avg_sqs,
    model_params,
    noop_flag: torch.Tensor,
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step: torch.Tensor,
    bias_correction: bool,
    weight_decay: float,
    grad_averaging: bool,
    adam_w_mode: int,
    global_grad_norm: torch.Tensor,
    max_grad_norm: torch.Tensor,
    use_nvlamb: bool,
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
) -> None:
    """multi_tensor_lamb for FusedMixedPrecisionLamb, capturable in a CUDA graph: ``lr``,
    ``step``, ``global_grad_norm``, ``max_grad_norm``, ``found_inf`` and ``inv_scale`` are
    one-element device tensors read by the kernels (lr, the norms, found_inf and inv_scale float32
    or float64; step int32, int64, float32 or float64, not incremented here).

    The grads are unscaled (``g * inv_scale``) before clipping; norm and ``max_grad_norm`` are
    both of the scaled grads in apex's optimizer, so their ratio is scale-free. ``params`` are the
    params stepped (float32 masters in the 5-list form); a non-empty ``model_params`` receives
    the new params rounded to its dtype (apex's 5-list form). Nothing at all is written when
    ``noop_flag[0]`` or ``found_inf`` is nonzero on entry. A non-finite norm chunk of p or of the
    update (see multi_tensor_lamb) sets noop_flag and skips stage 2, as apex's mp norm kernels
    and stage 2 do; m, v and the grads then hold the new values (apex also skips stage 1 when
    the param norm is the non-finite one).
    """
    torch.ops.apex_mta.multi_tensor_lamb_mp(
        grads,
        params,
        exp_avgs,
        exp_avg_sqs,
        [] if model_params is None else model_params,
        noop_flag,
        lr,
        beta1,
        beta2,
        eps,
        step,
        bias_correction,
        weight_decay,
        grad_averaging,
        adam_w_mode,
        global_grad_norm,
        max_grad_norm,
        use_nvlamb,
        found_inf,
        inv_scale,
    )


def adam_plan(params, work, exp_avgs, exp_avg_sqs, masters=()):
    """A cached C++ plan of one Adam bucket, or None where the compiled kernels are not in use
    (CPU tensors, the reference fallback, while torch.compile traces).

    ``plan.fetch()`` reads every param's ``.grad`` in C++ (False when one is missing; nothing is
    then held); ``plan.step(noop_flag, lr, beta1, beta2, eps, step, adam_w_mode,
    bias_correction, weight_decay)`` is multi_tensor_adam on [grads, work, exp_avgs,
    exp_avg_sqs]; ``plan.step_capturable(noop_flag, lr, beta1, beta2, eps, step, adam_w_mode,
    bias_correction, weight_decay, inv_scale)`` is multi_tensor_adam_capturable, or its _master
    form when ``masters`` is given. Each step fetches first if needed, releases the grads when it
    ends, and returns False (launching nothing) when a grad is missing. Per-step host work is a
    few loads per tensor in C++: no Python list is built or converted.
    """
    if not params or not params[0].is_cuda or torch.compiler.is_compiling():
        return None
    if not OPS.ensure_loaded():
        return None
    return torch.classes.apex_mta.AdamPlan(
        list(params), list(work), list(exp_avgs), list(exp_avg_sqs), list(masters)
    )


def sgd_plan(params, work, momenta=(), copies=()):
    """A cached C++ plan of one SGD bucket, or None where the compiled kernels are not in use
    (as adam_plan). ``plan.step(noop_flag, weight_decay, momentum, dampening, lr, nesterov,
    first_run, wd_after_momentum, scale)`` is multi_tensor_sgd on [grads, work, momenta(,
    copies)], the grads fetched from ``params`` in C++; without ``momenta`` (momentum 0) the
    grads stand in for them. ``fetch``, ``release`` and the False return are adam_plan's."""
    if not params or not params[0].is_cuda or torch.compiler.is_compiling():
        return None
    if not OPS.ensure_loaded():
        return None
    return torch.classes.apex_mta.SgdPlan(list(params), list(work), list(momenta), list(copies))


def lamb_plan(params, work, exp_avgs, exp_avg_sqs, copies=()):
    """A cached plan of one LAMB bucket: ``torch.classes.apex_mta.LambPlan`` where the compiled
    kernels run, ``reference.LambPlan`` (same methods, same results) elsewhere, such as CPU
    tensors; None while torch.compile traces (the list ops then run, and have fakes).

    ``plan.step(noop_flag, lr, beta1, beta2, eps, step, bias_correction, weight_decay,
    grad_averaging, adam_w_mode, global_grad_norm, max_grad_norm, use_nvlamb)`` is
    multi_tensor_lamb on [grads, work, exp_avgs, exp_avg_sqs], the grads fetched from ``params``
    in C++; with ``global_grad_norm=None`` the plan first takes multi_tensor_l2norm's total over
    its own grads (right when the bucket holds every grad of the optimizer: global norm, stage 1
    and stage 2 in one call); a non-empty ``copies`` then receives ``work`` rounded to its dtype
    (multi_tensor_scale: the model params of fp32 masters). Every check runs before the first
    launch. ``plan.grad_norm(noop_flag)`` is that total alone, or None when a grad is missing; a
    plan of params only (``work``, ``exp_avgs``, ``exp_avg_sqs`` empty) takes the global norm of
    several buckets that way. ``fetch``, ``release`` and the False return are adam_plan's.
    """
    if not params or torch.compiler.is_compiling():
        return None
    args = (list(params), list(work), list(exp_avgs), list(exp_avg_sqs), list(copies))
    if params[0].is_cuda and OPS.ensure_loaded():
        return torch.classes.apex_mta.LambPlan(*args)
    return reference.LambPlan(*args)


def amp_plan(model_params, masters, grad_views, fp32_params=()):
    """A cached plan of apex-amp's O2 step: ``torch.classes.apex_mta.AmpPlan`` where the compiled
    kernels run, ``reference.AmpPlan`` (same methods, same results) elsewhere, such as CPU
    tensors; None while torch.compile traces.

    ``model_params``: the low-precision model params; ``masters``: their fp32 masters;
    ``grad_views``: a float32 tensor per master, its shape, that becomes its grad (the views of
    amp's persistent master-grad buffer); ``fp32_params``: fp32 params that are their own masters.
    ``plan.prepare()``: when no master and no fp32 param has a grad, clear every model param's
    grad and return True; else change nothing and return False. ``plan.unscale(noop_flag,
    scale)``: multi_tensor_scale of [model grads, fp32 grads] into [grad_views, fp32 grads (in
    place)] times ``scale`` (overflow into noop_flag), then each master's grad is its view and the
    model grads are cleared; False, changing nothing, when a model or fp32 param has no grad, a
    master already has one or no longer has its view's shape. Whether anyone else still holds a
    view is the caller's to check first. ``plan.copy_back(noop_flag, release_grads)``:
    multi_tensor_scale of the masters into the model params, then (``release_grads``) every
    master's grad cleared. The lists are checked with multi_tensor_scale's checks the first time
    and again whenever a tensor's dtype, size, layout or device changed; between those, the
    per-step host work is a few loads per tensor in C++.
    """
    if torch.compiler.is_compiling():
        return None
    first = next(iter([*model_params, *fp32_params]), None)
    if first is None:
        return None
    if first.is_cuda and OPS.ensure_loaded():
        return torch.classes.apex_mta.AmpPlan(
            list(model_params), list(masters), list(grad_views), list(fp32_params)
        )
    return reference.AmpPlan(model_params, masters, grad_views, fp32_params)
