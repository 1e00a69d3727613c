"""What every fused optimizer shares: bad input, torch's keywords, zero_grad, the cached lists."""

from __future__ import annotations

import pytest
import torch
from optim_testing import NAMES, make, params, run_synthetic

from apex.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)


@pytest.mark.parametrize("name", NAMES)
def test_foreach_and_fused_keywords_are_accepted(name):
    opt = make(name, params(), foreach=True, fused=False)
    assert "foreach" not in opt.defaults and "fused" not in opt.defaults


@pytest.mark.parametrize("name", NAMES)
def test_negative_lr_names_the_group(name):
    ps = params()
    with pytest.raises(ValueError, match=rf"{name}: param group 1: invalid learning rate lr=-0.1"):
        make(name, [{"params": ps[:2]}, {"params": ps[2:], "lr": -0.1}])
    opt = make(name, ps[:2])
    with pytest.raises(ValueError, match=r"param group 1: invalid learning rate"):
        opt.add_param_group({"params": ps[2:], "lr": -1.0})
    assert len(opt.param_groups) == 1  # the bad group was not kept


@pytest.mark.parametrize("betas", [(1.0, 0.999), (0.9, -0.1), (0.9, 1.5)])
@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("FusedSGD", "FusedAdagrad")])
def test_betas_outside_unit_interval(name, betas):
    ps = params()
    with pytest.raises(
        ValueError, match=r"param group 1: invalid betas\[\d\]=.* \(must be in \[0, 1\)\)"
    ):
        make(name, [{"params": ps[:2]}, {"params": ps[2:], "betas": betas}])


@pytest.mark.parametrize("name", NAMES)
def test_negative_eps_and_weight_decay(name):
    if name != "FusedSGD":
        with pytest.raises(ValueError, match="param group 0: invalid eps=-1"):
            make(name, params(), eps=-1.0)
    with pytest.raises(ValueError, match="param group 0: invalid weight_decay=-0.1"):
        make(name, params(), weight_decay=-0.1)


@pytest.mark.parametrize("name", NAMES)
def test_unsupported_param_dtype(name):
    ps = params()
    ps[3] = torch.nn.Parameter(ps[3].double())
    with pytest.raises(
        TypeError, match=rf"{name}: param group 0: parameter 3 has dtype torch.float64"
    ):
        make(name, ps)


@pytest.mark.parametrize("name", NAMES)
def test_sparse_gradients(name):
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = make(name, [{"params": params()}, {"params": emb.parameters()}])
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(
        RuntimeError, match=rf"{name}: param group 1: parameter 0 has a sparse gradient"
    ):
        opt.step()


@pytest.mark.parametrize(
    "name, kw",
    [
        ("FusedAdam", {"capturable": True}),
        ("FusedSGD", {"capturable": True}),
        ("FusedNovoGrad", {}),
    ],
)
def test_params_on_different_devices(name, kw):
    ps = params()
    on_meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(
        ValueError, match=r"param group 0: its parameters are on several devices \(cpu, meta\)"
    ):
        make(name, ps + [on_meta], **kw)


@pytest.mark.parametrize("name", NAMES)
def test_zero_grad(name):
    ps = params()
    kw = {} if name == "FusedMixedPrecisionLamb" else {"set_grad_none": True}  # apex has none
    opt = make(name, ps, **kw)
    run_synthetic(opt, ps, steps=1)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in ps)
    opt.zero_grad()
    assert all(p.grad is None for p in ps)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_optimizer_steps_low_precision(name, dtype):
    ps = params(dtype)
    before = [p.detach().clone() for p in ps]
    opt = make(name, ps, lr=0.1)
    run_synthetic(opt, ps, steps=3)
    assert all(p.dtype == dtype and not torch.equal(p, b) for p, b in zip(ps, before))
    assert all(torch.isfinite(p).all() for p in ps)


@pytest.mark.parametrize("name", NAMES)
def test_master_weights_everywhere(name):
    ps = params(torch.bfloat16)
    opt = make(name, ps, master_weights=True)
    run_synthetic(opt, ps, steps=3)
    for p in ps:
        m = opt.state[p]["master_param"]
        assert m.dtype == torch.float32 and torch.equal(p, m.bfloat16())
    assert opt.param_groups_master[0]["params"][0] is opt.state[ps[0]]["master_param"]
    assert "master_param" in opt.state_dict()["state"][0]


@pytest.mark.parametrize("name", NAMES)
def test_masters_handed_out_before_a_step_stay_out_of_state(name):
    """param_groups_master (param_groups_full_precision) before any step: apex built that list
    beside self.state, and subclasses with their own step (NeMo's MegatronFusedAdam) create
    their state on `len(state) == 0`; our first step then takes the same master tensors."""
    ps = params(torch.bfloat16)
    opt = make(name, ps, master_weights=True)
    attr = (
        "param_groups_full_precision"
        if name == "FusedMixedPrecisionLamb"
        else "param_groups_master"
    )
    early = getattr(opt, attr)[0]["params"]
    assert all(len(opt.state[p]) == 0 for p in ps)
    assert getattr(opt, attr)[0]["params"][0] is early[0]  # asked again: the same tensors
    run_synthetic(opt, ps, steps=1)
    assert all(opt.state[p]["master_param"] is m for p, m in zip(ps, early))
    assert all(torch.equal(p, m.bfloat16()) for p, m in zip(ps, early))


@pytest.mark.parametrize("name", ["FusedAdam", "FusedLAMB", "FusedNovoGrad"])
def test_groups_without_grads_count_their_steps(name):
    """apex counts a step in every group with params, whether any has a grad (Megatron reads
    param_groups[i]['step'] of each)."""
    ps = params()
    opt = make(name, [{"params": ps[:2]}, {"params": ps[2:]}, {"params": []}])
    for step in (1, 2):
        for p in ps[:2]:
            p.grad = torch.ones_like(p)
        opt.step()
        assert [g.get("step") for g in opt.param_groups] == [step, step, None]
    assert all(p.grad is None and p not in opt.state for p in ps[2:])


@pytest.mark.parametrize("kw", [{"capturable": True}, {}])
def test_idle_group_steps_are_kept_as_the_active_ones(kw):
    """FusedAdam: an idle group's step is kept as an active group's: a device tensor when
    capturable or scaled, and a GradScaler step skipped for inf is not counted."""
    ps = params()
    opt = FusedAdam([{"params": ps[:2]}, {"params": ps[2:]}], **kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # the scaler's lazy init (the grads below stand for scaled ones)
    for bad in (False, True, False):
        for p in ps[:2]:
            p.grad = torch.full_like(p, float("inf") if bad else 1.0)
        scaler.step(opt)
        scaler.update()
    steps = [g["step"] for g in opt.param_groups]
    assert all(isinstance(s, torch.Tensor) and s.tolist() == [2] for s in steps)


def test_mixed_precision_lamb_counts_idle_groups():
    ps = params()
    opt = FusedMixedPrecisionLamb([{"params": ps[:2]}, {"params": ps[2:]}])
    for p in ps[:2]:
        p.grad = torch.ones_like(p)
    opt.step()
    for p in ps:
        p.grad = None
    opt.step()  # no grads anywhere: apex still counts the step
    assert [g["step"].tolist() for g in opt.param_groups] == [[2], [2]]


def test_early_masters_of_replaced_params_are_dropped():
    ps = params(torch.bfloat16)
    opt = FusedAdam(ps, master_weights=True)
    opt.param_groups_master  # noqa: B018  (made aside, before any step)
    assert len(opt._early_masters) == len(ps)
    new = params(torch.bfloat16, seed=1)
    opt.param_groups[0]["params"] = new
    run_synthetic(opt, new, steps=1)
    assert not opt._early_masters


@pytest.mark.parametrize("name", NAMES)
def test_closure_and_empty_step(name):
    ps = params()
    opt = make(name, ps)
    assert opt.step() is None  # no grads yet: nothing to do

    def closure():
        for p in ps:
            p.grad = torch.ones_like(p)
        return torch.tensor(3.0)

    assert opt.step(closure).item() == 3.0
    assert all(p in opt.state for p in ps)


@pytest.mark.parametrize("name", NAMES)
def test_cached_lists_follow_param_list_changes(name):
    """Replacing a group's params (same length) or adding some rebuilds the cached lists."""
    ps = params()
    opt = make(name, [{"params": ps[:3]}])
    run_synthetic(opt, ps[:3], steps=2)
    new = params(seed=9)[:1]
    opt.param_groups[0]["params"][0] = new[0]
    run_synthetic(opt, [new[0]] + ps[1:3], steps=2)
    assert new[0] in opt.state
    opt.param_groups[0]["params"].append(ps[3])
    if name != "FusedNovoGrad":  # NovoGrad keeps one norm per param: a new one is refused
        run_synthetic(opt, [new[0]] + ps[1:4], steps=1)
        assert ps[3] in opt.state


def test_no_host_sync_in_step(monkeypatch):
    """step() never reads a device value on the host (checked on CPU through Tensor.item)."""
    ps = params(torch.bfloat16)
    opts = [
        FusedAdam(ps, capturable=True, master_weights=True),
        FusedAdam(ps),
        FusedSGD(ps, lr=0.1, momentum=0.9, master_weights=True),
        FusedAdagrad(ps),
        FusedNovoGrad(ps, init_zero=False),
        FusedLAMB(ps, master_weights=True),
        FusedMixedPrecisionLamb(ps, reduced_precision_dtype=torch.bfloat16),
    ]

    def boom(*a, **k):
        raise AssertionError("host sync in step()")

    for opt in opts:
        for p in ps:
            p.grad = torch.randn(p.shape).bfloat16()
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "item", boom)
            m.setattr(torch.Tensor, "__bool__", boom)
            m.setattr(torch.Tensor, "tolist", boom)
            opt.step()
