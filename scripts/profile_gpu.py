"""Where the time goes, on the GPU machine (torch.profiler, no hardware counters needed):

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python scripts/profile_gpu.py amp|syncbn|norm|norm-one

- ``amp``: amp's per-step work on the 1.3 B list of bench_amp (scale_loss enter, exit, step): the
  host time of each phase, then the kernels of one step on the GPU's timeline with the idle gaps
  between them (host time the GPU waits on).
- ``syncbn``: apex SyncBatchNorm forward+backward, x = [64, 256, 56, 56], bf16 and fp32 in both
  layouts: each kernel's device time and what it moves, as % of the copy rate.
- ``norm``: LayerNorm and RMSNorm bf16 [32768, H] forward+backward: each kernel's time
  (``NORM_H=1024,16384``: the hidden sizes, default 4096).
- ``syncbn-one``: one bf16 channels_last forward+backward, nothing else (for ncu).
- ``norm-one``: one RMSNorm and one LayerNorm bf16 [32768, 4096] forward+backward, nothing else
  (for ncu: ``ncu --clock-control none -k regex:bwd ... python scripts/profile_gpu.py norm-one``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages/apex-mta-kernels/benchmarks"))
from bench_utils import copy_bandwidth  # noqa: E402


def kernels(prof):
    """The CUDA kernels and copies the profiler saw, in time order: (name, start us, end us)."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            start = e.time_range.start
            out.append((e.name, start, start + e.device_time))
    return sorted(out, key=lambda k: k[1])


def kernel_line(ev, tensor_gb):
    """One kernel of a profile: calls, device time per call, and one tensor's bytes over it."""
    us = ev.device_time_total / ev.count
    return (
        f"  {ev.count:4d} x {us:8.1f} us  {tensor_gb / (us * 1e-6) / 1e3:6.2f} TB/s per "
        f"tensor-pass  {ev.key[:90]}"
    )


def timeline(ks, limit=40):
    t0 = ks[0][1]
    busy = sum(e - s for _, s, e in ks)
    span = ks[-1][2] - t0
    prev = t0
    for name, s, e in ks[:limit]:
        print(f"  +{s - t0:9.1f} us  gap {s - prev:7.1f}  dur {e - s:8.1f}  {name[:90]}")
        prev = e
    print(f"  kernels busy {busy:.1f} us of a {span:.1f} us span ({100 * busy / span:.1f} %)")


def amp_profile():
    sys.path.insert(0, str(ROOT / "packages/apex-amp/benchmarks"))
    from bench_amp import overhead_setup

    from apex import amp

    opt, params, grads, loss = overhead_setup()  # bench_amp's 1.3 B list, on "cuda"
    n = sum(p.numel() for p in params)
    ceiling = copy_bandwidth().tbps

    def one(phases=None):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cm = amp.scale_loss(loss, opt)
        cm.__enter__()
        t1 = time.perf_counter()
        for p, g in zip(params, grads):
            p.grad = g
        t2 = time.perf_counter()
        cm.__exit__(None, None, None)
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        torch.cuda.synchronize()
        t5 = time.perf_counter()
        if phases is not None:
            phases.append((t1 - t0, t3 - t2, t4 - t3, t5 - t4, t5 - t0 - (t2 - t1)))

    for _ in range(5):
        one()
    phases = []
    for _ in range(20):
        one(phases)
    print(f"amp: {n / 1e9:.3f} B params in {len(params)} tensors, copy {ceiling:.2f} TB/s")
    for i, name in enumerate(
        (
            "enter (host)",
            "exit (host, incl. flag read)",
            "step (host)",
            "sync after step",
            "total less the grads' assignment",
        )
    ):
        print(f"  {name:34s} {1e3 * statistics.median(p[i] for p in phases):8.3f} ms")
    floor = n * 12 / 1e9 / ceiling
    print(f"  12 B/param at the copy rate: {floor:.3f} ms")
    stash = opt._amp_stash
    print(
        f"  unscales through amp's plan: {stash.plan_unscales}; general path: {stash.plan_misses}"
    )
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one()
    print("  one step on the GPU's timeline:")
    timeline(kernels(prof))
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60
        )
    )


def syncbn_profile():
    from apex.parallel import SyncBatchNorm

    ceiling = copy_bandwidth().tbps
    shape = (64, 256, 56, 56)
    for dtype in (torch.bfloat16, torch.float32):
        for cl in (True, False):
            bn = SyncBatchNorm(shape[1], channel_last=cl).cuda()
            x = torch.randn(shape, device="cuda", dtype=dtype)
            if cl:
                x = x.to(memory_format=torch.channels_last)
            x.requires_grad_(True)
            dy = torch.randn_like(x)
            for _ in range(5):
                bn(x).backward(dy)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    bn(x).backward(dy)
                torch.cuda.synchronize()
            tensor_gb = x.numel() * x.element_size() / 1e9
            print(
                f"syncbn {dtype} {'channels_last' if cl else 'NCHW'}: one tensor "
                f"{tensor_gb:.3f} GB, copy {ceiling:.2f} TB/s"
            )
            tot = 0.0
            for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
                if ev.device_time_total <= 0:
                    continue
                tot += ev.device_time_total / 10
                print(kernel_line(ev, tensor_gb))
            print(
                f"  device time per fwd+bwd {tot:.1f} us = {100 * 5 * tensor_gb / (tot * 1e-6) / 1e3 / ceiling:.1f} % of copy (5 tensors)"
            )


def norm_step(kind, x, w, b, dy):
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine

    if kind == "rms":
        y = fused_rms_norm_affine(x, w, (x.shape[-1],), 1e-5)
    else:
        y = fused_layer_norm_affine(x, w, b, (x.shape[-1],), 1e-5)
    y.backward(dy)


def norm_inputs(h=4096, dtype=torch.bfloat16):
    x = torch.randn(32768, h, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(h, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(h, device="cuda", dtype=dtype, requires_grad=True)
    return x, w, b, torch.randn_like(x)


def norm_profile():
    ceiling = copy_bandwidth().tbps
    for h in (int(v) for v in os.environ.get("NORM_H", "4096").split(",")):
        norm_profile_h(h, ceiling)


def norm_profile_h(h, ceiling):
    x, w, b, dy = norm_inputs(h)
    gb = x.numel() * x.element_size() / 1e9
    for kind in ("rms", "ln"):
        for _ in range(5):
            norm_step(kind, x, w, b, dy)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                norm_step(kind, x, w, b, dy)
            torch.cuda.synchronize()
        print(f"norm {kind} bf16 [32768, {h}]: one tensor {gb:.3f} GB, copy {ceiling:.2f} TB/s")
        for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
            if ev.device_time_total > 0:
                print(kernel_line(ev, gb))


def syncbn_one():
    from apex.parallel import SyncBatchNorm

    bn = SyncBatchNorm(256, channel_last=True).cuda()
    x = torch.randn(64, 56, 56, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bn(x).backward(torch.randn_like(x))
    torch.cuda.synchronize()


def norm_one():
    x, w, b, dy = norm_inputs()
    for kind in ("rms", "ln"):
        norm_step(kind, x, w, b, dy)
    torch.cuda.synchronize()


if __name__ == "__main__":
    {
        "amp": amp_profile,
        "syncbn": syncbn_profile,
        "syncbn-one": syncbn_one,
        "norm": norm_profile,
        "norm-one": norm_one,
    }[sys.argv[1]]()
