"""Where FusedLAMB.step()'s host time goes on the GPT-like list (GPU machine): host ms per step
(no sync inside) through the cached plans (one group; two groups, decay and no decay, whose
global norm takes a plan of its own) and through the list path (plans switched off), then the
profiler's CPU-side ops of the plan path, sorted by self CPU time.

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


def host_ms(opt, steps=10):
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    host = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        host.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    host.sort()
    return host[len(host) // 2], host[0]


plans = FusedLAMB(params, lr=1e-3, weight_decay=0.01)
decay = [p for p in params if p.dim() > 1]
no_decay = [p for p in params if p.dim() <= 1]
two_groups = FusedLAMB(
    [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, weight_decay=0.01
)
lists = FusedLAMB(params, lr=1e-3, weight_decay=0.01)
lists._native_plan = lambda group, bucket: None  # the list path every step
for name, opt in (("plans", plans), ("plans, two groups", two_groups), ("lists", lists)):
    median, best = host_ms(opt)
    print(f"FusedLAMB.step host ms ({name}): median {median:.3f} min {best:.3f}")
del two_groups, lists
from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        plans.step()
    torch.cuda.synchronize()
print(
    prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
)
