"""The launch shapes of apex-norm's kernels and torch.compile's, side by side (GPU machine).

For bf16 x = [32768, H], forward (under no_grad) and forward+backward, each kernel one call
launches: its grid and block, registers per thread, shared memory, the profiler's estimated
occupancy and its device time (median of 5 calls). torch.compile's Triton kernels are the model
the forward is compared with: their shapes say what ours could try.

    PYTHONPATH=... python scripts/norm_kernel_shapes.py [--hidden 1024,4096,16384] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "packages" / "apex-norm" / "benchmarks")
)
import bench_norm  # noqa: E402


def shapes(fn, reps: int = 5) -> list[dict]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    kernels: dict[str, dict] = {}
    for e in events:
        if e.get("cat") != "kernel":
            continue
        a = e.get("args", {})
        k = kernels.setdefault(
            e["name"],
            {
                "name": e["name"],
                "grid": a.get("grid"),
                "block": a.get("block"),
                "regs": a.get("registers per thread"),
                "smem": a.get("shared memory"),
                "occ": a.get("est. achieved occupancy %"),
                "us": [],
            },
        )
        k["us"].append(e.get("dur", 0.0))
    for k in kernels.values():
        k["us"] = statistics.median(k["us"])
    return list(kernels.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", default="1024,4096,16384")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--rows", type=int, default=32768)
    args = p.parse_args()
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    dtype = bench_norm.DTYPES[args.dtype]
    for norm in ("rmsnorm", "layernorm"):
        for H in (int(h) for h in args.hidden.split(",")):
            x = torch.randn(args.rows, H, device="cuda", dtype=dtype)
            xg = x.clone().requires_grad_(True)
            dy = torch.randn_like(x)
            for name, fn, params in bench_norm.impls(norm, H, dtype):
                if name == "torch":
                    continue

                def fwd(fn=fn, x=x):
                    with torch.no_grad():
                        fn(x)

                def fwd_bwd(fn=fn, params=params, xg=xg, dy=dy):
                    torch.autograd.grad(fn(xg), [xg, *params], dy)

                for passname, f in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                    for k in shapes(f):
                        print(
                            f"{norm:9s} {args.dtype} H={H:<5d} {passname:7s} {name:7s} "
                            f"{k['us']:8.1f} us grid={k['grid']} block={k['block']} "
                            f"regs={k['regs']} smem={k['smem']} occ={k['occ']}  {k['name'][:90]}",
                            flush=True,
                        )
            del x, xg, dy
    return 0


if __name__ == "__main__":
    sys.exit(main())
