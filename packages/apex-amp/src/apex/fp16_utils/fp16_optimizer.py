"""apex.fp16_utils.FP16_Optimizer: fp32 master weights and loss scaling around any optimizer.

Deprecated in apex and kept for old scripts; new code uses ``amp.initialize(opt_level="O2")``.
Grad copies and the master-to-model copy go through ``multi_tensor_scale``.
"""

from __future__ import annotations

import logging

import torch

from apex.multi_tensor_apply import ops

from .loss_scaler import DynamicLossScaler, LossScaler

logger = logging.getLogger("apex.fp16_utils")

LOW_PRECISION = (torch.float16, torch.bfloat16)


@torch.no_grad()
def _scale_into(src: list, dst: list, scale: float) -> bool:
    """dst[i] = src[i] * scale, one launch per device; True if a src element is inf/nan."""
    groups: dict = {}
    for s, d in zip(src, dst):
        pair = groups.setdefault(s.device, ([], []))
        pair[0].append(s)
        pair[1].append(d)
    found = False
    for device, (s, d) in groups.items():
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        ops.multi_tensor_scale(s, d, flag, scale)
        found = found or bool(flag.item())
    return found


class FP16_Optimizer:  # noqa: N801  (apex's name)
    """Wrap ``init_optimizer`` (built on the fp16/bf16 model's params): it then updates fp32
    masters, copied back to the model after each step; ``backward(loss)`` scales the loss."""

    def __init__(
        self,
        init_optimizer,
        static_loss_scale=1.0,
        dynamic_loss_scale=False,
        dynamic_loss_args=None,
        verbose=True,
    ):
        logger.warning(
            "FP16_Optimizer is deprecated and dangerous, and will be deleted soon. If it still "
            "works, you're probably getting lucky. For mixed precision, use "
            "amp.initialize(model, optimizer, opt_level='O2')."
        )
        self.verbose = verbose
        self.optimizer = init_optimizer
        self.fp16_groups = []
        self.fp32_from_fp16_groups = []
        self.fp32_from_fp32_groups = []
        for group in self.optimizer.param_groups:
            fp16, masters, fp32 = [], [], []
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in LOW_PRECISION:
                    master = param.detach().clone().float()
                    master.requires_grad = True
                    group["params"][i] = master
                    fp16.append(param)
                    masters.append(master)
                    if param in self.optimizer.state:
                        self.optimizer.state[master] = self.optimizer.state.pop(param)
                elif param.dtype == torch.float32:
                    fp32.append(param)
                else:
                    raise TypeError(
                        "FP16_Optimizer wraps optimizers of float16, bfloat16 and float32 "
                        f"params; got one of dtype {param.dtype}"
                    )
            self.fp16_groups.append(fp16)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(fp32)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]
        if len(self.optimizer.state) > 0:
            self.optimizer.load_state_dict(self.optimizer.state_dict())
        if dynamic_loss_scale:
            self.dynamic_loss_scale = True
            self.loss_scaler = DynamicLossScaler(**(dynamic_loss_args or {}))
        else:
            self.dynamic_loss_scale = False
            self.loss_scaler = LossScaler(static_loss_scale)
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = torch.nn.utils.clip_grad_norm_

    def maybe_print(self, msg) -> None:
        if self.verbose:
            logger.info("%s", msg)

    def __getstate__(self):
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state):
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    # ---- grads ---------------------------------------------------------------------------------

    def zero_grad(self, set_grads_to_None=False):  # noqa: N803  (apex's name)
        """Zero (or drop) the masters' and the model's grads."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if set_grads_to_None:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()
        for p in self.all_fp16_params:
            if p.grad is not None:
                if set_grads_to_None:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    def backward(self, loss, update_master_grads=True, retain_graph=False):
        """``(loss * loss_scale).backward()``, then (unless told not to) the master grads."""
        self.loss_scaler.backward(loss.float(), retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self):
        """Unscale the model's grads into the masters' (fp32 params: in place), noting an
        overflow under dynamic scaling."""
        src, dst = [], []
        for model, master in zip(self.all_fp16_params, self.all_fp32_from_fp16_params):
            if model.grad is None:
                master.grad = None
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master)
            src.append(model.grad)
            dst.append(master.grad)
        for p in self.all_fp32_from_fp32_params:
            if p.grad is not None:
                src.append(p.grad)
                dst.append(p.grad)
        found = _scale_into(src, dst, 1.0 / self.loss_scaler.loss_scale) if src else False
        self.overflow = bool(found) and self.dynamic_loss_scale

    def inspect_master_grad_data(self):
        """The masters' grads, one list per param group (None where a master has none)."""
        if self.overflow:
            self.maybe_print(
                "Warning:  calling FP16_Optimizer.inspect_master_grad_data while in an overflow "
                "state. Gradients are currently invalid (may be inf, nan, or stale). Returning "
                "None."
            )
            return None
        return [
            [p.grad.data if p.grad is not None else None for p in group["params"]]
            for group in self.optimizer.param_groups
        ]

    def clip_master_grads(self, max_norm, norm_type=2):
        """Clip the masters' grads; returns their total norm, or -1 on an overflow step."""
        if self.overflow:
            return -1
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return self.clip_grad_norm(params, max_norm, norm_type)

    # ---- step ----------------------------------------------------------------------------------

    def _master_params_to_model_params(self) -> None:
        if self.all_fp16_params:
            _scale_into(
                [m.data for m in self.all_fp32_from_fp16_params],
                [p.data for p in self.all_fp16_params],
                1.0,
            )

    def _update_scale(self, has_overflow=False) -> None:
        self.loss_scaler.update_scale(has_overflow)

    def step(self, closure=None):
        """The wrapped optimizer's step on the masters (skipped on an overflow), then the
        masters copied into the model."""
        self._update_scale(self.overflow)
        if self.overflow:
            logger.warning(
                "Gradient overflow.  Skipping step, reducing loss scale to %s",
                self.loss_scaler.loss_scale,
            )
            return None
        if closure is not None:
            return self._step_with_closure(closure)
        result = self.optimizer.step()
        self._master_params_to_model_params()
        return result

    def _step_with_closure(self, closure):
        def wrapped_closure():
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                self._master_params_to_model_params()
            loss = closure()
            while self.overflow:
                self._update_scale(self.overflow)
                self.maybe_print(
                    "OVERFLOW within closure! Skipping step, reducing loss scale to "
                    f"{self.loss_scaler.loss_scale}"
                )
                loss = closure()
            return loss

        result = self.optimizer.step(wrapped_closure)
        self._master_params_to_model_params()
        self.first_closure_call_this_step = True
        return result

    # ---- state ---------------------------------------------------------------------------------

    def state_dict(self):
        return {
            "loss_scaler": self.loss_scaler,
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": self.fp32_from_fp16_groups,
        }

    def load_state_dict(self, state_dict) -> None:
        self.loss_scaler = state_dict["loss_scaler"]
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        for current, saved in zip(self.fp32_from_fp16_groups, state_dict["fp32_from_fp16"]):
            for c, s in zip(current, saved):
                c.data.copy_(s.data)

    @property
    def loss_scale(self):
        return self.loss_scaler.loss_scale

    @loss_scale.setter
    def loss_scale(self, value):
        self.loss_scaler.cur_scale = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value
