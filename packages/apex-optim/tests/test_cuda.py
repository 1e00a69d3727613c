"""Every optimizer on the GPU: against itself on the CPU (the reference path), against torch.optim
on the GPU where torch has the same algorithm, and the cached C++ plans of FusedAdam, FusedSGD and
FusedLAMB (ops.adam_plan, ops.sgd_plan, ops.lamb_plan) in the situations that must make them step the general path or
rebuild."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from optim_testing import LOW, TOLERANCES

from apex.multi_tensor_apply import ops
from apex.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

pytestmark = pytest.mark.cuda

# Odd sizes, one over a 65536-element chunk, a 4-d tensor; a few hundred steps each.
SHAPES = [(7, 13), (13,), (3, 65537), (5,), (2, 3, 4, 5), (257, 129)]
STEPS = 200

FACTORIES = {
    "adam": lambda ps, **kw: FusedAdam(ps, lr=1e-3, weight_decay=0.1, **kw),
    "adam_l2": lambda ps, **kw: FusedAdam(ps, lr=1e-3, weight_decay=0.1, adam_w_mode=False, **kw),
    "adam_capturable": lambda ps, **kw: FusedAdam(ps, lr=1e-3, weight_decay=0.1, capturable=True, **kw),
    "sgd": lambda ps, **kw: FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, **kw),
    "adagrad": lambda ps, **kw: FusedAdagrad(ps, lr=0.05, weight_decay=1e-3, **kw),
    "lamb": lambda ps, **kw: FusedLAMB(ps, lr=1e-3, **kw),
    "novograd": lambda ps, **kw: FusedNovoGrad(ps, lr=1e-3, weight_decay=1e-3, **kw),
    "mp_lamb": lambda ps, **kw: FusedMixedPrecisionLamb(ps, lr=1e-3, **kw),
}  # fmt: skip
TORCH = {
    "adam": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=False),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1, foreach=False),
    "adam_capturable": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=False),
    "sgd": lambda ps: torch.optim.SGD(
        ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, foreach=False
    ),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, weight_decay=1e-3, foreach=False),
}


def make_params(device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=g).mul_(0.5).to(device, dtype)) for s in SHAPES
    ]


def run(opt, ps, steps=STEPS, seed=100, skip=lambda step, j: False):
    """``steps`` steps with random grads, the same on every device for one seed."""
    for i in range(steps):
        g = torch.Generator().manual_seed(seed + i)
        for j, p in enumerate(ps):
            grad = torch.randn(p.shape, generator=g)
            p.grad = None if skip(i, j) else grad.to(p.device, p.dtype)
        opt.step()


def close(actual, expected, dtype=torch.float32, scale=1.0):
    atol, rtol = TOLERANCES[dtype]
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(
            a.detach().float().cpu(), e.detach().float().cpu(), atol=atol * scale, rtol=rtol * scale
        )


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_matches_cpu_reference(name, dtype):
    if name == "mp_lamb" and dtype != torch.float32:
        kw = {"reduced_precision_dtype": dtype}
        gpu, cpu = make_params("cuda", torch.float32), make_params("cpu", torch.float32)
        # mp_lamb keeps fp32 params and steps them from low-precision grads: feed those.
        gpu_opt, cpu_opt = FACTORIES[name](gpu, **kw), FACTORIES[name](cpu, **kw)
    else:
        gpu, cpu = make_params("cuda", dtype), make_params("cpu", dtype)
        gpu_opt, cpu_opt = FACTORIES[name](gpu), FACTORIES[name](cpu)
    steps = STEPS if dtype == torch.float32 else 50
    run(gpu_opt, gpu, steps)
    run(cpu_opt, cpu, steps)
    # Low precision: both round every step to the param dtype; a last-place difference can grow.
    close(gpu, cpu, dtype, scale=1.0 if dtype == torch.float32 else 4.0)


@pytest.mark.parametrize("name", sorted(TORCH))
def test_gpu_matches_torch_optim(name):
    ours, ref = make_params("cuda"), make_params("cuda")
    run(FACTORIES[name](ours), ours)
    run(TORCH[name](ref), ref)
    close(ours, ref, scale=5.0)  # 200 steps of different rounding order


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("capturable", [False, True])
def test_master_weights_follow_fp32_trajectory(dtype, capturable):
    low, ref = make_params("cuda", dtype), make_params("cuda", torch.float32)
    with torch.no_grad():
        for r, p in zip(ref, low):
            r.copy_(p.float())  # the same starting point
    opt = FusedAdam(low, lr=1e-3, weight_decay=0.1, master_weights=True, capturable=capturable)
    run(opt, low, 50)
    run(FusedAdam(ref, lr=1e-3, weight_decay=0.1), ref, 50)
    masters = [opt.state[p]["master_param"] for p in low]
    close(masters, ref, scale=50.0 if dtype == torch.float16 else 200.0)  # grads were rounded
    for p, m in zip(low, masters):
        assert torch.equal(p, m.to(dtype))


# ---- the C++ plans of FusedAdam, FusedSGD and FusedLAMB ---------------------------------------------

PLANNED = {
    "adam": (FusedAdam, {}),
    "adam-capturable": (FusedAdam, {"capturable": True}),
    "adam-master": (FusedAdam, {"master_weights": True}),
    "sgd": (FusedSGD, {}),
    "sgd-momentum": (FusedSGD, {"momentum": 0.9, "weight_decay": 0.01}),
    "sgd-nesterov-wd-after": (
        FusedSGD,
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01, "wd_after_momentum": True},
    ),
    "sgd-master": (FusedSGD, {"momentum": 0.9, "master_weights": True}),
    "lamb": (FusedLAMB, {}),
    "lamb-l2-nvlamb": (FusedLAMB, {"adam_w_mode": False, "use_nvlamb": True}),
    "lamb-master": (FusedLAMB, {"master_weights": True}),
}


# FusedLAMB's plans need apex-mta-kernels >= 0.1.2 (ops.lamb_plan).
needs_lamb_plan = pytest.mark.skipif(
    not hasattr(ops, "lamb_plan"), reason="apex-mta-kernels < 0.1.2: no ops.lamb_plan"
)


def plan_names(*names):
    return [pytest.param(n, marks=needs_lamb_plan) if n.startswith("lamb") else n for n in names]


def natives(opt):
    return [b.native for plan in opt._plans.values() for b in plan.buckets]


@pytest.mark.parametrize("name", plan_names(*sorted(PLANNED)))
def test_native_plan_is_used_and_matches_the_ops_path(name, monkeypatch):
    cls, kw = PLANNED[name]
    dtype = torch.bfloat16 if kw.get("master_weights") else torch.float32
    a, b = make_params("cuda", dtype), make_params("cuda", dtype)
    opt_a, opt_b = cls(a, lr=1e-3, **kw), cls(b, lr=1e-3, **kw)
    run(opt_a, a, 20)
    assert natives(opt_a) and all(n is not None for n in natives(opt_a))
    # The same run with the plan switched off must give the same bits.
    monkeypatch.setattr(cls, "_native_plan", lambda self, group, bucket: None)
    run(opt_b, b, 20)
    assert all(n is None for n in natives(opt_b))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", plan_names("adam", "sgd-momentum", "lamb"))
def test_native_plan_survives_missing_grads(name, monkeypatch):
    """A param without a grad in some steps (the general path that step, a rebuilt plan after):
    the same bits as without the plan."""
    cls, kw = PLANNED[name]

    def skip(step, j):
        return step % 7 == 3 and j == 2

    a, b = make_params("cuda"), make_params("cuda")
    run(cls(a, lr=1e-3, **kw), a, 30, skip=skip)
    monkeypatch.setattr(cls, "_native_plan", lambda self, group, bucket: None)
    run(cls(b, lr=1e-3, **kw), b, 30, skip=skip)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", plan_names("adam", "sgd-momentum", "lamb"))
def test_native_plan_keeps_no_grad_alive(name):
    cls, kw = PLANNED[name]
    ps = make_params("cuda")
    opt = cls(ps, lr=1e-3, **kw)
    run(opt, ps, 3)
    refs = [weakref.ref(p.grad) for p in ps]
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is None for r in refs)


def _planned_two_groups(name, steps):
    """A planned optimizer over two groups of fresh params after ``steps`` steps, its C++ plans
    built, and what its params, state and step counts were then (for _assert_unchanged)."""
    cls, kw = PLANNED[name]
    dtype = torch.bfloat16 if kw.get("master_weights") else torch.float32
    ps = make_params("cuda", dtype)
    opt = cls([{"params": ps[:2]}, {"params": ps[2:]}], lr=1e-3, **kw)
    run(opt, ps, steps)
    assert all(n is not None for n in natives(opt))
    before = (
        [p.detach().clone() for p in ps],
        [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in ps],
        [copy.deepcopy(g.get("step")) for g in opt.param_groups],
    )
    return opt, ps, before


def _assert_unchanged(opt, ps, before):
    """Nothing launched or counted since ``before`` (params compared in float64: one may have
    been cast since)."""
    params, state, steps = before
    torch.cuda.synchronize()
    for p, b in zip(ps, params):
        assert torch.equal(p.double(), b.double())
    for p, s in zip(ps, state):
        for k, v in s.items():
            assert torch.equal(opt.state[p][k], v), k
    for g, s in zip(opt.param_groups, steps):
        assert str(g.get("step")) == str(s)


@pytest.mark.parametrize("before_steps", [1, 2])
@pytest.mark.parametrize("name", plan_names("adam", "adam-master", "sgd-momentum", "lamb"))
def test_native_plan_bad_grad_after_cached_steps_changes_nothing(name, before_steps):
    """A grad that turns bad after the C++ plans were built (their first step: not validated
    yet) or cached (validated), in the second group, twice in a row: every group's grads are
    checked before any bucket launches or any step is counted (the plans used to check each
    bucket's at its launch, after the buckets before it had stepped); with good grads again
    the plans step."""
    opt, ps, before = _planned_two_groups(name, before_steps)
    for p in ps:
        p.grad = torch.randn_like(p)
    ps[2].grad = torch.randn(tuple(reversed(ps[2].shape)), device="cuda", dtype=ps[2].dtype).t()
    for _ in range(2):
        with pytest.raises(
            ValueError, match="param group 1: the grad of parameter 0 is not contiguous"
        ):
            opt.step()
    _assert_unchanged(opt, ps, before)
    ps[2].grad = torch.randn_like(ps[2])
    opt.step()
    assert all(n is not None for n in natives(opt))
    assert not all(torch.equal(p, b) for p, b in zip(ps, before[0]))


@pytest.mark.parametrize("name", plan_names("adam", "sgd-momentum", "lamb"))
def test_native_plan_param_cast_after_cached_steps_changes_nothing(name):
    """A param cast after the C++ plans cached it (``p.data = p.data.double()``), in the second
    group: the plans refuse their fetch (the param's dtype is not the one they were built with),
    and the step's general path refuses float64 naming the group, before any group's kernel or
    step count (test_state_changes.py checks the same on the CPU's reference plans). Cast back,
    the optimizer steps; cast to bfloat16, which it takes, it steps in that dtype."""
    opt, ps, before = _planned_two_groups(name, 2)
    for p in ps:
        p.grad = torch.randn_like(p)
    ps[2].data = ps[2].data.double()
    with pytest.raises(TypeError, match=r"param group 1: the parameter 0 has dtype torch.float64"):
        opt.step()
    _assert_unchanged(opt, ps, before)
    ps[2].data = ps[2].data.float()
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(ps, before[0]))
    ps[2].data = ps[2].data.bfloat16()
    ps[2].grad = torch.randn_like(ps[2])
    cast = ps[2].detach().clone()
    opt.step()
    assert ps[2].dtype == torch.bfloat16 and torch.isfinite(ps[2].float()).all()
    assert not torch.equal(ps[2], cast)


@needs_lamb_plan
@pytest.mark.parametrize("master", [False, True])
def test_lamb_plans_of_two_groups_match_the_ops_path(master, monkeypatch):
    """Two groups (two buckets): a plan of every param takes the global grad norm, each
    bucket's plan steps with it; the same bits as the list path."""
    dtype = torch.bfloat16 if master else torch.float32

    def make(ps):
        return FusedLAMB([{"params": ps[:3]}, {"params": ps[3:], "weight_decay": 0.0, "lr": 3e-3}],
                         lr=1e-3, master_weights=master)  # fmt: skip

    a, b = make_params("cuda", dtype), make_params("cuda", dtype)
    opt_a = make(a)
    run(opt_a, a, 20, skip=lambda step, j: j == 4)  # a frozen param
    assert len(natives(opt_a)) == 2 and all(
        isinstance(n, torch.ScriptObject) for n in natives(opt_a)
    )
    assert isinstance(opt_a._norm_cache[1], torch.ScriptObject)
    monkeypatch.setattr(FusedLAMB, "_native_plan", lambda self, group, bucket: None)
    run(make(b), b, 20, skip=lambda step, j: j == 4)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_native_plan_in_a_cuda_graph():
    ps = make_params("cuda")
    opt = FusedAdam(ps, lr=1e-3, capturable=True)
    static = [torch.randn_like(p) for p in ps]
    for p, g in zip(ps, static):
        p.grad = g
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    assert all(n is not None for n in natives(opt))
    ref = make_params("cuda")
    ref_opt = FusedAdam(ref, lr=1e-3, capturable=True)
    for p, g in zip(ref, static):
        p.grad = g
    for _ in range(3):
        ref_opt.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for _ in range(5):
        graph.replay()
        ref_opt.step()
    torch.cuda.synchronize()
    for x, y in zip(ps, ref):
        assert torch.equal(x, y)
