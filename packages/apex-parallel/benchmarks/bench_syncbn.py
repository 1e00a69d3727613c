"""SyncBatchNorm forward+backward on one GPU against torch.nn.SyncBatchNorm's sync path and
torch.nn.BatchNorm2d; apex DistributedDataParallel against torch's, in one run.

x = [64, 256, 56, 56] in bf16 and fp32, NCHW and channels_last. A one-rank NCCL process group
is initialised so both SyncBatchNorms run as in training:

- ``apex SyncBatchNorm``: the module (Welford statistics, merge, forward; backward reduce and
  elementwise). With one rank its collectives are skipped; the kernels are the sync path's.
- ``torch SyncBatchNorm (sync path)``: ``torch.nn.modules._functions.SyncBatchNorm`` called
  directly, because the module itself drops to a local batch_norm at world size 1.
- ``torch BatchNorm2d``: cuDNN/native batch norm.

Per row: ms (CUDA events around one eager call, median: for a host-bound implementation this
is the host's pace, not the kernels'), host ms to issue one call (median, no sync inside), and
bytes as 5 tensors moved (x read and y written forward; dy and x read, dx written backward)
against a device-to-device copy measured in the same run. ``graph ms`` is the kernel time: the
same forward+backward captured in a CUDA graph (10 calls per graph) and replayed, so launch gaps
and host time vanish; ``graph pct copy`` is the bandwidth figure of that kernel time, and
``host over kernel`` is host ms / graph ms (below 1: the GPU, not the host, sets the pace).
An implementation whose call cannot be captured (a collective or a host sync inside) shows
nan there and the reason is printed. ``host burst ms`` is host time measured another way: 20
calls issued back to back (no sync between them) divided by 20, the host's pace in a training
loop; ``host ms`` times each call alone right after a synchronisation, which also counts the
wake-up of threads that slept through it. The ``floor`` rows are the least a differentiable
call costs the host: ``x * 2`` forward+backward (one kernel each way) and an identity
autograd.Function. ``benchmarks/host_syncbn.py`` measures the Python side without a GPU. The DDP rows time a whole forward +
backward of a small convolutional model (bytes 0: not a bandwidth benchmark).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from apex.parallel import DistributedDataParallel, SyncBatchNorm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "apex-mta-kernels" / "benchmarks"))
from bench_utils import (  # noqa: E402
    Row,
    copy_bandwidth,
    graph_ms,
    host_ms,
    time_cuda,
    wall_ms,
    write,
)
from host_syncbn import Identity  # noqa: E402 - beside this script (sys.path[0])

SHAPE = (64, 256, 56, 56)


def init_one_rank_group() -> bool:
    if dist.is_initialized():
        return True
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    try:
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    except Exception as e:  # noqa: BLE001 - reported, the local rows still run
        print(f"no NCCL process group ({type(e).__name__}: {e}); torch's sync path is skipped")
        return False
    return True


def torch_sync_path(bn):
    from torch.nn.modules._functions import SyncBatchNorm as TorchSyncFn

    group = dist.group.WORLD

    def run(x):
        return TorchSyncFn.apply(
            x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps, bn.momentum, group, 1
        )

    return run


def kernel_ms(step, name, case):
    """Kernel time of ``step`` from CUDA-graph replays, or nan (with the reason printed)."""
    try:
        ms = graph_ms(step)
    except Exception as e:  # noqa: BLE001 - capture may break the process group's stream state
        print(f"{name} {case}: no CUDA graph ({type(e).__name__}: {e})")
        torch.cuda.synchronize()
        return float("nan")
    if ms is None:
        print(f"{name} {case}: not capturable in a CUDA graph (a collective or host sync inside)")
        return float("nan")
    return ms


def _inputs(dtype, layout):
    """(x, g, case): the benchmark's input (requires grad) and output gradient in ``layout``."""
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = (
        torch.randn(SHAPE, device="cuda", dtype=dtype)
        .contiguous(memory_format=fmt)
        .requires_grad_()
    )
    g = torch.randn(SHAPE, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
    return x, g, f"{list(SHAPE)} {str(dtype).replace('torch.', '')} {layout}"


def _row(case, name, step, gbytes):
    """The eager measurements of ``step``: kernel (events), host, wall and host burst time."""
    ms = time_cuda(step, warmup=5, rep=30)
    host = host_ms(step, rep=30)
    wall = wall_ms(step, rep=20)
    extra = {"wall_ms": wall, "host_burst_ms": host_ms(step, rep=15, calls=20)}
    return Row("syncbn fwd+bwd", case, name, ms, gbytes, host, extra)


def floor_rows(dtype, layout, graphs):
    x, g, case = _inputs(dtype, layout)
    rows = []
    for name, fn in (
        ("floor: x * 2", lambda: x * 2),
        ("floor: identity Function", lambda: Identity.apply(x)),
    ):

        def step(fn=fn):
            x.grad = None
            fn().backward(g)

        row = _row(case, name, step, 0.0)
        rows.append(row)
        graphs.append((row, step))
    return rows


def bn_rows(dtype, layout, have_group, graphs):
    x, g, case = _inputs(dtype, layout)
    gbytes = 5 * x.numel() * x.element_size() / 1e9
    c = SHAPE[1]
    impls = {"apex SyncBatchNorm": SyncBatchNorm(c).cuda()}
    if have_group:
        impls["torch SyncBatchNorm (sync path)"] = torch_sync_path(torch.nn.SyncBatchNorm(c).cuda())
    impls["torch BatchNorm2d"] = torch.nn.BatchNorm2d(c).cuda()
    rows = []
    for name, mod in impls.items():

        def step(mod=mod):
            x.grad = None
            mod(x).backward(g)

        try:
            row = _row(case, name, step, gbytes)
        except Exception as e:  # noqa: BLE001 - one failing implementation must not hide the rest
            print(f"{name} {case}: {type(e).__name__}: {e}")
            continue
        rows.append(row)
        graphs.append((row, step))
    return rows


def add_kernel_times(graphs, ceiling):
    """The CUDA-graph pass, after every eager measurement: torch's sync path (an NCCL
    collective inside) goes last, so a capture that breaks the process group spoils nothing."""
    graphs = sorted(graphs, key=lambda rs: rs[0].impl.startswith("torch SyncBatchNorm"))
    for row, step in graphs:
        kms = kernel_ms(step, row.impl, row.case)
        row.extra.update(
            graph_ms=kms,
            graph_pct_copy=100 * (row.gbytes / kms) / ceiling.tbps,
            host_over_kernel=row.host_ms / kms,
            burst_over_kernel=row.extra["host_burst_ms"] / kms,
        )


def ddp_model():
    """The DDP rows' model: 4 conv + BatchNorm + ReLU stages and a linear head (channels_last)."""
    torch.manual_seed(0)
    layers = []
    ch = 3
    for out in (64, 128, 256, 256):
        layers += [
            torch.nn.Conv2d(ch, out, 3, padding=1),
            torch.nn.BatchNorm2d(out),
            torch.nn.ReLU(),
        ]
        ch = out
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(ch, 1000)]
    return torch.nn.Sequential(*layers).cuda().to(memory_format=torch.channels_last)


def ddp_step(ddp, x):
    """One training step of the DDP rows: gradients reset, bf16 autocast forward, backward."""
    for p in ddp.parameters():
        p.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = ddp(x)
    out.float().square().mean().backward()


def ddp_rows():
    x = torch.randn(32, 3, 64, 64, device="cuda").contiguous(memory_format=torch.channels_last)
    rows = []
    wrappers = {
        "apex DistributedDataParallel": lambda m: DistributedDataParallel(m),
        "apex DDP delay_allreduce": lambda m: DistributedDataParallel(m, delay_allreduce=True),
        "torch DistributedDataParallel": lambda m: torch.nn.parallel.DistributedDataParallel(m),
    }
    for name, wrap in wrappers.items():
        ddp = wrap(ddp_model())

        def step(ddp=ddp):
            ddp_step(ddp, x)

        ms = time_cuda(step, warmup=5, rep=20)
        host = host_ms(step, rep=20)
        wall = wall_ms(step, rep=20)
        extra = {"wall_ms": wall, "host_burst_ms": host_ms(step, rep=5, calls=5)}
        rows.append(
            Row(
                "ddp fwd+bwd",
                "4-conv net, batch 32x3x64x64, bf16 autocast",
                name,
                ms,
                0.0,
                host,
                extra,
            )
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_syncbn: no CUDA device; nothing to do")
        return
    torch.cuda.set_device(0)
    have_group = init_one_rank_group()
    ceiling = copy_bandwidth()
    rows, graphs = [], []
    for dtype in (torch.bfloat16, torch.float32):
        for layout in ("channels_last", "nchw"):
            rows += bn_rows(dtype, layout, have_group, graphs)
    rows += floor_rows(torch.bfloat16, "channels_last", graphs)
    if have_group:
        rows += ddp_rows()
    add_kernel_times(graphs, ceiling)
    table = write(rows, ceiling, args.out, "bench_syncbn")
    wall = ["", "| impl | case | wall ms (fwd+bwd, synced) |", "|---|---|---:|"]
    wall += [f"| {r.impl} | {r.case} | {r.extra['wall_ms']:.3f} |" for r in rows]
    with open(args.out / "bench_syncbn.md", "a") as f:
        f.write("\n".join(wall) + "\n")
    print(table)
    print("\n".join(wall))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
