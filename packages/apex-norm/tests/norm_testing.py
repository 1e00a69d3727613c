"""Shared pieces of the norm tests: tolerances, torch oracles, input makers."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# (atol, rtol) of a result in each dtype against a float64 oracle, for a correct computation in
# float32 that rounds once to the dtype; the CUDA tests also apply the 2x rule (STYLE.md).
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 2e-2),
}
LOW = [torch.float16, torch.bfloat16]

# (H, rows) with rows enough that every row group of the backward's persistent grid walks several
# rows (the prefetch of the next row, statistics carried across iterations, gradient sums over
# many rows): the CUDA many-row tests of both norms.
MANY_ROWS = [(64, 30011), (1024, 6007), (4096, 8009), (16384, 1031)]

# Hidden sizes of the CUDA tests of both norms. 8, 64, 256, 520, 1024: the forward's row groups
# narrower than a warp (1 to 16 threads a row; 520's last vectors past the row). 3080: 16-bit
# forward rows of 4 vectors a thread (2048 < H <= 4096) whose last vectors are past the row.
# 12288: 16-bit backward rows of 4 vectors a thread (rows of 512 threads) whose last vectors are
# partly past the row (LayerNorm's ring with its bias sums in shared memory, RMSNorm's LEAN ring).
CUDA_H = [1, 7, 8, 64, 100, 256, 520, 1000, 1024, 2048, 3080, 4104, 8192, 12288, 16384, 32768,
          65536, 65539]  # fmt: skip
DTYPES = [torch.float32, *LOW]


def tol(*dtypes: torch.dtype) -> dict:
    """The loosest tolerance of ``dtypes``, as assert_close keywords."""
    atol = max(TOLERANCES[d][0] for d in dtypes)
    rtol = max(TOLERANCES[d][1] for d in dtypes)
    return {"atol": atol, "rtol": rtol}


def grad_tol(H: int, *dtypes: torch.dtype) -> dict:
    """Weight/bias gradients sum over rows: allow for the length of the sums."""
    t = tol(*dtypes)
    return {"atol": t["atol"] * 10, "rtol": t["rtol"] * max(4.0, math.log2(max(H, 2)))}


def torch_layer_norm(x, shape, w, b, eps):
    """The oracle: torch's layer_norm in float64."""
    return F.layer_norm(
        x.double(), shape, None if w is None else w.double(), None if b is None else b.double(), eps
    )


def plain_rms_norm(x, shape, w, eps):
    """RMSNorm written out in plain torch, independent of apex-norm: x * rsqrt(mean(x^2) + eps)
    * w, over the last ``len(shape)`` dimensions, in float32 (float64 for float64 input), the
    result in x's dtype (as torch's rms_norm). The oracle where torch has no rms_norm (2.3)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(dtype)
    dims = tuple(range(-len(shape), 0))
    y = xf * torch.rsqrt(xf.square().mean(dims, keepdim=True) + eps)
    if w is not None:
        y = y * w.to(dtype)
    return y.to(x.dtype)


# torch.nn.functional.rms_norm and torch.nn.RMSNorm are new in torch 2.4; on 2.3 the tests
# compare with plain_rms_norm and PlainRMSNorm instead.
rms_norm = getattr(F, "rms_norm", plain_rms_norm)


class PlainRMSNorm(torch.nn.Module):
    """torch.nn.RMSNorm's state_dict (``weight``) and math, by plain_rms_norm; an int
    normalized_shape and an explicit eps only."""

    def __init__(self, normalized_shape: int, eps: float):
        super().__init__()
        self.normalized_shape = (normalized_shape,)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(normalized_shape))

    def forward(self, x):
        return plain_rms_norm(x, self.normalized_shape, self.weight, self.eps)


RMSNorm = getattr(torch.nn, "RMSNorm", PlainRMSNorm)


def torch_rms_norm(x, shape, w, eps):
    """The oracle: torch's rms_norm in float64 (plain_rms_norm where torch has none)."""
    return rms_norm(x.double(), shape, None if w is None else w.double(), eps)


def make(shape, dtype, device="cpu", requires_grad=False, scale=1.0, shift=0.0):
    t = torch.randn(shape, dtype=torch.float32, device=device) * scale + shift
    return t.to(dtype).requires_grad_(requires_grad)


def param(shape, dtype, device="cpu"):
    """A weight or bias away from zero (memory_efficient divides by the weight)."""
    t = (torch.rand(shape, device=device) + 0.5) * torch.where(
        torch.rand(shape, device=device) < 0.5, -1.0, 1.0
    )
    return t.to(dtype).requires_grad_(True)


def grads(out, inputs, seed_grad):
    return torch.autograd.grad(out, [t for t in inputs if t is not None], seed_grad)
