"""The apex_parallel ops: references against float64 math (CPU), the CUDA kernels against the
references, opcheck, torch.compile, bad input, and 1-rank NCCL runs of SyncBatchNorm and DDP."""

from __future__ import annotations

import pytest
import torch

from apex.multi_tensor_apply.testing import opcheck
from apex.parallel import ops, reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Elementwise results may differ from the reference by rounding of the output dtype.
OUT_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
STAT_TOL = (1e-5, 1e-4)

NCL_SHAPES = [
    (2, 3, 5),
    (4, 7, 13),
    (3, 16, 64),
    (1, 5, 1),
    (64, 3, 1),
    (5, 2, 4099),
    (0, 4, 5),
    (2, 1, 8),
]
MC_SHAPES = [(7, 3), (1000, 13), (257, 64), (4096, 256), (9, 8), (0, 8), (3, 1)]
SHAPES = NCL_SHAPES + MC_SHAPES


def _inputs(shape, dtype, device):
    x = (torch.randn(shape, device=device) * 2 + 0.5).to(dtype)
    g = torch.randn(shape, device=device).to(dtype)
    z = torch.randn(shape, device=device).to(dtype)
    c = shape[1]
    w = torch.rand(c, device=device) + 0.5
    b = torch.randn(c, device=device)
    return x, g, z, w, b


def _dims(x):
    return (0, 2) if x.dim() == 3 else (0,)


def _fused_args(name, x, g, z, w, b):
    """opcheck arguments of SyncBatchNorm's fused ops (None for the others)."""
    if not name.startswith("syncbn_"):
        return None
    stats = reference.syncbn_stats(x)
    rm, rv = torch.zeros_like(w), torch.ones_like(w)
    nbt = torch.zeros((), dtype=torch.long, device=x.device)
    _, saved = reference.syncbn_forward(x, stats, None, w, b, None, None, None, 1e-5, 0.1, False)
    y = reference.batchnorm_forward(x, saved[: x.shape[1]], saved[x.shape[1] : -1], w, b)
    sums = torch.randn(2 * x.shape[1], device=x.device)
    return {
        "syncbn_stats": (x,),
        "syncbn_forward": (x, torch.stack([stats, stats]), z, w, b, rm, rv, nbt, 1e-5, None, True),
        "syncbn_backward_reduce": (g, x, saved, w, y),
        "syncbn_backward": (g, x, saved, w, sums, None),
        "syncbn_backward_local": (g, x, saved, w, y),
    }[name]


@pytest.mark.parametrize("name", ["syncbn_forward", "syncbn_backward_local"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)], ids=str)
def test_opcheck_one_rank_forms(name, device):
    """syncbn_forward taking its own statistics (stats None), and the one-rank backward op
    without a weight or ReLU mask."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x, g, z, w, b = _inputs((3, 8, 16), dtype, device)
    if name == "syncbn_forward":
        rm, rv = torch.zeros_like(w), torch.ones_like(w)
        nbt = torch.zeros((), dtype=torch.long, device=device)
        args = (x, None, None, w, b, rm, rv, nbt, 1e-5, 0.1, False)
    else:
        _, saved = reference.syncbn_forward(x, None, None, w, b, None, None, None, 1e-5, 0.1, False)
        args = (g, x, saved, None, None)
    opcheck(getattr(torch.ops.apex_parallel, name).default, args)


# ---- references (CPU) -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_statistics_match_float64(shape):
    x, g, _, w, _ = _inputs(shape, torch.float32, "cpu")
    mean, var = ops.welford_mean_var(x)
    if x.numel() == 0:
        assert mean.abs().sum() == 0 and var.abs().sum() == 0
        return
    xd = x.double()
    torch.testing.assert_close(mean.double(), xd.mean(_dims(x)), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(var.double(), xd.var(_dims(x), unbiased=False), atol=1e-6, rtol=1e-5)


def test_welford_parallel_merges_uneven_and_empty_ranks():
    parts = [torch.randn(n, 5) * 3 + 1 for n in (4, 0, 1, 9)]
    means = torch.stack([p.mean(0) if len(p) else torch.zeros(5) for p in parts])
    vars_ = torch.stack([p.var(0, unbiased=False) if len(p) else torch.zeros(5) for p in parts])
    counts = torch.tensor([len(p) for p in parts], dtype=torch.int32)
    mean, var, inv_std = ops.welford_parallel(means, vars_, counts, 1e-5)
    whole = torch.cat(parts)
    torch.testing.assert_close(mean, whole.mean(0))
    torch.testing.assert_close(var, whole.var(0))
    torch.testing.assert_close(inv_std, torch.rsqrt(whole.var(0, unbiased=False) + 1e-5))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)], ids=str)
def test_a_constant_channel_comes_out_as_the_bias(device):
    """One value per channel: the variance is 0 and inv_std 1/sqrt(eps), so any rounding in
    x - mean is magnified ~300 times. (x - mean) * scale + bias keeps it exact; the folded
    x * scale + (bias - mean * scale) did not (seen on the H200: 2.5e-5 off)."""
    x = torch.tensor([[[3.7], [-1.3], [1000.25]]], device=device)
    w = torch.tensor([0.5, 2.0, 1.5], device=device)
    b = torch.tensor([0.1, -0.2, 0.3], device=device)
    mean, var = ops.welford_mean_var(x)
    assert torch.equal(mean, x.view(3)) and torch.equal(var, torch.zeros_like(var))
    inv = torch.rsqrt(var + 1e-5)
    y = ops.batchnorm_forward(x, mean, inv, w, b)
    assert torch.equal(y, b.view(1, 3, 1))


@pytest.mark.parametrize("name", sorted(ops.SCHEMAS))
def test_opcheck_on_cpu(name):
    x, g, z, w, b = _inputs((3, 4, 6), torch.float32, "cpu")
    mean, var = reference.welford_mean_var(x)
    inv = torch.rsqrt(var + 1e-5)
    args = (
        _fused_args(name, x, g, z, w, b)
        or {
            "welford_mean_var": (x,),
            "welford_parallel": (mean.view(1, -1), var.view(1, -1), torch.tensor([18.0]), 1e-5),
            "batchnorm_forward": (x, mean, inv, w, b, z, True),
            "batchnorm_backward_reduce": (g, x, mean, inv),
            "batchnorm_backward": (
                g,
                x,
                mean,
                inv,
                w,
                torch.randn(4),
                torch.randn(4),
                torch.tensor([18.0]),
            ),
        }[name]
    )
    opcheck(getattr(torch.ops.apex_parallel, name).default, args)


def test_syncbatchnorm_compiles_fullgraph():
    from apex.parallel import SyncBatchNorm

    bn = SyncBatchNorm(4)
    x = torch.randn(3, 4, 5, requires_grad=True)
    ref = bn(x)
    bn.running_mean.zero_()
    bn.running_var.fill_(1)
    bn.num_batches_tracked.zero_()
    compiled = torch.compile(bn, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert x.grad is not None


# ---- bad input ----------------------------------------------------------------------------------


def test_ops_refuse_bad_input():
    x = torch.randn(2, 3, 4)
    mean, var = ops.welford_mean_var(x)
    with pytest.raises(ValueError, match=r"input must be \(N, C, L\) or \(M, C\)"):
        ops.welford_mean_var(torch.randn(2, 3, 4, 5))
    with pytest.raises(TypeError, match="float64"):
        ops.welford_mean_var(x.double())
    with pytest.raises(ValueError, match="input must be contiguous"):
        ops.welford_mean_var(x.transpose(0, 2))
    with pytest.raises(ValueError, match=r"mean must have shape \[3\]"):
        ops.batchnorm_forward(x, mean[:2], var)
    with pytest.raises(TypeError, match="inv_std must be float32"):
        ops.batchnorm_forward(x, mean, var.half())
    with pytest.raises(ValueError, match="grad_out has shape"):
        ops.batchnorm_backward_reduce(torch.randn(2, 3, 5), x, mean, var)
    with pytest.raises(ValueError, match="count must have 1 elements"):
        ops.welford_parallel(mean.view(1, -1), var.view(1, -1), torch.ones(2), 1e-5)


# ---- CUDA kernels against the references ------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cuda_statistics_match_reference(shape, dtype):
    x, *_ = _inputs(shape, dtype, "cuda")
    mean, var = ops.welford_mean_var(x)
    rmean, rvar = reference.welford_mean_var(x)
    torch.testing.assert_close(mean, rmean, atol=STAT_TOL[0], rtol=STAT_TOL[1])
    torch.testing.assert_close(var, rvar, atol=STAT_TOL[0], rtol=STAT_TOL[1])


@pytest.mark.cuda
def test_cuda_welford_parallel_matches_reference():
    means = torch.randn(5, 37, device="cuda")
    vars_ = torch.rand(5, 37, device="cuda")
    counts = torch.tensor([3.0, 0.0, 1.0, 1000.0, 17.0], device="cuda")
    for got, want in zip(
        ops.welford_parallel(means, vars_, counts, 1e-3),
        reference.welford_parallel(means, vars_, counts, 1e-3),
    ):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("variant", ["affine", "plain", "z_relu", "half_weight"])
def test_cuda_forward_matches_reference(shape, dtype, variant):
    x, _, z, w, b = _inputs(shape, dtype, "cuda")
    mean, var = reference.welford_mean_var(x)
    inv = torch.rsqrt(var + 1e-5)
    args = {
        "affine": (w, b, None, False),
        "plain": (None, None, None, False),
        "z_relu": (w, b, z, True),
        "half_weight": (w.to(dtype), b.to(dtype), None, True),
    }[variant]
    got = ops.batchnorm_forward(x, mean, inv, *args)
    want = reference.batchnorm_forward(x, mean, inv, *args)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, atol=OUT_TOL[dtype][0], rtol=OUT_TOL[dtype][1])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cuda_backward_matches_reference(shape, dtype):
    x, g, _, w, _ = _inputs(shape, dtype, "cuda")
    mean, var = reference.welford_mean_var(x)
    inv = torch.rsqrt(var + 1e-5)
    got = ops.batchnorm_backward_reduce(g, x, mean, inv)
    want = reference.batchnorm_backward_reduce(g, x, mean, inv)
    scale = max(1.0, x.numel() / max(x.shape[1], 1)) ** 0.5
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-4 * scale, rtol=1e-4)
    count = torch.tensor([x.numel() / max(x.shape[1], 1), 0.0], device="cuda")
    for weight in (w, None):
        gi = ops.batchnorm_backward(g, x, mean, inv, weight, want[0], want[1], count)
        ri = reference.batchnorm_backward(g, x, mean, inv, weight, want[0], want[1], count)
        torch.testing.assert_close(gi, ri, atol=OUT_TOL[dtype][0] * 2, rtol=OUT_TOL[dtype][1] * 2)


@pytest.mark.cuda
def test_cuda_unaligned_and_strided_views_take_the_scalar_path():
    base = torch.randn(4 * 8 * 16 + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(4, 8, 16)  # not 16-byte aligned
    mean, var = ops.welford_mean_var(x)
    rmean, rvar = reference.welford_mean_var(x)
    torch.testing.assert_close(mean, rmean, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(var, rvar, atol=1e-5, rtol=1e-4)
    inv = torch.rsqrt(var + 1e-5)
    torch.testing.assert_close(
        ops.batchnorm_forward(x, mean, inv),
        reference.batchnorm_forward(x, mean, inv),
        atol=1.6e-2,
        rtol=1.6e-2,
    )


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(ops.SCHEMAS))
def test_opcheck_on_cuda(name):
    x, g, z, w, b = _inputs((3, 8, 16), torch.bfloat16, "cuda")
    mean, var = reference.welford_mean_var(x)
    inv = torch.rsqrt(var + 1e-5)
    args = (
        _fused_args(name, x, g, z, w, b)
        or {
            "welford_mean_var": (x,),
            "welford_parallel": (
                mean.view(1, -1),
                var.view(1, -1),
                torch.tensor([48.0], device="cuda"),
                1e-5,
            ),
            "batchnorm_forward": (x, mean, inv, w, b, z, True),
            "batchnorm_backward_reduce": (g, x, mean, inv),
            "batchnorm_backward": (
                g,
                x,
                mean,
                inv,
                w,
                torch.randn(8, device="cuda"),
                torch.randn(8, device="cuda"),
                torch.tensor([48.0], device="cuda"),
            ),
        }[name]
    )
    opcheck(getattr(torch.ops.apex_parallel, name).default, args)


@pytest.mark.cuda
def test_cuda_ops_refuse_cpu_tensors_mixed_in():
    x = torch.randn(2, 3, 4, device="cuda")
    mean, var = ops.welford_mean_var(x)
    with pytest.raises(ValueError, match="mean is on cpu but input is on cuda"):
        ops.batchnorm_forward(x, mean.cpu(), var)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "apex_nhwc"])
def test_cuda_syncbatchnorm_matches_batchnorm(dtype, layout):
    from apex.parallel import SyncBatchNorm

    x = torch.randn(8, 32, 9, 7, device="cuda") * 2 + 1
    ref = torch.nn.BatchNorm2d(32).cuda()
    sbn = SyncBatchNorm(32, channel_last=layout == "apex_nhwc").cuda()
    xr = x.clone().requires_grad_()
    g = torch.randn_like(x)
    yr = ref(xr)
    yr.backward(g)
    if layout == "channels_last":
        xs, gs = x.to(dtype).contiguous(memory_format=torch.channels_last), g.to(dtype)
    elif layout == "apex_nhwc":
        xs, gs = x.to(dtype).movedim(1, -1).contiguous(), g.to(dtype).movedim(1, -1).contiguous()
    else:
        xs, gs = x.to(dtype), g.to(dtype)
    xs.requires_grad_()
    y = sbn(xs)
    y.backward(gs)
    back = (lambda t: t.movedim(-1, 1)) if layout == "apex_nhwc" else (lambda t: t)
    atol, rtol = OUT_TOL[dtype]
    torch.testing.assert_close(back(y).float(), yr.detach(), atol=10 * atol, rtol=10 * rtol)
    torch.testing.assert_close(back(xs.grad).float(), xr.grad, atol=10 * atol, rtol=10 * rtol)
    # Sums over 504 elements of rounded dy: low-precision error grows with sqrt(504).
    wtol = 1e-3 if dtype == torch.float32 else 0.15
    torch.testing.assert_close(sbn.weight.grad, ref.weight.grad, atol=wtol, rtol=2e-2)
    torch.testing.assert_close(sbn.bias.grad, ref.bias.grad, atol=wtol, rtol=2e-2)
    torch.testing.assert_close(sbn.running_mean, ref.running_mean, atol=1e-2, rtol=1e-2)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.big_memory
def test_cuda_over_2_31_elements():
    n = 2**30 + 8  # 2 channels * n > 2**31 elements, bfloat16 (4.3 GB)
    x = torch.randn(1, 2, n, device="cuda", dtype=torch.bfloat16)
    mean, var = ops.welford_mean_var(x)
    xf = x.float()
    torch.testing.assert_close(mean, xf.mean((0, 2)), atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(var, xf.var((0, 2), unbiased=False), atol=1e-4, rtol=1e-3)
    inv = torch.rsqrt(var + 1e-5)
    y = ops.batchnorm_forward(x, mean, inv)
    tail = slice(n - 1000, n)
    want = reference.batchnorm_forward(x[:, :, tail].contiguous(), mean, inv)
    torch.testing.assert_close(y[:, :, tail], want, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.cuda
def test_cuda_compiled_syncbatchnorm_matches_eager():
    from apex.parallel import SyncBatchNorm

    bn = SyncBatchNorm(16).cuda()
    x = torch.randn(4, 16, 8, 8, device="cuda", dtype=torch.bfloat16)
    eager = bn(x)
    compiled = torch.compile(SyncBatchNorm(16).cuda(), fullgraph=True)
    torch.testing.assert_close(compiled(x), eager)


# ---- 1-rank NCCL ---------------------------------------------------------------------------------


def _nccl_worker(rank, world):
    import torch.distributed as dist

    from apex.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()
    ).cuda()
    ref = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()
    ).cuda()
    ref.load_state_dict(model.state_dict())
    model = convert_syncbn_model(model)
    assert isinstance(model[1], SyncBatchNorm)
    ddp = DistributedDataParallel(model, message_size=100)
    x = torch.randn(4, 3, 10, 10, device="cuda")
    for _ in range(3):
        ddp(x).square().mean().backward()
        ref(x).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model[1].running_var, ref[1].running_var)
    dist.barrier()
    return True


@pytest.mark.cuda
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_nccl_one_rank_syncbn_and_ddp():
    from dist_utils import run_ranks

    assert run_ranks(_nccl_worker, 1, backend="nccl", timeout=240) == [True]
