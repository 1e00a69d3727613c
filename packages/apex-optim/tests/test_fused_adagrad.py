"""FusedAdagrad against torch.optim.Adagrad and a for-loop oracle."""

from __future__ import annotations

import pytest
import torch
from optim_testing import (
    LOW,
    STEPS,
    assert_close,
    clone_params,
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
from apex.optimizers import FusedAdagrad


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adagrad(weight_decay):
    net, ref = model(), model()
    train(net, FusedAdagrad(net.parameters(), lr=0.05, weight_decay=weight_decay))
    t = torch.optim.Adagrad(ref.parameters(), lr=0.05, weight_decay=weight_decay, foreach=False)
    train(ref, t)
    assert_close(net.parameters(), ref.parameters())


def test_decoupled_weight_decay_against_oracle():
    ps = params()
    ws = [p.detach().double().clone() for p in ps]
    hs = [torch.zeros_like(w) for w in ws]
    for t in range(STEPS):
        for w, h, g in zip(ws, hs, grads(t)):
            g = g.double()
            h.add_(g * g)
            w.sub_(0.01 * (g / (h.sqrt() + 1e-10) + 0.1 * w))
    opt = FusedAdagrad(ps, 0.01, 1e-10, 0.1, True, True)
    assert opt.adagrad_w_mode == 1
    run_synthetic(opt, ps)
    assert_close(ps, ws)


@pytest.mark.parametrize("dtype", LOW)
def test_master_weights_and_low_precision(dtype):
    ps, ps_low = params(dtype), params(dtype)
    ref32, ref_low = fp32_copies(ps), clone_params(ps)
    opt = FusedAdagrad(ps, lr=0.01, master_weights=True)
    run_synthetic(opt, ps)
    run_synthetic(FusedAdagrad(ps_low, lr=0.01), ps_low)
    run_synthetic(torch.optim.Adagrad(ref32, lr=0.01), ref32, grad_dtype=dtype)
    run_synthetic(torch.optim.Adagrad(ref_low, lr=0.01), ref_low)
    assert_close([opt.state[p]["master_param"] for p in ps], ref32)
    assert all(opt.state[p]["sum"].dtype == torch.float32 for p in ps)
    assert max_err(ps_low, ref32) <= 2 * max_err(ref_low, ref32) + 1e-6


def test_groups_frozen_params_and_state_dict():
    ps = params()
    ps[1].requires_grad_(False)
    opt = FusedAdagrad([{"params": ps[:3]}, {"params": ps[3:], "lr": 0.1, "eps": 1e-6}], lr=0.01)
    run_synthetic(opt, ps, steps=5, skip={1})
    assert ps[1] not in opt.state and set(opt.state[ps[0]]) == {"sum"}
    saved = roundtrip({"params": [p.detach() for p in ps], "opt": opt.state_dict()})
    ps2 = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    opt2 = FusedAdagrad([{"params": ps2[:3]}, {"params": ps2[3:]}])
    opt2.load_state_dict(saved["opt"])
    run_synthetic(opt, ps, steps=5, seed=3, skip={1})
    run_synthetic(opt2, ps2, steps=5, seed=3, skip={1})
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)


def test_constructor_matches_apex():
    opt = FusedAdagrad(params(), 0.1, 1e-6, 0.01, False, False)
    assert set(opt.defaults) == {"lr", "eps", "weight_decay"}
    assert (opt.defaults["lr"], opt.defaults["eps"], opt.defaults["weight_decay"]) == (
        0.1,
        1e-6,
        0.01,
    )
    assert opt.set_grad_none is False and opt.adagrad_w_mode == 0
    assert opt.multi_tensor_adagrad is amp_C.multi_tensor_adagrad
    assert not opt._step_supports_amp_scaling
