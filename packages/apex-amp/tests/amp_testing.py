"""Shared pieces of the apex-amp tests: small models, data, reference loops, a LARC stand-in."""

from __future__ import annotations

import copy

import torch
from torch import nn

# Loss after training, relative to the fp32 reference's: |amp - ref| <= RTOL * ref + ATOL.
TOLERANCES = {
    torch.float32: (1e-6, 1e-7),
    torch.bfloat16: (0.05, 1e-3),
    torch.float16: (0.02, 1e-3),
}

LOW = [torch.bfloat16, torch.float16]


class MLP(nn.Module):
    """A GPT-ish MLP block stack with a batchnorm (to exercise keep_batchnorm_fp32)."""

    def __init__(self, width=32, depth=2, out=4, batchnorm=True):
        super().__init__()
        layers = [nn.Linear(8, width)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(width))
        layers.append(nn.GELU())
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.GELU()]
        layers.append(nn.Linear(width, out))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def make_model(seed=0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return MLP(**kwargs)


def batches(n, seed=1, batch=64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 4, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(batch, 8, generator=g)
        out.append((x, torch.tanh(x @ w)))
    return out


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)


def clone(model):
    return copy.deepcopy(model)


def train_reference(model, opt, data, dtype=None, scaler=None):
    """torch's own mixed precision: autocast (when dtype) and a GradScaler (when given)."""
    losses = []
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(x)
        loss = loss_fn(out, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        losses.append(loss.item())
    return losses


def train_amp(model, opt, data, amp):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class LARC:
    """apex.parallel.LARC's shape (not a torch Optimizer): proxies param_groups/state to
    ``optim`` and rescales each param's lr by its trust ratio before ``optim.step()``."""

    def __init__(self, optimizer, trust_coefficient=0.02, clip=True, eps=1e-8):
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, group):
        self.optim.add_param_group(group)

    def step(self):
        with torch.no_grad():
            saved = []
            for group in self.optim.param_groups:
                wd = group.get("weight_decay", 0)
                saved.append(wd)
                group["weight_decay"] = 0
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    pn, gn = torch.norm(p.data), torch.norm(p.grad.data)
                    if pn != 0 and gn != 0:
                        lr = self.trust_coefficient * pn / (gn + pn * wd + self.eps)
                        if self.clip:
                            lr = min(lr / group["lr"], 1)
                        p.grad.data += wd * p.data
                        p.grad.data *= lr
            self.optim.step()
            for group, wd in zip(self.optim.param_groups, saved):
                group["weight_decay"] = wd
