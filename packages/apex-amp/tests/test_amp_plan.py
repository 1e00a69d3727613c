"""amp O2 through its AmpPlan (_process_optimizer's module docstring) against the general path
it stands in for, bit for bit: the same scenario run twice, once with ``ops.amp_plan`` and once
without it, comparing params, master grads and loss scales step by step, and checking that the
plan really ran (or stood aside) where it should."""

from __future__ import annotations

import collections
import functools
import importlib.util
import io
from pathlib import Path

import pytest
import torch
from amp_testing import batches, loss_fn, make_model
from torch import nn

import apex.amp as amp
from apex.multi_tensor_apply import ops

FP16, BF16 = torch.float16, torch.bfloat16


class Spy:
    """ops.amp_plan, counting what each plan it makes answers."""

    def __init__(self, factory):
        self.factory = factory
        self.plans = 0
        self.calls = collections.Counter()

    def __call__(self, *args):
        plan = self.factory(*args)
        self.plans += len(args[0]) > 1  # not amp's one-tensor probe
        return None if plan is None else Counting(plan, self.calls)


class Counting:
    def __init__(self, plan, calls):
        self.plan, self.calls = plan, calls

    def prepare(self):
        r = self.plan.prepare()
        self.calls["prepare", r] += 1
        return r

    def unscale(self, flag, scale):
        r = self.plan.unscale(flag, scale)
        self.calls["unscale", r] += 1
        return r

    def copy_back(self, flag, release):
        self.plan.copy_back(flag, release)
        self.calls["copy_back", release] += 1


@functools.cache
def mta_amp_plan_tests():
    """apex-mta-kernels' tests/test_amp_plan.py, loaded from its file (under another name: this
    module is test_amp_plan too), or None where only the installed package is here."""
    import apex.multi_tensor_apply as mta

    path = Path(mta.__file__).resolve().parents[3] / "tests" / "test_amp_plan.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("apex_mta_tests_test_amp_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpp_cpu_factory():
    """torch.classes.apex_mta.AmpPlan built for CPU, by apex-mta-kernels' tests (cpp_cpu_plan:
    amp_plan.cpp with the reference's scale; skips on a GPU machine or without a compiler)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU build of AmpPlan is for machines without the CUDA extension")
    mta_tests = mta_amp_plan_tests()
    if mta_tests is None:
        pytest.skip("apex-mta-kernels' sources are not here (installed package)")
    cls = mta_tests.cpp_cpu_plan()
    return lambda *args: cls(*(list(a) for a in args))


MODES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cpp-cpu", id="cpp-cpu", marks=pytest.mark.slow),
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
]


@pytest.fixture(params=MODES)
def mode(request):
    """(device, plan factory)."""
    if request.param == "cpp-cpu":
        return "cpu", cpp_cpu_factory()
    if request.param == "cuda":
        request.getfixturevalue("monkeypatch").setenv("APEX_STRICT_KERNELS", "1")
    return request.param, ops.amp_plan


class Net(nn.Module):
    """amp_testing's MLP (a batchnorm: fp32 params beside the fp16 ones under O2) and a head
    that a step may leave out (its params then get no grad)."""

    def __init__(self, seed=0):
        super().__init__()
        self.mlp = make_model(seed)
        self.head = nn.Linear(4, 4)

    def forward(self, x, use_head=True):
        out = self.mlp(x)
        return self.head(out) + out if use_head else out


def init(device, dtype, opt_cls=torch.optim.Adam, seed=0):
    amp.reset()
    model = Net(seed).to(device)
    opt = opt_cls(model.parameters(), lr=1e-2)
    return amp.initialize(model, opt, opt_level="O2", low_precision_dtype=dtype, verbosity=0)


def step(model, opt, x, y, use_head=True):
    opt.zero_grad()
    with amp.scale_loss(loss_fn(model(x, use_head), y), opt) as scaled:
        scaled.backward()
    grads = [None if m.grad is None else m.grad.clone() for m in masters(opt)]
    opt.step()
    scale = amp._amp_state.loss_scalers[0].loss_scale()
    return [grads, [p.detach().clone() for p in model.parameters()], scale]


def masters(opt):
    return opt._amp_stash.all_fp32_from_fp16_params


def data(device, n):
    return [(x.to(device), y.to(device)) for x, y in batches(n)]


def poison_once(model, at):
    """inf in the first param's grad at backward number ``at`` (an overflowing step)."""
    hits = {"n": 0}

    def hook(grad):
        hits["n"] += 1
        return torch.full_like(grad, float("inf")) if hits["n"] in at else grad

    next(model.parameters()).register_hook(hook)


def same(a, b):
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    else:
        assert a == b


def compare(scenario, device, factory, monkeypatch, dtype=FP16):
    """``scenario(device, dtype)`` with the plan, then with the general path only: the same
    results bit for bit. Returns the plan run's Spy."""
    spy = Spy(factory)
    with monkeypatch.context() as m:
        m.setattr(ops, "amp_plan", spy)
        with_plan = scenario(device, dtype)
    with monkeypatch.context() as m:
        m.setattr(ops, "amp_plan", None)
        general = scenario(device, dtype)
    same(with_plan, general)
    return spy


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=str)
def test_o2_steps_with_overflows_match_the_general_path(mode, dtype, monkeypatch):
    device, factory = mode

    def scenario(device, dtype):
        model, opt = init(device, dtype)
        if dtype == FP16:  # bf16 runs without loss scaling: an inf would stay in the params
            poison_once(model, at={3, 6})
        return [step(model, opt, x, y) for x, y in data(device, 8)]

    spy = compare(scenario, device, factory, monkeypatch, dtype)
    assert spy.plans == 1
    skipped = 2 if dtype == FP16 else 0
    # step 1's unscale makes the views (general path); the plan does everything after
    assert spy.calls == {
        ("prepare", True): 7,
        ("unscale", True): 7,
        ("copy_back", True): 8 - skipped,
    }


def test_a_model_param_without_a_grad_takes_the_general_path(mode, monkeypatch):
    device, factory = mode

    def scenario(device, dtype):
        model, opt = init(device, dtype)
        return [
            step(model, opt, x, y, use_head=i % 3 != 2) for i, (x, y) in enumerate(data(device, 7))
        ]

    spy = compare(scenario, device, factory, monkeypatch)
    assert spy.calls["unscale", False] == 2  # steps 3 and 6: the head has no grad
    assert spy.calls["unscale", True] == 4


@pytest.mark.parametrize("what", ["view", "slice", "both"])
def test_a_held_master_grad_is_not_overwritten(mode, what, monkeypatch):
    """A master grad (``view``), or a tensor made from one (``slice``), kept across steps keeps
    its values: while held, the unscale takes the general path."""
    device, factory = mode
    held = {}

    def scenario(device, dtype):
        model, opt = init(device, dtype)
        out = []
        for i, (x, y) in enumerate(data(device, 7)):
            opt.zero_grad()
            with amp.scale_loss(loss_fn(model(x), y), opt) as scaled:
                scaled.backward()
            if i == 1:
                kept = [] if what == "slice" else [masters(opt)[0].grad]
                if what != "view":
                    kept.append(masters(opt)[2].grad.view(-1)[1:4])
                held["kept"] = [(t, t.clone()) for t in kept]
                del kept
            opt.step()
            out.append([p.detach().clone() for p in model.parameters()])
            if i == 4:  # released: the views are free again
                held.clear()
            assert all(torch.equal(t, v) for t, v in held.get("kept", ()))  # (no loop variables)
        return out

    spy = compare(scenario, device, factory, monkeypatch)
    # the plan unscaled steps 2 (where the grads are taken), 6 and 7; steps 3-5 (while they are
    # held) ran the general path
    assert spy.calls["unscale", True] == 3 and ("unscale", False) not in spy.calls


def test_the_stash_counts_plan_unscales_and_says_why_the_others_missed(mode, monkeypatch):
    """``_amp_stash.plan_unscales`` and ``plan_misses`` (what bench_amp reports): step 1 makes
    the views (no plan yet), a held master grad sends step 3 to the general path with its
    reason, the rest run through the plan."""
    device, factory = mode
    monkeypatch.setattr(ops, "amp_plan", factory)
    model, opt = init(device, FP16)
    kept = None
    for i, (x, y) in enumerate(data(device, 5)):
        opt.zero_grad()
        with amp.scale_loss(loss_fn(model(x), y), opt) as scaled:
            scaled.backward()
        if i == 1:
            kept = masters(opt)[0].grad
        opt.step()
        if i == 2:
            kept = None
    stash = opt._amp_stash
    assert kept is None
    assert stash.plan_unscales == 3  # steps 2, 4 and 5
    (why,) = stash.plan_misses
    assert why.startswith("a master-grad view is held") and stash.plan_misses[why] == 1


def test_add_param_group_after_steps_rebuilds_the_plan(mode, monkeypatch):
    device, factory = mode

    def scenario(device, dtype):
        model, opt = init(device, dtype)
        torch.manual_seed(3)
        extra = nn.Linear(4, 4).to(device, dtype)
        out = []
        for i, (x, y) in enumerate(data(device, 7)):
            if i == 3:
                opt.add_param_group({"params": extra.parameters(), "lr": 1e-3})
            opt.zero_grad()
            pred = model(x)
            if i >= 3:
                pred = pred + extra(pred.to(dtype)).float()
            with amp.scale_loss(loss_fn(pred, y), opt) as scaled:
                scaled.backward()
            opt.step()
            out.append([p.detach().clone() for p in [*model.parameters(), *extra.parameters()]])
        return out

    spy = compare(scenario, device, factory, monkeypatch)
    assert spy.plans == 2  # made at step 1's opt.step(), again at step 4's
    assert spy.calls["unscale", True] == 2 + 3  # steps 2-3, 5-7


def test_checkpoint_and_load_state_dict_match_the_general_path(mode, monkeypatch):
    device, factory = mode

    def scenario(device, dtype):
        batches_ = data(device, 8)
        model, opt = init(device, dtype)
        out = [step(model, opt, x, y) for x, y in batches_[:4]]
        buf = io.BytesIO()
        torch.save({"m": model.state_dict(), "o": opt.state_dict(), "a": amp.state_dict()}, buf)
        out += [step(model, opt, x, y) for x, y in batches_[4:]]
        buf.seek(0)
        ckpt = torch.load(buf)
        model2, opt2 = init(device, dtype, seed=5)
        step(model2, opt2, *batches_[0])  # a step before the load: the plan exists
        model2.load_state_dict(ckpt["m"])
        opt2.load_state_dict(ckpt["o"])
        amp.load_state_dict(ckpt["a"])
        assert opt2._amp_stash._plan is None  # the load drops it; the next step makes another
        resumed = [step(model2, opt2, x, y) for x, y in batches_[4:]]
        same(resumed, out[4:])
        return out + resumed

    spy = compare(scenario, device, factory, monkeypatch)
    assert spy.plans == 3  # the first run's, the second's before the load and after it


def test_no_plan_without_persistent_master_grads(monkeypatch):
    monkeypatch.setenv("APEX_AMP_PERSISTENT_MASTER_GRADS", "0")
    spy = Spy(ops.amp_plan)
    monkeypatch.setattr(ops, "amp_plan", spy)
    model, opt = init("cpu", FP16)
    for x, y in data("cpu", 3):
        step(model, opt, x, y)
    assert spy.plans == 0 and opt._amp_stash._plan is None


def test_an_overridden_master_copy_is_still_called(monkeypatch):
    spy = Spy(ops.amp_plan)
    monkeypatch.setattr(ops, "amp_plan", spy)
    model, opt = init("cpu", FP16)
    calls = []
    original = opt._master_params_to_model_params
    opt._master_params_to_model_params = lambda: calls.append(1) or original()
    for x, y in data("cpu", 3):
        step(model, opt, x, y)
    assert calls == [1, 1, 1]
    assert spy.calls["copy_back", False] == 3  # the original, through the plan
    for p, m in zip(opt._amp_stash.all_fp16_params, masters(opt)):
        assert torch.equal(p, m.half()) and m.grad is None
