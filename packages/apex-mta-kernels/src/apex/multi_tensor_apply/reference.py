"""Plain-torch references of every apex_mta op.

Each is the CPU path, the fallback when no compiler is available, and the oracle the CUDA kernels
are tested against. They run on any device, do their math in float32 like the kernels, and never
synchronise with the host (the overflow flag is set with tensor ops, not ``.item()``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._checks import check_lists, layouts

Tensors = Sequence[torch.Tensor]


def _raise_flag(noop_flag: torch.Tensor, bad: torch.Tensor) -> None:
    """noop_flag[0] = 1 where ``bad`` (a 0-dim bool tensor) is set; never cleared."""
    flat = noop_flag.view(-1)[:1]
    flat.masked_fill_(bad, 1)


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(t).all()


def multi_tensor_scale(
    inputs: Tensors, outputs: Tensors, noop_flag: torch.Tensor, scale: float
) -> None:
    """outputs[i] = inputs[i] * scale (in float32, rounded to the output dtype);
    noop_flag = 1 if any input element is inf or nan."""
    check_lists("multi_tensor_scale", {"inputs": inputs, "outputs": outputs}, noop_flag)
    bad = torch.zeros((), dtype=torch.bool, device=noop_flag.device)
    for x, out in zip(inputs, outputs):
        if x.numel() == 0:
            continue
        xf = x.float()
        bad |= _nonfinite(xf)
        out.copy_(xf * scale)
    _raise_flag(noop_flag, bad)


# ---- l2norm family -----------------------------------------------------------------------------

# The kernels' chunk (kChunk in csrc/multi_tensor_apply.cuh): the overflow flag is raised when a
# chunk's float32 sum of squares is not finite, as apex raises it per block.
_CHUNK = 65536


def _chunk_sums(xf: torch.Tensor) -> torch.Tensor:
    """Float32 sum of squares of each _CHUNK-element chunk of the float32 tensor ``xf``."""
    sq = xf.reshape(-1).square()
    whole = sq.numel() // _CHUNK * _CHUNK
    parts = [sq[:whole].view(-1, _CHUNK).sum(1)]
    if whole < sq.numel():
        parts.append(sq[whole:].sum().view(1))
    return torch.cat(parts)


def _norms(
    xs: Tensors,
    noop_flag: torch.Tensor,
    per_tensor: bool,
    mul: torch.Tensor | None = None,
    zero_if_flagged: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, per-tensor) norms of ``xs`` (each times ``mul`` if given); raises the flag on a
    non-finite chunk sum. With ``zero_if_flagged``, a set flag turns every norm into 0."""
    dev = noop_flag.device
    sums = [torch.zeros(1, device=dev)]
    per = []
    for x in xs:
        if x.numel() == 0:
            per.append(torch.zeros((), device=dev))
            continue
        xf = x.float()
        if mul is not None:
            xf = xf * mul
        chunks = _chunk_sums(xf)
        sums.append(chunks)
        per.append(chunks.sum())
    chunks = torch.cat(sums)
    _raise_flag(noop_flag, _nonfinite(chunks))
    total = chunks.sum().sqrt().view(1)
    per_norms = torch.stack(per).sqrt() if per_tensor and per else torch.zeros(0, device=dev)
    if zero_if_flagged:
        flagged = noop_flag.view(-1)[0] != 0
        total = total.masked_fill(flagged, 0)
        per_norms = per_norms.masked_fill(flagged, 0)
    return total, per_norms


def multi_tensor_l2norm(
    tensors: Tensors, noop_flag: torch.Tensor, per_tensor: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(||all tensors||, [||t|| for t] or empty), float32; flag on a non-finite chunk sum."""
    check_lists("multi_tensor_l2norm", {"tensors": tensors}, noop_flag)
    return _norms(tensors, noop_flag, per_tensor)


def multi_tensor_l2norm_mp(
    tensors: Tensors, noop_flag: torch.Tensor, per_tensor: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """multi_tensor_l2norm, with every norm 0 when noop_flag is set (on entry or by this call).

    Apex skips the work and leaves its outputs unwritten; we return zeros instead, computed
    without a host sync (the norms are computed, then masked by the flag)."""
    check_lists("multi_tensor_l2norm_mp", {"tensors": tensors}, noop_flag)
    return _norms(tensors, noop_flag, per_tensor, zero_if_flagged=True)


def multi_tensor_l2norm_scale(
    inputs: Tensors,
    outputs: Tensors,
    noop_flag: torch.Tensor,
    scale: float,
    per_tensor: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norms of ``inputs`` (as multi_tensor_l2norm) and outputs[i] = inputs[i] * scale."""
    check_lists("multi_tensor_l2norm_scale", {"inputs": inputs, "outputs": outputs}, noop_flag)
    result = _norms(inputs, noop_flag, per_tensor)
    for x, out in zip(inputs, outputs):
        if x.numel():
            out.copy_(x.float() * scale)
    return result


def _check_inv_scale(op: str, inv_scale: torch.Tensor, noop_flag: torch.Tensor) -> None:
    if not isinstance(inv_scale, torch.Tensor) or inv_scale.dtype != torch.float32:
        got = inv_scale.dtype if isinstance(inv_scale, torch.Tensor) else type(inv_scale).__name__
        raise TypeError(f"{op}: inv_scale must be a float32 tensor, got {got}")
    if inv_scale.numel() != 1:
        raise ValueError(f"{op}: inv_scale must have exactly one element, got {inv_scale.numel()}")
    if inv_scale.device != noop_flag.device:
        raise ValueError(
            f"{op}: inv_scale is on {inv_scale.device} but noop_flag is on {noop_flag.device}; "
            "every tensor must be on one device"
        )


def multi_tensor_unscale_l2norm(
    tensors: Tensors,
    noop_flag: torch.Tensor,
    inv_scale: torch.Tensor,
    per_tensor: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norms of tensors[i] * inv_scale (as multi_tensor_l2norm); the tensors are not modified."""
    op = "multi_tensor_unscale_l2norm"
    check_lists(op, {"tensors": tensors}, noop_flag)
    _check_inv_scale(op, inv_scale, noop_flag)
    return _norms(tensors, noop_flag, per_tensor, mul=inv_scale.reshape(()))


# ---- axpby -------------------------------------------------------------------------------------


def multi_tensor_axpby(
    x: Tensors,
    y: Tensors,
    outputs: Tensors,
    noop_flag: torch.Tensor,
    a: float,
    b: float,
    arg_to_check: int,
) -> None:
    """outputs[i] = a * x[i] + b * y[i] (float32, each product and the sum rounded in turn);
    noop_flag = 1 on an inf or nan in x and y (arg_to_check -1), x only (0) or y only (1)."""
    op = "multi_tensor_axpby"
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(
            f"{op}: arg_to_check must be -1 (check x and y), 0 (x) or 1 (y), got {arg_to_check}"
        )
    check_lists(op, {"x": x, "y": y, "outputs": outputs}, noop_flag)
    bad = torch.zeros((), dtype=torch.bool, device=noop_flag.device)
    for xi, yi, out in zip(x, y, outputs):
        if xi.numel() == 0:
            continue
        xf, yf = xi.float(), yi.float()
        if arg_to_check != 1:
            bad |= _nonfinite(xf)
        if arg_to_check != 0:
            bad |= _nonfinite(yf)
        out.copy_(xf * a + yf * b)
    _raise_flag(noop_flag, bad)


# ---- adam --------------------------------------------------------------------------------------

_FLOATS64 = (torch.float32, torch.float64)
_STEP_DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64)


def _check_adam_args(op: str, beta1: float, beta2: float, adam_w_mode: int) -> None:
    if adam_w_mode not in (0, 1):
        raise ValueError(
            f"{op}: adam_w_mode must be 0 (L2 weight decay) or 1 (decoupled, AdamW), "
            f"got {adam_w_mode}"
        )
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{op}: {name} must be in [0, 1), got {beta}")


def _check_scalar_tensor(
    op: str, name: str, t: torch.Tensor, noop_flag: torch.Tensor, dtypes: tuple[torch.dtype, ...]
) -> None:
    if t.dtype not in dtypes:
        supported = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: {supported}")
    if t.numel() != 1:
        raise ValueError(f"{op}: {name} must have exactly one element, got {t.numel()}")
    if t.device != noop_flag.device:
        raise ValueError(
            f"{op}: {name} is on {t.device} but noop_flag is on {noop_flag.device}; "
            "every tensor must be on one device"
        )


def _adam_update(g, p, m, v, beta1, beta2, eps, l2_wd, step_size, rsqrt_bc2, decay):
    """One Adam step in float32 on unscaled g; returns the new (p, m, v). The scalars are Python
    floats (rounded to float32 by torch, as the kernel rounds them) or 0-dim float32 tensors."""
    if l2_wd is not None:
        g = g + l2_wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = v.sqrt() * rsqrt_bc2 + eps
    return p * decay - step_size * (m / denom), m, v


def multi_tensor_adam(
    grads: Tensors,
    params: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
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
    """One Adam (adam_w_mode 0, L2 weight decay) or AdamW (1) step with host scalars; the bias
    corrections 1 - beta^step are computed on the host in double. noop_flag is not read."""
    op = "multi_tensor_adam"
    lists = {"grads": grads, "params": params, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    check_lists(op, lists, noop_flag)
    _check_adam_args(op, beta1, beta2, adam_w_mode)
    if bias_correction and step < 1:
        raise ValueError(f"{op}: step must be >= 1 when bias_correction is set, got {step}")
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    scalars = {
        "l2_wd": weight_decay if adam_w_mode == 0 else None,
        "step_size": lr / bc1,
        "rsqrt_bc2": 1.0 / math.sqrt(bc2),
        "decay": 1.0 - lr * weight_decay if adam_w_mode == 1 else 1.0,
    }
    for g, p, m, v in zip(grads, params, exp_avgs, exp_avg_sqs):
        if p.numel() == 0:
            continue
        new_p, new_m, new_v = _adam_update(
            g.float(), p.float(), m.float(), v.float(), beta1, beta2, eps, **scalars
        )
        p.copy_(new_p)
        m.copy_(new_m)
        v.copy_(new_v)


def _adam_capturable(
    op: str,
    lists: dict[str, Tensors],
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
    check_lists(op, lists, noop_flag)
    _check_scalar_tensor(op, "lr", lr, noop_flag, _FLOATS64)
    _check_scalar_tensor(op, "step", step, noop_flag, _STEP_DTYPES)
    _check_scalar_tensor(op, "inv_scale", inv_scale, noop_flag, _FLOATS64)
    _check_adam_args(op, beta1, beta2, adam_w_mode)
    # The kernel's per-thread scalars, in its float32 arithmetic: 1 - beta^step as
    # -expm1(step * log(beta)), lr / bc1, 1 / sqrt(bc2), and (AdamW) 1 - lr * wd in double.
    lr32 = lr.reshape(()).float()
    if bias_correction:
        st = step.reshape(()).float()
        bc1 = -torch.expm1(st * (math.log(beta1) if beta1 > 0 else -math.inf))
        bc2 = -torch.expm1(st * (math.log(beta2) if beta2 > 0 else -math.inf))
    else:
        bc1 = bc2 = torch.ones((), device=lr.device)
    decay = (1.0 - lr32.double() * weight_decay).float() if adam_w_mode == 1 else 1.0
    scalars = {
        "l2_wd": weight_decay if adam_w_mode == 0 else None,
        "step_size": lr32 / bc1,
        "rsqrt_bc2": bc2.rsqrt(),
        "decay": decay,
    }
    inv = inv_scale.reshape(()).float()
    skip = noop_flag.view(-1)[0] != 0
    masters = lists.get("master_params")
    groups = zip(
        lists["grads"],
        lists["params"],
        lists["exp_avgs"],
        lists["exp_avg_sqs"],
        masters if masters is not None else lists["params"],
    )
    for g, p, m, v, w in groups:
        if p.numel() == 0:
            continue
        gu = g.float() * inv
        new_p, new_m, new_v = _adam_update(
            gu, w.float(), m.float(), v.float(), beta1, beta2, eps, **scalars
        )
        g.copy_(torch.where(skip, g, gu))
        if masters is not None:
            w.copy_(torch.where(skip, w, new_p))
        p.copy_(torch.where(skip, p, new_p))
        m.copy_(torch.where(skip, m, new_m))
        v.copy_(torch.where(skip, v, new_v))


def multi_tensor_adam_capturable(
    grads: Tensors,
    params: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
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
    """multi_tensor_adam with lr, step and inv_scale read on the device: grads are unscaled in
    place (g *= inv_scale) and the step is taken; nothing is written when noop_flag is set."""
    lists = {"grads": grads, "params": params, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    _adam_capturable(
        "multi_tensor_adam_capturable",
        lists,
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
    grads: Tensors,
    params: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    master_params: Tensors,
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
    """multi_tensor_adam_capturable stepping master_params; params = master_params rounded."""
    lists = {
        "grads": grads,
        "params": params,
        "exp_avgs": exp_avgs,
        "exp_avg_sqs": exp_avg_sqs,
        "master_params": master_params,
    }
    _adam_capturable(
        "multi_tensor_adam_capturable_master",
        lists,
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


# ---- sgd, novograd, adagrad ----------------------------------------------------------------------


def multi_tensor_sgd(
    grads: Tensors,
    weights: Tensors,
    momenta: Tensors,
    model_weights: Tensors,
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
    """apex's SGD step in float32 (see csrc/sgd.cu for the formula); an empty ``model_weights``
    selects the 3-list form. Nothing is written while noop_flag[0] is set."""
    op = "multi_tensor_sgd"
    lists = {"grads": grads, "weights": weights, "momenta": momenta}
    if len(model_weights):
        lists["model_weights"] = model_weights
    check_lists(op, lists, noop_flag)
    skip = noop_flag.reshape(-1)[0] != 0
    copies = model_weights if len(model_weights) else [None] * len(grads)
    for g, w, m, c in zip(grads, weights, momenta, copies):
        if g.numel() == 0:
            continue
        wf = w.float()
        d = g.float() * scale
        if weight_decay != 0 and not wd_after_momentum:
            d = d + weight_decay * wf
        if momentum != 0:
            mf = d if first_run else momentum * m.float() + (1.0 - dampening) * d
            d = d + momentum * mf if nesterov else mf
            m.copy_(torch.where(skip, m, mf.to(m.dtype)))
        if weight_decay != 0 and wd_after_momentum:
            d = d + weight_decay * wf
        new_w = (wf - lr * d).to(w.dtype)
        if c is not None:
            c.copy_(torch.where(skip, c, new_w.to(c.dtype)))
        w.copy_(torch.where(skip, w, new_w))


def _check_novograd_args(
    grads: Tensors,
    noop_flag: torch.Tensor,
    grad_norms: torch.Tensor,
    step: int,
    bias_correction: bool,
    moment_mode: int,
    norm_type: int,
) -> None:
    op = "multi_tensor_novograd"
    if grad_norms.dtype != torch.float32:
        raise TypeError(f"{op}: grad_norms must be a float32 tensor, got {grad_norms.dtype}")
    if grad_norms.device != noop_flag.device:
        raise ValueError(
            f"{op}: grad_norms is on {grad_norms.device} but noop_flag is on {noop_flag.device}; "
            "every tensor must be on one device"
        )
    if grad_norms.numel() != len(grads):
        raise ValueError(
            f"{op}: grad_norms has {grad_norms.numel()} elements but grads has {len(grads)} "
            "tensors; one norm per tensor is required"
        )
    if not grad_norms.is_contiguous():
        raise ValueError(f"{op}: grad_norms is not contiguous")
    if moment_mode not in (0, 1):
        raise ValueError(
            f"{op}: moment_mode must be 0 (weight decay inside the moment) or 1 (decoupled), "
            f"got {moment_mode}"
        )
    if norm_type not in (0, 2):
        raise ValueError(f"{op}: norm_type must be 2 (L2) or 0 (Linf), got {norm_type}")
    if bias_correction and step < 1:
        raise ValueError(f"{op}: step must be >= 1 when bias_correction is set, got {step}")


def multi_tensor_novograd(
    grads: Tensors,
    params: Tensors,
    exp_avgs: Tensors,
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
    """apex's NovoGrad step (see csrc/novograd.cu): blends each grad's norm into grad_norms in
    place, then updates params and exp_avgs. A norm that is not finite sets noop_flag; the
    update runs regardless, as in apex."""
    op = "multi_tensor_novograd"
    check_lists(op, {"grads": grads, "params": params, "exp_avgs": exp_avgs}, noop_flag)
    _check_novograd_args(
        grads, noop_flag, grad_norms, step, bias_correction, moment_mode, norm_type
    )
    if not len(grads):
        return
    zero = torch.zeros((), dtype=torch.float32, device=noop_flag.device)
    stats = []  # sum of squares (L2) or largest magnitude (Linf) of each grad, as the kernel
    for g in grads:
        gf = g.float()
        if g.numel() == 0:
            stats.append(zero)
        elif norm_type == 2:
            stats.append(gf.square().sum())
        else:
            stats.append(gf.abs().amax())
    stat = torch.stack(stats)
    _raise_flag(noop_flag, _nonfinite(stat))
    gn = grad_norms.reshape(-1)
    if norm_type == 2:
        gn.copy_(torch.sqrt(beta2 * gn * gn + (1.0 - beta2) * stat))
    else:
        gn.copy_(beta2 * gn + (1.0 - beta2) * stat)
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = math.sqrt(1.0 - beta2**step) if bias_correction else 1.0
    beta3 = 1.0 - beta1 if grad_averaging else 1.0
    for i, (g, p, m) in enumerate(zip(grads, params, exp_avgs)):
        if g.numel() == 0:
            continue
        gf, pf, mf = g.float(), p.float(), m.float()
        denom = gn[i] / bc2 + eps
        if moment_mode == 0:
            gf = gf / denom + weight_decay * pf
            mf = beta1 * mf + beta3 * gf
            pf = pf - lr * (mf / bc1)
        else:
            mf = beta1 * mf + beta3 * gf
            pf = pf - lr * (mf / bc1 / denom + weight_decay * pf)
        p.copy_(pf)
        m.copy_(mf)


def multi_tensor_adagrad(
    grads: Tensors,
    params: Tensors,
    state_sums: Tensors,
    noop_flag: torch.Tensor,
    lr: float,
    eps: float,
    adagrad_w_mode: int,
    weight_decay: float,
) -> None:
    """apex's Adagrad step in float32: adagrad_w_mode 0 adds weight_decay * p to the grad (L2), 1
    decays the param directly; eps is added after the square root. noop_flag is not read."""
    op = "multi_tensor_adagrad"
    check_lists(op, {"grads": grads, "params": params, "state_sums": state_sums}, noop_flag)
    if adagrad_w_mode not in (0, 1):
        raise ValueError(
            f"{op}: adagrad_w_mode must be 0 (L2) or 1 (decoupled weight decay), "
            f"got {adagrad_w_mode}"
        )
    for g, p, h in zip(grads, params, state_sums):
        if g.numel() == 0:
            continue
        gf, pf, hf = g.float(), p.float(), h.float()
        if adagrad_w_mode == 0:
            # torch.optim.Adagrad's own ops (addcmul, addcdiv): its rounding on every CPU.
            gf = gf.add(pf, alpha=weight_decay)
            hf = hf.addcmul(gf, gf)
            pf = pf.addcdiv(gf, hf.sqrt().add(eps), value=-lr)
        else:
            hf = hf + gf * gf
            pf = pf - lr * (gf / (hf.sqrt() + eps) + weight_decay * pf)
        p.copy_(pf)
        h.copy_(hf)


# ---- update_scale_hysteresis -------------------------------------------------------------------


def _check_scaler_tensor(
    name: str, t: torch.Tensor, dtype: torch.dtype, first: torch.Tensor
) -> None:
    op = "update_scale_hysteresis"
    if t.dtype != dtype:
        raise TypeError(f"{op}: {name} must be a {dtype} tensor, got {t.dtype}")
    if t.numel() != 1:
        raise ValueError(f"{op}: {name} must have exactly one element, got {t.numel()}")
    if t.device != first.device:
        raise ValueError(
            f"{op}: {name} is on {t.device} but current_scale is on {first.device}; "
            "every tensor must be on one device"
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
) -> None:
    """GradScaler's scale update with hysteresis, in place (apex semantics): on an overflow
    (found_inf != 0) the hysteresis tracker drops by one and the growth tracker resets; the scale
    backs off only once the tracker is <= 0. On a finite step the growth tracker counts up and the
    scale grows every growth_interval steps (unless that overflows float32), and the hysteresis
    tracker resets to ``hysteresis``."""
    _check_scaler_tensor("current_scale", current_scale, torch.float32, current_scale)
    _check_scaler_tensor("growth_tracker", growth_tracker, torch.int32, current_scale)
    _check_scaler_tensor("hysteresis_tracker", hysteresis_tracker, torch.int32, current_scale)
    _check_scaler_tensor("found_inf", found_inf, torch.float32, current_scale)
    found = found_inf != 0
    left = hysteresis_tracker - found.to(torch.int32)
    scale64 = current_scale.double()
    backed_off = (scale64 * backoff_factor).float()
    grown = (scale64 * growth_factor).float()
    successful = growth_tracker.long() + 1
    at_interval = ~found & (successful == growth_interval)
    scale = torch.where(found & (left <= 0), backed_off, current_scale)
    scale = torch.where(at_interval & torch.isfinite(grown), grown, scale)
    current_scale.copy_(scale)
    growth_tracker.copy_(torch.where(found | at_interval, 0, successful))
    hysteresis_tracker.copy_(torch.where(found, left, hysteresis))


# ---- lamb --------------------------------------------------------------------------------------
# apex's LAMB, in two steps per tensor. Stage 1, per element (float32):
#   sg = g * inv_scale / clip           clip = gn / max_norm if gn > max_norm else 1
#   sg += wd * p                        (adam_w_mode 0, L2, only when wd != 0)
#   m = beta1 * m + beta3 * sg;  v = beta2 * v + (1 - beta2) * sg * sg
#   u = (m / bc1) / (sqrt(v / bc2) + eps)   (computed as m * (1/bc1) / (sqrt(v) * (1/sqrt(bc2)) + eps))
#   u += wd * p                         (adam_w_mode 1, decoupled, only when wd != 0)
# the update u is stored in the grad's dtype (apex writes it over the grad). Stage 2, per tensor:
#   ratio = lr * ||p|| / ||u|| when (use_nvlamb or wd != 0) and both norms are nonzero, else lr
#   p -= ratio * u
# p is read for stage 1 only when wd != 0 (apex's shortcut: an inf in p with wd 0 does not reach
# m and v). The fused ops raise noop_flag when a 65536-element chunk's float32 sum of squares of
# p (when read) or of u is not finite, as apex's norm kernels do.


def _check_betas(op: str, beta1: float, beta2: float) -> None:
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{op}: {name} must be in [0, 1), got {beta}")


def _check_per_tensor(
    op: str, name: str, t: torch.Tensor, n: int, list_name: str, noop_flag: torch.Tensor
) -> None:
    """A float32 tensor holding one value per tensor of the lists (per_tensor_decay, norms)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{op}: {name} must be a float32 tensor, got {got}")
    if t.device != noop_flag.device:
        raise ValueError(
            f"{op}: {name} is on {t.device} but noop_flag is on {noop_flag.device}; "
            "every tensor must be on one device"
        )
    if t.numel() != n:
        raise ValueError(
            f"{op}: {name} has {t.numel()} elements but {list_name} has {n} tensors; "
            "one value per tensor is required"
        )
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} is not contiguous")


def _grad_scale(
    global_grad_norm: torch.Tensor, max_norm, inv_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """inv_scale / clip as a float32 0-dim tensor, clip = gn / max_norm if gn > max_norm else 1."""
    gn = global_grad_norm.reshape(()).float()
    mx = max_norm.reshape(()).float() if isinstance(max_norm, torch.Tensor) else max_norm
    clip = torch.where(gn > mx, gn / mx, torch.ones_like(gn))
    inv = inv_scale.reshape(()).float() if inv_scale is not None else torch.ones_like(gn)
    return inv / clip


def _lamb_update(gf, pf, mf, vf, s: dict, wd, l2: bool):
    """Stage 1 for one tensor in float32: returns (u, m, v). ``pf`` is None when p is not read
    (no weight decay); ``wd`` a float or a 0-dim tensor."""
    sg = gf * s["gscale"]
    if l2 and pf is not None:
        sg = sg + wd * pf
    m = s["beta1"] * mf + s["beta3"] * sg
    v = s["beta2"] * vf + s["one_minus_beta2"] * sg * sg
    u = (m * s["inv_bc1"]) / (v.sqrt() * s["rsqrt_bc2"] + s["eps"])
    if not l2 and pf is not None:
        u = u + wd * pf
    return u, m, v


def _lamb_scalars(beta1, beta2, eps, grad_averaging, inv_bc1, rsqrt_bc2, gscale) -> dict:
    return {
        "beta1": beta1,
        "beta3": 1.0 - beta1 if grad_averaging else 1.0,
        "beta2": beta2,
        "one_minus_beta2": 1.0 - beta2,
        "eps": eps,
        "inv_bc1": inv_bc1,
        "rsqrt_bc2": rsqrt_bc2,
        "gscale": gscale,
    }


def _lamb_fused(
    lists: dict[str, Tensors],
    noop_flag: torch.Tensor,
    s: dict,
    lr,
    weight_decay: float,
    l2: bool,
    use_nvlamb: bool,
    skip: torch.Tensor | None,
) -> None:
    """Both stages of multi_tensor_lamb / multi_tensor_lamb_mp. ``skip`` (a 0-dim bool tensor, mp
    only) is the flag state on entry: when set nothing is written. For the mp op a non-finite norm
    chunk skips stage 2 (p stays, m, v and the grads hold the new values) and raises the flag."""
    dev = noop_flag.device
    decay = weight_decay != 0
    trust = use_nvlamb or decay
    masters = lists.get("model_params")
    staged = []
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    zero = torch.zeros((), device=dev)
    for i, (g, p, m, v) in enumerate(
        zip(lists["grads"], lists["params"], lists["exp_avgs"], lists["exp_avg_sqs"])
    ):
        if g.numel() == 0:
            continue
        pf = p.float()
        u, mf, vf = _lamb_update(
            g.float(), pf if decay else None, m.float(), v.float(), s, weight_decay, l2
        )
        u = u.to(g.dtype)  # the update lives in the grad's storage, in its dtype
        uf = u.float()
        u_sums = _chunk_sums(uf)
        bad |= _nonfinite(u_sums)
        p_norm = zero
        if trust:
            p_sums = _chunk_sums(pf)
            bad |= _nonfinite(p_sums)
            p_norm = p_sums.sum().sqrt()
        staged.append((i, u, uf, mf, vf, pf, p_norm, u_sums.sum().sqrt()))
    if skip is None:
        _raise_flag(noop_flag, bad)
        skip2 = None
    else:
        bad = bad & ~skip  # a skipped stage 1 computes no norms
        _raise_flag(noop_flag, bad)
        skip2 = skip | bad

    def put(dst, new, flag):
        dst.copy_(new if flag is None else torch.where(flag, dst, new.to(dst.dtype)))

    for i, u, uf, mf, vf, pf, p_norm, u_norm in staged:
        put(lists["grads"][i], u, skip)
        put(lists["exp_avgs"][i], mf, skip)
        put(lists["exp_avg_sqs"][i], vf, skip)
        ratio = lr
        if trust:
            ratio = torch.where((p_norm != 0) & (u_norm != 0), lr * (p_norm / u_norm), lr)
        new_p = pf - ratio * uf
        put(lists["params"][i], new_p, skip2)
        if masters is not None:
            put(masters[i], new_p, skip2)


def multi_tensor_lamb_stage1(
    grads: Tensors,
    params: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    updates: Tensors,
    noop_flag: torch.Tensor,
    per_tensor_decay: torch.Tensor,
    step: int,
    beta1: float,
    beta2: float,
    eps: float,
    global_grad_norm: torch.Tensor,
    max_global_grad_norm: float,
) -> None:
    """apex's LAMB stage 1: m, v in place and updates[i] = the update (decoupled weight decay
    per_tensor_decay[i], bias corrections with step + 1, beta3 = 1 - beta1). noop_flag not read."""
    op = "multi_tensor_lamb_stage1"
    lists = {
        "grads": grads,
        "params": params,
        "exp_avgs": exp_avgs,
        "exp_avg_sqs": exp_avg_sqs,
        "updates": updates,
    }
    check_lists(op, lists, noop_flag)
    _check_per_tensor(op, "per_tensor_decay", per_tensor_decay, len(grads), "grads", noop_flag)
    _check_betas(op, beta1, beta2)
    if step < 0:
        raise ValueError(f"{op}: step must be >= 0 (the bias correction uses step + 1), got {step}")
    _check_scalar_tensor(op, "global_grad_norm", global_grad_norm, noop_flag, _FLOATS64)
    bc1, bc2 = 1.0 - beta1 ** (step + 1), 1.0 - beta2 ** (step + 1)
    gscale = _grad_scale(global_grad_norm, max_global_grad_norm)
    s = _lamb_scalars(beta1, beta2, eps, True, 1.0 / bc1, 1.0 / math.sqrt(bc2), gscale)
    decays = per_tensor_decay.reshape(-1)
    for i, (g, p, m, v, out) in enumerate(zip(grads, params, exp_avgs, exp_avg_sqs, updates)):
        if g.numel() == 0:
            continue
        wd = decays[i]
        pm = torch.where(wd != 0, p.float(), 0.0)  # p is read only where the decay is nonzero
        u, mf, vf = _lamb_update(g.float(), pm, m.float(), v.float(), s, wd, False)
        out.copy_(u)
        m.copy_(mf)
        v.copy_(vf)


def multi_tensor_lamb_stage2(
    params: Tensors,
    updates: Tensors,
    noop_flag: torch.Tensor,
    per_tensor_param_norm: torch.Tensor,
    per_tensor_update_norm: torch.Tensor,
    lr: float,
    weight_decay: float,
    use_nvlamb: bool = False,
) -> None:
    """apex's LAMB stage 2: params[i] -= ratio * updates[i], ratio = lr * ||p|| / ||u|| (the given
    norms) when use_nvlamb or weight_decay != 0 and both norms are nonzero, else lr."""
    op = "multi_tensor_lamb_stage2"
    check_lists(op, {"params": params, "updates": updates}, noop_flag)
    n = len(params)
    _check_per_tensor(op, "per_tensor_param_norm", per_tensor_param_norm, n, "params", noop_flag)
    _check_per_tensor(op, "per_tensor_update_norm", per_tensor_update_norm, n, "params", noop_flag)
    trust = use_nvlamb or weight_decay != 0
    pn, un = per_tensor_param_norm.reshape(-1), per_tensor_update_norm.reshape(-1)
    for i, (p, u) in enumerate(zip(params, updates)):
        if p.numel() == 0:
            continue
        ratio = lr
        if trust:
            ratio = torch.where((pn[i] != 0) & (un[i] != 0), lr * (pn[i] / un[i]), lr)
        p.copy_(p.float() - ratio * u.float())


def multi_tensor_lamb(
    grads: Tensors,
    params: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
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
    """apex's fused LAMB step (see the note above); grads are overwritten with the update; the
    flag is raised on a non-finite norm chunk but not read."""
    op = "multi_tensor_lamb"
    lists = {"grads": grads, "params": params, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    check_lists(op, lists, noop_flag)
    _check_adam_args(op, beta1, beta2, adam_w_mode)
    if bias_correction and step < 1:
        raise ValueError(f"{op}: step must be >= 1 when bias_correction is set, got {step}")
    _check_scalar_tensor(op, "global_grad_norm", global_grad_norm, noop_flag, _FLOATS64)
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    gscale = _grad_scale(global_grad_norm, max_grad_norm)
    s = _lamb_scalars(beta1, beta2, eps, grad_averaging, 1.0 / bc1, 1.0 / math.sqrt(bc2), gscale)
    _lamb_fused(lists, noop_flag, s, lr, weight_decay, adam_w_mode == 0, use_nvlamb, None)


def multi_tensor_lamb_mp(
    grads: Tensors,
    params: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    model_params: Tensors,
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
    """multi_tensor_lamb with lr, step, the norms, found_inf and inv_scale on the device, grads
    unscaled by inv_scale; nothing written when noop_flag or found_inf is set. A non-empty
    ``model_params`` receives the new params (masters) rounded to its dtype."""
    op = "multi_tensor_lamb_mp"
    lists = {"grads": grads, "params": params, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if len(model_params):
        lists["model_params"] = model_params
    check_lists(op, lists, noop_flag)
    _check_adam_args(op, beta1, beta2, adam_w_mode)
    _check_scalar_tensor(op, "lr", lr, noop_flag, _FLOATS64)
    _check_scalar_tensor(op, "step", step, noop_flag, _STEP_DTYPES)
    _check_scalar_tensor(op, "global_grad_norm", global_grad_norm, noop_flag, _FLOATS64)
    _check_scalar_tensor(op, "max_grad_norm", max_grad_norm, noop_flag, _FLOATS64)
    _check_scalar_tensor(op, "found_inf", found_inf, noop_flag, _FLOATS64)
    _check_scalar_tensor(op, "inv_scale", inv_scale, noop_flag, _FLOATS64)
    # The kernel's float32 bias corrections from the device step, as in adam_capturable.
    if bias_correction:
        st = step.reshape(()).float()
        bc1 = -torch.expm1(st * (math.log(beta1) if beta1 > 0 else -math.inf))
        bc2 = -torch.expm1(st * (math.log(beta2) if beta2 > 0 else -math.inf))
    else:
        bc1 = bc2 = torch.ones((), device=noop_flag.device)
    gscale = _grad_scale(global_grad_norm, max_grad_norm, inv_scale)
    s = _lamb_scalars(beta1, beta2, eps, grad_averaging, 1.0 / bc1, bc2.rsqrt(), gscale)
    skip = (noop_flag.reshape(-1)[0] != 0) | (found_inf.reshape(()) != 0)
    lr32 = lr.reshape(()).float()
    _lamb_fused(lists, noop_flag, s, lr32, weight_decay, adam_w_mode == 0, use_nvlamb, skip)


def _grad_fits(g: torch.Tensor, p: torch.Tensor) -> bool:
    """A grad the ops take beside its param: dense, and sharing a memory format with it."""
    lay = layouts(g)
    return lay != 0 and (g.numel() <= 1 or (lay & layouts(p)) != 0)


class LambPlan:
    """The reference of ``torch.classes.apex_mta.LambPlan`` (see ``ops.lamb_plan``): a LAMB
    bucket's lists, held across steps, each step fetching the grads from the params. The same
    methods, checks and results as the C++ plan: ``step`` is multi_tensor_l2norm (when no global
    norm is given) + multi_tensor_lamb (+ multi_tensor_scale into ``copies``) on the held lists."""

    def __init__(self, params: Tensors, work: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors,
                 copies: Tensors = ()):  # fmt: skip
        n = len(params)
        self._params, self._work = list(params), list(work)
        self._m, self._v, self._copies = list(exp_avgs), list(exp_avg_sqs), list(copies)
        self._norm_only = not (self._work or self._m or self._v or self._copies)
        if not self._norm_only and not len(self._work) == len(self._m) == len(self._v) == n:
            raise ValueError(
                f"LambPlan: params has {n} tensors but work, exp_avgs and exp_avg_sqs have "
                f"{len(self._work)}, {len(self._m)} and {len(self._v)} (all {n}, or all 0 for a "
                "plan of the grad norm only)"
            )
        if self._copies and len(self._copies) != n:
            raise ValueError(f"LambPlan: copies has {len(self._copies)} tensors; expected 0 or {n}")
        self._grads: list[torch.Tensor] | None = None
        # Each param's dtype when the plan was built: a fetch refuses a param cast since (p.data
        # =, module.double()), as the C++ plan's (grad_plan.h).
        self._dtypes = [p.dtype for p in self._params]

    def __len__(self) -> int:
        return len(self._params)

    def fetch(self) -> bool:
        """Every param's grad, held until the step ends; False (nothing held) when one is
        missing, not strided, of other sizes than its param, not dense, or in no memory format
        of its param's, or when a param was cast since the plan was built (the C++ plan's
        per-step test: the caller's general path then checks every grad before any launch)."""
        grads = []
        for p, dtype in zip(self._params, self._dtypes):
            g = p.grad
            if (
                g is None
                or p.dtype != dtype
                or g.layout != torch.strided
                or g.shape != p.shape
                or not _grad_fits(g, p)
            ):
                self._grads = None
                return False
            grads.append(g)
        self._grads = grads
        return True

    def release(self) -> None:
        self._grads = None

    def _fetched(self) -> bool:
        return self._grads is not None or self.fetch()

    def grad_norm(self, noop_flag: torch.Tensor) -> torch.Tensor | None:
        """multi_tensor_l2norm's total over the grads, or None when a param has no grad."""
        try:
            if not self._fetched():
                return None
            return multi_tensor_l2norm(self._grads, noop_flag, False)[0]
        finally:
            self.release()

    def step(self, noop_flag: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
             step: int, bias_correction: bool, weight_decay: float, grad_averaging: bool,
             adam_w_mode: int, global_grad_norm: torch.Tensor | None, max_grad_norm: float,
             use_nvlamb: bool) -> bool:  # fmt: skip
        """multi_tensor_lamb on [grads, work, exp_avgs, exp_avg_sqs], the global norm taken from
        the grads first when not given; False (nothing run) when a param has no grad."""
        op = "multi_tensor_lamb"
        try:
            if self._norm_only:
                raise ValueError(
                    "LambPlan: this plan holds params only (a plan of the grad norm); it cannot step"
                )
            _check_adam_args(op, beta1, beta2, adam_w_mode)
            if bias_correction and step < 1:
                raise ValueError(f"{op}: step must be >= 1 when bias_correction is set, got {step}")
            if not self._fetched():
                return False
            g = self._grads
            lists = {"grads": g, "params": self._work, "exp_avgs": self._m, "exp_avg_sqs": self._v}
            check_lists(op, lists, noop_flag)  # every check before anything runs, as the plan
            if global_grad_norm is None:
                global_grad_norm = multi_tensor_l2norm(g, noop_flag, False)[0]
            multi_tensor_lamb(g, self._work, self._m, self._v, noop_flag, lr, beta1, beta2, eps,
                              step, bias_correction, weight_decay, grad_averaging, adam_w_mode,
                              global_grad_norm, max_grad_norm, use_nvlamb)  # fmt: skip
            if self._copies:
                multi_tensor_scale(self._work, self._copies, noop_flag, 1.0)
            return True
        finally:
            self.release()


class AmpPlan:
    """The reference of ``torch.classes.apex_mta.AmpPlan`` (see ``ops.amp_plan``): apex-amp's O2
    step on held lists, the same methods and results as the C++ plan. ``grad_views`` is kept as
    the very list given (not a copy), so the plan adds no Python reference to a view and the
    caller's reference counts of them stay what they were."""

    def __init__(self, model_params: Tensors, masters: Tensors, grad_views: list,
                 fp32_params: Tensors = ()):  # fmt: skip
        n = len(model_params)
        self._model, self._masters = list(model_params), list(masters)
        self._views, self._fp32 = grad_views, list(fp32_params)
        if not len(self._masters) == len(self._views) == n:
            raise ValueError(
                f"AmpPlan: model_params has {n} tensors but masters and grad_views have "
                f"{len(self._masters)} and {len(self._views)}"
            )
        for i, (m, v) in enumerate(zip(self._masters, self._views)):
            if v is None or not _fits(m, v):
                raise ValueError(
                    f"AmpPlan: grad_views[{i}] must be a float32 tensor of masters[{i}]'s shape "
                    "and device"
                )

    def __len__(self) -> int:
        return len(self._model)

    def prepare(self) -> bool:
        """When no master and no fp32 param has a grad, clear every model param's grad: True.
        Else change nothing: False."""
        if any(m.grad is not None for m in self._masters):
            return False
        if any(p.grad is not None for p in self._fp32):
            return False
        for p in self._model:
            p.grad = None
        return True

    @torch.no_grad()
    def unscale(self, noop_flag: torch.Tensor, scale: float) -> bool:
        """multi_tensor_scale of [model grads + fp32 grads] into [views + fp32 grads (in place)]
        times ``scale``; then each master's grad is its view and the model grads are cleared.
        False, changing nothing, when a model or fp32 param has no (strided) grad, a master has
        a grad, or a master no longer fits its view."""
        grads = []
        for p, m, v in zip(self._model, self._masters, self._views):
            g = p.grad
            if g is None or g.layout != torch.strided or m.grad is not None or not _fits(m, v):
                return False
            grads.append(g)
        fp32_grads = [p.grad for p in self._fp32]
        if any(g is None or g.layout != torch.strided for g in fp32_grads):
            return False
        multi_tensor_scale(grads + fp32_grads, list(self._views) + fp32_grads, noop_flag, scale)
        for p, m, v in zip(self._model, self._masters, self._views):
            m.grad = v
            p.grad = None
        return True

    @torch.no_grad()
    def copy_back(self, noop_flag: torch.Tensor, release_grads: bool) -> None:
        """multi_tensor_scale of the masters into the model params (scale 1); with
        ``release_grads`` every master's grad is then cleared."""
        multi_tensor_scale(self._masters, self._model, noop_flag, 1.0)
        if release_grads:
            for m in self._masters:
                m.grad = None


def _fits(master: torch.Tensor, view: torch.Tensor) -> bool:
    """What the .grad setter requires of ``view`` as ``master``'s grad (AmpPlan)."""
    return (
        master.dtype == torch.float32
        and master.device == view.device
        and master.shape == view.shape
    )
