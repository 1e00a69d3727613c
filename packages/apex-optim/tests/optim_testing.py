"""Helpers the optimizer tests share: models, synthetic grads, runners and tolerances."""

from __future__ import annotations

import copy
import io

import torch

from apex.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LOW = [torch.float16, torch.bfloat16]

# (atol, rtol) of a fused optimizer's float32 trajectory against torch.optim's (or a for-loop
# oracle's) after ~100 steps: the kernels round in a different order than torch's ops.
TOLERANCES = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
STEPS = 100
# Odd sizes, a vector, a 4-d tensor (stored channels_last in some tests).
SHAPES = [(7, 13), (13,), (3, 13), (5,), (2, 3, 4, 5)]


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 7, generator=g), torch.randn(32, 3, generator=g)


def train(net: torch.nn.Module, opt, steps: int = STEPS, seed: int = 1) -> None:
    """Full-batch regression steps: grads depend on the params, as in training."""
    x, y = batch(seed)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def params(dtype=torch.float32, shapes=SHAPES, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def grads(step: int, shapes=SHAPES, seed: int = 100) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + step)
    return [torch.randn(s, generator=g) for s in shapes]


def run_synthetic(opt, ps, steps: int = STEPS, seed: int = 100, skip=(), grad_dtype=None) -> None:
    """``steps`` steps with random grads (the same for every run with this seed), rounded to
    ``grad_dtype`` if given, then to each param's dtype; params listed by index in ``skip`` get
    no grad."""
    for i in range(steps):
        for j, (p, g) in enumerate(zip(ps, grads(i, [tuple(p.shape) for p in ps], seed))):
            if grad_dtype is not None:
                g = g.to(grad_dtype)
            p.grad = None if j in skip else g.to(p.dtype)
        opt.step()


def assert_close(actual, expected, dtype=torch.float32, scale: float = 1.0) -> None:
    atol, rtol = TOLERANCES[dtype]
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a.float(), e.float(), atol=atol * scale, rtol=rtol * scale)


def max_err(actual, expected) -> float:
    return max((a.double() - e.double()).abs().max().item() for a, e in zip(actual, expected))


def roundtrip(obj):
    """``obj`` through torch.save/torch.load, as a checkpoint would go."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def clone_params(ps) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in ps]


def fp32_copies(ps) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().float().clone()) for p in ps]


deepcopy = copy.deepcopy


# Every fused optimizer by name, with the arguments the shared tests give it.
OPTIMIZERS = {
    "FusedAdam": (FusedAdam, {}),
    "FusedSGD": (FusedSGD, {"lr": 0.1, "momentum": 0.9}),
    "FusedNovoGrad": (FusedNovoGrad, {}),
    "FusedAdagrad": (FusedAdagrad, {}),
    "FusedLAMB": (FusedLAMB, {}),
    "FusedMixedPrecisionLamb": (FusedMixedPrecisionLamb, {}),
}
NAMES = list(OPTIMIZERS)


def make(name, ps, **kw):
    cls, base = OPTIMIZERS[name]
    return cls(ps, **{**base, **kw})
