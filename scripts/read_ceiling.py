"""How fast a read-only pass goes on this GPU (2026-12-04): torch's reductions of SyncBatchNorm's
benchmark tensor against apex's statistics op, each a CUDA-graph replay, with the copy bandwidth
of the same run. A pass that only reads moves one tensor; "% of copy" compares its bytes per
second with the copy's (bytes read + written).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python scripts/read_ceiling.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages/apex-mta-kernels/benchmarks"))

from bench_utils import copy_bandwidth, graph_ms  # noqa: E402

from apex.parallel import ops  # noqa: E402


def main():
    ceiling = copy_bandwidth()
    print(f"copy {ceiling.tbps:.2f} TB/s")
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(64, 256, 56, 56, device="cuda", dtype=dtype)
        x = x.contiguous(memory_format=torch.channels_last)
        rows = x.permute(0, 2, 3, 1).reshape(-1, 256)  # a view: channels last
        gb = x.numel() * x.element_size() / 1e9
        cases = {
            "torch sum, whole tensor (float32 acc)": lambda x=x: x.sum(dtype=torch.float32),
            "torch sum over rows [M, C] -> [C]": lambda r=rows: r.sum(0, dtype=torch.float32),
            "torch var_mean over rows": lambda r=rows: torch.var_mean(r, 0),
            "torch amax, whole tensor": lambda x=x: x.amax(),
            "apex syncbn_stats (stats_mc + finalize)": lambda x=x: ops.syncbn_stats(x),
        }
        for name, fn in cases.items():
            fn()
            ms = graph_ms(fn)
            if ms is None:
                print(f"{str(dtype):15s} {name:42s} not capturable in a CUDA graph")
                continue
            print(
                f"{str(dtype):15s} {name:42s} {ms * 1e3:7.1f} us  {gb / ms:5.2f} TB/s"
                f"  {100 * gb / ms / ceiling.tbps:5.1f} % of copy"
            )


if __name__ == "__main__":
    main()
