"""DistributedDataParallel, Reducer and flat_dist_call across 2 and 3 gloo ranks: gradients
equal a single-process run over the whole batch, for every constructor option. One set of
processes runs every case; each case is reported as its own test."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

PER_RANK = 4
STEPS = 3


def _model(dtype=torch.float32, unused=False):
    torch.manual_seed(0)
    layers = [
        torch.nn.Linear(6, 8),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 5),
        torch.nn.Tanh(),
        torch.nn.Linear(5, 1),
    ]
    model = torch.nn.Sequential(*layers)
    if unused:
        model.add_module("spare", torch.nn.Linear(3, 3))
    return model.to(dtype)


def _forward(model, x):
    return model[:5](x) if isinstance(model, torch.nn.Sequential) else model(x)


# name -> (DDP keyword arguments, options of the check)
CASES = {
    "default": ({}, {}),
    "delay_allreduce": ({"delay_allreduce": True}, {}),
    "small_buckets": ({"message_size": 10}, {}),
    "trigger_params": ({"allreduce_trigger_params": "every_other"}, {}),
    "retain_buffers": ({"retain_allreduce_buffers": True, "message_size": 40}, {"retain": True}),
    "always_fp32_bf16": (
        {"allreduce_always_fp32": True, "message_size": 50},
        {"dtype": torch.bfloat16},
    ),
    "two_streams": ({"num_allreduce_streams": 2, "message_size": 30}, {}),
    "communicators": ({"allreduce_communicators": "two_groups", "message_size": 30}, {}),
    "no_average": ({"gradient_average": False}, {"scale_by_world": True}),
    "predivide": ({"gradient_predivide_factor": 2.0, "message_size": 20}, {}),
    "predivide_no_average": (
        {"gradient_predivide_factor": 2.0, "gradient_average": False},
        {"scale_by_world": True, "predivide": 2.0},
    ),
    "split_factor_alias": ({"gradient_average_split_factor": 3.0}, {}),
    "prof": ({"prof": True}, {}),
    "accumulate": ({"message_size": 25}, {"accumulate": True}),
    "unused_param": ({"message_size": 25}, {"unused": True}),
}


def _run_case(rank, world, ddp_kw, opts):
    import torch.distributed as dist

    from apex.parallel import DistributedDataParallel as DDP

    failures = []

    def close(what, actual, expected, tol):
        try:
            torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
        except AssertionError as e:
            failures.append(f"{what}: {e}")

    dtype = opts.get("dtype", torch.float32)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    model = _model(dtype, opts.get("unused", False))
    ref = _model(dtype, opts.get("unused", False))
    with torch.no_grad():  # DDP must broadcast rank 0's parameters
        for p in model.parameters():
            p.add_(rank * 0.5)
    kw = dict(ddp_kw)
    params = list(model.parameters())
    if kw.get("allreduce_trigger_params") == "every_other":
        kw["allreduce_trigger_params"] = params[::2]
    if kw.get("allreduce_communicators") == "two_groups":
        kw["allreduce_communicators"] = ([dist.new_group(), dist.new_group()], [None, None])
    ddp = DDP(model, **kw)
    for p, q in zip(model.parameters(), ref.parameters()):
        close("broadcast parameters", p, q, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    micro = 2 if opts.get("accumulate") else 1
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(50 + step)
        x = torch.randn(micro, world * PER_RANK, 6, generator=gen).to(dtype)
        t = torch.randn(micro, world * PER_RANK, 1, generator=gen).to(dtype)
        sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        for m in range(micro):
            if m < micro - 1:
                ddp.disable_allreduce()
            else:
                ddp.enable_allreduce()
            out = ddp(x[m, sl]) if not opts.get("unused") else _forward(ddp.module, x[m, sl])
            if opts.get("unused"):
                # Through DDP's forward bookkeeping, but the spare layer gets no gradient.
                ddp._begin_iteration()
            # The loss in float32 (the grads keep the params' dtype): torch 2.3's CPU mse_loss
            # has no bfloat16 kernel.
            torch.nn.functional.mse_loss(out.float(), t[m, sl].float()).backward()
            ref_loss = torch.nn.functional.mse_loss(_forward(ref, x[m]).float(), t[m].float())
            ref_loss.backward()
        # Without averaging the sum arrives, divided by gradient_predivide_factor (apex).
        factor = world / opts.get("predivide", 1.0) if opts.get("scale_by_world") else 1.0
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if q.grad is None:
                if p.grad is not None and p.grad.abs().max() != 0:
                    failures.append(f"step {step} {name}: unused parameter got a nonzero gradient")
                continue
            close(f"step {step} grad {name}", p.grad, q.grad * factor, tol)
        if opts.get("retain"):
            bufs = ddp.allreduce_buffers
            if not bufs:
                failures.append("retain_allreduce_buffers kept no buffer")
            ptrs = {b.untyped_storage().data_ptr() for b in bufs}
            if any(p.grad.untyped_storage().data_ptr() not in ptrs for p in model.parameters()):
                failures.append("a gradient is not a view into allreduce_buffers")
        if opts.get("scale_by_world"):
            for p in model.parameters():
                p.grad.div_(factor)
        opt.step()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            close(f"step {step} parameters", p, q, tol)
    dist.barrier()
    if failures:
        raise AssertionError("\n".join(failures[:5]))


def _syncbn_under_ddp(rank, world):
    """A converted model under apex DDP equals BatchNorm on the whole batch in one process:
    SyncBatchNorm's collectives and DDP's buckets interleave on one group."""
    from apex.parallel import DistributedDataParallel as DDP
    from apex.parallel import convert_syncbn_model

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Conv2d(2, 4, 3),
            torch.nn.BatchNorm2d(4),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(36, 1),
        )

    ref = net()
    ddp = DDP(convert_syncbn_model(net()), message_size=20)
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(world * 3, 2, 5, 5, generator=gen)
        ref.zero_grad()
        ddp.module.zero_grad()
        ddp(x[rank * 3 : (rank + 1) * 3]).square().mean().backward()
        ref(x).square().mean().backward()
        for (name, p), q in zip(ddp.module.named_parameters(), ref.parameters()):
            torch.testing.assert_close(
                p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
            )
        torch.testing.assert_close(ddp.module[1].running_var, ref[1].running_var)


def _worker(rank, world):
    import torch.distributed as dist

    from apex.parallel import DistributedDataParallel as DDP
    from apex.parallel import Reducer
    from apex.parallel.distributed import flat_dist_call

    results = {}
    for name, (kw, opts) in CASES.items():
        try:
            _run_case(rank, world, kw, opts)
            results[name] = None
        except Exception as e:
            results[name] = f"rank {rank}: {type(e).__name__}: {e}"
        dist.barrier()

    try:
        _syncbn_under_ddp(rank, world)
        results["syncbn_under_ddp"] = None
    except Exception as e:
        results["syncbn_under_ddp"] = f"rank {rank}: {type(e).__name__}: {e}"
    dist.barrier()

    try:
        tensors = [
            torch.full((3,), float(rank)),
            torch.full((2, 2), float(rank + 1)),
            torch.ones(2, dtype=torch.float64),
        ]
        flat_dist_call(tensors, dist.broadcast, (0,))
        assert tensors[0].eq(0).all() and tensors[1].eq(1).all(), "broadcast from rank 0"
        flat_dist_call(tensors, dist.all_reduce)  # apex divides by the world size after all_reduce
        assert tensors[1].eq(1).all() and tensors[2].eq(1).all(), "all_reduce averages"
        results["flat_dist_call"] = None
    except Exception as e:
        results["flat_dist_call"] = f"rank {rank}: {type(e).__name__}: {e}"
    dist.barrier()

    try:
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank)
        reducer = Reducer(model)
        ref = _model()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=0, rtol=0)
        x = torch.randn(world * PER_RANK, 6, generator=torch.Generator().manual_seed(3))
        _forward(model, x[rank * PER_RANK : (rank + 1) * PER_RANK]).sum().backward()
        reducer.reduce()
        (_forward(ref, x).sum() / world).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)
        grads = [torch.full((4,), float(rank))]
        Reducer(grads).reduce()
        torch.testing.assert_close(grads[0], torch.full((4,), (world - 1) / 2))
        results["reducer"] = None
    except Exception as e:
        results["reducer"] = f"rank {rank}: {type(e).__name__}: {e}"
    dist.barrier()

    try:
        ddp = DDP(_model(), gradient_predivide_factor=2.0, retain_allreduce_buffers=True)
        bucket = [torch.full((3,), float(rank)), torch.full((2,), float(rank + 1))]
        ddp.allreduce_maybe_retain(bucket, 0)
        mean = (world - 1) / 2
        torch.testing.assert_close(bucket[0], torch.full((3,), mean))
        torch.testing.assert_close(bucket[1], torch.full((2,), mean + 1))
        assert len(ddp.allreduce_buffers) == 1
        bucket = [torch.ones(2), torch.full((3,), float(rank))]
        flat = DDP(_model(), gradient_average=False).allreduce_bucket(bucket, 1)
        torch.testing.assert_close(flat[:2], torch.full((2,), float(world)))
        # apex writes the result back into the bucket unless retain_allreduce_buffers.
        torch.testing.assert_close(bucket[0], torch.full((2,), float(world)))
        torch.testing.assert_close(bucket[1], torch.full((3,), world * (world - 1) / 2))
        half = [torch.full((2,), float(rank), dtype=torch.bfloat16)]
        flat = DDP(_model(), allreduce_always_fp32=True).allreduce_bucket(half, 0)
        assert flat.dtype == torch.bfloat16  # the bucket's dtype, as apex returns it
        torch.testing.assert_close(half[0].float(), torch.full((2,), mean))
        d = DDP(_model())
        d.needs_refresh = True  # apex's attribute: the buckets are rebuilt at the next forward
        assert d.needs_refresh and d._refresh
        d._disable_allreduce = True
        assert not d.needs_reduction
        d.enable_allreduce()
        assert d._disable_allreduce is False
        results["bucket_helpers"] = None
    except Exception as e:
        results["bucket_helpers"] = f"rank {rank}: {type(e).__name__}: {e}"
    dist.barrier()

    try:
        # A branch taken on rank 0 only, so one layer has a gradient there and None elsewhere,
        # and a layer no rank uses: every mode reduces the first on every rank (zeros where it
        # had none; delay_allreduce used to pair all_reduces of different sizes) and leaves the
        # second None under delay_allreduce, as apex.
        for kw in ({"delay_allreduce": True}, {}):
            torch.manual_seed(0)
            a, b, spare = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(2, 2)
            model = torch.nn.ModuleList([a, b, spare])
            ref_b = torch.nn.Linear(4, 4)
            ref_b.load_state_dict(b.state_dict())
            ddp = DDP(model, **kw)
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                ddp._begin_iteration()
                h = a(torch.ones(2, 4))
                (b(h) if rank == 0 else h).sum().backward()
            ref_b.zero_grad(set_to_none=True)
            ref_b(a(torch.ones(2, 4)).detach()).sum().backward()
            torch.testing.assert_close(b.weight.grad, ref_b.weight.grad / world)
            if kw:
                assert spare.weight.grad is None, "a parameter no rank used got a gradient"
        results["uneven_unused"] = None
    except Exception as e:
        results["uneven_unused"] = f"rank {rank}: {type(e).__name__}: {e}"
    dist.barrier()

    try:
        checks = [
            ({"shared_param": True}, "shared_param is no longer supported"),
            ({"delay_allreduce": True, "allreduce_trigger_params": []}, "allreduce_trigger_params"),
            ({"delay_allreduce": True, "num_allreduce_streams": 2}, "num_allreduce_streams"),
        ]
        for kw, words in checks:
            try:
                DDP(_model(), **kw)
            except ValueError as e:
                assert words in str(e), str(e)
            else:
                raise AssertionError(f"{kw} was accepted")
        results["bad_arguments"] = None
    except Exception as e:
        results["bad_arguments"] = f"rank {rank}: {type(e).__name__}: {e}"
    dist.barrier()
    return results


_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_worker, world, timeout=240)
    return _RESULTS[world]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "case",
    [
        *CASES,
        "syncbn_under_ddp",
        "flat_dist_call",
        "reducer",
        "bucket_helpers",
        "uneven_unused",
        "bad_arguments",
    ],
)
def test_ddp_matches_one_process_over_the_whole_batch(world, case):
    errors = [r[case] for r in _results(world) if r[case] is not None]
    assert not errors, "\n".join(errors)


def test_ddp_needs_an_initialised_process_group():
    from apex.parallel import DistributedDataParallel

    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(torch.nn.Linear(2, 2))


def test_multiproc_points_to_torchrun():
    from apex.parallel import multiproc

    assert "torchrun --nproc_per_node" in multiproc.MESSAGE
    assert multiproc.main() == 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_write_back_equals_one_copy_per_gradient(device, src_dtype):
    """The reduced bucket's write-back (one multi-tensor copy for the gradients whose strides
    match their view, one copy each for the rest, e.g. a channels_last conv weight) gives the
    bits of a copy_ per gradient, also from a float32 bucket (allreduce_always_fp32) into
    bfloat16 gradients."""
    from apex.parallel import distributed

    torch.manual_seed(0)
    shapes = [(8, 3, 3, 3), (8,), (16, 8, 3, 3), (16,), (5, 16)]

    def grads():
        g = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in shapes]
        g[2] = g[2].contiguous(memory_format=torch.channels_last)  # strides differ from its view
        return g

    a, b = grads(), grads()
    flat = torch.randn(sum(torch.Size(s).numel() for s in shapes), device=device, dtype=src_dtype)
    views = distributed.unflatten(flat, a)
    distributed._copy_all_(a, views)
    for d, v in zip(b, views):
        d.copy_(v)
    for x, y in zip(a, b):
        assert x.stride() == y.stride()
        assert torch.equal(x, y)
    assert a[2].is_contiguous(memory_format=torch.channels_last)


def test_scale_skips_a_factor_of_one():
    """One rank averaging multiplies by exactly 1: no launch (the bits would not change)."""
    from apex.parallel import distributed

    class Flat:
        def __init__(self):
            self.factors = []

        def mul_(self, f):
            self.factors.append(f)

    flat = Flat()
    distributed._scale_(flat, 1.0)
    assert flat.factors == []
    distributed._scale_(flat, 0.5)
    assert flat.factors == [0.5]
