"""Whole optimizer steps against torch's fused and foreach optimizers, in one run.

Two numbers per row: device milliseconds per step (CUDA events, median) and host milliseconds to
issue one step (no sync in the timed region, median). The host number is the per-step Python
overhead the optimizers are designed to keep small: the target is under 0.3 ms for a list of
about 300 tensors (a GPT-like 1.3 B model).

Bytes counted per parameter (each input read once, each output written once):
  adam fp32             g,p,m,v read + p,m,v written                    = 28 bytes
  adam bf16 + masters   g(2),master,m,v read + p(2),master,m,v written  = 30 bytes
  sgd momentum fp32     g,p,m read + p,m written                        = 20 bytes
  lamb fp32             g read for the norm, then g,p,m,v read + g(update),p,m,v written = 36;
                        counted as 32 (the norm pass over g is a separate launch)
  lamb bf16 + masters   counted as 32 as well (bf16 g and p, fp32 master, m, v)

``--host-only`` runs anywhere (CPU included): it replaces every kernel with a no-op and times
only the Python around them, on 300 small tensors.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import apex.optimizers as O
from apex.multi_tensor_apply import ops

# The shared timing helpers and parameter sets live beside the kernel benchmarks.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "apex-mta-kernels" / "benchmarks"))
from bench_utils import (  # noqa: E402
    Row,
    copy_bandwidth,
    gpt_like_shapes,
    host_ms,
    small_shapes,
    time_cuda,
)
from bench_utils import write as write_rows  # noqa: E402


def make_params(shapes, dtype, device):
    ps = [torch.nn.Parameter(torch.randn(s, dtype=dtype, device=device) * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    return ps


def wall_ms(fn, rep=20) -> float:
    """Milliseconds per step of ``rep`` steps issued back to back: host and device together,
    whichever is the bottleneck (the number that matters for many small tensors)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(rep):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / rep


def cases(device):
    """(bench, impl, dtype, factory, bytes per param)."""
    return [
        ("adamw fp32", "apex-optim FusedAdam", torch.float32, lambda ps: O.FusedAdam(ps), 28),
        ("adamw fp32", "apex-optim FusedAdam capturable", torch.float32,
         lambda ps: O.FusedAdam(ps, capturable=True), 28),
        ("adamw fp32", "torch AdamW fused", torch.float32,
         lambda ps: torch.optim.AdamW(ps, fused=True), 28),
        ("adamw fp32", "torch AdamW foreach", torch.float32,
         lambda ps: torch.optim.AdamW(ps, foreach=True), 28),
        ("adamw bf16+fp32 masters", "apex-optim FusedAdam master_weights", torch.bfloat16,
         lambda ps: O.FusedAdam(ps, master_weights=True), 30),
        ("adamw bf16+fp32 masters", "apex-optim FusedAdam capturable master_weights",
         torch.bfloat16, lambda ps: O.FusedAdam(ps, master_weights=True, capturable=True), 30),
        ("sgd momentum fp32", "apex-optim FusedSGD", torch.float32,
         lambda ps: O.FusedSGD(ps, lr=0.01, momentum=0.9), 20),
        ("sgd momentum fp32", "torch SGD fused", torch.float32,
         lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, fused=True), 20),
        ("sgd momentum fp32", "torch SGD foreach", torch.float32,
         lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, foreach=True), 20),
        ("lamb fp32", "apex-optim FusedLAMB", torch.float32, lambda ps: O.FusedLAMB(ps), 32),
        ("lamb fp32", "apex-optim FusedMixedPrecisionLamb", torch.float32,
         lambda ps: O.FusedMixedPrecisionLamb(ps), 32),
        ("lamb bf16+fp32 masters", "apex-optim FusedMixedPrecisionLamb bf16", torch.bfloat16,
         lambda ps: O.FusedMixedPrecisionLamb(ps, reduced_precision_dtype=torch.bfloat16), 32),
    ]  # fmt: skip


def gpu_rows(case, shapes, only=None):
    rows = []
    for bench, impl, dtype, factory, per in cases("cuda"):
        if only is not None and bench not in only:
            continue
        ps = opt = None
        try:
            ps = make_params(shapes, dtype, "cuda")
            opt = factory(ps)
            n = sum(p.numel() for p in ps)
            ms = time_cuda(opt.step, 3, 20)
            extra = {"tensors": len(ps), "wall_ms": wall_ms(opt.step)}
            rows.append(Row(bench, case, impl, ms, per * n / 1e9, host_ms(opt.step), extra))
        except Exception as exc:  # noqa: BLE001 - one failing row must not hide the others
            print(f"{bench} / {impl}: {type(exc).__name__}: {exc}")
        finally:
            ps = opt = None
            torch.cuda.empty_cache()
    return rows


_KERNELS = (
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_sgd",
    "multi_tensor_scale",
    "multi_tensor_adagrad",
    "multi_tensor_novograd",
    "multi_tensor_lamb",
    "multi_tensor_lamb_mp",
)
_NORMS = ("multi_tensor_l2norm", "multi_tensor_l2norm_mp")


def host_only_rows(n_tensors=300):
    """Python overhead per step with every kernel a no-op, on the CPU."""
    for name in _KERNELS:
        setattr(ops, name, lambda *a, **k: None)
    for name in _NORMS:
        setattr(ops, name, lambda *a, **k: (torch.zeros(1), torch.zeros(0)))
    rows = []
    for bench, impl, dtype, factory, _ in cases("cpu"):
        if impl.startswith("torch"):
            continue
        ps = make_params([(8,)] * n_tensors, dtype, "cpu")
        opt = factory(ps)
        for _ in range(10):
            opt.step()
        rows.append(dict(bench=bench, impl=impl + " (kernels stubbed)", tensors=n_tensors,
                         host_ms=host_ms(opt.step, rep=500, sync=False)))  # fmt: skip
    return rows


def write_host_only(rows, out: Path, name: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    lines = ["| bench | impl | tensors | host ms |", "|---|---|---:|---:|"]
    lines += [f"| {r['bench']} | {r['impl']} | {r['tensors']} | {r['host_ms']:.3f} |" for r in rows]
    table = "\n".join(lines)
    (out / f"{name}.md").write_text(table + "\n")
    return table


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--host-only", action="store_true", help="CPU, kernels stubbed: Python only")
    args = p.parse_args()
    if args.host_only or not torch.cuda.is_available():
        print(write_host_only(host_only_rows(), args.out, "bench_fused_optimizers"))
        return
    ceiling = copy_bandwidth()
    rows = gpu_rows("gpt-1.3B", gpt_like_shapes())
    # Many small tensors: host-bound for torch; adam and sgd only.
    rows += gpu_rows("5000x4096", small_shapes(), only=("adamw fp32", "sgd momentum fp32"))
    print(write_rows(rows, ceiling, args.out, "bench_fused_optimizers"))


if __name__ == "__main__":
    main()
