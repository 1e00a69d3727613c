"""LARC around torch.optim.SGD against the update computed by hand in float64."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from apex.parallel.LARC import LARC


def _hand_step(params, grads, lr, wd, trust, clip, eps, momentum_bufs=None):
    """The LARC-scaled SGD step (no momentum) in float64, written out."""
    out = []
    for p, g in zip(params, grads):
        p, g = p.double(), g.double()
        pn, gn = p.norm().item(), g.norm().item()
        if pn != 0 and gn != 0:
            local = trust * pn / (gn + pn * wd + eps)
            if clip:
                local = min(local / lr, 1.0)
            g = (g + wd * p) * local
        out.append(p - lr * g)
    return out


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.05])
@pytest.mark.parametrize("trust", [0.02, 0.001, 10.0])
def test_larc_sgd_step_matches_the_hand_computed_update(clip, wd, trust):
    params = [
        torch.nn.Parameter(torch.randn(5, 3)),
        torch.nn.Parameter(torch.randn(7)),
        torch.nn.Parameter(torch.zeros(4)),
    ]
    for p in params:
        p.grad = torch.randn_like(p) * 0.1
    params[1].grad.zero_()  # a zero gradient is left as it is
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    lr = 0.5
    opt = LARC(
        torch.optim.SGD(params, lr=lr, weight_decay=wd),
        trust_coefficient=trust,
        clip=clip,
        eps=1e-8,
    )
    opt.step()
    expected = _hand_step(before, grads, lr, wd, trust, clip, 1e-8)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach().double(), e, atol=1e-6, rtol=1e-6)
    assert opt.param_groups[0]["weight_decay"] == wd  # restored after the inner step


def test_larc_proxies_the_wrapped_optimizer():
    p = torch.nn.Parameter(torch.randn(3))
    inner = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    opt = LARC(inner, trust_coefficient=0.001, clip=False)
    assert opt.optim is inner
    assert opt.param_groups is inner.param_groups
    assert opt.defaults is inner.defaults
    p.grad = torch.randn(3)
    opt.step()
    assert opt.state is inner.state and len(opt.state) == 1
    sd = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    assert p.grad is None
    q = torch.nn.Parameter(torch.randn(2))
    opt.add_param_group({"params": [q], "lr": 0.2})
    assert len(inner.param_groups) == 2
    opt.param_groups = inner.param_groups[:1]
    assert len(inner.param_groups) == 1
    opt.load_state_dict(sd)
    assert repr(opt) == repr(inner)
    assert not isinstance(opt, torch.optim.Optimizer)
    clone = pickle.loads(pickle.dumps(opt))
    assert clone.param_groups[0]["lr"] == 0.1


def test_larc_step_takes_no_closure():
    opt = LARC(torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1))
    with pytest.raises(TypeError):
        opt.step(lambda: 0.0)


def test_larc_is_a_submodule_of_apex_parallel_as_in_apex():
    """apex's apex/parallel/__init__.py did not import the class: after `import apex.parallel`,
    `apex.parallel.LARC` is the submodule, and clients write `apex.parallel.LARC.LARC(opt)`
    (bitsandbytes' tests, LARS branches of optimizer builders) as well as
    `from apex.parallel.LARC import LARC`."""
    import types

    import apex.parallel

    assert isinstance(apex.parallel.LARC, types.ModuleType)
    inner = torch.optim.SGD([torch.nn.Parameter(torch.randn(3))], lr=0.1)
    assert isinstance(apex.parallel.LARC.LARC(inner, trust_coefficient=0.001), LARC)
