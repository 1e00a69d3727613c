"""SyncBatchNorm in one process (no process group, or a world of one) against torch's
BatchNorm; convert_syncbn_model; bad input; the legacy ``syncbn`` module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import apex.parallel as P
from apex.parallel import SyncBatchNorm

TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
SHAPES = [(6, 4), (3, 4, 7), (2, 4, 5, 3), (2, 4, 2, 3, 2)]


def _pair(ndim, c=4, **kw):
    ref = BN[ndim](c, **kw)
    sbn = SyncBatchNorm(c, **kw)
    if ref.affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-0.5, 0.5)
            sbn.weight.copy_(ref.weight)
            sbn.bias.copy_(ref.bias)
    return ref, sbn


def _check_step(ref, sbn, x, dtype=torch.float32, channels_last=False, device="cpu"):
    atol, rtol = TOL[dtype]
    ref, sbn = ref.to(device), sbn.to(device)
    x = x.to(device)
    xr = x.clone().requires_grad_()
    xs = x.to(dtype)
    if channels_last:
        xs = xs.contiguous(
            memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        )
    xs.requires_grad_()
    g = torch.randn_like(x)
    yr = ref(xr)
    yr.backward(g)
    ys = sbn(xs)
    ys.backward(g.to(dtype))
    assert ys.dtype == dtype and ys.shape == x.shape
    torch.testing.assert_close(ys.float(), yr, atol=atol, rtol=rtol)
    torch.testing.assert_close(xs.grad.float(), xr.grad, atol=10 * atol, rtol=10 * rtol)
    if ref.affine:
        torch.testing.assert_close(
            sbn.weight.grad, ref.weight.grad, atol=100 * atol, rtol=10 * rtol
        )
        torch.testing.assert_close(sbn.bias.grad, ref.bias.grad, atol=100 * atol, rtol=10 * rtol)
    if ref.track_running_stats:
        torch.testing.assert_close(sbn.running_mean, ref.running_mean, atol=atol, rtol=rtol)
        torch.testing.assert_close(sbn.running_var, ref.running_var, atol=atol, rtol=rtol)
        assert int(sbn.num_batches_tracked) == int(ref.num_batches_tracked)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matches_batchnorm(shape, dtype):
    ref, sbn = _pair(len(shape))
    _check_step(ref, sbn, torch.randn(shape) * 3 + 1, dtype)


@pytest.mark.parametrize("shape", SHAPES[2:], ids=str)
def test_channels_last_memory_format(shape):
    ref, sbn = _pair(len(shape))
    _check_step(ref, sbn, torch.randn(shape), channels_last=True)


@pytest.mark.parametrize(
    "kw",
    [{"affine": False}, {"momentum": None}, {"track_running_stats": False}, {"eps": 1e-2}],
    ids=str,
)
def test_options_match_batchnorm_over_steps(kw):
    ref, sbn = _pair(4, **kw)
    for _ in range(3):
        _check_step(ref, sbn, torch.randn(3, 4, 3, 2))


@pytest.mark.parametrize("track", [True, False])
def test_eval_matches_batchnorm(track):
    ref, sbn = _pair(4, track_running_stats=track)
    _check_step(ref, sbn, torch.randn(3, 4, 3, 3))
    ref.eval()
    sbn.eval()
    x = torch.randn(2, 4, 3, 3)
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, ys = ref(xr), sbn(xs)
    torch.testing.assert_close(ys, yr, atol=1e-5, rtol=1e-5)
    yr.sum().backward()
    ys.sum().backward()  # an expanded gradient
    torch.testing.assert_close(xs.grad, xr.grad, atol=1e-5, rtol=1e-5)
    assert int(sbn.num_batches_tracked if track else 0) == int(
        ref.num_batches_tracked if track else 0
    )


def test_apex_channel_last_layout_with_z_and_fused_relu():
    x = torch.randn(3, 4, 3, 5)
    z = torch.randn(3, 4, 3, 5)
    ref, _ = _pair(4)
    sbn = SyncBatchNorm(4, channel_last=True, fuse_relu=True)
    with torch.no_grad():
        sbn.weight.copy_(ref.weight)
        sbn.bias.copy_(ref.bias)
    xr = x.clone().requires_grad_()
    yr = torch.relu(ref(xr) + z)
    g = torch.randn_like(x)
    yr.backward(g)
    xs = x.movedim(1, -1).contiguous().requires_grad_()
    zs = z.movedim(1, -1).contiguous().requires_grad_()
    ys = sbn(xs, zs)
    ys.backward(g.movedim(1, -1))
    torch.testing.assert_close(ys.movedim(-1, 1), yr, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(xs.grad.movedim(-1, 1), xr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(zs.grad.movedim(-1, 1), g * (yr > 0), atol=0, rtol=0)
    torch.testing.assert_close(sbn.running_var, ref.running_var)


def test_differentiating_the_gradients_again_raises():
    """create_graph=True works; differentiating its gradients again raises (as torch's
    SyncBatchNorm), instead of dropping the second-order terms."""
    sbn = SyncBatchNorm(4)
    x = torch.randn(6, 4, requires_grad=True)
    (gx,) = torch.autograd.grad(sbn(x).square().sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="cannot be differentiated again"):
        gx.sum().backward()
    (gx,) = torch.autograd.grad(sbn(x).square().sum(), [x])
    assert gx.grad_fn is None and not gx.requires_grad


def test_module_path_and_repr():
    assert SyncBatchNorm.__module__ == "apex.parallel.optimized_sync_batchnorm"
    bn = SyncBatchNorm(8, channel_last=True, fuse_relu=True)
    assert "channel_last=True" in repr(bn) and "fuse_relu=True" in repr(bn)
    bn._specify_channel_last(False)
    bn._specify_process_group("pg")
    assert bn.channel_last is False and bn.process_group == "pg"
    import apex

    assert apex.parallel.SyncBatchNorm is SyncBatchNorm
    from apex.parallel.sync_batchnorm import SyncBatchNorm as Legacy

    assert Legacy is SyncBatchNorm
    assert P.ReduceOp is torch.distributed.ReduceOp


# ---- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_empty_batch_leaves_the_running_statistics(device, momentum):
    """A batch of no rows (here, the whole world's): the running estimates stay where they were
    (they were pulled toward 0 before), num_batches_tracked counts the step, as torch's
    BatchNorm does; the output is empty."""
    ref, sbn = _pair(4, momentum=momentum)
    ref, sbn = ref.to(device), sbn.to(device)
    for m in (ref, sbn):
        m.running_mean.fill_(1.0)
        m.running_var.fill_(2.0)
    x = torch.randn(0, 4, 3, 2, device=device)
    assert sbn(x).shape == x.shape
    ref(x)
    torch.testing.assert_close(sbn.running_mean, ref.running_mean, atol=0, rtol=0)
    torch.testing.assert_close(sbn.running_var, ref.running_var, atol=0, rtol=0)
    assert sbn.num_batches_tracked.item() == ref.num_batches_tracked.item() == 1
    assert sbn.running_mean.eq(1.0).all() and sbn.running_var.eq(2.0).all()


def test_eval_takes_what_torch_batch_norm_takes():
    """apex's eval path (running statistics, no channel_last, z or fused ReLU) is torch's
    batch_norm: float64 and 6-D input too, as there."""
    for m, x in (
        (SyncBatchNorm(3).double().eval(), torch.randn(2, 3, 4, 4, dtype=torch.float64)),
        (SyncBatchNorm(3).eval(), torch.randn(2, 3, 2, 2, 2, 2)),
    ):
        with torch.no_grad():
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
        want = torch.nn.functional.batch_norm(
            x, m.running_mean, m.running_var, m.weight, m.bias, False, 0.0, m.eps
        )
        torch.testing.assert_close(m(x), want, atol=0, rtol=0)


def test_wrong_rank_input_is_refused():
    with pytest.raises(ValueError, match="expected a 2-D to 5-D input"):
        SyncBatchNorm(4)(torch.randn(4))
    with pytest.raises(ValueError, match="expected a 2-D to 5-D input"):
        SyncBatchNorm(4)(torch.randn(1, 4, 1, 1, 1, 1))


def test_wrong_channel_count_is_refused():
    with pytest.raises(ValueError, match="expected 4 channels in dimension 1"):
        SyncBatchNorm(4)(torch.randn(2, 3, 2, 2))
    with pytest.raises(ValueError, match=r"expected input of shape \(N, 4\)"):
        SyncBatchNorm(4)(torch.randn(2, 3))


def test_channel_last_with_contiguous_nchw_is_refused():
    with pytest.raises(ValueError, match="a contiguous NCHW tensor"):
        SyncBatchNorm(4, channel_last=True)(torch.randn(2, 4, 3, 5))


def test_single_value_per_channel_is_refused():
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        SyncBatchNorm(4)(torch.randn(1, 4))


def test_unsupported_dtype_is_refused():
    with pytest.raises(TypeError, match="float64 is not supported"):
        SyncBatchNorm(4).double()(torch.randn(3, 4, dtype=torch.float64))


def test_mismatched_z_is_refused():
    with pytest.raises(ValueError, match="z must have the input's shape"):
        SyncBatchNorm(4)(torch.randn(3, 4, 2), torch.randn(3, 4, 3))


# ---- convert_syncbn_model ---------------------------------------------------------------------


def test_convert_syncbn_model_replaces_batchnorms_only():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1),
        nn.BatchNorm2d(4),
        nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
        nn.Sequential(nn.Flatten(2), nn.BatchNorm1d(4, momentum=None, eps=1e-3)),
        nn.Unflatten(2, (2, 2)),
        nn.BatchNorm2d(4, affine=False),
    )
    model[1].weight.requires_grad_(False)
    for _ in range(2):
        model(torch.randn(3, 3, 2, 2))
    model.eval()
    old = [model[1], model[3][1], model[5]]
    converted = P.convert_syncbn_model(model, process_group="pg", channel_last=False)
    assert converted is model
    new = [model[1], model[3][1], model[5]]
    assert all(type(m) is SyncBatchNorm for m in new)
    assert type(model[2]) is nn.InstanceNorm2d
    for o, n in zip(old, new):
        assert n.running_mean is o.running_mean and n.running_var is o.running_var
        assert n.num_batches_tracked is o.num_batches_tracked
        assert (n.eps, n.momentum, n.affine) == (o.eps, o.momentum, o.affine)
        assert n.process_group == "pg" and n.training is False
        if o.affine:
            assert torch.equal(n.weight, o.weight) and n.weight is not o.weight
            assert n.weight.requires_grad == o.weight.requires_grad
    assert int(new[0].num_batches_tracked) == 2


def test_convert_syncbn_model_outputs_match_and_root_is_replaced():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    x = torch.randn(2, 3, 5, 5)
    ref = model(x)
    import copy

    synced = P.convert_syncbn_model(copy.deepcopy(model))
    torch.testing.assert_close(synced(x), ref, atol=1e-5, rtol=1e-5)
    root = P.convert_syncbn_model(nn.BatchNorm1d(5), channel_last=True)
    assert type(root) is SyncBatchNorm and root.channel_last is True
    torch_sync = P.convert_syncbn_model(nn.SyncBatchNorm(3))
    assert type(torch_sync) is SyncBatchNorm


def test_create_syncbn_process_group_without_distributed():
    assert P.create_syncbn_process_group(0) is None
    with pytest.raises(RuntimeError, match="init_process_group"):
        P.create_syncbn_process_group(2)


# ---- the legacy syncbn module -----------------------------------------------------------------


def test_legacy_syncbn_module_matches_torch():
    import syncbn

    x = torch.randn(3, 5, 4, 2)
    mean, var = syncbn.welford_mean_var(x)
    torch.testing.assert_close(mean, x.mean((0, 2, 3)))
    torch.testing.assert_close(var, x.var((0, 2, 3), unbiased=False))
    xl = x.movedim(1, -1).contiguous()
    ml, vl = syncbn.welford_mean_var_c_last(xl)
    torch.testing.assert_close(ml, mean)
    torch.testing.assert_close(vl, var)
    m, v, inv = syncbn.welford_parallel(
        mean.view(1, -1), var.view(1, -1), torch.tensor([24], dtype=torch.int32), 1e-5
    )
    torch.testing.assert_close(v, x.var((0, 2, 3)))
    w, b = torch.rand(5) + 0.5, torch.randn(5)
    y = syncbn.batchnorm_forward(x, m, inv, w, b)
    expect = nn.functional.batch_norm(x, None, None, w, b, True, 0.0, 1e-5)
    torch.testing.assert_close(y, expect, atol=1e-5, rtol=1e-5)
    z = torch.randn_like(xl)
    yl = syncbn.batchnorm_forward_c_last(xl, z, m, inv, w, b, True)
    torch.testing.assert_close(yl, torch.relu(expect.movedim(1, -1) + z), atol=1e-5, rtol=1e-5)

    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    out = nn.functional.batch_norm(xr, None, None, wr, b, True, 0.0, 1e-5)
    g = torch.randn_like(x)
    out.backward(g)
    sum_dy, sum_dy_xmu, gw, gb = syncbn.reduce_bn(g, x, m, inv, w)
    torch.testing.assert_close(gw, wr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gb, g.sum((0, 2, 3)), atol=1e-4, rtol=1e-4)
    gx = syncbn.batchnorm_backward(
        g, x, m, inv, w, sum_dy, sum_dy_xmu, torch.tensor([24], dtype=torch.int32)
    )
    torch.testing.assert_close(gx, xr.grad, atol=1e-5, rtol=1e-4)
    gl = g.movedim(1, -1).contiguous()
    parts = syncbn.reduce_bn_c_last(gl, xl, m, inv, w)
    torch.testing.assert_close(parts[2], gw, atol=1e-4, rtol=1e-4)
    gxl = syncbn.batchnorm_backward_c_last(
        gl, xl, m, inv, w, parts[0], parts[1], torch.tensor([24])
    )
    torch.testing.assert_close(gxl.movedim(-1, 1), xr.grad, atol=1e-5, rtol=1e-4)
    masked = syncbn.relu_bw_c_last(gl, xl, z, m, inv, w, b)
    torch.testing.assert_close(masked, gl * (yl > 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_eval_with_z_and_fused_relu_keeps_dtype_and_layout(dtype):
    bn = SyncBatchNorm(4, fuse_relu=True).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 4, 3, 5).to(dtype).contiguous(memory_format=torch.channels_last)
    z = torch.randn(2, 4, 3, 5).to(dtype)
    y = bn(x, z)
    assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last)
    shape = (1, -1, 1, 1)
    inv = torch.rsqrt(bn.running_var + bn.eps).view(shape)
    want = (x.float() - bn.running_mean.view(shape)) * inv * bn.weight.view(shape) + bn.bias.view(
        shape
    )
    want = torch.relu(want + z.float())
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y.float(), want.detach(), atol=10 * atol, rtol=10 * rtol)


def test_parametrized_weight_is_used():
    """forward reads parameters from the module's dicts, or by attribute where a
    parametrization made ``weight`` a property."""
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    x = torch.randn(3, 4, 5)
    plain, para = SyncBatchNorm(4), SyncBatchNorm(4)
    with torch.no_grad():
        plain.weight.mul_(2)
    parametrize.register_parametrization(para, "weight", Double())
    torch.testing.assert_close(para(x), plain(x))


# ---- apex's autograd Function called directly ------------------------------------------------


def _apex_function():
    from apex.parallel.optimized_sync_batchnorm_kernel import SyncBatchnormFunction

    return SyncBatchnormFunction


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("momentum", [0.1, 1.0])
def test_function_takes_apex_argument_list(momentum, device):
    """apex's positional call (input, z, weight, bias, running_mean, running_var, eps,
    track_running_stats, momentum, process_group, channel_last, fuse_relu): batch statistics,
    the running estimates updated by ``momentum``, torch's gradients."""
    fn = _apex_function()
    ref, _ = _pair(4, momentum=momentum)
    ref = ref.to(device)
    x = torch.randn(3, 4, 5, 2, device=device) * 2 + 1
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    w, b = ref.weight.detach().clone().requires_grad_(), ref.bias.detach().clone().requires_grad_()
    rm, rv = torch.zeros(4, device=device), torch.ones(4, device=device)
    yr = ref(xr)
    ys = fn.apply(xs, None, w, b, rm, rv, 1e-5, True, momentum, None, False, False)
    torch.testing.assert_close(ys, yr, atol=1e-5, rtol=1e-4)
    g = torch.randn_like(x)
    yr.backward(g)
    ys.backward(g)
    torch.testing.assert_close(xs.grad, xr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.grad, ref.weight.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.grad, ref.bias.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rm, ref.running_mean)
    torch.testing.assert_close(rv, ref.running_var)


def test_function_apex_channel_last_z_and_fused_relu():
    """channel_last=True takes (..., C) input; z added before the fused ReLU; apex's defaults
    for the arguments after eps (a batch-statistics step, momentum 1.0)."""
    fn = _apex_function()
    ref, _ = _pair(4, momentum=1.0)
    x, z = torch.randn(3, 4, 3, 5), torch.randn(3, 4, 3, 5)
    xr = x.clone().requires_grad_()
    yr = torch.relu(ref(xr) + z)
    g = torch.randn_like(x)
    yr.backward(g)
    xs = x.movedim(1, -1).contiguous().requires_grad_()
    zs = z.movedim(1, -1).contiguous().requires_grad_()
    rm, rv = torch.zeros(4), torch.ones(4)
    ys = fn.apply(xs, zs, ref.weight.detach(), ref.bias.detach(), rm, rv, 1e-5, True, 1.0, None,
                  True, True)  # fmt: skip
    ys.backward(g.movedim(1, -1))
    torch.testing.assert_close(ys.movedim(-1, 1), yr, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(xs.grad.movedim(-1, 1), xr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(zs.grad.movedim(-1, 1), g * (yr > 0), atol=0, rtol=0)
    torch.testing.assert_close(rm, ref.running_mean)
    torch.testing.assert_close(rv, ref.running_var)
    plain = fn.apply(x, None, None, None, None, None, 1e-5)  # apex's defaults: (N, C, *)
    want = torch.nn.functional.batch_norm(x, None, None, training=True, eps=1e-5)
    torch.testing.assert_close(plain, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("channel_last", [False, True])
def test_function_without_batch_statistics_is_eval_batch_norm(channel_last, device):
    """track_running_stats=False (apex's module passes ``training or not
    track_running_stats``): normalised by the running estimates, which stay as they are, and
    differentiated as torch's eval batch_norm (no batch-mean terms in the input gradient)."""
    fn = _apex_function()
    x = torch.randn(3, 4, 5, 2, device=device) * 2 + 1
    w, b = torch.rand(4, device=device) + 0.5, torch.randn(4, device=device)
    rm, rv = torch.randn(4, device=device), torch.rand(4, device=device) + 0.5
    rm0, rv0 = rm.clone(), rv.clone()
    xr = x.clone().requires_grad_()
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    yr = torch.nn.functional.batch_norm(xr, rm, rv, wr, br, False, 0.1, 1e-5)
    g = torch.randn_like(x)
    yr.backward(g)
    xs = (x.movedim(1, -1).contiguous() if channel_last else x.clone()).requires_grad_()
    ws, bs = w.clone().requires_grad_(), b.clone().requires_grad_()
    ys = fn.apply(xs, None, ws, bs, rm, rv, 1e-5, False, 0.1, None, channel_last, False)
    ys.backward(g.movedim(1, -1) if channel_last else g)
    back = (lambda t: t.movedim(-1, 1)) if channel_last else (lambda t: t)
    torch.testing.assert_close(back(ys), yr, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(back(xs.grad), xr.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ws.grad, wr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(bs.grad, br.grad, atol=1e-4, rtol=1e-4)
    assert torch.equal(rm, rm0) and torch.equal(rv, rv0)


def test_function_without_batch_statistics_needs_running_estimates():
    fn = _apex_function()
    with pytest.raises(ValueError, match="running_mean and running_var must be given"):
        fn.apply(torch.randn(4, 3), None, None, None, None, None, 1e-5, False)


def test_python_function_takes_apex_argument_list():
    """apex.parallel.sync_batchnorm_kernel.SyncBatchnormFunction.apply(input, weight, bias,
    mean, var, eps, process_group, world_size), as apex's Python SyncBatchNorm called it:
    normalised by the given batch statistics, differentiated as torch's training batch_norm
    (one process: no exchange)."""
    from apex.parallel.sync_batchnorm_kernel import SyncBatchnormFunction

    x = torch.randn(4, 3, 5) * 2 + 1
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    yr = torch.nn.functional.batch_norm(xr, None, None, wr, br, True, 0.1, 1e-5)
    g = torch.randn_like(x)
    yr.backward(g)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    mean, var = x.mean((0, 2)), x.var((0, 2), unbiased=False)
    ys = SyncBatchnormFunction.apply(xs, ws, bs, mean, var, 1e-5, None, 1)
    ys.backward(g)
    torch.testing.assert_close(ys, yr, atol=1e-5, rtol=1e-4)
    for got, want in ((xs.grad, xr.grad), (ws.grad, wr.grad), (bs.grad, br.grad)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="running_mean must be a tensor of the 3 channels"):
        SyncBatchnormFunction.apply(xs, ws, bs, mean[:2], var, 1e-5)


def test_function_direct_call_checks_its_arguments():
    """A direct call names what is wrong (z of another shape, a per-channel vector of another
    size, running_mean without running_var) before any op runs; a non-contiguous (..., C)
    input is taken."""
    fn = _apex_function()
    x, w = torch.randn(2, 3, 4, 5), torch.ones(5)
    with pytest.raises(ValueError, match=r"z must have the input's shape \(2, 3, 4, 5\)"):
        fn.apply(x, torch.randn(2, 5, 3, 4), w, None, None, None, 1e-5, True, 0.1, None, True)
    with pytest.raises(ValueError, match=r"weight must have shape \(5,\) for the input's 5"):
        fn.apply(x, None, torch.ones(4), None, None, None, 1e-5, True, 0.1, None, True)
    rm = torch.zeros(5)
    with pytest.raises(ValueError, match="give both running_mean and running_var, or neither"):
        fn.apply(x, None, w, None, rm, None, 1e-5, True, 0.1, None, True)
    xt = torch.randn(2, 5, 3, 4).permute(0, 2, 3, 1)  # (..., C), not contiguous
    y = fn.apply(xt, None, w, None, None, None, 1e-5, True, 0.1, None, True)
    want = torch.nn.functional.batch_norm(xt.permute(0, 3, 1, 2), None, None, w, training=True)
    torch.testing.assert_close(y.permute(0, 3, 1, 2), want, atol=1e-5, rtol=1e-4)
