"""NVIDIA apex's ``amp_C`` extension module, for code that imports it by name.

Same function names and arguments: ``(chunk_size, noop_flag, tensor_lists, *args)``. The chunk
size is accepted and ignored (the kernels choose their own; results do not depend on it). Each
function forwards to the ``apex_mta`` op of the same name.
"""

from __future__ import annotations

import functools

import torch

import apex.multi_tensor_apply.ops as _ops


def _below_autograd(fn):
    """apex's amp_C functions are C++ below autograd: they write into tensors that require grad
    (apex's own FusedSGD passed its Parameters, outside no_grad) and return norms without a
    grad_fn. Each function here runs its op under no_grad for the same (nothing to enter where
    grad mode is off already, as in the optimizers' steps)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        with torch.no_grad():
            return fn(*args, **kwargs)

    return run


def _unpack(op: str, tensor_lists, depth: int):
    if not isinstance(tensor_lists, (list, tuple)) or len(tensor_lists) != depth:
        got = len(tensor_lists) if isinstance(tensor_lists, (list, tuple)) else type(tensor_lists)
        raise ValueError(f"{op}: tensor_lists must hold {depth} lists, got {got}")
    return [list(lst) for lst in tensor_lists]


@_below_autograd
def multi_tensor_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: float
) -> None:
    """``tensor_lists = [inputs, outputs]``: outputs = inputs * scale; flag on inf/nan."""
    inputs, outputs = _unpack("multi_tensor_scale", tensor_lists, 2)
    _ops.multi_tensor_scale(inputs, outputs, noop_flag, scale)


@_below_autograd
def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, per_tensor=None):
    """``tensor_lists = [tensors]``: returns ``(total_norm[1], per_tensor_norms[n] or [0])``."""
    (tensors,) = _unpack("multi_tensor_l2norm", tensor_lists, 1)
    return _ops.multi_tensor_l2norm(tensors, noop_flag, bool(per_tensor))


@_below_autograd
def multi_tensor_l2norm_mp(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, per_tensor=None):
    """As multi_tensor_l2norm; skipped (norms returned as 0) when noop_flag is set."""
    (tensors,) = _unpack("multi_tensor_l2norm_mp", tensor_lists, 1)
    return _ops.multi_tensor_l2norm_mp(tensors, noop_flag, bool(per_tensor))


@_below_autograd
def multi_tensor_l2norm_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: float, per_tensor=None
):
    """``tensor_lists = [inputs, outputs]``: norms of inputs; outputs = inputs * scale."""
    inputs, outputs = _unpack("multi_tensor_l2norm_scale", tensor_lists, 2)
    return _ops.multi_tensor_l2norm_scale(inputs, outputs, noop_flag, scale, bool(per_tensor))


@_below_autograd
def multi_tensor_unscale_l2norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists, inv_scale: torch.Tensor, per_tensor=None
):
    """``tensor_lists = [tensors]``: norms of tensors * inv_scale (a float32 [1] device tensor)."""
    (tensors,) = _unpack("multi_tensor_unscale_l2norm", tensor_lists, 1)
    return _ops.multi_tensor_unscale_l2norm(tensors, noop_flag, inv_scale, bool(per_tensor))


@_below_autograd
def multi_tensor_axpby(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists, a: float, b: float, arg_to_check: int
) -> None:
    """``tensor_lists = [x, y, out]``: out = a*x + b*y; flag on inf/nan in x and y (-1), x (0), y (1)."""
    x, y, out = _unpack("multi_tensor_axpby", tensor_lists, 3)
    _ops.multi_tensor_axpby(x, y, out, noop_flag, a, b, arg_to_check)


@_below_autograd
def multi_tensor_adam(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    mode: int,
    bias_correction: int,
    weight_decay: float,
) -> None:
    """``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]``: one Adam (mode 0) or AdamW
    (mode 1) step; host lr and step; noop_flag not read."""
    lists = _unpack("multi_tensor_adam", tensor_lists, 4)
    bc = bool(bias_correction)
    _ops.multi_tensor_adam(
        *lists, noop_flag, lr, beta1, beta2, epsilon, step, mode, bc, weight_decay
    )


@_below_autograd
def multi_tensor_adam_capturable(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists,
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: torch.Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: torch.Tensor,
) -> None:
    """``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]``: lr, step and inv_scale device
    tensors; grads unscaled in place; skipped when noop_flag is set."""
    lists = _unpack("multi_tensor_adam_capturable", tensor_lists, 4)
    bc = bool(bias_correction)
    _ops.multi_tensor_adam_capturable(
        *lists, noop_flag, lr, beta1, beta2, epsilon, step, mode, bc, weight_decay, inv_scale
    )


@_below_autograd
def multi_tensor_adam_capturable_master(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists,
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: torch.Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: torch.Tensor,
) -> None:
    """``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs, master_params]``: as
    multi_tensor_adam_capturable, stepping the fp32 masters and writing params = masters."""
    lists = _unpack("multi_tensor_adam_capturable_master", tensor_lists, 5)
    bc = bool(bias_correction)
    _ops.multi_tensor_adam_capturable_master(
        *lists, noop_flag, lr, beta1, beta2, epsilon, step, mode, bc, weight_decay, inv_scale
    )


@_below_autograd
def multi_tensor_sgd(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists,
    wd: float,
    momentum: float,
    dampening: float,
    lr: float,
    nesterov: bool,
    first_run: bool,
    wd_after_momentum: bool,
    scale: float = 1.0,
) -> None:
    """``tensor_lists = [grads, weights, momenta]`` or ``[grads, fp32 weights, momenta, model
    weights (out)]``: one SGD step; skipped while noop_flag is set. (``scale`` defaults to 1 for
    callers of apex releases before it existed.)"""
    op = "multi_tensor_sgd"
    if not isinstance(tensor_lists, (list, tuple)) or len(tensor_lists) not in (3, 4):
        got = len(tensor_lists) if isinstance(tensor_lists, (list, tuple)) else type(tensor_lists)
        raise ValueError(f"{op}: tensor_lists must hold 3 or 4 lists, got {got}")
    lists = _unpack(op, tensor_lists, len(tensor_lists))
    grads, weights, momenta = lists[:3]
    model_weights = lists[3] if len(lists) == 4 else []
    _ops.multi_tensor_sgd(
        grads,
        weights,
        momenta,
        model_weights,
        noop_flag,
        wd,
        momentum,
        dampening,
        lr,
        nesterov,
        first_run,
        wd_after_momentum,
        scale,
    )


@_below_autograd
def multi_tensor_novograd(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists,
    grad_norms: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    norm_type: int,
) -> None:
    """``tensor_lists = [grads, params, exp_avgs]``: blends the per-tensor grad norms into
    ``grad_norms`` in place, then one NovoGrad step; noop_flag set on a non-finite norm."""
    grads, params, exp_avgs = _unpack("multi_tensor_novograd", tensor_lists, 3)
    _ops.multi_tensor_novograd(
        grads,
        params,
        exp_avgs,
        noop_flag,
        grad_norms,
        lr,
        beta1,
        beta2,
        epsilon,
        step,
        bool(bias_correction),
        weight_decay,
        bool(grad_averaging),
        mode,
        norm_type,
    )


@_below_autograd
def multi_tensor_adagrad(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists,
    lr: float,
    epsilon: float,
    mode: int,
    weight_decay: float,
) -> None:
    """``tensor_lists = [grads, params, state_sums]``: one Adagrad step (mode 0 L2, 1 decoupled);
    noop_flag not read."""
    grads, params, sums = _unpack("multi_tensor_adagrad", tensor_lists, 3)
    _ops.multi_tensor_adagrad(grads, params, sums, noop_flag, lr, epsilon, mode, weight_decay)


@_below_autograd
def multi_tensor_lamb_stage1_cuda(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists,
    per_tensor_decay: torch.Tensor,
    step: int,
    beta1: float,
    beta2: float,
    epsilon: float,
    global_grad_norm: torch.Tensor,
    max_global_grad_norm: float,
) -> None:
    """``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs, updates]``: LAMB stage 1 (bias
    corrections of step + 1, per-tensor decoupled decay); global_grad_norm read on the device."""
    g, p, m, v, upd = _unpack("multi_tensor_lamb_stage1_cuda", tensor_lists, 5)
    _ops.multi_tensor_lamb_stage1(
        g,
        p,
        m,
        v,
        upd,
        noop_flag,
        per_tensor_decay,
        step,
        beta1,
        beta2,
        epsilon,
        global_grad_norm,
        max_global_grad_norm,
    )


@_below_autograd
def multi_tensor_lamb_stage2_cuda(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists,
    per_tensor_param_norm: torch.Tensor,
    per_tensor_update_norm: torch.Tensor,
    lr: float,
    weight_decay: float,
    use_nvlamb=None,
) -> None:
    """``tensor_lists = [params, updates]``: LAMB stage 2, params -= trust ratio * update."""
    p, upd = _unpack("multi_tensor_lamb_stage2_cuda", tensor_lists, 2)
    _ops.multi_tensor_lamb_stage2(
        p,
        upd,
        noop_flag,
        per_tensor_param_norm,
        per_tensor_update_norm,
        lr,
        weight_decay,
        bool(use_nvlamb),
    )


@_below_autograd
def multi_tensor_lamb(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    global_grad_norm: torch.Tensor,
    max_grad_norm: float,
    use_nvlamb=None,
) -> None:
    """``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]``: one fused LAMB step (mode 0 L2,
    1 decoupled); grads overwritten with the update; noop_flag set on a non-finite norm."""
    g, p, m, v = _unpack("multi_tensor_lamb", tensor_lists, 4)
    _ops.multi_tensor_lamb(
        g,
        p,
        m,
        v,
        noop_flag,
        lr,
        beta1,
        beta2,
        epsilon,
        step,
        bool(bias_correction),
        weight_decay,
        bool(grad_averaging),
        mode,
        global_grad_norm,
        max_grad_norm,
        bool(use_nvlamb),
    )


@_below_autograd
def multi_tensor_lamb_mp(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists,
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: torch.Tensor,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    global_grad_norm: torch.Tensor,
    max_grad_norm: torch.Tensor,
    use_nvlamb,
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
) -> None:
    """``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]`` or ``[grads, fp32 master params,
    exp_avgs, exp_avg_sqs, model params (out)]``: one LAMB step with device lr, step, norms,
    found_inf and inv_scale; nothing written when noop_flag or found_inf is set."""
    op = "multi_tensor_lamb_mp"
    if not isinstance(tensor_lists, (list, tuple)) or len(tensor_lists) not in (4, 5):
        got = len(tensor_lists) if isinstance(tensor_lists, (list, tuple)) else type(tensor_lists)
        raise ValueError(f"{op}: tensor_lists must hold 4 or 5 lists, got {got}")
    lists = _unpack(op, tensor_lists, len(tensor_lists))
    g, p, m, v = lists[:4]
    model_params = lists[4] if len(lists) == 5 else []
    _ops.multi_tensor_lamb_mp(
        g,
        p,
        m,
        v,
        model_params,
        noop_flag,
        lr,
        beta1,
        beta2,
        epsilon,
        step,
        bool(bias_correction),
        weight_decay,
        bool(grad_averaging),
        mode,
        global_grad_norm,
        max_grad_norm,
        bool(use_nvlamb),
        found_inf,
        inv_scale,
    )


@_below_autograd
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
    """The loss-scale update with hysteresis, in place on the device; returns current_scale.
    (No chunk size, noop flag or tensor lists, as in apex.)"""
    return _ops.update_scale_hysteresis(
        current_scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
    )
