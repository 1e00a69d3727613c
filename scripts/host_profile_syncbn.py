"""Where SyncBatchNorm's host time goes on the GPU machine (2026-12-04): forward and backward
issue times apart for apex SyncBatchNorm, torch's BatchNorm2d and ``x * 2`` on the same input,
then torch.profiler's view (CPU and CUDA) of 20 apex steps, by self CPU time (each op and CUDA
runtime call). ``x.grad`` is not cleared between calls: every backward also accumulates into it
(one ``add_``), as parameters' gradients do in training.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python scripts/host_profile_syncbn.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages/apex-parallel/benchmarks"))

from bench_syncbn import init_one_rank_group  # noqa: E402 - it puts bench_utils on sys.path
from bench_utils import host_ms  # noqa: E402

from apex.parallel import SyncBatchNorm  # noqa: E402


def issue_us(fn, rep=200):
    """Median host microseconds to issue ``fn()``, each call after a device sync."""
    return host_ms(fn, rep=rep) * 1e3


def main():
    init_one_rank_group()
    shape = (64, 256, 56, 56)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    g = torch.randn_like(x)
    mods = {
        "apex SyncBatchNorm": SyncBatchNorm(256).cuda(),
        "torch BatchNorm2d": torch.nn.BatchNorm2d(256).cuda(),
        "x * 2": lambda t: t * 2,
    }
    for name, mod in mods.items():
        for _ in range(20):
            mod(x).backward(g)
        fwd = issue_us(lambda mod=mod: mod(x))
        outs = []

        def bwd(mod=mod, outs=outs):
            outs.pop().backward(g)

        times = []
        for _ in range(200):
            outs.append(mod(x))
            torch.cuda.synchronize()
            t = time.perf_counter()
            bwd()
            times.append((time.perf_counter() - t) * 1e6)
        step = issue_us(lambda mod=mod: mod(x).backward(g))
        print(
            f"{name:20s} host us: forward {fwd:6.1f}  backward {statistics.median(times):6.1f}"
            f"  forward+backward {step:6.1f}"
        )
    bn = mods["apex SyncBatchNorm"]
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(20):
            x.grad = None
            bn(x).backward(g)
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60
        )
    )


if __name__ == "__main__":
    main()
