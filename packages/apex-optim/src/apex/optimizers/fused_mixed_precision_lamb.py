"""FusedMixedPrecisionLamb: apex's sync-free LAMB for reduced-precision params, on apex_mta's
lamb_mp kernel."""

from __future__ import annotations

from typing import Any

import torch

import amp_C
from apex.multi_tensor_apply import ops

from ._base import (
    LOW_PRECISION,
    FusedOptimizer,
    check_betas,
    check_eps,
    check_lr,
    check_nonneg,
    opaque_to_dynamo,
)

__all__ = ["FusedMixedPrecisionLamb"]

_TENSOR_DEFAULTS = ("lr", "step")


class FusedMixedPrecisionLamb(FusedOptimizer):
    """LAMB without host syncs, for reduced-precision training
    (apex.optimizers.FusedMixedPrecisionLamb).

    The constructor is apex's, positional order included; FusedLAMB's algorithm, with
    ``group['lr']`` (float32, 0-dim as apex's) and ``group['step']`` (int32, one element, from
    ``step=``) kept as tensors on the params' device, so nothing is read on the host. Params whose dtype is
    ``reduced_precision_dtype`` (e.g. ``torch.bfloat16``) are stepped through float32 masters
    (apex's ``param_groups_full_precision``), created on the first step so that a model
    broadcast after the optimizer was built is respected; their ``exp_avg``/``exp_avg_sq`` are
    float32, other params' have the param's dtype. Every param must be on one device.

    The optimizer takes part in torch.amp.GradScaler's fused-optimizer protocol
    (``_step_supports_amp_scaling``): ``scaler.step(opt)`` hands it the scale and the overflow
    flag; the global norm and ``max_grad_norm`` are both taken on the scaled grads, the grads
    are unscaled inside the kernel, and an overflow (or a non-finite grad norm, scaler or not)
    skips the step on the device, ``group['step']`` included. apex's ``step(grad_scaler=...)``
    still works.

    Beyond apex: the fp32 masters are saved in ``state_dict`` (state key ``master_param``) and
    restored; ``master_weights=True`` gives masters to every fp16/bf16 param whatever
    ``reduced_precision_dtype``; params of different dtypes may share a group;
    ``zero_grad(set_to_none=...)``; ``foreach=``/``fused=`` accepted and ignored.
    """

    _state_keys = ("exp_avg", "exp_avg_sq")
    _single_device = True
    _supports_amp_scaling = True

    def __init__(
        self,
        params,
        lr=1e-3,
        step=0,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.01,
        amsgrad=False,
        adam_w_mode=True,
        grad_averaging=True,
        max_grad_norm=1.0,
        use_nvlamb=False,
        reduced_precision_dtype=None,
        *,
        master_weights=False,
        foreach=None,
        fused=None,
    ):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        if reduced_precision_dtype is not None and reduced_precision_dtype not in LOW_PRECISION:
            raise TypeError(
                f"FusedMixedPrecisionLamb: reduced_precision_dtype must be torch.float16 or "
                f"torch.bfloat16 (or None), got {reduced_precision_dtype}"
            )
        defaults = dict(
            lr=torch.tensor(lr, dtype=torch.float32),
            step=torch.tensor([step], dtype=torch.int32),
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
        )
        self.reduced_precision_dtype = reduced_precision_dtype
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb
        self._device = None
        super().__init__(
            params,
            defaults,
            set_grad_none=None,
            master_weights=master_weights,
            foreach=foreach,
            fused=fused,
        )
        self.multi_tensor_l2norm = amp_C.multi_tensor_l2norm_mp
        self.multi_tensor_lamb = amp_C.multi_tensor_lamb_mp

    # ---- groups --------------------------------------------------------------------------------

    def _check_hyper(self, where: str, group: dict[str, Any]) -> None:
        check_lr(where, group["lr"])
        check_betas(where, group["betas"])
        check_eps(where, group["eps"])
        check_nonneg(where, "weight_decay", group["weight_decay"])
        check_nonneg(where, "max_grad_norm", group["max_grad_norm"])

    def _single_device_reason(self) -> str:
        return " (its global grad norm and device-side lr and step)"

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        super()._check_group(index, group)
        self._place_tensors(group)

    def _place_tensors(self, group: dict[str, Any]) -> None:
        """lr and step as this group's own tensors on the params' device (torch's
        add_param_group would share the defaults' tensors between groups), in apex's shapes: lr
        0-dim (so `f"{group['lr']:.2e}"` in a logger works), step one element."""
        first = self._first_param()
        device = first.device if first is not None else torch.device("cpu")
        dtypes = {"lr": torch.float32, "step": torch.int32}
        for key in _TENSOR_DEFAULTS:
            value = group[key]
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value if key == "lr" else [value], dtype=dtypes[key])
            elif value is self.defaults[key]:
                value = value.clone()
            if key == "step" and value.dim() == 0:
                value = value.reshape(1)
            elif key == "lr" and value.dim() != 0 and value.numel() == 1:
                value = value.reshape(())  # a one-element lr (older checkpoints, a user's) too
            group[key] = value.to(device)

    def _uses_master(self, p: torch.Tensor) -> bool:
        if self.reduced_precision_dtype is not None and p.dtype == self.reduced_precision_dtype:
            return True
        return self.master_weights and p.dtype in LOW_PRECISION

    @property
    def param_groups_full_precision(self) -> list[dict[str, list]]:
        """apex's fp32 masters per group, in param order: the master of each param stepped through
        one (created now if no step has created it yet, outside ``self.state``, as
        param_groups_master's), None for the others."""
        return [
            {"params": [self._master_of(p) if self._uses_master(p) else None for p in g["params"]]}
            for g in self.param_groups
        ]

    def _after_load_group(self, group: dict[str, Any]) -> None:
        for key in _TENSOR_DEFAULTS:
            if isinstance(group.get(key), torch.Tensor) and group[key] is self.defaults[key]:
                group[key] = group[key].clone()
        self._place_tensors(group)

    # ---- step ----------------------------------------------------------------------------------

    @opaque_to_dynamo  # see FusedOptimizer: compiled code calls the step, never traces it
    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """One LAMB step over every group, without a host sync; ``closure`` re-evaluates the
        model and returns the loss. ``grad_scaler`` (keyword) is apex's protocol; prefer
        ``GradScaler.step(optimizer)``."""
        grad_scaler = kwargs.pop("grad_scaler", None)
        if kwargs:
            raise TypeError(
                f"FusedMixedPrecisionLamb.step() got an unexpected keyword argument "
                f"{next(iter(kwargs))!r}"
            )
        loss = self._closure(closure)
        scaling = self._scaling(grad_scaler)
        work, idle = [], []
        for index, group, plan, grads in self._prepare():
            if plan is not None:
                work.append((index, group, plan, grads))
            elif group["params"]:
                idle.append(group)  # apex counts its step too (below)
        if not work:
            for group in idle:
                self._count_idle_group(group)
            self._end_step()
            return loss
        device = work[0][2].device
        f = self._device_flags(device)
        if scaling is not None:
            flags = scaling.flags(device)  # f.skip now holds found_inf
            inv = flags.inv
            scale = scaling.grad_scale
            scale = f.one if scale is None else torch.as_tensor(scale).to(device).reshape(1)
        else:
            f.skip.zero_()
            inv, scale = f.one, f.one
        noop = f.skip  # read and raised by the norm and the kernel: one overflow skips the rest
        found = torch.zeros(1, device=device)  # already folded into noop
        # The norm is of the scaled grads, so max_grad_norm is scaled too.
        max_grad_norm = scale.float() * self.defaults["max_grad_norm"]
        all_grads = [g for *_, grads in work for g in grads]
        grad_norm = ops.multi_tensor_l2norm_mp(all_grads, noop, False)[0]
        if idle:  # as apex: every group's step counts the steps not skipped
            counted = noop.eq(0)
            for group in idle:
                group["step"].add_(counted.to(group["step"].device, group["step"].dtype))
        for index, group, plan, grads in work:
            step = group["step"]
            step.add_(noop.eq(0).to(step.dtype))
            beta1, beta2 = group["betas"]
            lr = self._lr_tensor(index, group, device)
            for b in plan.buckets:
                ops.multi_tensor_lamb_mp(
                    grads[b.start : b.stop],
                    b.work,
                    b.state["exp_avg"],
                    b.state["exp_avg_sq"],
                    b.params if b.masters is not None else [],
                    noop,
                    lr,
                    beta1,
                    beta2,
                    group["eps"],
                    step,
                    bool(group["bias_correction"]),
                    group["weight_decay"],
                    bool(group["grad_averaging"]),
                    self.adam_w_mode,
                    grad_norm,
                    max_grad_norm,
                    bool(self.use_nvlamb),
                    found,
                    inv,
                )
        self._end_step()
        return loss
