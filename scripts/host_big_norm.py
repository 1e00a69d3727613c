"""Where the host time of an eager call goes at bench size: bench_norm measured apex's forward at
[32768, H] bf16 at 32-105 us of host time a call against torch's 15-36 (H100, 12-05), while on
[4, H] (host_norm.py) the two are within 4 us; and FusedRMSNorm's forward+backward 218 us a call
back to back against FusedLayerNorm's 172, the other way round from [4, H]. Asked whether
something in our path grows with the size: in three calls (12-05 16:5x-17:0x) no module made a
device allocation, and the host figures moved by up to 19x between calls of one machine, more
than any difference between sizes or modules (packages/apex-norm/benchmarks/NOTES.md).

Per module and rows (4 and 32768): host us per call of forward and forward+backward (after a
sync, as bench_norm's host column; [32768, H] twice, the second time in the reverse order), the
caching allocator's device allocations and frees during those 102 calls, then the torch
profiler's table (CPU and CUDA runtime calls) over 50 forward+backward calls at [32768, H].
Usage: python scripts/host_big_norm.py [H] (default 1024)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from norm_steps import calls, modules
from torch.profiler import ProfilerActivity, profile

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "packages/apex-mta-kernels/benchmarks")
)
from bench_utils import host_ms, warm_up  # noqa: E402


def device_calls() -> tuple[int, int]:
    stats = torch.cuda.memory_stats()
    return stats.get("num_device_alloc", -1), stats.get("num_device_free", -1)


def main() -> None:
    h = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    dt = torch.bfloat16
    print(f"H={h} bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    mods = modules(h, dt)
    steps = {}
    # [32768, H] twice, the second time in the reverse order: whether a module's figure is its
    # own or that of its place in the run (bench_norm and wall_floor_norm.py time RMSNorm first).
    order = list(mods)
    for rows, names in ((4, order), (32768, order), (32768, order[::-1])):
        x = torch.randn(rows, h, device="cuda", dtype=dt, requires_grad=True)
        dy = torch.randn_like(x)
        for name in names:
            fwd, step = calls(mods[name], x, dy)
            steps[(name, rows)] = step
            warm_up(fwd, 5)
            warm_up(step, 5)
            before = device_calls()
            f_us = host_ms(fwd, rep=51) * 1e3
            s_us = host_ms(step, rep=51) * 1e3
            after = device_calls()
            print(
                f"rows {rows:5d} {name:20s} host fwd {f_us:7.1f} us  fwd+bwd {s_us:7.1f} us  "
                f"device allocs/frees over 102 calls: {after[0] - before[0]}/{after[1] - before[1]}"
            )
    for name in ("apex FusedRMSNorm", "apex FusedLayerNorm", "torch RMSNorm"):
        step = steps[(name, 32768)]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(50):
                step()
                torch.cuda.synchronize()
        print(f"\n{name}, [32768, {h}], 50 synchronised forward+backward calls")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))


if __name__ == "__main__":
    main()
