"""FusedNovoGrad against a for-loop oracle of apex's algorithm."""

from __future__ import annotations

import math

import pytest
import torch
from optim_testing import LOW, assert_close, fp32_copies, grads, params, roundtrip, run_synthetic

import amp_C
from apex.optimizers import FusedNovoGrad

STEPS = 50


def oracle(
    ps,
    steps,
    *,
    lr=1e-2,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.0,
    bias_correction=True,
    grad_averaging=True,
    norm_type=2,
    init_zero=False,
    reg_inside_moment=False,
    grad_dtype=None,
):
    """apex's NovoGrad, one param at a time in float64 (defaults: FusedNovoGrad's, lr 1e-2)."""
    wd = weight_decay
    b1, b2 = betas
    b3 = 1 - b1 if grad_averaging else 1.0
    ws = [p.detach().double().clone() for p in ps]
    ms = [torch.zeros_like(w) for w in ws]
    norms = [None] * len(ws)
    for t in range(1, steps + 1):
        gs = grads(t - 1, [tuple(p.shape) for p in ps])
        for i, (w, m, g) in enumerate(zip(ws, ms, gs)):
            if grad_dtype is not None:
                g = g.to(grad_dtype)
            g = g.double()
            n = g.norm() if norm_type == 2 else g.abs().max()
            if norms[i] is None:
                norms[i] = torch.zeros((), dtype=torch.float64) if init_zero else n
            if norm_type == 2:
                norms[i] = torch.sqrt(b2 * norms[i] ** 2 + (1 - b2) * n**2)
            else:
                norms[i] = b2 * norms[i] + (1 - b2) * n
            bc1 = 1 - b1**t if bias_correction else 1.0
            bc2 = math.sqrt(1 - b2**t) if bias_correction else 1.0
            denom = norms[i] / bc2 + eps
            if reg_inside_moment:
                m.mul_(b1).add_(b3 * (g / denom + wd * w))
                w.sub_(lr * m / bc1)
            else:
                m.mul_(b1).add_(b3 * g)
                w.sub_(lr * (m / bc1 / denom + wd * w))
    return ws


CASES = [
    dict(),
    dict(reg_inside_moment=True, weight_decay=0.01),
    dict(weight_decay=0.01, norm_type=0),
    dict(init_zero=True, grad_averaging=False, bias_correction=False),
    dict(betas=(0.95, 0.98), weight_decay=0.1, reg_inside_moment=True, norm_type=0, init_zero=True),
]


@pytest.mark.parametrize("kw", CASES, ids=str)
def test_matches_oracle(kw):
    ps = params()
    expected = oracle(ps, STEPS, **kw)
    opt = FusedNovoGrad(ps, lr=1e-2, **kw)
    run_synthetic(opt, ps, steps=STEPS)
    assert_close(ps, expected)
    norms = opt.param_groups[0]["exp_avg_sq"]
    assert len(norms) == 2 and norms[0].numel() == 0 and norms[1].numel() == len(ps)
    assert opt.param_groups[0]["step"] == STEPS


@pytest.mark.parametrize("dtype", LOW)
def test_master_weights(dtype):
    ps = params(dtype)
    expected = oracle(fp32_copies(ps), STEPS, weight_decay=0.01, grad_dtype=dtype)
    opt = FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01, master_weights=True)
    run_synthetic(opt, ps, steps=STEPS)
    assert_close([opt.state[p]["master_param"] for p in ps], expected)
    slot = {torch.float16: 0, torch.bfloat16: 2}[dtype]
    assert opt.param_groups[0]["exp_avg_sq"][slot].numel() == len(ps)


def test_mixed_dtypes_keep_apex_layout():
    """Norms per dtype in apex's order, [fp16, fp32] (+ bf16), and a round trip."""
    ps = params(torch.float16)[:2] + params()[2:4] + params(torch.bfloat16)[4:]
    opt = FusedNovoGrad(ps, lr=1e-2)
    run_synthetic(opt, ps, steps=5)
    norms = opt.param_groups[0]["exp_avg_sq"]
    assert [n.numel() for n in norms] == [2, 2, 1]
    saved = roundtrip({"params": [p.detach() for p in ps], "opt": opt.state_dict()})
    ps2 = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    opt2 = FusedNovoGrad(ps2, lr=1.0)
    opt2.load_state_dict(saved["opt"])
    run_synthetic(opt, ps, steps=5, seed=4)
    run_synthetic(opt2, ps2, steps=5, seed=4)
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)


def test_changing_set_of_grads_is_refused():
    ps = params()
    opt = FusedNovoGrad(ps)
    run_synthetic(opt, ps, steps=1)
    with pytest.raises(RuntimeError, match="param group 0: 4 torch.float32 params have a grad"):
        run_synthetic(opt, ps, steps=1, skip={0})


def test_constructor_matches_apex():
    ps = params()
    opt = FusedNovoGrad(
        ps, 1e-2, False, (0.95, 0.98), 1e-6, 0.1, False, True, False, 0, True, False
    )
    assert set(opt.defaults) == {
        "lr", "bias_correction", "betas", "eps", "weight_decay", "grad_averaging", "norm_type",
        "init_zero",
    }  # fmt: skip
    assert opt.moment_mode == 0 and opt.set_grad_none is False
    assert opt.defaults["norm_type"] == 0 and opt.defaults["init_zero"] is True
    assert opt.multi_tensor_novograd is amp_C.multi_tensor_novograd
    with pytest.raises(RuntimeError, match="does not support the AMSGrad variant"):
        FusedNovoGrad(ps, amsgrad=True)
    with pytest.raises(ValueError, match="param group 0: invalid norm_type=1"):
        FusedNovoGrad(ps, norm_type=1)
