"""Shared benchmark helpers: CUDA-event timing, the copy-bandwidth ceiling, the GPT-like list.

Method (shared/.library METHOD.md): warm up, time many repetitions with CUDA events, report the
median; count the bytes that must move (each input read once, each output written once) and
compare against a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class Row:
    bench: str
    case: str
    impl: str
    ms: float
    gbytes: float
    host_ms: float = float("nan")
    extra: dict = field(default_factory=dict)

    @property
    def tbps(self) -> float:
        return self.gbytes / self.ms if self.ms > 0 else float("nan")  # GB/ms == TB/s


def warm_up(fn, calls: int = 5, ms: float = 100.0) -> None:
    """At least ``calls`` calls of ``fn()`` and ``ms`` milliseconds of them, synchronized: an
    idle H200 sits at 345 MHz, and a case timed right after a pause (a new model, a new process)
    measured its first rows at the lower clock (seen: apex DDP 8.4 ms against 3.9 ms). No calls
    at all when ``calls`` is 0. Not for collectives across ranks: the ranks' call counts differ."""
    if calls <= 0:
        return
    start = time.perf_counter()
    done = 0
    while done < calls or (time.perf_counter() - start) * 1e3 < ms:
        fn()
        done += 1
        if done >= calls:
            torch.cuda.synchronize()


def time_cuda(fn, warmup: int = 5, rep: int = 20) -> float:
    """Median milliseconds of ``fn()`` on the current stream, by CUDA events, after
    ``warm_up`` (``warmup`` calls and at least 100 ms)."""
    warm_up(fn, warmup)
    times = []
    for _ in range(rep):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn, per_graph: int = 10, warmup: int = 3, rep: int = 15) -> float | None:
    """Median milliseconds of one ``fn()`` replayed from a CUDA graph of ``per_graph`` calls:
    the device time of its kernels with the launch gaps shrunk (METHOD.md: "for many small
    launches, capture a graph and time its replays"). None if ``fn`` cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up off the capture stream (lazy init, autotuning, caches)
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(per_graph):
                fn()
    except Exception:  # noqa: BLE001 - not capturable: the caller falls back to events
        torch.cuda.synchronize()
        return None
    ms = time_cuda(graph.replay, warmup=warmup, rep=rep) / per_graph
    del graph
    return ms


def host_ms(fn, rep: int = 50, calls: int = 1, sync: bool = True) -> float:
    """Median host milliseconds per call to issue ``fn()`` (no sync inside the timed region):
    ``calls`` calls back to back per sample (a burst: the launch queue fills as in training),
    each sample after a device sync unless ``sync`` is False (then the queue may be full and
    the issue wait on it)."""
    times = []
    for _ in range(rep):
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) * 1e3 / calls)
    if sync:
        torch.cuda.synchronize()
    return statistics.median(times)


def wall_ms(fn, warmup: int = 3, rep: int = 20) -> float:
    """Median wall milliseconds of ``fn()`` including the final synchronisation."""
    warm_up(fn, warmup)
    times = []
    for _ in range(rep):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def steady_ms(fn, calls: int = 50, rep: int = 7) -> float:
    """Median wall milliseconds per call of ``calls`` calls back to back with one synchronisation
    at the end: what a loop of eager calls (a training loop) sees, the host running ahead."""
    warm_up(fn, 3)
    times = []
    for _ in range(rep):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth(gbytes: float = 4.0) -> Row:
    """The ceiling: a large device-to-device copy, counting bytes read plus bytes written."""
    n = int(gbytes * 1e9 / 2 / 4)
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), warmup=5, rep=30)
    return Row("copy", f"{n * 4 / 1e9:.1f} GB fp32", "torch copy_", ms, 2 * n * 4 / 1e9)


def gpt_like_shapes(layers: int = 24, h: int = 2048, vocab: int = 50304) -> list[tuple[int, ...]]:
    """About 1.3 B parameters in about 300 tensors, shaped like a GPT block stack."""
    shapes: list[tuple[int, ...]] = [(vocab, h), (h, h)]
    for _ in range(layers):
        shapes += [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]
        shapes += [(h,), (h,), (h,), (h,)]  # two LayerNorms, weight and bias
    return shapes


def small_shapes(n: int = 5000, size: int = 4096) -> list[tuple[int, ...]]:
    return [(size,)] * n


def make(shapes, dtype=torch.float32, device="cuda", fill="randn") -> list[torch.Tensor]:
    out = []
    for s in shapes:
        t = torch.empty(s, dtype=dtype, device=device)
        if fill == "randn":
            t.normal_()
        elif fill == "rand":
            t.uniform_(0.0, 1.0)
        out.append(t)
    return out


def numel(tensors) -> int:
    return sum(t.numel() for t in tensors)


def _num(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def write(rows: list[Row], ceiling: Row, out_dir: Path, name: str) -> str:
    """Write raw rows as JSON and a markdown table; return the table. Keys of the rows'
    ``extra`` dicts that hold numbers become extra columns (tensors, wall ms, ...)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = [dict(asdict(r), tbps=r.tbps, pct_copy=100 * r.tbps / ceiling.tbps) for r in rows]
    (out_dir / f"{name}.json").write_text(
        json.dumps({"ceiling": asdict(ceiling), "rows": data}, indent=1)
    )
    extras = []
    for r in rows:
        extras += [k for k, v in r.extra.items() if isinstance(v, (int, float)) and k not in extras]
    lines = [
        f"copy bandwidth (same run): {ceiling.tbps:.2f} TB/s ({ceiling.case})",
        "",
        "| bench | case | impl | ms | GB moved | TB/s | % of copy | host ms |"
        + "".join(f" {k.replace('_', ' ')} |" for k in extras),
        "|---|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(extras),
    ]
    for r in rows:
        cells = "".join(f" {_num(r.extra.get(k))} |" for k in extras)
        lines.append(
            f"| {r.bench} | {r.case} | {r.impl} | {r.ms:.3f} | {r.gbytes:.2f} | {r.tbps:.2f} | "
            f"{100 * r.tbps / ceiling.tbps:.1f} | {r.host_ms:.3f} |{cells}"
        )
    table = "\n".join(lines)
    (out_dir / f"{name}.md").write_text(table + "\n")
    return table
