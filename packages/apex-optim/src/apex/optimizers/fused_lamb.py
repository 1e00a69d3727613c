"""FusedLAMB: apex's multi-tensor LAMB, on apex_mta's lamb kernel."""

from __future__ import annotations

from typing import Any

import torch

import amp_C
from apex.multi_tensor_apply import ops

from ._base import FusedOptimizer, check_betas, check_eps, check_lr, check_nonneg

__all__ = ["FusedLAMB"]


class FusedLAMB(FusedOptimizer):
    """LAMB (layer-wise adaptive moments) in a few multi-tensor kernel launches per step
    (apex.optimizers.FusedLAMB).

    The constructor is apex's, positional order included. Each step clips the grads by their
    global L2 norm over every group (``max_grad_norm``, read from the constructor's defaults as
    apex does), takes an Adam-style update (``adam_w_mode=True``, the default: decoupled weight
    decay; False: L2) and scales it per tensor by the trust ratio ``||p|| / ||update||`` where
    ``weight_decay != 0`` or ``use_nvlamb``. As in apex the update overwrites ``p.grad``, the
    step counter is per group (``group['step']``) and ``exp_avg``/``exp_avg_sq`` have the
    param's dtype (float32 with master weights). Every param must be on one device.

    Beyond apex: bfloat16 params; ``master_weights=True`` (float32 masters of fp16/bf16 params,
    state key ``master_param``, in ``state_dict``); ``zero_grad(set_to_none=...)``;
    ``foreach=``/``fused=`` accepted and ignored. The kernel cannot skip a step on the device, so
    under a torch.amp.GradScaler the scaler unscales and skips as for any optimizer
    (FusedMixedPrecisionLamb takes part in GradScaler's fused protocol).
    """

    _state_keys = ("exp_avg", "exp_avg_sq")
    _single_device = True

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.01,
        amsgrad=False,
        adam_w_mode=True,
        grad_averaging=True,
        set_grad_none=True,
        max_grad_norm=1.0,
        use_nvlamb=False,
        *,
        master_weights=False,
        foreach=None,
        fused=None,
    ):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
        )
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb
        super().__init__(
            params,
            defaults,
            set_grad_none=set_grad_none,
            master_weights=master_weights,
            foreach=foreach,
            fused=fused,
        )
        self.multi_tensor_l2norm = amp_C.multi_tensor_l2norm
        self.multi_tensor_lamb = amp_C.multi_tensor_lamb

    def _check_hyper(self, where: str, group: dict[str, Any]) -> None:
        check_lr(where, group["lr"])
        check_betas(where, group["betas"])
        check_eps(where, group["eps"])
        check_nonneg(where, "weight_decay", group["weight_decay"])
        check_nonneg(where, "max_grad_norm", group["max_grad_norm"])

    def _single_device_reason(self) -> str:
        return " (its global grad norm)"

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB step over every group; ``closure`` re-evaluates the model, returns the loss."""
        loss = self._closure(closure)
        self._begin_step()
        work = []
        for index, group in enumerate(self.param_groups):
            plan, grads = self._plan(index, group)
            if plan is not None:
                work.append((group, plan, grads))
        if work:
            device = work[0][1].device
            flag = self._device_flags(device).scratch
            all_grads = [g for _, _, grads in work for g in grads]
            global_grad_norm = ops.multi_tensor_l2norm(all_grads, flag, False)[0]
            max_grad_norm = self.defaults["max_grad_norm"]
            for group, plan, grads in work:
                group["step"] = group.get("step", 0) + 1
                beta1, beta2 = group["betas"]
                for b in plan.buckets:
                    ops.multi_tensor_lamb(
                        grads[b.start : b.stop],
                        b.work,
                        b.state["exp_avg"],
                        b.state["exp_avg_sq"],
                        flag,
                        group["lr"],
                        beta1,
                        beta2,
                        group["eps"],
                        group["step"],
                        bool(group["bias_correction"]),
                        group["weight_decay"],
                        bool(group["grad_averaging"]),
                        self.adam_w_mode,
                        global_grad_norm,
                        max_grad_norm,
                        bool(self.use_nvlamb),
                    )
                    if b.masters is not None:
                        self._copy_masters(b)
        self._end_step()
        return loss
