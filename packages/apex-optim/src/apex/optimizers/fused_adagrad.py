"""FusedAdagrad: apex's multi-tensor Adagrad, on apex_mta's adagrad kernel."""

from __future__ import annotations

from typing import Any

import torch

import amp_C
from apex.multi_tensor_apply import ops

from ._base import FusedOptimizer, check_eps, check_lr, check_nonneg, opaque_to_dynamo

__all__ = ["FusedAdagrad"]


class FusedAdagrad(FusedOptimizer):
    """Adagrad in a few multi-tensor kernel launches per step (apex.optimizers.FusedAdagrad).

    The constructor is apex's, positional order included. ``adagrad_w_mode=False`` (the default)
    adds ``weight_decay * p`` to the grad (torch.optim.Adagrad with ``lr_decay=0`` and
    ``initial_accumulator_value=0``); True decays the param directly. The state is ``sum``, in
    the param's dtype (float32 with master weights). Params may be float32, float16 or bfloat16.

    Beyond apex: ``master_weights=True`` (float32 masters of fp16/bf16 params, state key
    ``master_param``, in ``state_dict``); ``zero_grad(set_to_none=...)``; ``foreach=``/``fused=``
    accepted and ignored. The kernel cannot skip a step on the device, so under a
    torch.amp.GradScaler the scaler unscales the grads and skips overflowing steps itself, as for
    any optimizer.
    """

    _state_keys = ("sum",)
    _sparse_hint = " (torch.optim.Adagrad does)"

    def __init__(
        self,
        params,
        lr=1e-2,
        eps=1e-10,
        weight_decay=0.0,
        set_grad_none=True,
        adagrad_w_mode=False,
        *,
        master_weights=False,
        foreach=None,
        fused=None,
    ):
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay)
        self.adagrad_w_mode = 1 if adagrad_w_mode else 0
        super().__init__(
            params,
            defaults,
            set_grad_none=set_grad_none,
            master_weights=master_weights,
            foreach=foreach,
            fused=fused,
        )
        self.multi_tensor_adagrad = amp_C.multi_tensor_adagrad

    def _check_hyper(self, where: str, group: dict[str, Any]) -> None:
        check_lr(where, group["lr"])
        check_eps(where, group["eps"])
        check_nonneg(where, "weight_decay", group["weight_decay"])

    @opaque_to_dynamo  # see FusedOptimizer: compiled code calls the step, never traces it
    @torch.no_grad()
    def step(self, closure=None):
        """One Adagrad step over every group; ``closure`` re-evaluates the model, returns the loss."""
        loss = self._closure(closure)
        for _, group, plan, grads in self._prepare():
            if plan is None:
                continue
            for b in plan.buckets:
                ops.multi_tensor_adagrad(
                    grads[b.start : b.stop],
                    b.work,
                    b.state["sum"],
                    self._device_flags(b.device).zero,
                    group["lr"],
                    group["eps"],
                    self.adagrad_w_mode,
                    group["weight_decay"],
                )
                if b.masters is not None:
                    self._copy_masters(b)
        self._end_step()
        return loss
