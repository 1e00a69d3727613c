"""FusedLAMB: apex's multi-tensor LAMB, on apex_mta's lamb kernel."""

from __future__ import annotations

import operator
from typing import Any

import torch

import amp_C
from apex.multi_tensor_apply import ops

from ._base import FusedOptimizer, check_betas, check_eps, check_lr, check_nonneg, opaque_to_dynamo

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

    Each bucket's lists are held by a plan (ops.lamb_plan, in C++ on the GPU) from the second
    step on: a step then fetches the grads in C++, with no Python per tensor and no list
    conversion, and gives the same bits as the list path it falls back to whenever a param
    gains or loses a grad.
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
        self._norm_cache = None  # (the groups' plans, the plan of their global grad norm)
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

    # ---- step ----------------------------------------------------------------------------------

    @opaque_to_dynamo  # see FusedOptimizer: compiled code calls the step, never traces it
    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB step over every group; ``closure`` re-evaluates the model, returns the loss."""
        loss = self._closure(closure)
        work = []
        native = True  # every group's buckets fetched their grads in C++ (grads is None)
        for _, group, plan, grads in self._prepare():
            if plan is not None:
                work.append((group, plan, grads))
                native = native and grads is None
            else:
                self._count_idle_group(group)
        if work:
            flag = self._device_flags(work[0][1].device).scratch
            if not (native and self._step_native(work, flag)):
                self._step_lists(work, flag)
        self._end_step()
        return loss

    def _step_native(self, work, flag) -> bool:
        """The step through each bucket's cached plan (ops.lamb_plan): no Python per tensor, no
        list conversion. A single bucket takes the global grad norm of its own grads in the same
        call; several take it from a plan of every live param, in the list path's order. The
        same kernels on the same lists as _step_lists: the same bits. False (nothing run, every
        grad released): tensor lr or step, which the plan does not take."""
        if any(isinstance(g["lr"], torch.Tensor) or isinstance(g.get("step"), torch.Tensor)
               for g, _, _ in work):  # fmt: skip
            self._release(work)
            return False
        try:
            gnorm = None
            if len(work) > 1 or len(work[0][1].buckets) > 1:
                gnorm = self._norm_plan(work).grad_norm(flag)
                if gnorm is None:  # a grad vanished between the fetches: cannot happen
                    raise RuntimeError(f"{self._name}: a grad was lost during the step")
            for group, plan, _ in work:
                group["step"] = group.get("step", 0) + 1
                args = self._lamb_args(group, gnorm)
                for b in plan.buckets:
                    if not b.native.step(flag, *args):  # fetched above: cannot happen
                        raise RuntimeError(f"{self._name}: a grad was lost during the step")
        except BaseException:
            self._release(work)  # no plan keeps a grad past the step
            raise
        return True

    def _lamb_args(self, group: dict[str, Any], global_grad_norm) -> tuple:
        """multi_tensor_lamb's hyper-parameters after its lists and flag, in its order (a plan's
        step takes the same): the group's, with its step already counted."""
        beta1, beta2 = group["betas"]
        return (
            group["lr"], beta1, beta2, group["eps"], group["step"],
            bool(group["bias_correction"]), group["weight_decay"], bool(group["grad_averaging"]),
            self.adam_w_mode, global_grad_norm, self.defaults["max_grad_norm"],
            bool(self.use_nvlamb),
        )  # fmt: skip

    def _norm_plan(self, work):
        """A plan of every live param of ``work`` for the global grad norm, rebuilt whenever a
        group's plan is."""
        plans = tuple(plan for _, plan, _ in work)
        cached = self._norm_cache
        if (
            cached is None
            or len(cached[0]) != len(plans)
            or not all(map(operator.is_, cached[0], plans))
        ):
            params = [p for plan in plans for p in plan.live]
            cached = self._norm_cache = (plans, ops.lamb_plan(params, (), (), ()))
        return cached[1]

    def _step_lists(self, work, flag) -> None:
        """The step on Python lists of grads (the first step after a plan is built, a param
        that lost its grad, no plan at all)."""
        all_grads = []
        for i, (group, plan, grads) in enumerate(work):
            if grads is None:  # fetched by the plans, which this path does not use
                self._release(work[i : i + 1])
                grads = [p.grad for p in plan.live]
                work[i] = (group, plan, grads)
            all_grads.extend(grads)
        global_grad_norm = ops.multi_tensor_l2norm(all_grads, flag, False)[0]
        for group, plan, grads in work:
            group["step"] = group.get("step", 0) + 1
            args = self._lamb_args(group, global_grad_norm)
            for b in plan.buckets:
                ops.multi_tensor_lamb(
                    grads[b.start : b.stop],
                    b.work,
                    b.state["exp_avg"],
                    b.state["exp_avg_sq"],
                    flag,
                    *args,
                )
                if b.masters is not None:
                    self._copy_masters(b)

    def _native_plan(self, group: dict[str, Any], bucket):
        lamb_plan = getattr(ops, "lamb_plan", None)  # apex-mta-kernels >= 0.1.2
        if lamb_plan is None:
            return None
        copies = bucket.params if bucket.masters is not None else ()
        return lamb_plan(
            bucket.params, bucket.work, bucket.state["exp_avg"], bucket.state["exp_avg_sq"], copies
        )

    # ---- plans ---------------------------------------------------------------------------------

    def _begin_step(self) -> None:
        super()._begin_step()
        if not self._plans:
            self._norm_cache = None  # it holds the old plans, and through them the old state

    def _invalidate(self) -> None:
        super()._invalidate()
        self._norm_cache = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_norm_cache", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._norm_cache = None
