"""Host cost of apex-norm's eager calls on a GPU: microseconds per call of a loop of calls on a
tiny input (the GPU idles, so the loop's time is the host's), for the apex modules, torch's
modules, the bare ops, and a thin autograd.Function over the ops; then cProfile of the apex
module's forward+backward. Usage: python scripts/host_norm.py [H] (default 1024)."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
from norm_steps import calls, modules

from apex.normalization import ops as norm_ops

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "packages/apex-mta-kernels/benchmarks")
)
from bench_utils import host_ms, warm_up  # noqa: E402


def per_call_us(f, calls=2000) -> float:
    """Host microseconds per call: bench_utils.host_ms over bursts of ``calls`` calls (the GPU
    idles on these tiny inputs, so the burst's time is the host's), after a warm-up."""
    warm_up(f, calls=200)
    return host_ms(f, rep=5, calls=calls) * 1e3


def profile_table(*fns, calls=200) -> None:
    """The torch profiler's CPU table (by self time) over ``calls`` calls of each of ``fns``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        for f in fns:
            for _ in range(calls):
                f()
    torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


class _ThinRMS(torch.autograd.Function):
    """The least Python an autograd.Function over the ops can have (no checks): a floor."""

    @staticmethod
    def forward(ctx, x, w, shape, eps):
        out, invvar = torch.ops.apex_norm.rms_norm_fwd.default(x, w, shape, eps, False, None)
        ctx.save_for_backward(x, invvar, w)
        ctx.shape, ctx.eps = shape, eps
        return out

    @staticmethod
    def backward(ctx, g):
        x, invvar, w = ctx.saved_tensors
        gi, gw = torch.ops.apex_norm.rms_norm_bwd.default(
            g, invvar, x, ctx.shape, w, ctx.eps, False, None
        )
        return gi, gw, None, None


class ThinRMS(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(h, device="cuda", dtype=torch.bfloat16))
        self.shape = [h]

    def forward(self, x):
        return _ThinRMS.apply(x, self.weight, self.shape, 1e-5)


def main() -> None:
    h = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    dt = torch.bfloat16
    x = torch.randn(4, h, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn(4, h, device="cuda", dtype=dt)
    norm_ops.OPS.ensure_loaded()
    mods = modules(h, dt)
    mods["thin Function (floor)"] = ThinRMS(h)
    print(
        f"host us per call, [4, {h}] bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    fwds, steps = {}, {}
    for name, m in mods.items():
        fwd, step = calls(m, x, dy)
        fwds[name], steps[name] = fwd, step
        print(f"{name:24s} fwd {per_call_us(fwd):7.1f}   fwd+bwd {per_call_us(step):7.1f}")
    # The ops alone, on tensors that need no gradient (no autograd kernel runs).
    w = mods["thin Function (floor)"].weight.detach()
    op = torch.ops.apex_norm.rms_norm_fwd
    xd = x.detach()
    op_calls = {
        "apex_norm op packet": lambda: op(xd, w, [h], 1e-5, False, None),
        "apex_norm op .default": lambda: op.default(xd, w, [h], 1e-5, False, None),
        "apex_norm LN op .default": lambda: torch.ops.apex_norm.layer_norm_fwd.default(
            xd, w, w, [h], 1e-5, False, None
        ),
        "aten native_layer_norm": lambda: torch.ops.aten.native_layer_norm.default(
            xd, [h], w, None, 1e-5
        ),
        "torch.rms_norm": lambda: torch.rms_norm(xd, [h], w, 1e-5),
        "torch.empty_like": lambda: torch.empty_like(xd),
    }
    for name, f in op_calls.items():
        print(f"{name:24s} {per_call_us(f):7.1f}")
    # The torch profiler's table over 200 calls of each: RMSNorm's op, torch's, the module's
    # step; then FusedLayerNorm alone: its op, its forward, its step (its forward measured 17 us
    # of host time above FusedRMSNorm's on an H100 at 12-05 13:4x; 0.3 us below at 16:4x).
    profile_table(
        op_calls["apex_norm op .default"],
        op_calls["aten native_layer_norm"],
        steps["apex FusedRMSNorm"],
    )
    profile_table(
        op_calls["apex_norm LN op .default"],
        fwds["apex FusedLayerNorm"],
        steps["apex FusedLayerNorm"],
    )
    m = mods["apex FusedRMSNorm"]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3000):
        torch.autograd.grad(m(x), [x, m.weight], dy)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue())


if __name__ == "__main__":
    main()
