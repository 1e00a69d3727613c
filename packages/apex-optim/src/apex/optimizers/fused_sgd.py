"""FusedSGD: apex's multi-tensor SGD, on apex_mta's sgd kernel."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import required

import amp_C
from apex.multi_tensor_apply import multi_tensor_applier, ops

from ._base import Bucket, FusedOptimizer, Scaling, check_lr, check_nonneg, opaque_to_dynamo

__all__ = ["FusedSGD"]

_foreach_copy_ = getattr(torch, "_foreach_copy_", None)


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if _foreach_copy_ is not None and all(d.dtype == s.dtype for d, s in zip(dst, src)):
        _foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)


class FusedSGD(FusedOptimizer):
    """SGD with momentum in a few multi-tensor kernel launches per step
    (apex.optimizers.FusedSGD).

    The constructor is apex's, positional order included, with torch.optim.SGD's semantics
    (momentum, dampening, Nesterov, L2 weight decay) plus ``wd_after_momentum`` (weight decay
    added after the momentum instead of before). Params may be float32, float16 or bfloat16
    (apex silently skipped bf16 params); ``momentum_buffer`` has the param's dtype, float32 with
    master weights, and exists only where ``momentum != 0``.

    Beyond apex:

    - ``master_weights=True``: float32 masters of fp16/bf16 params (state key
      ``master_param``, in ``state_dict``), updated by the kernel, which writes the rounded
      params in the same pass;
    - ``capturable=True``: ``group['lr']`` is a float32 device tensor read on the device, so the
      step can be captured in a CUDA graph (that path runs on torch's foreach ops);
    - torch.amp.GradScaler's fused-optimizer protocol, without a host sync: an overflow leaves
      params and momenta untouched (the kernel skips on the device); the grads are unscaled in
      place (float16 grads into float32 copies, so small grads do not underflow);
    - ``zero_grad(set_to_none=...)``; ``foreach=``/``fused=`` accepted and ignored.

    ``set_grad_none`` defaults to False, as in apex, where it then called ``Optimizer.zero_grad()``:
    since torch 2.0 that drops the grads, and so does ``zero_grad()`` here.
    apex amp's attributes are kept: ``most_recent_scale`` (grads are multiplied by its inverse;
    reset to 1 after each step), ``scale_set_by_backward``, and the O2 path through
    ``_amp_stash`` (fp32 masters held by amp).
    """

    _state_keys = ("momentum_buffer",)
    _supports_amp_scaling = True
    _sparse_hint = " (torch.optim.SGD does)"

    def __init__(
        self,
        params,
        lr=required,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        wd_after_momentum=False,
        materialize_master_grads=True,
        set_grad_none=False,
        *,
        capturable=False,
        master_weights=False,
        foreach=None,
        fused=None,
    ):
        self.capturable = bool(capturable)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        super().__init__(
            params,
            defaults,
            set_grad_none=set_grad_none,
            master_weights=master_weights,
            foreach=foreach,
            fused=fused,
        )
        self.multi_tensor_sgd = amp_C.multi_tensor_sgd

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    # ---- groups --------------------------------------------------------------------------------

    def _check_hyper(self, where: str, group: dict[str, Any]) -> None:
        check_lr(where, group["lr"])
        check_nonneg(where, "momentum", group["momentum"])
        check_nonneg(where, "weight_decay", group["weight_decay"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"{where}: Nesterov momentum requires a momentum and zero dampening")

    @property
    def _group_single_device(self) -> bool:
        return self.capturable

    def _single_device_reason(self) -> str:
        return " with capturable=True (lr lives on the group's device)"

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        super()._check_group(index, group)
        if self.capturable:
            self._make_capturable(group)

    def _after_load_group(self, group: dict[str, Any]) -> None:
        if self.capturable:
            self._make_capturable(group)

    def _state_keys_for(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._state_keys if group["momentum"] != 0 else ()

    # ---- apex's helper -------------------------------------------------------------------------

    def get_momentums(self, params):
        """apex's helper: the momentum buffers of ``params`` (created as zeros where missing) and
        whether this is their first run (the last one was just created)."""
        momentums = []
        first_run = True
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                first_run = True
                buf = state["momentum_buffer"] = torch.zeros_like(p)
            else:
                first_run = False
                buf = state["momentum_buffer"]
            momentums.append(buf)
        return momentums, first_run

    # ---- step ----------------------------------------------------------------------------------

    @opaque_to_dynamo  # see FusedOptimizer: compiled code calls the step, never traces it
    @torch.no_grad()
    def step(self, closure=None):
        """One SGD step over every group; ``closure`` re-evaluates the model, returns the loss."""
        loss = self._closure(closure)
        stash = getattr(self, "_amp_stash", None)
        if stash is not None and hasattr(stash, "fp32_from_fp16_groups"):
            self._step_amp_stash(stash)
        else:
            scaling = self._scaling()
            with self._stepping() as work:
                for index, group, plan, grads in work:
                    if plan is None:
                        continue
                    for b in plan.buckets:
                        # grads is None when every bucket's C++ plan fetched its own (see
                        # FusedAdam).
                        g = grads[b.start : b.stop] if grads is not None else None
                        if self.capturable:
                            self._step_tensors(index, group, b, g, scaling)
                        else:
                            self._step_kernel(group, b, g, scaling)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss

    def _unscaled(self, grads, flags, scaling: Scaling):
        """The grads divided by the GradScaler's scale, on the device: in place for float32 and
        bfloat16 grads (as GradScaler.unscale_ does), float32 copies of float16 grads."""
        if scaling.grad_scale is None:
            return grads
        if grads and grads[0].dtype == torch.float16:
            grads = [g.float() for g in grads]
        torch._foreach_mul_(grads, flags.inv.reshape(()))
        return grads

    def _native_plan(self, group: dict[str, Any], bucket: Bucket):
        if self.capturable:
            return None
        momenta = bucket.state["momentum_buffer"] if "momentum_buffer" in bucket.state else ()
        copies = bucket.params if bucket.masters is not None else ()
        return ops.sgd_plan(bucket.params, bucket.work, momenta, copies)

    def _step_kernel(self, group, b: Bucket, grads, scaling: Scaling | None) -> None:
        """multi_tensor_sgd over the bucket. ``grads`` is None when the bucket's C++ plan holds
        this step's grads: the plan then takes the step (no Python per tensor) unless the grads
        must be unscaled first, new momentum buffers need their first run, or lr is a tensor;
        then its grads are released and the list path below runs."""
        momentum = group["momentum"]
        flags = scaling.flags(b.device) if scaling is not None else None
        noop = flags.skip if flags is not None else self._device_flags(b.device).zero
        hyper = (
            group["weight_decay"],
            momentum,
            group["dampening"],
            group["lr"],
            group["nesterov"],
        )
        scale = 1.0 / self.most_recent_scale
        fresh = [i for i, f in enumerate(b.fresh) if f] if momentum != 0 else []
        if grads is None:
            unscale = scaling is not None and scaling.grad_scale is not None
            if not (unscale or fresh or isinstance(group["lr"], torch.Tensor)):
                if b.native.step(noop, *hyper, False, self.wd_after_momentum, scale):
                    return
            else:
                b.native.release()
            grads = [p.grad for p in b.params]
        if flags is not None:
            grads = self._unscaled(grads, flags, scaling)
        copies = b.params if b.masters is not None else []
        momenta = b.state["momentum_buffer"] if momentum != 0 else grads  # unused without momentum
        if not fresh:
            ops.multi_tensor_sgd(
                grads, b.work, momenta, copies, noop, *hyper, False, self.wd_after_momentum, scale
            )
            return
        # New buffers take the grad itself (torch's first step). Under a GradScaler that step
        # may be skipped on the device, so the zero buffers are blended in with dampening 0
        # (momentum * 0 + g == g) rather than marked as a first run the host cannot undo.
        wd, mom, damp, lr, nesterov = hyper
        old = [i for i, f in enumerate(b.fresh) if not f]
        for ids, first in ((fresh, True), (old, False)):
            if not ids:
                continue
            if len(ids) == len(grads):
                sub = (grads, b.work, momenta, copies)
            else:
                sub = tuple(
                    [lst[i] for i in ids] if lst else lst
                    for lst in (grads, b.work, momenta, copies)
                )
            first_run = first and scaling is None
            d = 0.0 if first and not first_run else damp
            ops.multi_tensor_sgd(
                *sub, noop, wd, mom, d, lr, nesterov, first_run, self.wd_after_momentum, scale
            )
        b.fresh = [False] * len(b.fresh)

    def _step_tensors(self, index, group, b: Bucket, grads, scaling: Scaling | None) -> None:
        """Capturable SGD: lr read on the device; torch foreach ops in float32."""
        wd, momentum, damp = group["weight_decay"], group["momentum"], group["dampening"]
        lr_t = self._lr_tensor(index, group, b.device).reshape(()).float()
        flags = scaling.flags(b.device) if scaling is not None else None
        d = torch._foreach_mul([g.float() for g in grads], 1.0 / self.most_recent_scale)
        if flags is not None and scaling.grad_scale is not None:
            torch._foreach_mul_(d, flags.inv.reshape(()))
        low = b.masters is None and b.dtype != torch.float32
        w = [p.float() for p in b.params] if low else b.work
        if wd != 0 and not self.wd_after_momentum:
            torch._foreach_add_(d, w, alpha=wd)
        new_m = None
        if momentum != 0:
            m = b.state["momentum_buffer"]
            m32 = [x.float() for x in m]
            # New buffers are zeros: momentum * 0 + 1 * g == g, torch's first step.
            new_m = torch._foreach_mul(m32, momentum)
            if damp == 0 or not any(b.fresh):
                torch._foreach_add_(new_m, d, alpha=1 - damp)
            else:
                for x, g, f in zip(new_m, d, b.fresh):
                    x.add_(g, alpha=1.0 if f else 1 - damp)
            b.fresh = [False] * len(b.fresh)
            d = torch._foreach_add(d, new_m, alpha=momentum) if group["nesterov"] else list(new_m)
        if wd != 0 and self.wd_after_momentum:
            d = torch._foreach_add(d, w, alpha=wd)
        upd = torch._foreach_mul(d, lr_t)
        new_w = torch._foreach_sub(w, upd)
        targets = b.params if low else b.work
        if flags is None:
            _copy_all(targets, new_w)
            if new_m is not None:
                _copy_all(b.state["momentum_buffer"], new_m)
        else:
            skip = flags.skip.bool()
            for dst, new in zip(targets, new_w):
                dst.copy_(torch.where(skip, dst, new.to(dst.dtype)))
            if new_m is not None:
                for dst, new in zip(b.state["momentum_buffer"], new_m):
                    dst.copy_(torch.where(skip, dst, new.to(dst.dtype)))
        if b.masters is not None:
            self._copy_masters(b)

    def _step_amp_stash(self, stash) -> None:
        """apex amp O2's path: fp32 masters held by amp, the kernel writing the fp16 model
        params in the same pass (apex's FusedSGD.step, unchanged)."""
        scale = 1.0 / self.most_recent_scale
        for gid, group in enumerate(self.param_groups):
            fp32_params = [p for p in stash.fp32_from_fp32_groups[gid] if p.grad is not None]
            fp32_grads = [p.grad for p in fp32_params]
            fp32_momentums, first32 = self.get_momentums(fp32_params)
            pairs = zip(stash.fp32_from_fp16_groups[gid], stash.fp16_groups[gid])
            if self.materialize_master_grads:
                pairs = [(m, p) for m, p in pairs if m.grad is not None]
                grads16 = [m.grad for m, _ in pairs]
            else:
                pairs = [(m, p) for m, p in pairs if p.grad is not None]
                grads16 = [p.grad for _, p in pairs]
            masters = [m for m, _ in pairs]
            models = [p for _, p in pairs]
            momentums16, first16 = self.get_momentums(masters)
            launch_sets = [
                ([grads16, masters, momentums16, models], first16),
                ([fp32_grads, fp32_params, fp32_momentums], first32),
            ]
            for lists, first_run in launch_sets:
                if not lists[0]:
                    continue
                noop = self._device_flags(lists[0][0].device).zero
                multi_tensor_applier(
                    self.multi_tensor_sgd,
                    noop,
                    lists,
                    group["weight_decay"],
                    group["momentum"],
                    group["dampening"],
                    group["lr"],
                    group["nesterov"],
                    first_run,
                    self.wd_after_momentum,
                    scale,
                )
