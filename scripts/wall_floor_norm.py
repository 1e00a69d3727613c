"""Whether issue 5's host target (eager forward+backward wall time at H=1024 within 1.3x of its
own kernel time) is within reach of any eager module, in one run: bf16 [32768, H], apex's and
torch's RMSNorm / LayerNorm modules, against the floor of an eager forward+backward through
torch.autograd.

Per module: device ms of forward and forward+backward (CUDA-graph replays, as bench_norm),
bench_norm's wall (one eager call, synchronised), the steady wall (50 calls back to back, one
synchronisation: what a training loop sees) and the host ms per call.

The floor: ``torch.autograd.grad(x * w, [x, w], dy)`` on 8 float32 elements, one synchronised
call. Its kernels are next to nothing, so its wall is the host's cost of an eager forward, the
engine's backward call and the synchronisation. A module's backward kernels cannot start before
the engine launches them, so its wall is at least about floor + its backward's device time
(forward+backward less forward); ``bound`` is that over its forward+backward device time. Where
the bound passes 1.3, no eager module with those kernels meets the target on this machine (and
faster kernels raise the bound). Read as a training loop's steady wall (calls back to back, one
synchronisation), a call takes at least the floor's steady time or its own device time:
``s.bound`` is the larger over the device time. Usage: python scripts/wall_floor_norm.py [H] (default 1024)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from apex.normalization import FusedLayerNorm, FusedRMSNorm

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

    floor = wall_ms(floor_step, warmup=10, rep=101)
    floor_host = host_ms(floor_step, rep=101)
    floor_steady = steady_ms(floor_step)
    print(f"[32768, {h}] bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        f"floor (eager x * w forward+backward, 8 elements): synchronised {floor * 1e3:.1f} us, "
        f"host {floor_host * 1e3:.1f} us, steady {floor_steady * 1e3:.1f} us a call"
    )
    print(
        f"{'module':20s} {'fwd us':>8s} {'f+b us':>8s} {'wall us':>8s} {'wall/dev':>8s} "
        f"{'steady us':>9s} {'steady/dev':>10s} {'host us':>8s} {'bound':>6s} {'s.bound':>7s}"
    )
    mods = {
        "apex FusedRMSNorm": FusedRMSNorm(h).cuda().to(dt),
        "apex FusedLayerNorm": FusedLayerNorm(h).cuda().to(dt),
        "torch RMSNorm": torch.nn.RMSNorm(h).cuda().to(dt),
        "torch LayerNorm": torch.nn.LayerNorm(h).cuda().to(dt),
    }
    # Each module twice, the second time in the reverse order (a figure of the module's own, not
    # of its place in the run).
    for name in [*mods, *reversed(mods)]:
        m = mods[name]
        params = list(m.parameters())

        def fwd(m=m):
            with torch.no_grad():
                m(x)

        def step(m=m, params=params):
            torch.autograd.grad(m(x), [x, *params], dy)

        k_fwd = graph_ms(fwd) or float("nan")
        k = graph_ms(step) or float("nan")
        wall = wall_ms(step, warmup=3, rep=51)
        steady = steady_ms(step)
        host = host_ms(step, rep=51)
        bound = (floor + k - k_fwd) / k
        steady_bound = max(floor_steady, k) / k
        print(
            f"{name:20s} {k_fwd * 1e3:8.1f} {k * 1e3:8.1f} {wall * 1e3:8.1f} {wall / k:8.2f} "
            f"{steady * 1e3:9.1f} {steady / k:10.2f} {host * 1e3:8.1f} {bound:6.2f} "
            f"{steady_bound:7.2f}"
        )


if __name__ == "__main__":
    main()
