"""apex DDP against torch DDP on one GPU, interleaved, on bench_syncbn's 4-conv net (2026-12-04).

bench_syncbn times each wrapper once, one after the other, and the machine's host speed drifts
between and within runs (the same code measured 4.47 and 5.68 ms). Here the wrappers take
turns for ROUNDS rounds and the medians over rounds are compared; ``apex (per-param copy)`` is
apex DDP writing the reduced bucket back with one copy per parameter (before 2183f55). (The net
is channels_last: its conv weights' gradients do not have their bucket views' strides, so in
the 10:35 UTC run 2183f55's multi-tensor copy took torch's per-tensor path for the whole list
and both apex rows timed the same copies; the write-back now copies only those weights one by
one.)

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python scripts/ddp_ab.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages/apex-parallel/benchmarks"))
sys.path.insert(0, str(ROOT / "packages/apex-mta-kernels/benchmarks"))

from bench_syncbn import ddp_model, ddp_step, init_one_rank_group  # noqa: E402
from bench_utils import time_cuda, wall_ms  # noqa: E402

from apex.parallel import DistributedDataParallel, distributed  # noqa: E402


def per_param_copy(dst, src):
    for d, s in zip(dst, src):
        d.copy_(s)


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    if not init_one_rank_group():
        raise SystemExit("ddp_ab: no NCCL process group")
    x = torch.randn(32, 3, 64, 64, device="cuda").contiguous(memory_format=torch.channels_last)
    wrapped = {
        "apex DDP": DistributedDataParallel(ddp_model()),
        "apex (per-param copy)": DistributedDataParallel(ddp_model()),
        "torch DDP": torch.nn.parallel.DistributedDataParallel(ddp_model()),
    }
    batched = distributed._copy_all_
    res = {k: ([], []) for k in wrapped}
    for _ in range(rounds):
        for name, ddp in wrapped.items():
            old = name == "apex (per-param copy)"
            distributed._copy_all_ = per_param_copy if old else batched
            res[name][0].append(time_cuda(lambda ddp=ddp: ddp_step(ddp, x), warmup=3, rep=20))
            res[name][1].append(wall_ms(lambda ddp=ddp: ddp_step(ddp, x), rep=20))
    distributed._copy_all_ = batched
    print(
        f"{'wrapper':24s} {'events ms (median of rounds)':>30s} {'wall ms':>9s}   per round (events)"
    )
    for name, (ev, wall) in res.items():
        rr = " ".join(f"{v:.3f}" for v in ev)
        print(f"{name:24s} {statistics.median(ev):30.3f} {statistics.median(wall):9.3f}   {rr}")


if __name__ == "__main__":
    main()
