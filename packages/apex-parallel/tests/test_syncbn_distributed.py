"""SyncBatchNorm across 2 and 3 gloo ranks against torch's BatchNorm on the concatenated batch:
outputs, input/weight/bias gradients and running statistics, with uneven and empty batches,
every layout, sub-groups and bad groups. One set of processes runs every case; each case is
reported as its own test."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

C = 3
TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 3e-2)}

# name -> (batch sizes per rank, spatial shape, options)
CASES = {
    "2d_even": ([3, 3, 3], (4, 5), {}),
    "2d_uneven": ([1, 4, 2], (3, 3), {}),
    "2d_empty_rank": ([0, 3, 2], (3, 2), {}),
    "one_value_a_rank": ([1, 1, 0], (), {}),  # two values a channel over the group, one here
    "1d_nc": ([4, 3, 5], (), {}),
    "1d_ncl": ([2, 3, 1], (7,), {}),
    "3d": ([2, 1, 2], (2, 3, 2), {}),
    "channels_last": ([2, 3, 1], (3, 4), {"layout": "torch_cl"}),
    "channels_last_3d": ([2, 1, 2], (2, 2, 3), {"layout": "torch_cl"}),
    "apex_channel_last": ([2, 3, 2], (3, 4), {"layout": "nhwc"}),
    "affine_false": ([2, 3, 2], (3, 3), {"affine": False}),
    "momentum_none": ([3, 2, 2], (2, 3), {"momentum": None, "steps": 3}),
    "no_running_stats": ([2, 2, 3], (3, 2), {"track_running_stats": False}),
    "fuse_relu_z": ([2, 3, 1], (3, 3), {"fuse_relu": True, "z": True, "layout": "nhwc"}),
    "fp16": ([2, 3, 2], (3, 3), {"dtype": torch.float16}),
    "bf16_channels_last": ([3, 2, 2], (3, 3), {"dtype": torch.bfloat16, "layout": "torch_cl"}),
    "eval_after_train": ([2, 3, 2], (3, 3), {"eval": True}),
}


def _ref_bn(ndim, **kw):
    return {
        2: torch.nn.BatchNorm1d,
        3: torch.nn.BatchNorm1d,
        4: torch.nn.BatchNorm2d,
        5: torch.nn.BatchNorm3d,
    }[ndim](C, **kw)


def _layout(x, layout):
    if layout == "torch_cl":
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        return x.contiguous(memory_format=fmt)
    if layout == "nhwc":
        return x.movedim(1, -1).contiguous()
    return x


def _back(y, layout):
    return y.movedim(-1, 1) if layout == "nhwc" else y


def _run_case(rank, world, sizes, spatial, opts, group=None, group_ranks=None):
    """Every collective runs whatever the comparisons find (a failed comparison raises at the
    end), so one rank's mismatch never leaves the others waiting."""
    from apex.parallel import SyncBatchNorm

    failures = []

    def close(what, actual, expected, atol, rtol):
        try:
            torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
        except AssertionError as e:
            failures.append(f"{what}: {e}")

    sizes = sizes[:world]
    members = group_ranks if group_ranks is not None else list(range(world))
    dtype = opts.get("dtype", torch.float32)
    layout = opts.get("layout", "ncl")
    atol, rtol = TOL[dtype]
    kw = dict(
        momentum=opts.get("momentum", 0.1),
        affine=opts.get("affine", True),
        track_running_stats=opts.get("track_running_stats", True),
    )
    ref = _ref_bn(2 + len(spatial), **kw)
    sbn = SyncBatchNorm(
        C,
        **kw,
        process_group=group,
        channel_last=(layout == "nhwc"),
        fuse_relu=opts.get("fuse_relu", False),
    )
    if kw["affine"]:
        wgen = torch.Generator().manual_seed(7)  # the same weights on every rank
        with torch.no_grad():
            ref.weight.copy_(torch.rand(C, generator=wgen) + 0.5)
            ref.bias.copy_(torch.rand(C, generator=wgen) - 0.5)
            sbn.weight.copy_(ref.weight)
            sbn.bias.copy_(ref.bias)
    for step in range(opts.get("steps", 1)):
        gen = torch.Generator().manual_seed(100 + step)
        xs = [torch.randn((n, C, *spatial), generator=gen) * 2 + 1 for n in sizes]
        gs = [torch.randn((n, C, *spatial), generator=gen) for n in sizes]
        zs = [torch.randn((n, C, *spatial), generator=gen) for n in sizes]
        x_all = torch.cat([xs[r] for r in members]).requires_grad_()
        z_all = torch.cat([zs[r] for r in members])
        y_ref = ref(x_all)
        if opts.get("z"):
            y_ref = y_ref + z_all
        if opts.get("fuse_relu"):
            y_ref = torch.relu(y_ref)
        y_ref.backward(torch.cat([gs[r] for r in members]))
        start = sum(sizes[r] for r in members[: members.index(rank)])
        sl = slice(start, start + sizes[rank])

        x = _layout(xs[rank].to(dtype), layout).requires_grad_()
        z = _layout(zs[rank].to(dtype), layout) if opts.get("z") else None
        y = sbn(x, z) if z is not None else sbn(x)
        assert y.dtype == dtype, y.dtype
        if layout == "torch_cl" and y.numel():
            fmt = torch.channels_last if y.dim() == 4 else torch.channels_last_3d
            assert y.is_contiguous(memory_format=fmt), "output lost the channels_last format"
        y.backward(_layout(gs[rank].to(dtype), layout))
        close("output", _back(y, layout).float(), y_ref[sl].detach(), atol, rtol)
        close("input grad", _back(x.grad, layout).float(), x_all.grad[sl], atol * 10, rtol * 10)
        if kw["affine"]:
            import torch.distributed as dist

            wg = torch.stack([sbn.weight.grad, sbn.bias.grad])
            dist.all_reduce(wg, group=group)
            close("weight grad", wg[0], ref.weight.grad, atol * 100, rtol * 10)
            close("bias grad", wg[1], ref.bias.grad, atol * 100, rtol * 10)
            ref.weight.grad = ref.bias.grad = sbn.weight.grad = sbn.bias.grad = None
        if kw["track_running_stats"]:
            close("running_mean", sbn.running_mean, ref.running_mean, atol, rtol)
            close("running_var", sbn.running_var, ref.running_var, atol, rtol)
            close("num_batches_tracked", sbn.num_batches_tracked, ref.num_batches_tracked, 0, 0)
    if opts.get("eval"):
        sbn.eval()
        ref.eval()
        x = torch.randn(2, C, *spatial)
        close("eval output", sbn(x), ref(x), 1e-5, 1e-5)
    if failures:
        raise AssertionError("\n".join(failures))


def _run_python_function(rank, world, sizes, group=None, members=None):
    """apex.parallel.sync_batchnorm_kernel.SyncBatchnormFunction given the group's batch mean
    and biased variance, called as apex's Python module called it: output and input gradient
    of torch's training BatchNorm on the group's whole batch (its backward all-reduces the
    batch-mean terms over the group), weight and bias gradients summing to torch's over the
    group's ranks."""
    import torch.distributed as dist

    from apex.parallel.sync_batchnorm_kernel import SyncBatchnormFunction

    members = members if members is not None else list(range(world))
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn((n, C, 3, 2), generator=gen) * 2 + 1 for n in sizes[:world]]
    gs = [torch.randn((n, C, 3, 2), generator=gen) for n in sizes[:world]]
    w, b = torch.rand(C, generator=gen) + 0.5, torch.randn(C, generator=gen)
    x_all = torch.cat([xs[r] for r in members]).requires_grad_()
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    y_ref = torch.nn.functional.batch_norm(x_all, None, None, wr, br, True, 0.1, 1e-5)
    y_ref.backward(torch.cat([gs[r] for r in members]))
    start = sum(sizes[r] for r in members[: members.index(rank)])
    sl = slice(start, start + sizes[rank])
    x = xs[rank].clone().requires_grad_()
    ws, bs = w.clone().requires_grad_(), b.clone().requires_grad_()
    red = (0, 2, 3)
    moments = torch.cat([x.detach().sum(red), x.detach().square().sum(red)])
    moments = torch.cat([moments, torch.tensor([float(x.numel() // C)])])
    dist.all_reduce(moments, group=group)
    n = moments[-1]
    mean = moments[:C] / n
    var = moments[C : 2 * C] / n - mean.square()
    y = SyncBatchnormFunction.apply(x, ws, bs, mean, var, 1e-5, group, len(members))
    y.backward(gs[rank])
    torch.testing.assert_close(y, y_ref[sl].detach(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(x.grad, x_all.grad[sl], atol=1e-4, rtol=1e-3)
    wg = torch.stack([ws.grad, bs.grad])
    dist.all_reduce(wg, group=group)
    torch.testing.assert_close(wg[0], wr.grad, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(wg[1], br.grad, atol=1e-3, rtol=1e-3)


def _worker(rank, world):
    import torch.distributed as dist

    import apex.parallel as P

    results = {}
    for name, (sizes, spatial, opts) in CASES.items():
        try:
            _run_case(rank, world, sizes, spatial, opts)
            results[name] = None
        except Exception as e:  # reported per case by the tests below
            results[name] = f"rank {rank}: {type(e).__name__}: {e}"
        dist.barrier()

    # Sub-groups: ranks {0, 1} together, the rest alone (a world of 3), or each rank alone.
    try:
        if world == 3:
            g01, g2 = dist.new_group([0, 1]), dist.new_group([2])
            group, members = (g01, [0, 1]) if rank < 2 else (g2, [2])
        else:
            group, members = P.create_syncbn_process_group(1), [rank]
        _run_case(rank, world, [3, 2, 4], (3, 3), {}, group=group, group_ranks=members)
        whole = P.create_syncbn_process_group(world)
        _run_case(rank, world, [2, 3, 1], (2, 2), {}, group=whole, group_ranks=list(range(world)))
        assert P.create_syncbn_process_group(0) is None
        results["subgroup"] = None
    except Exception as e:
        results["subgroup"] = f"rank {rank}: {type(e).__name__}: {e}"
    dist.barrier()

    # apex's Python Function called directly with the world's statistics (uneven batches).
    try:
        _run_python_function(rank, world, [3, 1, 2])
        if world == 3:  # ranks {0, 1} together, 2 alone
            g01, g2 = dist.new_group([0, 1]), dist.new_group([2])
            group, members = (g01, [0, 1]) if rank < 2 else (g2, [2])
            _run_python_function(rank, world, [2, 4, 3], group, members)
        results["python_function"] = None
    except Exception as e:
        results["python_function"] = f"rank {rank}: {type(e).__name__}: {e}"
    dist.barrier()

    # One value per channel over the whole group (one rank's single row, the others empty):
    # every rank refuses it, as torch's BatchNorm does in one process, before the running
    # variance takes its 0/0.
    try:
        bn = P.SyncBatchNorm(C)
        try:
            bn(torch.randn(1 if rank == 0 else 0, C))
        except ValueError as e:
            assert "more than 1 value per channel" in str(e), str(e)
            assert f"got 1 over the process group's {world} ranks" in str(e), str(e)
        else:
            raise AssertionError("one value a channel over the group was accepted")
        assert torch.equal(bn.running_var, torch.ones(C)), bn.running_var
        # No value at all on any rank: accepted, the running statistics left (an empty batch).
        y = bn(torch.randn(0, C))
        assert y.shape == (0, C)
        assert torch.equal(bn.running_mean, torch.zeros(C)), bn.running_mean
        assert torch.equal(bn.running_var, torch.ones(C)), bn.running_var
        results["one_value_in_group"] = None
    except Exception as e:
        results["one_value_in_group"] = f"rank {rank}: {type(e).__name__}: {e}"
    dist.barrier()

    # Bad groups: one that leaves this rank out, and a size that does not divide the world.
    try:
        other = dist.new_group([r for r in range(world) if r != 0])
        if rank == 0:
            bn = P.SyncBatchNorm(C, process_group=other)
            try:
                bn(torch.randn(2, C, 2, 2))
            except ValueError as e:
                assert "does not include this rank" in str(e), str(e)
            else:
                raise AssertionError("a group without this rank was accepted")
        try:
            P.create_syncbn_process_group(world + 1)
        except ValueError as e:
            assert "must divide the world size" in str(e)
        else:
            raise AssertionError("group_size world+1 was accepted")
        results["bad_groups"] = None
    except Exception as e:
        results["bad_groups"] = f"rank {rank}: {type(e).__name__}: {e}"
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
    "case", [*CASES, "subgroup", "python_function", "one_value_in_group", "bad_groups"]
)
def test_syncbn_matches_batchnorm_on_the_whole_batch(world, case):
    errors = [r[case] for r in _results(world) if r[case] is not None]
    assert not errors, "\n".join(errors)
