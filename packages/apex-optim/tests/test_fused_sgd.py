"""FusedSGD against torch.optim.SGD and a for-loop oracle, and apex's API around it."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from optim_testing import (
    LOW,
    STEPS,
    assert_close,
    clone_params,
    deepcopy,
    fp32_copies,
    grads,
    max_err,
    model,
    params,
    roundtrip,
    run_synthetic,
    train,
)

import amp_C
from apex.optimizers import FusedSGD

CASES = [
    dict(momentum=0.0),
    dict(momentum=0.9),
    dict(momentum=0.9, dampening=0.3, weight_decay=0.05),
    dict(momentum=0.9, nesterov=True, weight_decay=0.05),
]


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("kw", CASES, ids=str)
def test_matches_torch_sgd(kw, capturable):
    net, ref = model(), model()
    train(net, FusedSGD(net.parameters(), lr=0.05, capturable=capturable, **kw))
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.05, foreach=False, **kw))
    assert_close(net.parameters(), ref.parameters())


def oracle_sgd(ps, steps, lr, momentum, dampening, wd, nesterov, wd_after_momentum):
    ws = [p.detach().double().clone() for p in ps]
    bufs = [None] * len(ws)
    for t in range(steps):
        for i, (w, g) in enumerate(zip(ws, grads(t, [tuple(p.shape) for p in ps]))):
            d = g.double()
            if not wd_after_momentum:
                d = d + wd * w
            if momentum:
                bufs[i] = d.clone() if bufs[i] is None else momentum * bufs[i] + (1 - dampening) * d
                d = d + momentum * bufs[i] if nesterov else bufs[i]
            if wd_after_momentum:
                d = d + wd * w
            w.sub_(lr * d)
    return ws


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("nesterov", [False, True])
def test_wd_after_momentum_against_oracle(nesterov, capturable):
    ps = params()
    expected = oracle_sgd(ps, STEPS, 0.01, 0.9, 0.0, 0.1, nesterov, True)
    opt = FusedSGD(ps, 0.01, 0.9, 0, 0.1, nesterov, wd_after_momentum=True, capturable=capturable)
    run_synthetic(opt, ps)
    assert_close(ps, expected)


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("dtype", LOW)
def test_master_weights_follow_fp32_torch(dtype, capturable):
    ps = params(dtype)
    ref = fp32_copies(ps)
    opt = FusedSGD(ps, lr=0.01, momentum=0.9, master_weights=True, capturable=capturable)
    run_synthetic(opt, ps)
    run_synthetic(torch.optim.SGD(ref, lr=0.01, momentum=0.9), ref, grad_dtype=dtype)
    masters = [opt.state[p]["master_param"] for p in ps]
    assert_close(masters, ref)
    assert all(opt.state[p]["momentum_buffer"].dtype == torch.float32 for p in ps)
    for p, m in zip(ps, masters):
        assert torch.equal(p, m.to(dtype))


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_params_2x_rule(dtype, capturable):
    """bf16 params are stepped (apex silently skipped them), within twice torch's error."""
    ps = params(dtype)
    ref32, ref_low = fp32_copies(ps), clone_params(ps)
    opt = FusedSGD(ps, lr=0.01, momentum=0.9, capturable=capturable)
    run_synthetic(opt, ps)
    run_synthetic(torch.optim.SGD(ref32, lr=0.01, momentum=0.9), ref32, grad_dtype=dtype)
    run_synthetic(torch.optim.SGD(ref_low, lr=0.01, momentum=0.9), ref_low)
    assert max_err(ps, ref32) <= 2 * max_err(ref_low, ref32) + 1e-6


def test_groups_add_param_group_and_frozen_params():
    ps = params()
    ref = clone_params(ps)

    def groups(q):
        return [
            {"params": q[:2], "lr": 0.1, "momentum": 0.5},
            {"params": q[2:3], "nesterov": True, "momentum": 0.9},
        ]

    opt = FusedSGD(groups(ps), lr=0.01, momentum=0.0)
    opt.add_param_group({"params": ps[3:], "weight_decay": 0.1, "momentum": 0.8, "dampening": 0.2})
    t = torch.optim.SGD(groups(ref), lr=0.01)
    t.add_param_group({"params": ref[3:], "weight_decay": 0.1, "momentum": 0.8, "dampening": 0.2})
    run_synthetic(opt, ps, skip={4})
    run_synthetic(t, ref, skip={4})
    assert_close(ps, ref)
    assert ps[4] not in opt.state


def test_momentum_buffers_created_at_different_times():
    """A param that first gets a grad later starts its buffer with that grad (torch), while
    the others keep theirs: apex treated the whole list as a first run."""
    ps = params()
    ref = clone_params(ps)
    opt = FusedSGD(ps, lr=0.01, momentum=0.9, dampening=0.5)
    t = torch.optim.SGD(ref, lr=0.01, momentum=0.9, dampening=0.5)
    run_synthetic(opt, ps, steps=5, skip={2})
    run_synthetic(t, ref, steps=5, skip={2})
    run_synthetic(opt, ps, steps=5, seed=3)
    run_synthetic(t, ref, steps=5, seed=3)
    assert_close(ps, ref)


# ---- GradScaler ---------------------------------------------------------------------------------


def scaled_steps(net, opt, steps, inf_at=(), scale=2.0**10):
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000)
    dtype = next(net.parameters()).dtype
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 7, generator=g, dtype=dtype), torch.randn(8, 3, generator=g, dtype=dtype)
    for i in range(steps):
        opt.zero_grad()
        # The loss in float32 (the grads keep the params' dtype): torch 2.3's CPU mse_loss has no
        # bfloat16 forward and no float16 backward.
        scaler.scale(torch.nn.functional.mse_loss(net(x).float(), y.float())).backward()
        if i in inf_at:
            next(net.parameters()).grad[0, 0] = float("nan")
        scaler.step(opt)
        scaler.update()
    return scaler


@pytest.mark.parametrize("capturable", [False, True])
def test_grad_scaler_protocol(capturable):
    net, ref = model(), model()
    opt = FusedSGD(net.parameters(), lr=0.05, momentum=0.9, dampening=0.1, capturable=capturable)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaled_steps(net, opt, 10)
    ref_opt = FusedSGD(ref.parameters(), lr=0.05, momentum=0.9, dampening=0.1)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 7, generator=g), torch.randn(8, 3, generator=g)
    for _ in range(10):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    assert_close(net.parameters(), ref.parameters())


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grad_scaler_overflow_leaves_everything(dtype, capturable):
    """fp16 params under a GradScaler (torch's own unscale_ refuses fp16 grads)."""
    net = model().to(dtype)
    opt = FusedSGD(
        net.parameters(), lr=0.05, momentum=0.9, master_weights=True, capturable=capturable
    )
    scaled_steps(net, opt, 3)
    before = deepcopy(opt.state_dict())
    params_before = [p.detach().clone() for p in net.parameters()]
    scaler = scaled_steps(net, opt, 1, inf_at={0})
    assert scaler.get_scale() == 2.0**9
    for p, q in zip(net.parameters(), params_before):
        assert torch.equal(p, q)
    after = opt.state_dict()
    for i, entry in before["state"].items():
        for k, v in entry.items():
            assert torch.equal(after["state"][i][k], v), k


# ---- checkpoints and apex's API -----------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"master_weights": True}, {"capturable": True}], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_resumes_bit_identically(dtype, kw):
    ps = params(dtype)
    opt = FusedSGD(ps, lr=0.01, momentum=0.9, weight_decay=0.01, **kw)
    run_synthetic(opt, ps, steps=10)
    saved = roundtrip({"params": [p.detach() for p in ps], "opt": opt.state_dict()})
    ps2 = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    opt2 = FusedSGD(ps2, lr=1.0, momentum=0.9, **kw)
    opt2.load_state_dict(saved["opt"])
    run_synthetic(opt, ps, steps=10, seed=7)
    run_synthetic(opt2, ps2, steps=10, seed=7)
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)


def test_torch_sgd_state_loads():
    net, ref = model(), model()
    t = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, foreach=False)
    train(ref, t, steps=5)
    net.load_state_dict(ref.state_dict())
    opt = FusedSGD(net.parameters(), lr=0.05, momentum=0.9)
    opt.load_state_dict(roundtrip(t.state_dict()))
    train(net, opt, steps=10, seed=2)
    train(ref, t, steps=10, seed=2)
    assert_close(net.parameters(), ref.parameters())


def test_constructor_and_attributes_match_apex():
    ps = params()
    opt = FusedSGD(ps, 0.1, 0.9, 0.0, 0.01, True, True, False, True)
    g = opt.param_groups[0]
    assert (g["lr"], g["momentum"], g["dampening"], g["weight_decay"], g["nesterov"]) == (
        0.1,
        0.9,
        0.0,
        0.01,
        True,
    )
    assert opt.wd_after_momentum is True and opt.materialize_master_grads is False
    assert opt.set_grad_none is True
    assert opt.multi_tensor_sgd is amp_C.multi_tensor_sgd
    assert opt.most_recent_scale == 1.0 and opt.scale_set_by_backward is False
    assert set(FusedSGD(ps, lr=0.1).defaults) == {
        "lr",
        "momentum",
        "dampening",
        "weight_decay",
        "nesterov",
    }
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        FusedSGD(ps)
    with pytest.raises(
        ValueError, match="Nesterov momentum requires a momentum and zero dampening"
    ):
        FusedSGD(ps, lr=0.1, nesterov=True)


def test_zero_grad_drops_the_grads_as_apex_on_current_torch():
    """apex's FusedSGD (set_grad_none=False by default) called Optimizer.zero_grad(), which drops
    the grads since torch 2.0; set_to_none=False zeroes them in place."""
    ps = params()
    opt = FusedSGD(ps, lr=0.1)
    assert opt.set_grad_none is False
    run_synthetic(opt, ps, steps=1)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in ps)
    opt.zero_grad()
    assert all(p.grad is None for p in ps)


def test_most_recent_scale_divides_the_grads():
    ps, ps2 = params(), params()
    a, b = FusedSGD(ps, lr=0.1, momentum=0.9), FusedSGD(ps2, lr=0.1, momentum=0.9)
    for p, q, g in zip(ps, ps2, grads(0)):
        p.grad, q.grad = g * 8, g.clone()
    a.most_recent_scale = 8.0
    a.step()
    b.step()
    assert a.most_recent_scale == 1.0
    for p, q in zip(ps, ps2):
        assert torch.equal(p, q)


def test_amp_stash_path():
    """apex amp O2's layout: fp16 model params, fp32 masters held by amp."""
    model16 = params(torch.float16, shapes=[(4, 3), (3,)])
    masters = fp32_copies(model16)
    fp32 = params(shapes=[(5,)], seed=3)
    opt = FusedSGD([{"params": model16 + fp32}], lr=0.1, momentum=0.9)
    opt._amp_stash = types.SimpleNamespace(
        fp16_groups=[model16], fp32_from_fp16_groups=[masters], fp32_from_fp32_groups=[fp32]
    )
    ref = fp32_copies(masters + fp32)
    t = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    for step in range(3):
        gs = grads(step, [(4, 3), (3,), (5,)])
        for p, g in zip(masters + fp32, gs):
            p.grad = g.clone()
        for p, g in zip(ref, gs):
            p.grad = g.clone()
        opt.step()
        t.step()
    assert_close(masters + fp32, ref)
    for p, m in zip(model16, masters):
        assert torch.equal(p, m.half())
    momentums, first_run = opt.get_momentums(masters)
    assert first_run is False and momentums[0] is opt.state[masters[0]]["momentum_buffer"]
