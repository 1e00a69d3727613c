"""FusedAdam: apex's multi-tensor Adam/AdamW, on apex_mta's adam kernels."""

from __future__ import annotations

import warnings
from typing import Any

import torch

import amp_C
from apex.multi_tensor_apply import ops

from ._base import (
    MASTER_KEY,
    Bucket,
    FusedOptimizer,
    Scaling,
    check_betas,
    check_eps,
    check_lr,
    check_nonneg,
    group_device,
    opaque_to_dynamo,
)

__all__ = ["FusedAdam", "fused_adam_state_to_torch", "torch_state_to_fused_adam"]

_LEGACY_STEP_ARGS = (
    "FusedAdam has been updated. Simply initialize it identically to torch.optim.Adam, and call "
    "step() with no arguments."
)


class FusedAdam(FusedOptimizer):
    """Adam and AdamW in a few multi-tensor kernel launches per step (apex.optimizers.FusedAdam).

    The constructor is apex's, positional order included; ``adam_w_mode=True`` (the default)
    is AdamW (decoupled weight decay, torch.optim.AdamW), False is Adam with L2 weight decay
    (torch.optim.Adam). Params may be float32, float16 or bfloat16, on any device (CPU runs
    the kernels' plain-torch reference); ``exp_avg``/``exp_avg_sq`` are float32 whatever the
    param dtype.

    Beyond apex:

    - ``amsgrad=True`` works, with torch.optim.Adam(amsgrad=True)'s numerics (state key
      ``max_exp_avg_sq``); it runs on torch ops, not the fused kernel;
    - ``master_weights=True`` keeps a float32 master of every fp16 and bf16 param (state key
      ``master_param``, saved in ``state_dict``) with or without ``capturable``, also for groups
      added later;
    - ``zero_grad(set_to_none=...)``; ``foreach=`` and ``fused=`` are accepted and ignored;
    - torch.amp.GradScaler's fused-optimizer protocol: ``scaler.step(opt)`` hands the optimizer
      the scale and the overflow flag, the kernel unscales the grads as it reads them, and an
      overflow leaves params and state untouched, all without a host sync. A group's step
      counter then lives on the device (``group['step']`` becomes an int32 tensor, as in
      capturable mode), so a skipped step does not count.

    The step counter is per param group (``group['step']``, apex's layout); every param of a
    group takes its bias correction from it. Checkpoints of torch.optim.Adam/AdamW load
    directly (``load_state_dict`` takes the group's step from its params'), and
    :func:`fused_adam_state_to_torch` / :func:`torch_state_to_fused_adam` convert explicitly.

    ``capturable=True``: ``group['lr']`` is kept as a float32 device tensor and ``group['step']``
    as an int32 device tensor, so ``step()`` can be captured in a CUDA graph (update the lr
    in place: ``group['lr'].fill_(...)``; torch's LR schedulers do).
    """

    _state_keys = ("exp_avg", "exp_avg_sq")
    _fp32_state = True
    _supports_amp_scaling = True
    _sparse_hint = " (torch.optim.SparseAdam does)"

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
        capturable=False,
        master_weights=False,
        *,
        foreach=None,
        fused=None,
    ):
        self.capturable = bool(capturable)
        self.adam_w_mode = 1 if adam_w_mode else 0
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=bool(amsgrad),
        )
        super().__init__(
            params,
            defaults,
            set_grad_none=set_grad_none,
            master_weights=master_weights,
            foreach=foreach,
            fused=fused,
        )
        # The amp_C functions, for subclasses written against apex (fairseq, NeMo).
        self.multi_tensor_adam = amp_C.multi_tensor_adam
        self.multi_tensor_adam_capturable = amp_C.multi_tensor_adam_capturable
        self.multi_tensor_adam_capturable_master = amp_C.multi_tensor_adam_capturable_master

    # ---- groups --------------------------------------------------------------------------------

    def _check_hyper(self, where: str, group: dict[str, Any]) -> None:
        check_lr(where, group["lr"])
        check_betas(where, group["betas"])
        check_eps(where, group["eps"])
        check_nonneg(where, "weight_decay", group["weight_decay"])

    @property
    def _group_single_device(self) -> bool:
        return self.capturable

    def _single_device_reason(self) -> str:
        return " with capturable=True (lr and step live on the group's device)"

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        super()._check_group(index, group)
        if self.capturable:
            self._make_capturable(group)

    def _make_capturable(self, group: dict[str, Any]) -> None:
        super()._make_capturable(group)
        device = group_device(group)
        if device is None:
            return
        step = group.get("step")
        if step is not None and not isinstance(step, torch.Tensor):
            group["step"] = torch.tensor([step], dtype=torch.int32, device=device)
        elif isinstance(step, torch.Tensor) and step.device != device:
            group["step"] = step.to(device)

    def _state_keys_for(self, group: dict[str, Any]) -> tuple[str, ...]:
        if group.get("amsgrad", False):
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        return self._state_keys

    # ---- step ----------------------------------------------------------------------------------

    @opaque_to_dynamo  # see FusedOptimizer: compiled code calls the step, never traces it
    @torch.no_grad()
    def step(
        self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None, **kwargs
    ):
        """One step over every group. ``closure`` re-evaluates the model and returns the loss.

        ``grads``, ``output_params``, ``scale`` and ``grad_norms`` are apex's long-removed
        arguments and raise. ``grad_scaler`` (keyword) is apex's capturable protocol; prefer
        ``GradScaler.step(optimizer)``, which sets ``grad_scale``/``found_inf`` instead.
        """
        if any(a is not None for a in (grads, output_params, scale, grad_norms)):
            raise RuntimeError(_LEGACY_STEP_ARGS)
        grad_scaler = kwargs.pop("grad_scaler", None)
        if kwargs:
            raise TypeError(
                f"FusedAdam.step() got an unexpected keyword argument {next(iter(kwargs))!r}"
            )
        loss = self._closure(closure)
        scaling = self._scaling(grad_scaler)
        with self._stepping() as work:
            for index, group, plan, group_grads in work:
                if plan is None:
                    # apex counts a step in every group with params, grads or not (see
                    # _count_idle_group), kept here as an active group's is.
                    if group["params"]:
                        self._advance_step(group, group["params"][0].device, scaling)
                    continue
                self._step_group(index, group, plan, group_grads, scaling)
        return loss

    def _advance_step(self, group, device: torch.device, scaling: Scaling | None):
        """Counts the group's step; returns (step, on_device). Capturable, scaled or already a
        tensor: an int32 device tensor on ``device`` (if it has to be made) counting only the
        steps that were not skipped; else a host int."""
        step = group.get("step", 0)
        if self.capturable or scaling is not None or isinstance(step, torch.Tensor):
            if not isinstance(step, torch.Tensor):
                step = group["step"] = torch.tensor([step], dtype=torch.int32, device=device)
            step.add_(1 if scaling is None else scaling.flags(step.device).keep)
            return step, True
        step = group["step"] = step + 1
        return step, False

    def _step_group(self, index, group, plan, grads, scaling: Scaling | None) -> None:
        beta1, beta2 = group["betas"]
        eps = group["eps"]
        wd = group["weight_decay"]
        bc = bool(group["bias_correction"])
        step, on_device = self._advance_step(group, plan.device, scaling)
        on_device = on_device or isinstance(group["lr"], torch.Tensor)
        if group.get("amsgrad", False):
            for b in plan.buckets:
                self._amsgrad(index, group, b, grads[b.start : b.stop], step, scaling)
            return
        for b in plan.buckets:
            # grads is None when every bucket's C++ plan fetched its own (the usual step after
            # the first): then no per-tensor Python runs and no list crosses into C++.
            g = grads[b.start : b.stop] if grads is not None else None
            m, v = b.state["exp_avg"], b.state["exp_avg_sq"]
            # Master weights take the kernel that steps the masters and writes the params in one
            # pass (30 bytes per bf16 param), also with a host step: its lr and step go to the
            # device as one-element tensors (no sync), instead of a step plus a copy pass.
            if on_device or b.masters is not None:
                flags = scaling.flags(b.device) if scaling is not None else None
                noop = flags.skip if flags is not None else self._device_flags(b.device).zero
                inv = flags.inv if flags is not None else self._device_flags(b.device).one
                lr_t = self._lr_tensor(index, group, b.device)
                step_t = self._step_tensor(step, b.device)
                args = (lr_t, beta1, beta2, eps, step_t, self.adam_w_mode, bc, wd, inv)
                if g is None and b.native.step_capturable(noop, *args):
                    continue
                g = g if g is not None else [p.grad for p in b.params]
                if b.masters is not None:
                    ops.multi_tensor_adam_capturable_master(
                        g, b.params, m, v, b.masters, noop, *args
                    )
                else:
                    ops.multi_tensor_adam_capturable(g, b.params, m, v, noop, *args)
            else:
                noop = self._device_flags(b.device).zero
                args = (group["lr"], beta1, beta2, eps, step, int(self.adam_w_mode), bc, wd)
                if g is None and b.native.step(noop, *args):
                    pass
                else:
                    g = g if g is not None else [p.grad for p in b.params]
                    ops.multi_tensor_adam(g, b.work, m, v, noop, *args)

    def _native_plan(self, group: dict[str, Any], bucket) -> Any:
        if group.get("amsgrad", False):
            return None
        # With master weights the master kernel steps the masters and writes the params (host
        # step or not); without, the host-step or capturable kernel steps the params.
        masters = bucket.masters if bucket.masters is not None else ()
        return ops.adam_plan(
            bucket.params, bucket.work, bucket.state["exp_avg"], bucket.state["exp_avg_sq"], masters
        )

    def _amsgrad(self, index, group, b: Bucket, grads, step, scaling: Scaling | None) -> None:
        """AMSGrad on torch ops, with torch.optim.Adam(amsgrad=True)'s order of operations
        (bit-identical to it for float32 params with a host step)."""
        beta1, beta2 = group["betas"]
        eps, wd, lr = group["eps"], group["weight_decay"], group["lr"]
        m, v, vmax = b.state["exp_avg"], b.state["exp_avg_sq"], b.state["max_exp_avg_sq"]
        low = b.masters is None and b.dtype != torch.float32
        w = [p.float() for p in b.params] if low else list(b.work)
        g = [x.float() for x in grads]
        flags = scaling.flags(b.device) if scaling is not None else None
        if flags is not None and scaling.grad_scale is not None:
            g = torch._foreach_mul(g, flags.inv.reshape(()))
        skip = flags.skip.bool() if flags is not None else None
        if skip is not None:
            # Work on copies, committed below only where no overflow was found.
            w = [t.clone() for t in w]
            m_new, v_new, vmax_new = ([t.clone() for t in ts] for ts in (m, v, vmax))
        else:
            m_new, v_new, vmax_new = m, v, vmax
        device_scalars = isinstance(step, torch.Tensor) or isinstance(lr, torch.Tensor)
        if wd != 0:
            if self.adam_w_mode:
                if device_scalars:
                    lr_t = self._lr_tensor(index, group, b.device)
                    torch._foreach_mul_(w, (1 - lr_t * wd).reshape(()))
                else:
                    torch._foreach_mul_(w, 1 - lr * wd)
            else:
                g = torch._foreach_add(g, w, alpha=wd)
        torch._foreach_lerp_(m_new, g, 1 - beta1)
        torch._foreach_mul_(v_new, beta2)
        torch._foreach_addcmul_(v_new, g, g, 1 - beta2)
        torch._foreach_maximum_(vmax_new, v_new)
        denom = torch._foreach_sqrt(vmax_new)
        if device_scalars:
            st = self._step_tensor(step, b.device).reshape(()).double()
            lr_t = self._lr_tensor(index, group, b.device).reshape(()).double()
            bc1 = 1 - torch.pow(beta1, st) if group["bias_correction"] else torch.ones_like(st)
            bc2 = 1 - torch.pow(beta2, st) if group["bias_correction"] else torch.ones_like(st)
            torch._foreach_div_(denom, bc2.sqrt().float())
            torch._foreach_add_(denom, eps)
            upd = torch._foreach_div(m_new, denom)
            torch._foreach_mul_(upd, (lr_t / bc1).float())
            torch._foreach_sub_(w, upd)
        else:
            bc1 = 1 - beta1**step if group["bias_correction"] else 1.0
            bc2 = 1 - beta2**step if group["bias_correction"] else 1.0
            torch._foreach_div_(denom, bc2**0.5)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(w, m_new, denom, -(lr / bc1))
        if skip is not None:
            for dst, new in zip(m, m_new):
                dst.copy_(torch.where(skip, dst, new))
            for dst, new in zip(v, v_new):
                dst.copy_(torch.where(skip, dst, new))
            for dst, new in zip(vmax, vmax_new):
                dst.copy_(torch.where(skip, dst, new))
            targets = b.work if not low else b.params
            for dst, new in zip(targets, w):
                dst.copy_(torch.where(skip, dst, new.to(dst.dtype)))
        elif low:
            for p, new in zip(b.params, w):
                p.copy_(new)
        if b.masters is not None:
            self._copy_masters(b)

    # ---- state_dict ----------------------------------------------------------------------------

    def _normalize_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        groups = state_dict["param_groups"]
        if any("step" not in g for g in groups) and _has_param_steps(state_dict):
            return torch_state_to_fused_adam(state_dict)
        return state_dict

    def _after_load_group(self, group: dict[str, Any]) -> None:
        if self.capturable:
            self._make_capturable(group)
        else:
            device = group_device(group)
            step = group.get("step")
            if isinstance(step, torch.Tensor) and device is not None and step.device != device:
                group["step"] = step.to(device)


# ---- checkpoint conversion -----------------------------------------------------------------------

# Group keys torch.optim.Adam/AdamW add and FusedAdam has no use for.
_TORCH_ONLY_KEYS = (
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
)


def _has_param_steps(state_dict: dict[str, Any]) -> bool:
    return any("step" in s for s in state_dict["state"].values())


def _as_int(step) -> int:
    if isinstance(step, torch.Tensor):
        return int(step.detach().reshape(-1)[0].item())
    return int(step)


def torch_state_to_fused_adam(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A torch.optim.Adam/AdamW ``state_dict`` in FusedAdam's (apex's) layout.

    Each group's ``step`` becomes the largest per-param ``step`` of its params (they agree
    unless some params skipped steps without a grad); per-param steps are dropped; moments are
    kept as they are (``max_exp_avg_sq`` too, for ``amsgrad``); torch-only group keys
    (``maximize``, ``foreach``, ``fused``, ...) are dropped and ``bias_correction=True`` is
    added. Raises ValueError for ``maximize=True``, which FusedAdam cannot do. The input is
    not modified. ``FusedAdam.load_state_dict`` applies this itself when it sees torch's layout.
    """
    state = {k: dict(v) for k, v in state_dict["state"].items()}
    groups = []
    for j, saved in enumerate(state_dict["param_groups"]):
        group = {k: v for k, v in saved.items() if k not in _TORCH_ONLY_KEYS}
        if saved.get("maximize", False):
            raise ValueError(f"param group {j} has maximize=True, which FusedAdam does not support")
        steps = [_as_int(state[i]["step"]) for i in saved["params"] if "step" in state.get(i, {})]
        if "step" not in group:
            group["step"] = max(steps) if steps else 0
        if len(set(steps)) > 1:
            warnings.warn(
                f"param group {j}: its params have different step counts {sorted(set(steps))}; "
                f"FusedAdam keeps one per group and takes the largest, {max(steps)}",
                stacklevel=2,
            )
        group.setdefault("bias_correction", True)
        group.setdefault("amsgrad", False)
        groups.append(group)
        for i in saved["params"]:
            state.get(i, {}).pop("step", None)
    out = dict(state_dict)
    out["state"] = state
    out["param_groups"] = groups
    return out


def fused_adam_state_to_torch(
    state_dict: dict[str, Any], *, adam_w_mode: bool = True, capturable: bool = False
) -> dict[str, Any]:
    """A FusedAdam ``state_dict`` in torch.optim.AdamW's layout (torch.optim.Adam's with
    ``adam_w_mode=False``), for ``torch.optim.AdamW(params).load_state_dict(...)``.

    Every param with state gets the group's ``step`` as its own (a float32 tensor, on the CPU
    unless ``capturable``, as torch keeps it); fp32 masters (``master_param``) are dropped (torch
    steps the params themselves: load the masters into the model first if it is low precision);
    ``bias_correction`` is dropped, and ``False`` raises ValueError (torch always corrects);
    torch's own group keys get torch's defaults. The input is not modified.
    """
    state = {}
    groups = []
    for j, saved in enumerate(state_dict["param_groups"]):
        if not saved.get("bias_correction", True):
            raise ValueError(
                f"param group {j} has bias_correction=False, which torch.optim.Adam/AdamW cannot "
                "represent"
            )
        step = saved.get("step", 0)
        step_value = float(_as_int(step)) if step is not None else 0.0
        group = {k: v for k, v in saved.items() if k not in ("step", "bias_correction")}
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor) and not capturable:
            group["lr"] = float(lr.detach().reshape(-1)[0].item())
        group.setdefault("amsgrad", False)
        group.update(
            maximize=False,
            foreach=None,
            capturable=bool(capturable),
            differentiable=False,
            fused=None,
        )
        if torch.optim.AdamW.__mro__[1] is torch.optim.Adam:  # torch >= 2.6: AdamW is an Adam
            group["decoupled_weight_decay"] = bool(adam_w_mode)
        groups.append(group)
        for i in saved["params"]:
            if i not in state_dict["state"]:
                continue
            entry = {k: v for k, v in state_dict["state"][i].items() if k != MASTER_KEY}
            device = entry["exp_avg"].device if capturable and "exp_avg" in entry else "cpu"
            entry["step"] = torch.tensor(step_value, dtype=torch.float32, device=device)
            state[i] = entry
    out = dict(state_dict)
    out["state"] = state
    out["param_groups"] = groups
    return out
