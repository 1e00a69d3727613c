"""What the host and wall scripts time (host_norm.py, host_big_norm.py, wall_floor_norm.py,
wall_trace_norm.py): apex's and torch's RMSNorm / LayerNorm modules on the GPU, and a module's
eager forward (under no_grad) and forward+backward (autograd.grad of the input and the
parameters: nothing accumulates), as bench_norm times them."""

from __future__ import annotations

import torch

from apex.normalization import FusedLayerNorm, FusedRMSNorm


def modules(h: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.nn.Module]:
    """apex's and torch's RMSNorm and LayerNorm over the last ``h`` elements, on the GPU."""
    return {
        "apex FusedRMSNorm": FusedRMSNorm(h).cuda().to(dtype),
        "apex FusedLayerNorm": FusedLayerNorm(h).cuda().to(dtype),
        "torch RMSNorm": torch.nn.RMSNorm(h).cuda().to(dtype),
        "torch LayerNorm": torch.nn.LayerNorm(h).cuda().to(dtype),
    }


def calls(m: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """(forward, forward+backward) of ``m`` on ``x`` (which requires grad), ``dy`` the gradient."""
    params = list(m.parameters())

    def fwd():
        with torch.no_grad():
            m(x)

    def step():
        torch.autograd.grad(m(x), [x, *params], dy)

    return fwd, step
