"""apex.fp16_utils' loss scalers for FP16_Optimizer: static (``LossScaler``) and dynamic
(``DynamicLossScaler``: halve on overflow, floor 1, double after ``scale_window`` clean steps)."""

from __future__ import annotations

import torch

from apex.multi_tensor_apply import ops


def _grads(params) -> list:
    return [p.grad for p in params if p.grad is not None]


def grads_have_overflow(params) -> bool:
    """Whether any grad of ``params`` holds inf or nan: one fused pass per device (the L2-norm
    kernel raises its flag on non-finite chunks) and one sync."""
    groups: dict = {}
    for g in _grads(params):
        groups.setdefault(g.device, []).append(g)
    found = False
    for device, grads in groups.items():
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        ops.multi_tensor_l2norm(grads, flag, False)
        found = found or bool(flag.item())
    return found


class LossScaler:
    """A static loss scale."""

    def __init__(self, scale=1):
        self.cur_scale = scale

    def has_overflow(self, params) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x) -> bool:
        return False

    def update_scale(self, overflow) -> None:
        pass

    @property
    def loss_scale(self):
        return self.cur_scale

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss, retain_graph=False):
        scaled_loss = loss * self.loss_scale
        scaled_loss.backward(retain_graph=retain_graph)


class DynamicLossScaler:
    """A loss scale that halves on overflow (not below 1) and doubles after ``scale_window``
    iterations without one."""

    def __init__(self, init_scale=2**32, scale_factor=2.0, scale_window=1000):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params) -> bool:
        return grads_have_overflow(params)

    @staticmethod
    def _has_inf_or_nan(x) -> bool:
        return not bool(torch.isfinite(x).all())

    def update_scale(self, overflow) -> None:
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    @property
    def loss_scale(self):
        return self.cur_scale

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss, retain_graph=False):
        scaled_loss = loss * self.loss_scale
        scaled_loss.backward(retain_graph=retain_graph)


# FP16_Optimizer.state_dict() holds its scaler object: let torch.load's default
# weights_only=True (torch >= 2.6) rebuild these two classes (add_safe_globals: torch >= 2.4).
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([LossScaler, DynamicLossScaler])
