"""FusedLAMB and FusedMixedPrecisionLamb against a float64 oracle of apex's LAMB."""

from __future__ import annotations

import warnings

import pytest
import torch
from optim_testing import (
    LOW,
    assert_close,
    clone_params,
    deepcopy,
    fp32_copies,
    grads,
    model,
    params,
    roundtrip,
    run_synthetic,
)

import amp_C
from apex.multi_tensor_apply import ops
from apex.optimizers import FusedLAMB, FusedMixedPrecisionLamb

STEPS = 50


def oracle(
    ps,
    steps,
    *,
    lr=1e-2,
    betas=(0.9, 0.999),
    eps=1e-6,
    weight_decay=0.01,
    adam_w_mode=True,
    grad_averaging=True,
    max_grad_norm=1.0,
    use_nvlamb=False,
    bias_correction=True,
    grad_dtype=None,
):
    """apex's LAMB, one param at a time in float64 (defaults: FusedLAMB's, lr 1e-2)."""
    b1, b2 = betas
    b3 = 1 - b1 if grad_averaging else 1.0
    ws = [p.detach().double().clone() for p in ps]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    for t in range(1, steps + 1):
        gs = grads(t - 1, [tuple(p.shape) for p in ps])
        gs = [(g.to(grad_dtype) if grad_dtype else g).double() for g in gs]
        gn = torch.sqrt(sum(g.square().sum() for g in gs))
        clip = gn / max_grad_norm if gn > max_grad_norm else 1.0
        bc1 = 1 - b1**t if bias_correction else 1.0
        bc2 = 1 - b2**t if bias_correction else 1.0
        for w, m, v, g in zip(ws, ms, vs, gs):
            sg = g / clip
            if not adam_w_mode and weight_decay:
                sg = sg + weight_decay * w
            m.mul_(b1).add_(b3 * sg)
            v.mul_(b2).add_((1 - b2) * sg * sg)
            u = (m / bc1) / ((v / bc2).sqrt() + eps)
            if adam_w_mode and weight_decay:
                u = u + weight_decay * w
            ratio = lr
            pn, un = w.norm(), u.norm()
            if (use_nvlamb or weight_decay) and pn != 0 and un != 0:
                ratio = lr * pn / un
            w.sub_(ratio * u)
    return ws


CASES = [
    dict(),
    dict(weight_decay=0.0),
    dict(weight_decay=0.0, use_nvlamb=True),
    dict(adam_w_mode=False, weight_decay=0.05),
    dict(max_grad_norm=100.0, grad_averaging=False, bias_correction=False),
]


@pytest.mark.parametrize("kw", CASES, ids=str)
@pytest.mark.parametrize("cls", [FusedLAMB, FusedMixedPrecisionLamb])
def test_matches_oracle(cls, kw):
    ps = params()
    expected = oracle(ps, STEPS, **kw)
    opt = cls(ps, lr=1e-2, **kw)
    run_synthetic(opt, ps, steps=STEPS)
    assert_close(ps, expected)
    assert int(opt.param_groups[0]["step"]) == STEPS


@pytest.mark.parametrize("cls", [FusedLAMB, FusedMixedPrecisionLamb])
def test_groups_add_param_group_frozen(cls):
    """The global norm spans every group; each group keeps its own hyper-parameters."""
    ps = params()
    ps2 = clone_params(ps)
    opt = cls([{"params": ps[:3]}], lr=1e-2, weight_decay=0.01)
    opt.add_param_group({"params": ps[3:], "lr": 3e-3, "weight_decay": 0.0})
    ref = FusedLAMB([{"params": ps2[:3]}, {"params": ps2[3:], "lr": 3e-3, "weight_decay": 0.0}],
                    lr=1e-2, weight_decay=0.01)  # fmt: skip
    run_synthetic(opt, ps, steps=20, skip={4})
    run_synthetic(ref, ps2, steps=20, skip={4})
    assert_close(ps, ps2)
    assert ps[4] not in opt.state
    if cls is FusedMixedPrecisionLamb:
        lr0, lr1 = opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]
        assert lr0 is not lr1 and lr1.item() == pytest.approx(3e-3)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("cls", [FusedLAMB, FusedMixedPrecisionLamb])
def test_master_weights(cls, dtype):
    ps = params(dtype)
    expected = oracle(fp32_copies(ps), STEPS, grad_dtype=dtype)
    kw = {"reduced_precision_dtype": dtype} if cls is FusedMixedPrecisionLamb else {}
    opt = cls(ps, lr=1e-2, master_weights=cls is FusedLAMB, **kw)
    run_synthetic(opt, ps, steps=STEPS)
    masters = [opt.state[p]["master_param"] for p in ps]
    # the update passes through the grads' storage (apex): bf16/fp16 rounding of the update
    assert_close(masters, expected, dtype)
    for p, m in zip(ps, masters):
        assert torch.equal(p, m.to(dtype))
        assert opt.state[p]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("cls", [FusedLAMB, FusedMixedPrecisionLamb])
def test_bf16_params_without_masters(cls):
    ps = params(torch.bfloat16)
    before = [p.detach().clone() for p in ps]
    opt = cls(ps, lr=0.1)
    run_synthetic(opt, ps, steps=3)
    assert all(not torch.equal(p, b) and torch.isfinite(p).all() for p, b in zip(ps, before))
    assert opt.state[ps[0]]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("kw", [{}, {"master_weights": True}], ids=str)
@pytest.mark.parametrize("cls", [FusedLAMB, FusedMixedPrecisionLamb])
def test_state_dict_resumes_bit_identically(cls, kw):
    ps = params(torch.bfloat16)
    opt = cls(ps, lr=1e-2, **kw)
    run_synthetic(opt, ps, steps=5)
    saved = roundtrip({"params": [p.detach() for p in ps], "opt": opt.state_dict()})
    ps2 = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    opt2 = cls(ps2, lr=1.0, **kw)
    opt2.load_state_dict(saved["opt"])
    if kw:
        assert opt2.state[ps2[0]]["master_param"].dtype == torch.float32
    run_synthetic(opt, ps, steps=5, seed=3)
    run_synthetic(opt2, ps2, steps=5, seed=3)
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)


# ---- FusedMixedPrecisionLamb and GradScaler --------------------------------------------------------


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
            next(net.parameters()).grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    return scaler


def test_grad_scaler_protocol_matches_unscaled_run():
    net, ref = model(), model()
    opt = FusedMixedPrecisionLamb(net.parameters(), lr=1e-2, max_grad_norm=0.05)
    assert opt._step_supports_amp_scaling
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaled_steps(net, opt, 10)
    ref_opt = FusedMixedPrecisionLamb(ref.parameters(), lr=1e-2, max_grad_norm=0.05)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 7, generator=g), torch.randn(8, 3, generator=g)
    for _ in range(10):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    assert_close(net.parameters(), ref.parameters())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grad_scaler_overflow_leaves_everything(dtype):
    net = model().to(dtype)
    opt = FusedMixedPrecisionLamb(net.parameters(), lr=1e-2, reduced_precision_dtype=dtype)
    scaled_steps(net, opt, 3)
    before = deepcopy(opt.state_dict())
    params_before = [p.detach().clone() for p in net.parameters()]
    scaler = scaled_steps(net, opt, 1, inf_at={0})
    assert scaler.get_scale() == 2.0**9
    for p, q in zip(net.parameters(), params_before):
        assert torch.equal(p, q)
    after = opt.state_dict()
    assert after["param_groups"][0]["step"].tolist() == [3]
    for i, entry in before["state"].items():
        for k, v in entry.items():
            assert torch.equal(after["state"][i][k], v), k


def test_nonfinite_grad_skips_without_a_scaler():
    ps = params()
    opt = FusedMixedPrecisionLamb(ps, lr=1e-2)
    run_synthetic(opt, ps, steps=2)
    before = [p.detach().clone() for p in ps]
    for p, g in zip(ps, grads(0)):
        p.grad = g
    ps[1].grad[0] = float("nan")
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    assert opt.param_groups[0]["step"].tolist() == [2]


def test_apex_grad_scaler_keyword():
    net = model()
    opt = FusedMixedPrecisionLamb(net.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.nn.functional.mse_loss(net(torch.randn(4, 7)), torch.randn(4, 3))).backward()
    opt.step(grad_scaler=scaler)
    assert opt.param_groups[0]["step"].tolist() == [1]


# ---- apex's API -----------------------------------------------------------------------------------


def test_fused_lamb_constructor_matches_apex():
    ps = params()
    opt = FusedLAMB(ps, 1e-2, False, (0.8, 0.9), 1e-7, 0.1, False, False, False, False, 2.0, True)
    assert opt.defaults == dict(
        lr=1e-2, bias_correction=False, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.1,
        grad_averaging=False, max_grad_norm=2.0,
    )  # fmt: skip
    assert opt.adam_w_mode == 0 and opt.set_grad_none is False and opt.use_nvlamb is True
    assert opt.multi_tensor_lamb is amp_C.multi_tensor_lamb
    assert opt.multi_tensor_l2norm is amp_C.multi_tensor_l2norm
    assert not opt._step_supports_amp_scaling
    with pytest.raises(RuntimeError, match="does not support the AMSGrad variant"):
        FusedLAMB(ps, amsgrad=True)


def test_fused_lamb_overwrites_grads_with_the_update():
    ps = params()
    opt = FusedLAMB(ps, lr=1e-2)
    run_synthetic(opt, ps, steps=1)
    g0 = grads(0)[0]
    assert not torch.equal(ps[0].grad, g0)  # apex's kernel writes the update over the grad


def test_mixed_precision_lamb_constructor_matches_apex():
    ps = params(torch.bfloat16)
    opt = FusedMixedPrecisionLamb(
        ps, 1e-2, 5, False, (0.8, 0.9), 1e-7, 0.1, False, False, False, 2.0, True, torch.bfloat16
    )
    g = opt.param_groups[0]
    assert g["lr"].dtype == torch.float32 and g["lr"].item() == pytest.approx(1e-2)
    # apex's shapes: lr 0-dim (loggers format it: f"{lr:.2e}"), step one element
    assert g["lr"].dim() == 0 and f"{g['lr']:.2e}" == "1.00e-02"
    opt.add_param_group({"params": params(torch.bfloat16, seed=1), "lr": torch.tensor([0.5])})
    assert opt.param_groups[1]["lr"].dim() == 0  # a one-element lr too (older checkpoints)
    assert g["step"].dtype == torch.int32 and g["step"].tolist() == [5]
    assert (g["bias_correction"], g["betas"], g["eps"], g["weight_decay"]) == (
        False, (0.8, 0.9), 1e-7, 0.1)  # fmt: skip
    assert (g["grad_averaging"], g["max_grad_norm"]) == (False, 2.0)
    assert opt.adam_w_mode == 0 and opt.use_nvlamb is True
    assert opt.reduced_precision_dtype is torch.bfloat16
    assert opt.multi_tensor_lamb is amp_C.multi_tensor_lamb_mp
    assert opt.multi_tensor_l2norm is amp_C.multi_tensor_l2norm_mp
    full = opt.param_groups_full_precision
    assert all(m.dtype == torch.float32 for m in full[0]["params"])
    assert FusedMixedPrecisionLamb(params()).param_groups_full_precision[0]["params"][0] is None
    with pytest.raises(TypeError, match="reduced_precision_dtype must be torch.float16"):
        FusedMixedPrecisionLamb(ps, reduced_precision_dtype=torch.float32)


@pytest.mark.parametrize("cls", [FusedLAMB, FusedMixedPrecisionLamb])
def test_params_on_two_devices_are_refused(cls):
    ps = params()
    on_meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(
        ValueError, match=r"param group 1: a parameter is on meta but the optimizer"
    ):
        cls([{"params": ps}, {"params": [on_meta]}])


# ---- FusedLAMB's cached plans (ops.lamb_plan; on the CPU, its reference) ---------------------------

# FusedLAMB takes the list path every step with apex-mta-kernels < 0.1.2, which has no lamb_plan.
needs_lamb_plan = pytest.mark.skipif(
    not hasattr(ops, "lamb_plan"), reason="apex-mta-kernels < 0.1.2: no ops.lamb_plan"
)

PLAN_RUNS = {
    "one group": dict(groups=1),
    "one group, frozen param": dict(groups=1, skip={2}),
    "two groups": dict(groups=2),
    "two groups, l2, nvlamb": dict(groups=2, adam_w_mode=False, use_nvlamb=True),
    "bf16 masters": dict(groups=1, dtype=torch.bfloat16, master_weights=True),
    "fp32 and bf16 masters": dict(groups=1, mixed=True, master_weights=True),
    "no clip, no bias correction": dict(groups=2, max_grad_norm=100.0, bias_correction=False),
}


def plan_run(name, monkeypatch=None, steps=12):
    """A FusedLAMB run of PLAN_RUNS[name]: with its plans, or (monkeypatch given) without them."""
    kw = dict(PLAN_RUNS[name])
    groups, skip = kw.pop("groups"), kw.pop("skip", ())
    dtype, mixed = kw.pop("dtype", torch.float32), kw.pop("mixed", False)
    ps = params(dtype)
    if mixed:
        ps[1::2] = [torch.nn.Parameter(p.detach().bfloat16()) for p in ps[1::2]]
    if monkeypatch is not None:
        monkeypatch.setattr(FusedLAMB, "_native_plan", lambda self, group, bucket: None)
    if groups == 2:
        opt = FusedLAMB([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0, "lr": 3e-3}],
                        lr=1e-2, **kw)  # fmt: skip
    else:
        opt = FusedLAMB(ps, lr=1e-2, **kw)
    run_synthetic(opt, ps, steps=steps, skip=skip)
    if monkeypatch is not None:
        monkeypatch.undo()
    return opt, ps


@needs_lamb_plan
@pytest.mark.parametrize("name", sorted(PLAN_RUNS))
def test_plan_path_is_bit_identical_to_the_list_path(name, monkeypatch):
    opt, ps = plan_run(name)
    natives = [b.native for plan in opt._plans.values() for b in plan.buckets]
    assert natives and all(n is not None for n in natives)
    ref, ref_ps = plan_run(name, monkeypatch)
    assert all(b.native is None for plan in ref._plans.values() for b in plan.buckets)
    for a, b in zip(ps, ref_ps):
        assert torch.equal(a, b)
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)  # the update
    for a, b in zip(ps, ref_ps):
        for key, value in opt.state[a].items():
            assert torch.equal(value, ref.state[b][key]), key


@needs_lamb_plan
def test_plan_path_runs_after_the_first_step(monkeypatch):
    """The list path only on the step that builds the plans, and on a step where a param lost
    its grad (the plans are rebuilt then); the plans every other step."""
    calls = []
    lists = FusedLAMB._step_lists
    monkeypatch.setattr(
        FusedLAMB, "_step_lists", lambda self, *a: calls.append(1) or lists(self, *a)
    )
    ps = params()
    opt = FusedLAMB([{"params": ps[:3]}, {"params": ps[3:]}], lr=1e-2)
    run_synthetic(opt, ps, steps=5)
    assert len(calls) == 1
    ps[1].grad = None
    opt.step()
    assert len(calls) == 2
    run_synthetic(opt, ps, steps=3)
    assert len(calls) == 3  # the grad came back: one more rebuild
    assert int(opt.param_groups[0]["step"]) == 9


@needs_lamb_plan
def test_plan_path_keeps_no_grad_alive():
    import gc
    import weakref

    ps = params()
    opt = FusedLAMB([{"params": ps[:3]}, {"params": ps[3:]}], lr=1e-2)
    run_synthetic(opt, ps, steps=3)
    refs = [weakref.ref(p.grad) for p in ps]
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is None for r in refs)


@needs_lamb_plan
def test_plan_path_survives_deepcopy_and_state_dict(monkeypatch):
    ps = params()
    opt = FusedLAMB([{"params": ps[:3]}, {"params": ps[3:]}], lr=1e-2)
    run_synthetic(opt, ps, steps=3)
    assert opt._norm_cache is not None
    twin = deepcopy(opt)
    assert twin._norm_cache is None and not twin._plans
    opt.load_state_dict(opt.state_dict())
    assert opt._norm_cache is None
    run_synthetic(opt, ps, steps=2)
    ref_ps = params()
    ref = FusedLAMB([{"params": ref_ps[:3]}, {"params": ref_ps[3:]}], lr=1e-2)
    monkeypatch.setattr(FusedLAMB, "_native_plan", lambda self, group, bucket: None)
    run_synthetic(ref, ref_ps, steps=3)
    run_synthetic(ref, ref_ps, steps=2)
    for a, b in zip(ps, ref_ps):
        assert torch.equal(a, b)


@needs_lamb_plan
def test_plan_path_bad_grad_raises_before_anything_runs():
    ps = params()
    opt = FusedLAMB(ps, lr=1e-2)
    run_synthetic(opt, ps, steps=2)
    before = [p.detach().clone() for p in ps]
    ps[0].grad = torch.randn(7, 13, 2)[..., 0]
    with pytest.raises(
        ValueError, match="FusedLAMB: param group 0: the grad of parameter 0 is not contiguous"
    ):
        opt.step()
    for p, b in zip(ps, before):
        assert torch.equal(p, b)
    assert all(b.native._grads is None for plan in opt._plans.values() for b in plan.buckets)
