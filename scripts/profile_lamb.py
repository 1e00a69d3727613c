"""Where FusedLAMB.step()'s host time goes on the GPT-like list (GPU machine): host ms per step
(no sync inside) and the profiler's CPU-side ops, sorted by self CPU time.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python scripts/profile_lamb.py
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "packages/apex-mta-kernels/benchmarks")
)
from bench_utils import gpt_like_shapes  # noqa: E402

from apex.optimizers import FusedLAMB  # noqa: E402

params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in gpt_like_shapes()]
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
opt = FusedLAMB(params, lr=1e-3, weight_decay=0.01)
for _ in range(3):
    opt.step()
torch.cuda.synchronize()
host = []
for _ in range(10):
    torch.cuda.synchronize()
    t = time.perf_counter()
    opt.step()
    host.append((time.perf_counter() - t) * 1e3)
torch.cuda.synchronize()
host.sort()
print(f"FusedLAMB.step host ms: median {host[5]:.3f} min {host[0]:.3f}")
from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        opt.step()
    torch.cuda.synchronize()
print(
    prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
)
