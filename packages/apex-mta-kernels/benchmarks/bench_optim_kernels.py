"""The optimizer kernels against torch's own fused and foreach paths, in one run. Each op is
timed as called from Python with its lists (``apex_mta adam``) and through its cached C++ plan
(``adam_plan``, ``sgd_plan``: what FusedAdam and FusedSGD step through), where the host work per
call does not grow with Python per tensor.

Bytes counted (each input read once, each output written once), per parameter:
  adam fp32             g,p,m,v read + p,m,v written            = 28 bytes
  adam bf16 + masters   g(2),p_master,m,v read (14) + p(2),p_master,m,v written (14) = 30 bytes
  sgd momentum fp32     g,p,m read + p,m written                 = 20 bytes
  l2norm fp32           g read                                   =  4 bytes
  unscale_l2norm fp32   g read                                   =  4 bytes
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_utils import (  # noqa: E402
    Row,
    copy_bandwidth,
    gpt_like_shapes,
    host_ms,
    make,
    numel,
    small_shapes,
    time_cuda,
    wall_ms,
    write,
)

from apex.multi_tensor_apply import ops  # noqa: E402

# The host-step hyper-parameters every Adam and SGD row passes, op or plan alike:
# lr, beta1, beta2, eps, step, adam_w_mode, bias_correction, weight_decay (AdamW as torch's rows);
# weight_decay, momentum, dampening, lr, nesterov, first_run, wd_after_momentum, scale.
ADAM = (1e-4, 0.9, 0.999, 1e-8, 10, 1, True, 0.01)
SGD = (1e-4, 0.9, 0.0, 0.1, False, False, False, 1.0)


def _params(shapes, dtype=torch.float32):
    ps = make(shapes, dtype)
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def adam_rows(case, shapes) -> list[Row]:
    rows = []
    ps = _params(shapes)
    n = numel(ps)
    gs = [p.grad for p in ps]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.rand_like(p) for p in ps]
    noop = torch.zeros(1, dtype=torch.int32, device="cuda")
    gb = 28 * n / 1e9

    def ours():
        ops.multi_tensor_adam(gs, ps, ms, vs, noop, *ADAM)

    lr_t = torch.tensor([1e-4], device="cuda")
    step_t = torch.tensor([10], dtype=torch.int32, device="cuda")
    one = torch.ones(1, device="cuda")

    def ours_capturable():
        ops.multi_tensor_adam_capturable(
            gs, ps, ms, vs, noop, lr_t, 0.9, 0.999, 1e-8, step_t, 1, True, 0.01, one
        )

    # The cached C++ plan (what FusedAdam steps through): grads fetched from p.grad in C++, the
    # lists checked once, no Python per tensor.
    plan = ops.adam_plan(ps, ps, ms, vs)

    def ours_plan():
        plan.step(noop, *ADAM)

    torch_fused = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True)
    torch_foreach = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=True)
    impls = [
        ("apex_mta adam", ours),
        ("apex_mta adam_plan", ours_plan),
        ("apex_mta adam_capturable", ours_capturable),
        ("torch AdamW(fused=True)", torch_fused.step),
        ("torch AdamW(foreach=True)", torch_foreach.step),
    ]
    for impl, fn in impls:
        rows.append(
            Row(
                "adam fp32",
                case,
                impl,
                time_cuda(fn, 3, 10),
                gb,
                host_ms(fn, 10),
                {"wall_ms": wall_ms(fn, 2, 10)},
            )
        )
    return rows


def adam_master_rows(case, shapes) -> list[Row]:
    masters = make(shapes, torch.float32)
    ps = [m.to(torch.bfloat16) for m in masters]
    gs = [torch.randn_like(p) for p in ps]
    ms = [torch.zeros_like(m) for m in masters]
    vs = [torch.rand_like(m) for m in masters]
    noop = torch.zeros(1, dtype=torch.int32, device="cuda")
    lr_t = torch.tensor([1e-4], device="cuda")
    step_t = torch.tensor([10], dtype=torch.int32, device="cuda")
    one = torch.ones(1, device="cuda")
    n = numel(ps)

    def ours():
        ops.multi_tensor_adam_capturable_master(
            gs, ps, ms, vs, masters, noop, lr_t, 0.9, 0.999, 1e-8, step_t, 1, True, 0.01, one
        )

    def ours_bf16_moments_fp32():
        ops.multi_tensor_adam(gs, masters, ms, vs, noop, *ADAM)

    rows = [
        Row(
            "adam bf16 params + fp32 master",
            case,
            "apex_mta adam_capturable_master",
            time_cuda(ours, 3, 10),
            30 * n / 1e9,
            host_ms(ours, 10),
        )
    ]
    rows.append(
        Row(
            "adam bf16 grads, fp32 p/m/v",
            case,
            "apex_mta adam",
            time_cuda(ours_bf16_moments_fp32, 3, 10),
            26 * n / 1e9,
            host_ms(ours_bf16_moments_fp32, 10),
        )
    )
    return rows


def sgd_rows(case, shapes) -> list[Row]:
    ps = _params(shapes)
    gs = [p.grad for p in ps]
    bufs = [torch.randn_like(p) for p in ps]
    noop = torch.zeros(1, dtype=torch.int32, device="cuda")
    n = numel(ps)

    def ours():
        ops.multi_tensor_sgd(gs, ps, bufs, None, noop, *SGD)

    plan = ops.sgd_plan(ps, ps, bufs)

    def ours_plan():
        plan.step(noop, *SGD)

    torch_fused = torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True)
    torch_foreach = torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True)
    torch_fused.step()
    torch_foreach.step()  # create momentum buffers
    rows = []
    for impl, fn in (
        ("apex_mta sgd", ours),
        ("apex_mta sgd_plan", ours_plan),
        ("torch SGD(fused=True)", torch_fused.step),
        ("torch SGD(foreach=True)", torch_foreach.step),
    ):
        rows.append(
            Row(
                "sgd momentum fp32",
                case,
                impl,
                time_cuda(fn, 3, 10),
                20 * n / 1e9,
                host_ms(fn, 10),
                {"wall_ms": wall_ms(fn, 2, 10)},
            )
        )
    return rows


def norm_rows(case, shapes) -> list[Row]:
    gs = make(shapes, torch.float32)
    noop = torch.zeros(1, dtype=torch.int32, device="cuda")
    inv = torch.tensor([0.5], device="cuda")
    n = numel(gs)
    impls = [
        ("apex_mta l2norm", lambda: ops.multi_tensor_l2norm(gs, noop, False)),
        ("apex_mta unscale_l2norm", lambda: ops.multi_tensor_unscale_l2norm(gs, noop, inv, False)),
        (
            "torch._foreach_norm + stack",
            lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs))),
        ),
        (
            "torch._amp_foreach_non_finite_check_and_unscale_ + _foreach_norm",
            lambda: (
                torch._amp_foreach_non_finite_check_and_unscale_(gs, noop.float(), inv),
                torch._foreach_norm(gs),
            ),
        ),
    ]
    rows = [
        Row("l2norm fp32", case, impl, time_cuda(fn, 3, 10), 4 * n / 1e9, host_ms(fn, 10))
        for impl, fn in impls
    ]
    return rows


def sweep_rows() -> list[Row]:
    """Bandwidth against size: lists of up to 2^22-element fp32 tensors, 2^20 to 2^30 params in
    all; the plans (as FusedAdam and FusedSGD step) and the l2norm against torch's best."""
    rows = []
    for k in range(20, 31, 2):
        rows += _sweep_size(k)
        torch.cuda.empty_cache()
    return rows


def _sweep_size(k: int) -> list[Row]:
    total = 1 << k
    ps = _params([(min(total, 1 << 22),)] * max(1, total >> 22))
    gs = [p.grad for p in ps]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.rand_like(p) for p in ps]
    noop = torch.zeros(1, dtype=torch.int32, device="cuda")
    adam = ops.adam_plan(ps, ps, ms, vs)
    sgd = ops.sgd_plan(ps, ps, ms)
    torch_adam = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True)
    torch_sgd = torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True)
    torch_sgd.step()  # its momentum buffers
    cases = [
        ("adam fp32 by size", "apex_mta adam_plan", 28,
         lambda: adam.step(noop, *ADAM)),
        ("adam fp32 by size", "torch AdamW(fused=True)", 28, torch_adam.step),
        ("sgd momentum fp32 by size", "apex_mta sgd_plan", 20,
         lambda: sgd.step(noop, *SGD)),
        ("sgd momentum fp32 by size", "torch SGD(fused=True)", 20, torch_sgd.step),
        ("l2norm fp32 by size", "apex_mta l2norm", 4,
         lambda: ops.multi_tensor_l2norm(gs, noop, False)),
        ("l2norm fp32 by size", "torch._foreach_norm + stack", 4,
         lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs)))),
    ]  # fmt: skip
    return [
        Row(bench, f"2^{k} params", impl, time_cuda(fn, 3, 10), per * total / 1e9,
            host_ms(fn, 10), {"numel": total})
        for bench, impl, per, fn in cases
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args()
    ceiling = copy_bandwidth()
    rows: list[Row] = []
    for case, shapes in (("gpt-1.3B", gpt_like_shapes()), ("5000x4096", small_shapes())):
        for fn in (adam_rows, adam_master_rows, sgd_rows, norm_rows):
            try:
                rows += fn(case, shapes)
            except Exception as exc:  # noqa: BLE001 - one failing row must not hide the others
                print(f"{fn.__name__} {case}: {type(exc).__name__}: {exc}")
    try:
        rows += sweep_rows()
    except Exception as exc:  # noqa: BLE001
        print(f"sweep_rows: {type(exc).__name__}: {exc}")
    print(write(rows, ceiling, args.out, "bench_optim_kernels"))


if __name__ == "__main__":
    main()
