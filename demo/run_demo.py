"""The apex-* stack against plain torch, in one run, on whatever this machine has.

1. A small GPT-style byte-level language model trained on the text this repository ships (its
   *.md and *.py files, read now; nothing is downloaded), twice from the same initial weights and
   the same batches:
   apex:  apex.amp (bf16) + apex.optimizers.FusedAdam + apex.normalization.FusedLayerNorm/RMSNorm
   torch: torch.autocast(bf16) + torch.optim.AdamW (fused on CUDA, foreach on CPU) + nn.LayerNorm
2. A small ResNet-style CNN on generated class-conditional images, on 2 processes:
   apex:  apex.parallel.convert_syncbn_model + apex.parallel.DistributedDataParallel + FusedSGD
   torch: nn.SyncBatchNorm (plain BatchNorm on CPU, where torch's refuses to run) + torch DDP + SGD

Both stacks train in the same process, in alternating blocks of steps, so that other work on a
shared machine slows both alike. It prints loss and throughput of each, the speed ratio apex/torch, writes a PNG plot and a JSON
file of the numbers into --out, and exits non-zero if apex's loss does not fall or ends far above
torch's.

    python demo/run_demo.py                 # GPU if there is one, else the CPU default (minutes)
    python demo/run_demo.py --quick         # tiny, for tests
    python demo/run_demo.py --device cpu --steps 100 --out /tmp/demo
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import queue
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".nox", ".venv", "venv", "build", "dist", "_build", "node_modules", "demo-out"}
# Pass/fail rules.
MAX_FINAL_OVER_INITIAL = 0.8  # apex's final mean loss must be below 0.8x its initial one
MAX_FINAL_OVER_TORCH = 1.15  # ... and at most 15% (+0.05) above torch's final loss
LOSS_WINDOW = 10  # steps averaged for "initial" and "final" loss


# --- configuration --------------------------------------------------------------------------


@dataclass
class GPTConfig:
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 4
    context: int = 128
    batch: int = 16
    steps: int = 200
    lr: float = 3e-3
    warmup: int = 20
    vocab: int = 256  # bytes


@dataclass
class CNNConfig:
    width: int = 16
    image: int = 16
    classes: int = 10
    batch: int = 32  # per process
    steps: int = 100
    lr: float = 0.05
    world: int = 2
    cuda: bool = False  # NCCL on 2 GPUs, else gloo on the CPU
    time_limit: float = 300.0  # seconds for the whole 2-process part (hang guard)


def configs(args: argparse.Namespace, device: torch.device) -> tuple[GPTConfig, CNNConfig]:
    gpt, cnn = GPTConfig(), CNNConfig()
    if device.type == "cuda":
        gpt.batch, gpt.steps = 64, 500
    cnn.cuda = device.type == "cuda" and torch.cuda.device_count() >= cnn.world
    if cnn.cuda:
        # The first steps may compile apex-parallel's kernels: a generous limit.
        cnn.width, cnn.image, cnn.batch, cnn.steps, cnn.time_limit = 32, 32, 128, 200, 600.0
    if args.quick:
        gpt = GPTConfig(n_layer=2, d_model=64, n_head=2, context=32, batch=8, steps=40, warmup=5)
        cnn.width, cnn.image, cnn.batch, cnn.steps = 8, 8, 16, 25
        cnn.time_limit = 600.0 if cnn.cuda else 120.0
    if args.steps is not None:
        gpt.steps = args.steps
    if args.cnn_steps is not None:
        cnn.steps = args.cnn_steps
    if args.time_limit is not None:
        cnn.time_limit = args.time_limit
    return gpt, cnn


# --- progress -------------------------------------------------------------------------------


class SimpleBar:
    """tqdm's few calls used here, for machines without tqdm."""

    def __init__(self, total: int, desc: str, width: int = 30) -> None:
        self.total, self.desc, self.width, self.n, self.post = total, desc, width, 0, ""
        self.start = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._draw()

    def set_postfix_str(self, s: str) -> None:
        self.post = s

    def _draw(self) -> None:
        done = int(self.width * self.n / max(self.total, 1))
        rate = self.n / max(time.perf_counter() - self.start, 1e-9)
        bar = "#" * done + "." * (self.width - done)
        line = f"\r{self.desc}: [{bar}] {self.n}/{self.total} {rate:.1f} it/s {self.post}"
        sys.stderr.write(line)
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return SimpleBar(total, desc)
    return tqdm(total=total, desc=desc, leave=True, dynamic_ncols=True, file=sys.stderr)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- part 1: GPT ----------------------------------------------------------------------------


def repo_text() -> bytes:
    """Every *.md and *.py file of the repository, in a fixed order, as one byte string."""
    chunks = []
    for top, dirs, files in os.walk(REPO):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith((".md", ".py")):
                try:
                    chunks.append((Path(top) / name).read_bytes())
                except OSError:
                    continue
    return b"\n".join(chunks)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, norm) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.norm1 = norm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm2 = norm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, norm) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, norm) for _ in range(cfg.n_layer))
        self.norm = norm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02  # fmt: skip
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def gpt_batches(data: torch.Tensor, cfg: GPTConfig, n: int, seed: int):
    """n batches of (input, target) windows, the same for every run with the same seed."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(data) - cfg.context - 1, (n, cfg.batch), generator=g)
    offsets = torch.arange(cfg.context + 1)
    for s in starts:
        w = data[s[:, None] + offsets]
        yield w[:, :-1], w[:, 1:]


def lr_at(step: int, cfg: GPTConfig) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def norm_classes(kind: str):
    from apex.normalization import FusedLayerNorm, FusedRMSNorm

    if kind == "rms":
        return FusedRMSNorm, nn.RMSNorm
    return FusedLayerNorm, nn.LayerNorm


def gpt_stepper(stack: str, cfg: GPTConfig, init_state: dict, device, args):
    """The model and a ``step(i, x, y) -> loss`` closure for one stack."""
    apex_norm, torch_norm = norm_classes(args.norm)
    model = GPT(cfg, apex_norm if stack == "apex" else torch_norm)
    model.load_state_dict(init_state)  # the same weights for both stacks
    model.to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    betas = (0.9, 0.95)

    if stack == "apex":
        from apex import amp
        from apex.optimizers import FusedAdam, clip_grad_norm_

        opt = FusedAdam(groups, lr=cfg.lr, betas=betas, eps=1e-8, adam_w_mode=True)
        # O2: bf16 model, fp32 master weights in the optimizer; bf16 needs no loss scaling.
        model, opt = amp.initialize(
            model, opt, opt_level=args.opt_level, low_precision_dtype=torch.bfloat16, verbosity=0
        )

        def forward(x):
            return model(x)

        def backward_and_step(loss):
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            clip_grad_norm_(amp.master_params(opt), 1.0)
            opt.step()
    else:
        fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=1e-8, **fused)

        def forward(x):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return model(x)

        def backward_and_step(loss):
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

    def loss_of(x, y):
        logits = forward(x.to(device, non_blocking=True))
        return F.cross_entropy(logits.float().view(-1, cfg.vocab), y.to(device).reshape(-1))

    def step(i, x, y):
        for g in opt.param_groups:
            g["lr"] = lr_at(i, cfg)
        loss = loss_of(x, y)
        backward_and_step(loss)
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    model.train()
    return model, step, loss_of


def interleave(steppers: dict, batches, steps: int, device, bar, barrier=None) -> dict:
    """Trains every stack on the same batches, alternating blocks of steps between them (the
    order flips each block), so that a machine shared with other work slows all stacks alike.
    The first block of each is a warm-up (kernel builds, allocator) and is not timed."""
    block = min(10, max(steps // 5, 1))
    names = list(steppers)
    losses = {n: [] for n in names}
    seconds = dict.fromkeys(names, 0.0)
    timed, done, it = 0, 0, iter(batches)
    while done < steps:
        chunk = list(itertools.islice(it, min(block, steps - done)))
        for n in names if (done // block) % 2 == 0 else names[::-1]:
            sync(device)
            if barrier:
                barrier()
            t0 = time.perf_counter()
            for j, (x, y) in enumerate(chunk):
                losses[n].append(steppers[n](done + j, x, y))
            sync(device)
            if barrier:
                barrier()
            if done > 0:
                seconds[n] += time.perf_counter() - t0
        timed += len(chunk) if done > 0 else 0
        done += len(chunk)
        if bar is not None:
            bar.update(len(chunk))
            bar.set_postfix_str(", ".join(f"{n} {losses[n][-1].item():.3f}" for n in names))
    return {n: (torch.stack(losses[n]), seconds[n], timed) for n in names}


def run_gpt(cfg: GPTConfig, device: torch.device, args) -> dict:
    text = repo_text()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = int(len(data) * 0.95)
    train, val = data[:split], data[split:]
    torch.manual_seed(args.seed)
    init = GPT(cfg, nn.LayerNorm if args.norm == "layer" else nn.RMSNorm).state_dict()
    n_params = sum(v.numel() for v in init.values())
    norm = "RMSNorm" if args.norm == "rms" else "LayerNorm"
    print(
        f"\n== GPT: {cfg.n_layer} layers, d={cfg.d_model}, {cfg.n_head} heads, context {cfg.context}, "
        f"{n_params / 1e6:.2f} M params, batch {cfg.batch}, {cfg.steps} steps, on {device}; "
        f"{len(text) / 1e6:.2f} MB of the repo's *.md/*.py as bytes"
    )
    print(f"   apex:  apex.amp {args.opt_level} bf16 + FusedAdam + Fused{norm}")
    kind = "fused" if device.type == "cuda" else "foreach"
    print(f"   torch: torch.autocast bf16 + AdamW({kind}) + nn.{norm}")
    stacks = {s: gpt_stepper(s, cfg, init, device, args) for s in ("apex", "torch")}
    bar = progress(cfg.steps, "GPT")
    runs = interleave(
        {s: v[1] for s, v in stacks.items()},
        gpt_batches(train, cfg, cfg.steps, args.seed),
        cfg.steps,
        device,
        bar,
    )
    bar.close()
    out = {"config": asdict(cfg), "params": n_params, "device": str(device)}
    for s, (model, _, loss_of) in stacks.items():
        losses, seconds, timed = runs[s]
        model.eval()
        with torch.no_grad():
            held = [loss_of(x, y) for x, y in gpt_batches(val, cfg, 4, args.seed + 1)]
        r = out[s] = {
            "losses": losses.float().cpu().tolist(),
            "tokens_per_s": timed * cfg.batch * cfg.context / seconds,
            "timed_steps": timed,
            "seconds": seconds,
            "heldout_loss": torch.stack(held).mean().item(),
        }
        print(
            f"   {s:5s}: loss {mean_head(r['losses']):.3f} -> {mean_tail(r['losses']):.3f}, "
            f"held-out {r['heldout_loss']:.3f}, {r['tokens_per_s']:,.0f} tokens/s"
        )
    return out


# --- part 2: ResNet-style CNN on 2 processes ------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ResNet(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        w = width
        self.stem = nn.Sequential(
            nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU()
        )
        self.layers = nn.Sequential(BasicBlock(w, w, 1), BasicBlock(w, 2 * w, 2), BasicBlock(2 * w, 4 * w, 2))  # fmt: skip
        self.fc = nn.Linear(4 * w, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layers(self.stem(x)).mean(dim=(2, 3)))


def image_batches(cfg: CNNConfig, rank: int, seed: int):
    """Class-conditional images: a smooth template per class (the same on every rank), scaled,
    shifted by up to 2 pixels and buried in noise. Each rank draws its own batches."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(cfg.classes, 3, 4, 4, generator=g)
    templates = F.interpolate(coarse, size=(cfg.image, cfg.image), mode="bilinear", align_corners=False)  # fmt: skip
    templates = templates / templates.flatten(1).std(dim=1)[:, None, None, None]
    g = torch.Generator().manual_seed(seed + 1000 * (rank + 1))
    for _ in range(cfg.steps):
        y = torch.randint(cfg.classes, (cfg.batch,), generator=g)
        amp = 0.7 + 0.6 * torch.rand(cfg.batch, 1, 1, 1, generator=g)
        x = templates[y] * amp + 1.0 * torch.randn(cfg.batch, 3, cfg.image, cfg.image, generator=g)
        dx, dy = torch.randint(-2, 3, (2,), generator=g).tolist()
        yield torch.roll(x, shifts=(dx, dy), dims=(2, 3)), y


def cnn_worker(rank: int, cfg: CNNConfig, port: int, use_cuda: bool, seed: int, results) -> None:
    try:
        torch.set_num_threads(1 if not use_cuda else max(torch.get_num_threads() // 2, 1))
        if use_cuda:
            torch.cuda.set_device(rank)
        device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=cfg.world,
            timeout=timedelta(seconds=max(cfg.time_limit, 30)),
        )
        steppers = {s: cnn_stepper(s, cfg, device, seed) for s in ("apex", "torch")}
        bar = progress(cfg.steps, "CNN") if rank == 0 else None
        runs = interleave(
            steppers, image_batches(cfg, rank, seed), cfg.steps, device, bar, dist.barrier
        )
        if bar is not None:
            bar.close()
        out = {}
        for s, (losses, seconds, timed) in runs.items():
            curve = losses.float()
            dist.all_reduce(curve)  # each step's loss, averaged over the ranks
            curve /= cfg.world
            images = timed * cfg.batch * cfg.world
            out[s] = {
                "losses": curve.cpu().tolist(),
                "images_per_s": images / seconds,
                "timed_steps": timed,
                "seconds": seconds,
            }
        if rank == 0:
            results.put(("ok", out))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise SystemExit(1) from None


def cnn_stepper(stack: str, cfg: CNNConfig, device: torch.device, seed: int):
    torch.manual_seed(seed)  # the same initial weights for both stacks
    model = ResNet(cfg.width, cfg.classes)
    if stack == "apex":
        from apex.optimizers import FusedSGD
        from apex.parallel import DistributedDataParallel as ApexDDP
        from apex.parallel import convert_syncbn_model

        model = ApexDDP(convert_syncbn_model(model).to(device))
        opt = FusedSGD(model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=5e-4)
    else:
        if device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # torch's SyncBatchNorm refuses CPU tensors: there the torch side keeps BatchNorm2d.
        model = model.to(device)
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=5e-4)
    model.train()

    def step(i, x, y):
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (i + 1) / 5) * (0.1 + 0.9 * (1 - i / cfg.steps))
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cnn(cfg: CNNConfig, device: torch.device, args) -> dict:
    use_cuda = cfg.cuda
    backend = "nccl" if use_cuda else "gloo"
    where = f"{cfg.world} GPUs" if use_cuda else f"CPU ({cfg.world} processes)"
    print(
        f"\n== CNN: ResNet-style, width {cfg.width}, {cfg.image}x{cfg.image} images, "
        f"{cfg.classes} classes, batch {cfg.batch}/process, {cfg.steps} steps, "
        f"{backend} on {where}, time limit {cfg.time_limit:.0f} s"
    )
    if device.type == "cuda" and not use_cuda:
        print(f"   (fewer than {cfg.world} GPUs: the 2-process part runs on the CPU with gloo)")
    print("   apex:  convert_syncbn_model + apex DistributedDataParallel + FusedSGD")
    if use_cuda:
        print("   torch: nn.SyncBatchNorm + torch DistributedDataParallel + SGD")
    else:
        print(
            "   torch: nn.BatchNorm2d (NOT synchronised: torch's SyncBatchNorm refuses CPU "
            "tensors) + torch DistributedDataParallel + SGD"
        )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=cnn_worker, args=(r, cfg, port, use_cuda, args.seed, results))
        for r in range(cfg.world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + cfg.time_limit
    got, error = None, None
    try:
        while time.monotonic() < deadline:
            try:
                kind, payload = results.get(timeout=0.5)
                if kind == "ok":
                    got = payload
                else:
                    error = error or payload
            except queue.Empty:
                pass
            if error or all(p.exitcode is not None for p in procs):
                break
        else:
            error = f"the 2-process CNN run passed its time limit of {cfg.time_limit:.0f} s"
    finally:
        for p in procs:
            p.join(timeout=10 if error is None else 1)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if error is None and got is None:
        codes = [p.exitcode for p in procs]
        error = f"the CNN processes ended without a result (exit codes {codes})"
    if error is not None:
        raise DemoFailure(f"CNN part failed: {error}")
    out = {"config": asdict(cfg), "backend": backend, "torch_syncbn": use_cuda, **got}
    for stack in ("apex", "torch"):
        r = out[stack]
        print(
            f"   {stack:5s}: loss {mean_head(r['losses']):.3f} -> {mean_tail(r['losses']):.3f}, "
            f"{r['images_per_s']:,.0f} images/s"
        )
    return out


# --- report ---------------------------------------------------------------------------------


class DemoFailure(RuntimeError):
    pass


def mean_head(xs: list[float]) -> float:
    n = min(LOSS_WINDOW, max(len(xs) // 4, 1))
    return sum(xs[:n]) / n


def mean_tail(xs: list[float]) -> float:
    n = min(LOSS_WINDOW, max(len(xs) // 4, 1))
    return sum(xs[-n:]) / n


def check(name: str, part: dict) -> list[str]:
    """The reasons, if any, why this part failed."""
    a, t = part["apex"]["losses"], part["torch"]["losses"]
    problems = []
    if not all(math.isfinite(v) for v in a):
        return [f"{name}: apex's loss is not finite"]
    a0, a1, t1 = mean_head(a), mean_tail(a), mean_tail(t)
    if not a1 < MAX_FINAL_OVER_INITIAL * a0:
        problems.append(
            f"{name}: apex's loss did not fall: final {a1:.3f} is not below "
            f"{MAX_FINAL_OVER_INITIAL}x the initial {a0:.3f}"
        )
    if math.isfinite(t1) and a1 > MAX_FINAL_OVER_TORCH * t1 + 0.05:
        problems.append(
            f"{name}: apex's final loss {a1:.3f} is far above torch's {t1:.3f} "
            f"(allowed: {MAX_FINAL_OVER_TORCH}x + 0.05)"
        )
    return problems


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"apex": "tab:green", "torch": "tab:blue"}
    parts = [p for p in (("gpt", "tokens/s"), ("cnn", "images/s")) if p[0] in results]
    fig, axes = plt.subplots(len(parts), 2, figsize=(12, 4 * len(parts)), squeeze=False)
    for row, (part, unit) in enumerate(parts):
        r = results[part]
        ax = axes[row][0]
        for stack in ("apex", "torch"):
            ax.plot(r[stack]["losses"], label=stack, color=colours[stack], linewidth=1)
        note = ""
        if part == "cnn" and not r.get("torch_syncbn", True):
            note = " (torch: BatchNorm2d, not synced on CPU)"
        ax.set_title(f"{part.upper()} training loss{note}")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy")
        ax.legend()
        ax.grid(alpha=0.3)
        ax = axes[row][1]
        key = "tokens_per_s" if part == "gpt" else "images_per_s"
        vals = [r["apex"][key], r["torch"][key]]
        bars = ax.bar(["apex", "torch"], vals, color=[colours["apex"], colours["torch"]])
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in vals])
        ax.set_title(f"{part.upper()} throughput ({unit}), apex/torch = {vals[0] / vals[1]:.2f}x")
        ax.set_ylabel(unit)
    device = results["gpt"]["device"]
    fig.suptitle(f"apex-* vs plain torch on {device} (torch {torch.__version__})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DemoFailure("--device cuda, but torch.cuda.is_available() is False")
    return device


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("demo-out"), help="output folder (demo-out)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda[:N]")
    ap.add_argument("--steps", type=int, help="GPT steps (CPU 200, GPU 500, quick 40)")
    ap.add_argument("--cnn-steps", type=int, help="CNN steps (CPU 100, GPU 200, quick 25)")
    ap.add_argument("--quick", action="store_true", help="tiny models and few steps (tests)")
    ap.add_argument("--norm", choices=["layer", "rms"], default="layer", help="GPT norm layers")
    ap.add_argument("--opt-level", default="O2", choices=["O1", "O2"], help="apex.amp level")
    ap.add_argument("--time-limit", type=float, help="seconds allowed to the 2-process part")
    ap.add_argument("--skip-cnn", action="store_true", help="only the GPT part")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    start = time.perf_counter()
    try:
        device = pick_device(args.device)
        if device.type == "cuda":
            if device.index is None:  # "--device cuda": the current GPU, by its index
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
        gpt_cfg, cnn_cfg = configs(args, device)
        if gpt_cfg.steps < 2 * LOSS_WINDOW:
            raise DemoFailure(f"--steps must be at least {2 * LOSS_WINDOW}")
        if not args.out.exists():
            args.out.mkdir(parents=True)
            # A folder of our own: keep it out of `git status`.
            (args.out / ".gitignore").write_text("*\n")
        print(
            f"apex-* demo: torch {torch.__version__}, device {device}, "
            f"{torch.get_num_threads()} CPU threads, output in {args.out}"
        )
        results = {"gpt": run_gpt(gpt_cfg, device, args)}
        if not args.skip_cnn:
            results["cnn"] = run_cnn(cnn_cfg, device, args)
    except DemoFailure as e:
        print(f"\nDEMO FAILED: {e}", file=sys.stderr)
        return 1

    print("\n== Summary (throughput measured after a few warm-up steps)")
    problems = []
    for part, key, unit in [("gpt", "tokens_per_s", "tokens/s"), ("cnn", "images_per_s", "images/s")]:  # fmt: skip
        if part not in results:
            continue
        r = results[part]
        ratio = r["apex"][key] / r["torch"][key]
        r["speed_ratio_apex_over_torch"] = ratio
        print(
            f"   {part.upper()}: apex {r['apex'][key]:,.0f} {unit}, torch {r['torch'][key]:,.0f} "
            f"{unit}, ratio apex/torch {ratio:.2f}x; final loss apex "
            f"{mean_tail(r['apex']['losses']):.3f}, torch {mean_tail(r['torch']['losses']):.3f}"
        )
        problems += check(part.upper(), r)
    results["wall_seconds"] = time.perf_counter() - start
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    try:
        plot(results, args.out / "demo.png")
        print(f"   plot: {args.out / 'demo.png'}")
    except ImportError:
        problems.append("matplotlib is not installed: no plot (pip install matplotlib)")
    print(f"   numbers: {args.out / 'results.json'}; wall time {results['wall_seconds']:.0f} s")
    if problems:
        print("\nDEMO FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print("\nDEMO PASSED: apex's losses fell and stayed close to torch's.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
