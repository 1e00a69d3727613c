"""Whether issue 5's host target (eager forward+backward wall time at H=1024 within 1.3x of its
own kernel time) is within reach of any eager module, in one run: bf16 [32768, H], apex's and
torch's RMSNorm / LayerNorm modules, against the floor of an eager forward+backward through
torch.autograd.

Per module: device ms of forward and forward+backward (CUDA-graph replays, as bench_norm),
bench_norm's wall (one eager call, synchronised), the steady wall (50 calls back to back, one
synchronisation: what a training loop sees) and the host ms per call.

The floor: ``torch.autograd.grad(x * w, [x, w], dy)`` on 8 float32 elements, timed before the
modules and after them. Its kernels are next to nothing, so its synchronised wall is the host's
cost of an eager forward, the engine's backward call and the synchronisation. A module's backward
kernels cannot start before the engine launches them, so its synchronised wall is about the
floor plus its backward's device time (forward+backward less forward) or more; ``est`` is that
over its forward+backward device time. An estimate, not a strict bound: part of the floor's host
time (the engine's return, the synchronisation call) overlaps a module's backward kernels, and
the floor is a median. So the run checks it against every module: ``short`` is the most any
module's wall came under floor + backward, and ``est-short`` the estimate less that. Where
``est-short`` passes 1.3, no eager module with those kernels meets the target on this machine
(faster kernels raise it). Read as a training loop's steady wall (calls back to back, one
synchronisation) instead, no call takes less than the floor's steady time: ``fl.st/dev`` is that
over the module's forward+backward device time, the least its ``steady/dev`` could be.
Usage: python scripts/wall_floor_norm.py [H] (default 1024)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from norm_steps import calls, modules

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "packages/apex-mta-kernels/benchmarks")
)
from bench_utils import graph_ms, host_ms, steady_ms, wall_ms  # noqa: E402


def main() -> None:
    h = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    dt = torch.bfloat16
    x = torch.randn(32768, h, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    tx = torch.randn(8, device="cuda", requires_grad=True)
    tw = torch.randn(8, device="cuda", requires_grad=True)
    tdy = torch.randn(8, device="cuda")

    def floor_step():
        torch.autograd.grad(tx * tw, [tx, tw], tdy)

    def floor_times():
        return (
            wall_ms(floor_step, warmup=10, rep=101),
            host_ms(floor_step, rep=101),
            steady_ms(floor_step),
        )

    mods = modules(h, dt)
    floors = [floor_times()]
    # Each module twice, the second time in the reverse order (a figure of the module's own, not
    # of its place in the run).
    rows = []
    for name in [*mods, *reversed(mods)]:
        fwd, step = calls(mods[name], x, dy)
        k_fwd = graph_ms(fwd) or float("nan")
        k = graph_ms(step) or float("nan")
        rows.append(
            (
                name,
                k_fwd,
                k,
                wall_ms(step, warmup=3, rep=51),
                steady_ms(step),
                host_ms(step, rep=51),
            )
        )
    floors.append(floor_times())
    floor = min(f[0] for f in floors)
    floor_steady = min(f[2] for f in floors)
    print(f"[32768, {h}] bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for when, (f_wall, f_host, f_steady) in zip(("before", "after"), floors):
        print(
            f"floor {when} (eager x * w forward+backward, 8 elements): synchronised "
            f"{f_wall * 1e3:.1f} us, host {f_host * 1e3:.1f} us, "
            f"steady {f_steady * 1e3:.1f} us a call"
        )
    # How far the estimate overshot on this run: the most a wall came under floor + backward.
    short = max(0.0, max(floor + k - k_fwd - wall for _, k_fwd, k, wall, _, _ in rows))
    print(
        f"floor (the lesser): synchronised {floor * 1e3:.1f} us, "
        f"steady {floor_steady * 1e3:.1f} us; "
        f"short (the most a wall came under floor + backward): {short * 1e3:.1f} us"
    )
    print(
        f"{'module':20s} {'fwd us':>8s} {'f+b us':>8s} {'wall us':>8s} {'wall/dev':>8s} "
        f"{'steady us':>9s} {'steady/dev':>10s} {'host us':>8s} {'est':>6s} {'est-short':>9s} "
        f"{'fl.st/dev':>9s}"
    )
    for name, k_fwd, k, wall, steady, host in rows:
        est = (floor + k - k_fwd) / k
        print(
            f"{name:20s} {k_fwd * 1e3:8.1f} {k * 1e3:8.1f} {wall * 1e3:8.1f} {wall / k:8.2f} "
            f"{steady * 1e3:9.1f} {steady / k:10.2f} {host * 1e3:8.1f} {est:6.2f} "
            f"{est - short / k:9.2f} {floor_steady / k:9.2f}"
        )


if __name__ == "__main__":
    main()
