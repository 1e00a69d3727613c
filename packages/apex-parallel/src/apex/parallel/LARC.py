"""LARC: layer-wise adaptive rate control around any torch optimizer (apex's semantics)."""

from __future__ import annotations

import torch

__all__ = ["LARC"]


class LARC:
    """Wraps ``optimizer`` and scales each parameter's gradient by its adaptive learning rate
    before the inner ``step()``.

    For each parameter with a gradient: ``local_lr = trust_coefficient * ||p|| / (||g|| +
    weight_decay * ||p|| + eps)``; with ``clip=True`` the factor is ``min(local_lr / lr, 1)``
    (LARC clipping), else ``local_lr`` itself (LARS scaling). The gradient becomes ``(g +
    weight_decay * p) * factor`` and the group's ``weight_decay`` is 0 during the inner step (it
    is folded in here). Where ``||p||`` or ``||g||`` is 0 the gradient is left as it is. No
    host synchronisation: the norms stay on the device.

    As in apex, ``step()`` takes no closure, and ``state``, ``param_groups``, ``defaults``,
    ``state_dict()``, ``load_state_dict()``, ``zero_grad()`` and ``add_param_group()`` are the
    wrapped optimizer's (kept as ``.optim``). It is not a ``torch.optim.Optimizer`` subclass.
    """

    def __init__(self, optimizer, trust_coefficient=0.02, clip=True, eps=1e-8):
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    def __getstate__(self):
        # apex returned the inner optimizer's state here, which made LARC unpicklable; the
        # wrapper's own attributes (the optimizer among them) pickle and deepcopy.
        return dict(self.__dict__)

    def __setstate__(self, state):
        if "optim" in state and "trust_coefficient" in state:
            self.__dict__.update(state)
        else:  # apex's form: the inner optimizer's state
            self.optim.__setstate__(state)

    @property
    def state(self):
        return self.optim.state

    def __repr__(self):
        return self.optim.__repr__()

    @property
    def param_groups(self):
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optim.param_groups = value

    @property
    def defaults(self):
        return self.optim.defaults

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, *args, **kwargs):
        self.optim.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)

    def step(self):
        weight_decays = []
        with torch.no_grad():
            for group in self.optim.param_groups:
                weight_decay = group.get("weight_decay", 0)
                weight_decays.append(weight_decay)
                group["weight_decay"] = 0
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    g = p.grad
                    param_norm = torch.linalg.vector_norm(p.float())
                    grad_norm = torch.linalg.vector_norm(g.float())
                    adaptive_lr = (
                        self.trust_coefficient
                        * param_norm
                        / (grad_norm + param_norm * weight_decay + self.eps)
                    )
                    if self.clip:
                        adaptive_lr = torch.clamp(adaptive_lr / group["lr"], max=1.0)
                    apply = (param_norm != 0) & (grad_norm != 0)
                    factor = torch.where(apply, adaptive_lr, torch.ones_like(adaptive_lr))
                    decay = torch.where(
                        apply, torch.full_like(param_norm, float(weight_decay)), 0.0
                    )
                    new = (g.float() + decay * p.float()) * factor
                    g.copy_(new)
        try:
            self.optim.step()
        finally:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = weight_decay
