"""FusedNovoGrad: apex's multi-tensor NovoGrad, on apex_mta's novograd kernel."""

from __future__ import annotations

from typing import Any

import torch

import amp_C
from apex.multi_tensor_apply import ops

from ._base import FusedOptimizer, check_betas, check_eps, check_lr, check_nonneg, opaque_to_dynamo

__all__ = ["FusedNovoGrad"]

# group['exp_avg_sq'] holds one float32 tensor of per-param grad norms per dtype, in apex's order
# [float16, float32]; bfloat16 (which apex did not take) adds a third entry.
_NORM_SLOT = {torch.float16: 0, torch.float32: 1, torch.bfloat16: 2}


class FusedNovoGrad(FusedOptimizer):
    """NovoGrad (layer-wise second moments) in a few multi-tensor kernel launches per step
    (apex.optimizers.FusedNovoGrad).

    The constructor is apex's, positional order included. ``reg_inside_moment=False`` (the
    default) decouples the weight decay from the moment; ``norm_type`` 2 blends L2 grad norms,
    0 infinity norms; ``init_zero=False`` starts the norms at the first step's (so that step's
    blend has no effect), computed on the device (apex read each one on the host).

    State as in apex: ``exp_avg`` per param (the param's dtype, float32 with master weights),
    and per group ``group['step']`` and ``group['exp_avg_sq'] = [fp16 norms, fp32 norms]``
    (+ ``bf16 norms``), one float32 norm per param with a grad, in ``param_groups`` and so in
    ``state_dict``. The set of params with a grad must stay the same from step to step. Every
    param of a group must be on one device.

    Beyond apex: bfloat16 params; ``master_weights=True`` (float32 masters of fp16/bf16 params,
    state key ``master_param``, in ``state_dict``); ``zero_grad(set_to_none=...)``;
    ``foreach=``/``fused=`` accepted and ignored. The kernel cannot skip a step on the device,
    so under a torch.amp.GradScaler the scaler unscales and skips as for any optimizer.
    """

    _state_keys = ("exp_avg",)
    _group_single_device = True

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        reg_inside_moment=False,
        grad_averaging=True,
        norm_type=2,
        init_zero=False,
        set_grad_none=True,
        *,
        master_weights=False,
        foreach=None,
        fused=None,
    ):
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant.")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            norm_type=norm_type,
            init_zero=init_zero,
        )
        self.moment_mode = 0 if reg_inside_moment else 1
        super().__init__(
            params,
            defaults,
            set_grad_none=set_grad_none,
            master_weights=master_weights,
            foreach=foreach,
            fused=fused,
        )
        self.multi_tensor_novograd = amp_C.multi_tensor_novograd

    def _check_hyper(self, where: str, group: dict[str, Any]) -> None:
        check_lr(where, group["lr"])
        check_betas(where, group["betas"])
        check_eps(where, group["eps"])
        check_nonneg(where, "weight_decay", group["weight_decay"])
        if group["norm_type"] not in (0, 2):
            raise ValueError(
                f"{where}: invalid norm_type={group['norm_type']!r} (FusedNovoGrad supports 2, the "
                "L2 norm, and 0, the infinity norm)"
            )

    def _order_buckets(self, order: dict) -> None:
        items = sorted(order.items(), key=lambda kv: _NORM_SLOT[kv[0][1]])
        order.clear()
        order.update(items)

    def _first_norms(self, grads, norm_type: int, device) -> torch.Tensor:
        """The norm of each grad, float32 on the device (no host sync)."""
        if not grads:
            return torch.zeros(0, device=device)
        if norm_type == 2:
            flag = self._device_flags(device).scratch
            return ops.multi_tensor_l2norm(grads, flag, True)[1].clone()
        return torch.stack(
            [
                g.detach().abs().amax().float() if g.numel() else torch.zeros((), device=device)
                for g in grads
            ]
        )

    @opaque_to_dynamo  # see FusedOptimizer: compiled code calls the step, never traces it
    @torch.no_grad()
    def step(self, closure=None):
        """One NovoGrad step over every group; ``closure`` re-evaluates the model, returns the loss."""
        loss = self._closure(closure)
        work = self._prepare()
        for index, group, plan, _ in work:  # every check before the first kernel
            norms = group.get("exp_avg_sq") or ()
            for b in plan.buckets if plan is not None else ():
                slot = _NORM_SLOT[b.dtype]
                n = b.stop - b.start
                if slot < len(norms) and norms[slot] is not None and norms[slot].numel() != n:
                    raise RuntimeError(
                        f"FusedNovoGrad: param group {index}: {n} {b.dtype} params have a grad "
                        f"but the group keeps {norms[slot].numel()} grad norms for them; the set of "
                        "params with a grad must not change between steps"
                    )
        for _, group, plan, grads in work:
            if plan is None:
                self._count_idle_group(group)
                continue
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            norms = group.get("exp_avg_sq")
            if norms is None:
                norms = group["exp_avg_sq"] = [None, None]
            for b in plan.buckets:
                g = grads[b.start : b.stop]
                slot = _NORM_SLOT[b.dtype]
                while len(norms) <= slot:
                    norms.append(None)
                if norms[slot] is None:
                    norms[slot] = (
                        torch.zeros(len(g), device=b.device)
                        if group["init_zero"]
                        else self._first_norms(g, group["norm_type"], b.device)
                    )
                ops.multi_tensor_novograd(
                    g,
                    b.work,
                    b.state["exp_avg"],
                    self._device_flags(b.device).scratch,
                    norms[slot],
                    group["lr"],
                    beta1,
                    beta2,
                    group["eps"],
                    group["step"],
                    bool(group["bias_correction"]),
                    group["weight_decay"],
                    bool(group["grad_averaging"]),
                    self.moment_mode,
                    group["norm_type"],
                )
                if b.masters is not None:
                    self._copy_masters(b)
            for slot in (0, 1):  # apex's two entries exist from the first step on
                if norms[slot] is None:
                    norms[slot] = torch.zeros(0, device=plan.device)
        self._end_step()
        return loss

    def _after_load_group(self, group: dict[str, Any]) -> None:
        norms = group.get("exp_avg_sq")
        device = next((p.device for p in group["params"]), None)
        if norms is not None and device is not None:
            group["exp_avg_sq"] = [
                n.to(device=device, dtype=torch.float32) if isinstance(n, torch.Tensor) else n
                for n in norms
            ]
