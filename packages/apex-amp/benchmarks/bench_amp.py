"""apex.amp against torch's own mixed precision, in one run on one GPU.

1. Training steps of a GPT-like MLP block stack (LayerNorm, Linear h->4h, GELU, Linear 4h->h,
   residual): amp O2 (fp16 and bf16; torch AdamW fused or apex FusedAdam on the fp32 masters)
   and O1 against torch.autocast + torch.amp.GradScaler (fp16) or plain torch.autocast (bf16)
   with torch.optim.AdamW(fused=True). Milliseconds per whole step (zero_grad, forward, loss,
   backward, unscale + overflow check, optimizer step, master copy), CUDA events, median.
   Targets (issue 7): O2 bf16 no slower than the torch baseline of the same dtype; O2 fp16 with
   FusedAdam at least 1.1x faster than autocast + GradScaler + fused AdamW.

2. amp's own per-step work on a 1.3 B-parameter GPT-like list (about 300 tensors), timed
   through ``amp.scale_loss`` (grads stashed on enter; on exit the unscale of the fp16 grads into
   fp32 master grads with the overflow check, read 2 + write 4 bytes per param, and the one flag
   read) and ``optimizer.step()`` (amp's wrapper: the master-to-model copy, read 4 + write 2,
   and the master grads released; the wrapped step is a no-op): 12 bytes per param against a
   device-to-device copy measured in the same run, host time included. Target: at least 90 %.

Usage: python bench_amp.py --out DIR [--layers 8 --hidden 2048 --tokens 2048,8192]
(each token count is its own table: few tokens weigh the per-param work, many the matmuls)
Writes DIR/bench_amp.md and DIR/bench_amp.json. ``--smoke`` runs tiny sizes on the CPU (host
timer) to check the script itself; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "apex-mta-kernels" / "benchmarks"))
from bench_utils import copy_bandwidth, gpt_like_shapes, time_cuda, warm_up  # noqa: E402

import apex.amp as amp  # noqa: E402


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.up = nn.Linear(h, 4 * h)
        self.down = nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


DEVICE = "cuda"


def make_model(layers, h):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(h) for _ in range(layers)], nn.LayerNorm(h)).to(DEVICE)


def time_ms(fn, warmup, rep):
    if DEVICE == "cuda":
        return time_cuda(fn, warmup=warmup, rep=rep)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def adamw(params):
    # fused=True on CUDA; the CPU smoke run takes foreach (torch < 2.4 has no fused CPU AdamW).
    return torch.optim.AdamW(params, lr=1e-4, fused=DEVICE == "cuda", foreach=DEVICE != "cuda")


def fused_adam(params):
    from apex.optimizers import FusedAdam

    return FusedAdam(params, lr=1e-4, adam_w_mode=True)


def torch_step_fn(layers, h, x, dtype):
    model = make_model(layers, h)
    opt = adamw(model.parameters())
    scaler = torch.amp.GradScaler(DEVICE) if dtype == torch.float16 else None

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=dtype):
            out = model(x)
        loss = out.float().pow(2).mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    return step


def amp_step_fn(layers, h, x, dtype, opt_level, make_opt):
    amp.reset()
    model = make_model(layers, h)
    opt = make_opt(model.parameters())
    model, opt = amp.initialize(
        model, opt, opt_level=opt_level, low_precision_dtype=dtype, verbosity=0
    )

    def step():
        opt.zero_grad()
        out = model(x)
        loss = out.float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    return step


def bench_training(args, tokens):
    layers, h = args.layers, args.hidden
    x = torch.randn(tokens, h, device=DEVICE)
    n_params = sum(p.numel() for p in make_model(layers, h).parameters())
    cases = [
        ("torch autocast fp16 + GradScaler + AdamW(fused)", torch.float16, None, None),
        ("torch autocast bf16 + AdamW(fused)", torch.bfloat16, None, None),
        ("amp O2 fp16 + AdamW(fused)", torch.float16, "O2", adamw),
        ("amp O2 fp16 + FusedAdam", torch.float16, "O2", fused_adam),
        ("amp O2 bf16 + AdamW(fused)", torch.bfloat16, "O2", adamw),
        ("amp O2 bf16 + FusedAdam", torch.bfloat16, "O2", fused_adam),
        ("amp O1 fp16 + AdamW(fused)", torch.float16, "O1", adamw),
        ("amp O1 bf16 + AdamW(fused)", torch.bfloat16, "O1", adamw),
    ]
    try:
        import apex.optimizers  # noqa: F401
    except ImportError:  # apex-optim not installed: torch optimizers only
        cases = [c for c in cases if c[3] is not fused_adam]
    rows = []
    for name, dtype, level, make_opt in cases:
        if level is None:
            step = torch_step_fn(layers, h, x, dtype)
        else:
            step = amp_step_fn(layers, h, x, dtype, level, make_opt)
        ms = time_ms(step, args.warmup, args.rep)
        rows.append({"case": name, "dtype": str(dtype), "ms": ms})
        del step
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    amp.reset()
    base = {str(torch.float16): rows[0]["ms"], str(torch.bfloat16): rows[1]["ms"]}
    for r in rows:
        r["speedup_vs_torch_same_dtype"] = base[r["dtype"]] / r["ms"]
    return {"layers": layers, "hidden": h, "tokens": tokens, "params": n_params}, rows


class _NoStep(torch.optim.SGD):
    """An optimizer whose own step does nothing: ``opt.step()`` then times amp's step wrapper
    alone (the master -> model copy and releasing the master grads)."""

    def step(self, closure=None):
        return None


class _Spans:
    """Milliseconds between mark() calls, leaving out what runs inside ``excluded()``: CUDA
    events on the GPU (host time in the spans counts while the GPU waits on it), a host timer on
    the CPU."""

    def __init__(self):
        self.marks = []

    def mark(self):
        if DEVICE == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    @contextlib.contextmanager
    def excluded(self):
        self.mark()
        yield
        self.mark()

    def ms(self) -> float:
        pairs = list(zip(self.marks[::2], self.marks[1::2]))
        if DEVICE == "cuda":
            self.marks[-1].synchronize()
            return sum(a.elapsed_time(b) for a, b in pairs)
        return sum((b - a) * 1e3 for a, b in pairs)


def time_spans(fn, warmup, rep):
    """Median milliseconds of ``fn(spans)`` minus what it runs in ``spans.excluded()``."""
    if DEVICE == "cuda":
        warm_up(lambda: fn(_Spans()), warmup)
    else:
        for _ in range(warmup):
            fn(_Spans())
    times = []
    for _ in range(rep):
        spans = _Spans()
        spans.mark()
        fn(spans)
        spans.mark()
        times.append(spans.ms())
    return statistics.median(times)


def overhead_setup():
    """bench_overhead's setup, also scripts/profile_gpu.py's: the 1.3 B-parameter GPT-like list
    (a tiny one on the CPU) under amp O2 fp16 with a no-op optimizer step, its masters made.
    Returns ``(opt, params, grads, loss)``: the amp-wrapped optimizer, the fp16 model params,
    an fp16 grad for each (what a backward would write) and a zero loss for ``scale_loss``."""
    shapes = gpt_like_shapes() if DEVICE == "cuda" else gpt_like_shapes(2, 64, 128)
    holder = nn.ParameterList(
        [nn.Parameter(torch.empty(s, device=DEVICE).normal_(0, 0.02)) for s in shapes]
    )
    opt = _NoStep(holder.parameters(), lr=0.0)
    holder, opt = amp.initialize(
        holder, opt, opt_level="O2", low_precision_dtype=torch.float16, verbosity=0
    )
    opt._lazy_init_maybe_master_weights()
    params = opt._amp_stash.all_fp16_params
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    return opt, params, grads, torch.zeros((), device=DEVICE)


def bench_overhead(args):
    """amp's own per-step work on a 1.3 B list, through the calls a training step makes:
    ``scale_loss`` around a backward (enter: stash and clear the grads; exit: unscale the fp16
    grads into the fp32 master grads with the overflow check, read the flag) and
    ``optimizer.step()`` (amp's wrapper: master -> model copy, master grads released; the
    wrapped optimizer's own step is a no-op here). The backward itself is left out: the fp16
    grads are assigned inside ``excluded()``, host work while the GPU is idle. The GPU starts
    each span idle (the flag read syncs), so amp's host time counts in full; in training it
    partly overlaps the backward's kernels."""
    amp.reset()
    opt, params, grads, loss = overhead_setup()
    n = sum(p.numel() for p in params)

    def scale_loss(spans):
        with amp.scale_loss(loss, opt):
            with spans.excluded():  # the backward: writes the fp16 grads
                for p, g in zip(params, grads):
                    p.grad = g

    masters = opt._amp_stash.all_fp32_from_fp16_params

    def scale_loss_alone(spans):
        # What step() would leave: no master grads (else the next exit accumulates into them,
        # 10 bytes a param, not the unscale's 6).
        scale_loss(spans)
        with spans.excluded():
            for m in masters:
                m.grad = None

    def step(spans):
        opt.step()

    def both(spans):
        scale_loss(spans)
        step(spans)

    if DEVICE == "cuda":
        ceiling_tbps = copy_bandwidth().tbps
    else:
        src = torch.randn(n)
        dst = torch.empty_like(src)
        ceiling_tbps = 2 * n * 4 / 1e9 / time_ms(lambda: dst.copy_(src), 2, 5)
    out = []
    for name, fn, bytes_per in (
        ("unscale + overflow check + flag read", scale_loss_alone, 6),
        ("master -> model copy", step, 6),
        ("amp per-step total", both, 12),
    ):
        ms = time_spans(fn, args.warmup, args.rep)
        gb = n * bytes_per / 1e9
        out.append(
            {
                "case": name,
                "ms": ms,
                "gbytes": gb,
                "tbps": gb / ms,
                "pct_copy": 100 * (gb / ms) / ceiling_tbps,
            }
        )
    stash = opt._amp_stash
    paths = {"plan_unscales": stash.plan_unscales, "plan_misses": dict(stash.plan_misses)}
    amp.reset()
    return {"params": n, "tensors": len(params), "copy_tbps": ceiling_tbps, **paths}, out


def _device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--tokens", default="2048,8192", help="comma-separated token counts")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
        args.layers, args.hidden, args.tokens, args.warmup, args.rep = 2, 32, "16", 1, 2
    elif not torch.cuda.is_available():
        note = "bench_amp: no CUDA GPU here; nothing measured.\n"
        (args.out / "bench_amp.md").write_text(note)
        print(note, end="")
        return 0

    training = [bench_training(args, int(t)) for t in str(args.tokens).split(",")]
    over_info, over_rows = bench_overhead(args)
    (args.out / "bench_amp.json").write_text(
        json.dumps(
            {
                "device": _device_name(),
                "torch": torch.__version__,
                "training": [{"setup": info, "rows": rows} for info, rows in training],
                "overhead": {"setup": over_info, "rows": over_rows},
            },
            indent=1,
        )
    )
    lines = [f"# bench_amp ({_device_name()}, torch {torch.__version__})"]
    for train_info, train_rows in training:
        fp16_base = train_rows[0]["ms"]
        lines += [
            "",
            f"Training step, GPT-like MLP stack: {train_info['layers']} blocks, hidden "
            f"{train_info['hidden']}, {train_info['tokens']} tokens, "
            f"{train_info['params'] / 1e6:.0f} M params; median of {args.rep} steps.",
            "",
            "| case | ms/step | vs torch same dtype | vs autocast fp16 + GradScaler |",
            "|---|---:|---:|---:|",
        ]
        for r in train_rows:
            lines.append(
                f"| {r['case']} | {r['ms']:.2f} | {r['speedup_vs_torch_same_dtype']:.3f}x | "
                f"{fp16_base / r['ms']:.3f}x |"
            )
    lines += [
        "",
        f"amp per-step overhead, {over_info['params'] / 1e9:.2f} B params in "
        f"{over_info['tensors']} tensors; copy bandwidth {over_info['copy_tbps']:.2f} TB/s. "
        f"Unscales through amp's plan: {over_info['plan_unscales']}; through the general path: "
        f"{over_info['plan_misses'] or 'none'}.",
        "",
        "| work | ms | GB moved | TB/s | % of copy |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in over_rows:
        lines.append(
            f"| {r['case']} | {r['ms']:.3f} | {r['gbytes']:.2f} | {r['tbps']:.2f} | "
            f"{r['pct_copy']:.1f} |"
        )
    table = "\n".join(lines) + "\n"
    (args.out / "bench_amp.md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
