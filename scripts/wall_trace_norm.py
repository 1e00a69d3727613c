"""Where one eager forward+backward's wall time goes, bf16 [32768, H] (bench_norm's wall case):
for apex FusedRMSNorm / FusedLayerNorm, torch's modules and torch.compile of them, the wall and
device (CUDA-graph) milliseconds as bench_norm times them, then one synchronised step under
torch.profiler as a timeline: each host launch call and each kernel, in microseconds from the
step's start, so the gaps in which the GPU waits for the host show. Usage:
python scripts/wall_trace_norm.py [H] (default 1024)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from norm_steps import calls, modules
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "packages/apex-mta-kernels/benchmarks")
)
from bench_utils import graph_ms, wall_ms  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def timeline(step, label: str) -> None:
    """One profiled step: host launches and kernels, microseconds from the step's start."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("STEP"):
            step()
            torch.cuda.synchronize()
    events = prof.events()
    start = next(e for e in events if e.name == "STEP")
    t0 = start.time_range.start
    rows = []
    for e in events:
        kind = getattr(e, "device_type", None)
        on_gpu = kind is not None and "CUDA" in str(kind)
        if on_gpu or e.name in LAUNCHES or e.name.startswith("cudaDeviceSynchronize"):
            rows.append((e.time_range.start - t0, e.time_range.end - t0, on_gpu, e.name))
    print(f"{label}: step {start.time_range.end - t0:.1f} us")
    for s, t, gpu, name in sorted(rows):
        print(f"  {'gpu ' if gpu else 'host'} {s:8.1f} {t:8.1f}  {name[:100]}")


def main() -> None:
    h = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    dt = torch.bfloat16
    x = torch.randn(32768, h, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    mods = modules(h, dt)
    mods["compile RMSNorm"] = torch.compile(torch.nn.RMSNorm(h).cuda().to(dt))
    mods["compile LayerNorm"] = torch.compile(torch.nn.LayerNorm(h).cuda().to(dt))
    print(f"[32768, {h}] bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, m in mods.items():
        _, step = calls(m, x, dy)
        ms = graph_ms(step) or float("nan")
        wall = wall_ms(step, warmup=3, rep=31)
        print(f"{name:22s} device {ms:.4f} ms  wall {wall:.4f} ms  wall/device {wall / ms:.2f}")
        timeline(step, name)


if __name__ == "__main__":
    main()
