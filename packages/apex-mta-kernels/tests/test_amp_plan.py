"""AmpPlan (ops.amp_plan): apex-amp's O2 step on held lists. Each implementation (the reference,
the C++ class built for CPU with the reference's scale, the CUDA class) against the list ops it
stands for, bit for bit, and its False cases leaving everything as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apex.multi_tensor_apply import ops, reference
from apex.multi_tensor_apply.build import loader
from apex.multi_tensor_apply.build.spec import KernelSpec

HERE = Path(__file__).parent
CSRC = HERE.parent / "src" / "apex" / "multi_tensor_apply" / "csrc"
# amp_plan.cpp as the extension compiles it, with scale.h's halves on CPU (the launch is the
# reference multi_tensor_scale through the dispatcher): the C++ plan's logic, tested on CPU.
AMP_PLAN_CPU = KernelSpec(
    name="apex_test_amp_plan_cpu",
    package="",
    sources=(str(CSRC / "amp_plan.cpp"), "scale_cpu.cpp"),
    directory=str(HERE / "data" / "amp_plan_cpu"),
    extra_cflags=("-O3", f"-I{CSRC}"),
)

SHAPES = [(7, 5), (129,), (3, 4, 5), (1,), (0,), (1000,)]
LOW = [torch.float16, torch.bfloat16]


def cpp_cpu_plan():
    """torch.classes.apex_mta.AmpPlan from the CPU build (compiled once, then cached)."""
    if torch.cuda.is_available():  # the GPU build's AmpPlan would clash with it: tested there
        pytest.skip("the CPU build of AmpPlan is for machines without the CUDA extension")
    if loader.load(AMP_PLAN_CPU) is None:
        pytest.skip("no C++ compiler for the CPU build of AmpPlan")
    return torch.classes.apex_mta.AmpPlan


IMPLS = [
    pytest.param("reference", id="reference"),
    pytest.param("cpp", id="cpp-cpu", marks=pytest.mark.slow),
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
]


@pytest.fixture(params=IMPLS)
def impl(request):
    """(device, factory of plans) of one implementation."""
    if request.param == "reference":
        return "cpu", reference.AmpPlan
    if request.param == "cpp":
        return "cpu", cpp_cpu_plan()
    request.getfixturevalue("strict_kernels")
    return "cuda", ops.amp_plan


class Lists:
    """An O2 stash in miniature: low-precision model params with grads, fp32 masters, a buffer
    of views, fp32 params with grads."""

    def __init__(self, device, dtype, fp32_shapes=((6,), (2, 3))):
        self.model = [torch.randn(s, device=device).to(dtype).requires_grad_() for s in SHAPES]
        self.masters = [p.detach().float().requires_grad_() for p in self.model]
        buf = torch.empty(sum(m.numel() for m in self.masters) + 64, device=device)
        self.views, off = [], 0
        for m in self.masters:
            self.views.append(buf[off : off + m.numel()].view(m.shape))
            off += m.numel()
        self.fp32 = [torch.randn(s, device=device, requires_grad=True) for s in fp32_shapes]
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.give_grads()

    def give_grads(self, inf_at=None):
        for i, p in enumerate([*self.model, *self.fp32]):
            g = torch.randn(p.shape, device=p.device).mul_(1e3).to(p.dtype)
            if i == inf_at and g.numel():
                g.view(-1)[0] = float("inf")
            p.grad = g

    def plan(self, factory):
        return factory(self.model, self.masters, self.views, self.fp32)

    def state(self):
        grads = [t.grad for t in [*self.model, *self.masters, *self.fp32]]
        return [None if g is None else g.clone() for g in grads], self.flag.clone()


def same_state(a, b):
    (ga, fa), (gb, fb) = a, b
    assert len(ga) == len(gb)
    for x, y in zip(ga, gb):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y)
    assert torch.equal(fa, fb)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("inf_at", [None, 2, 7], ids=["finite", "inf-model", "inf-fp32"])
def test_unscale_matches_multi_tensor_scale(impl, dtype, inf_at):
    device, factory = impl
    lists = Lists(device, dtype)
    plan = lists.plan(factory)
    assert len(plan) == len(SHAPES)
    for step in range(3):  # checked once, then the held lists
        lists.give_grads(inf_at if step == 1 else None)
        lists.flag.zero_()
        grads = [p.grad for p in lists.model]
        fp32_grads = [p.grad.clone() for p in lists.fp32]
        want = [torch.empty_like(m) for m in lists.masters]
        want_flag = torch.zeros_like(lists.flag)
        ops.multi_tensor_scale(grads + fp32_grads, want + fp32_grads, want_flag, 1 / 1024)
        assert plan.unscale(lists.flag, 1 / 1024)
        assert torch.equal(lists.flag, want_flag) and bool(want_flag.item()) == (
            step == 1 and inf_at is not None
        )
        for m, v, w in zip(lists.masters, lists.views, want):
            assert m.grad is v and torch.equal(m.grad, w)
        assert all(p.grad is None for p in lists.model)
        for p, w in zip(lists.fp32, fp32_grads):
            assert torch.equal(p.grad, w)
        for m in lists.masters:
            m.grad = None


def test_prepare_clears_model_grads_only_when_nothing_is_stashed(impl):
    device, factory = impl
    lists = Lists(device, torch.float16)
    plan = lists.plan(factory)
    for p in lists.fp32:
        p.grad = None
    assert plan.prepare()
    assert all(p.grad is None for p in lists.model)
    lists.give_grads()  # fp32 params with grads: stashing them is the general path's work
    before = lists.state()
    assert not plan.prepare()
    same_state(before, lists.state())
    for p in lists.fp32:
        p.grad = None
    lists.masters[3].grad = torch.zeros_like(lists.masters[3])  # a master grad to stash
    before = lists.state()
    assert not plan.prepare()
    same_state(before, lists.state())


@pytest.mark.parametrize("case", ["model-grad-missing", "fp32-grad-missing", "master-has-grad",
                                  "master-resized"])  # fmt: skip
def test_unscale_false_changes_nothing(impl, case):
    device, factory = impl
    lists = Lists(device, torch.float16)
    plan = lists.plan(factory)
    assert plan.unscale(lists.flag, 0.5)  # checked once already
    for m in lists.masters:
        m.grad = None
    lists.give_grads(inf_at=1)
    if case == "model-grad-missing":
        lists.model[4].grad = None
    elif case == "fp32-grad-missing":
        lists.fp32[1].grad = None
    elif case == "master-has-grad":
        lists.masters[2].grad = torch.zeros_like(lists.masters[2])
    else:
        lists.masters[0].data = torch.zeros(35, device=device)
    views = [v.clone() for v in lists.views]
    lists.flag.zero_()
    before = lists.state()
    assert not plan.unscale(lists.flag, 0.5)
    same_state(before, lists.state())
    assert all(torch.equal(a, b) for a, b in zip(views, lists.views))


def test_a_changed_grad_dtype_is_checked_again_and_handled(impl):
    device, factory = impl
    lists = Lists(device, torch.float16)
    plan = lists.plan(factory)
    assert plan.unscale(lists.flag, 0.25)
    for m in lists.masters:
        m.grad = None
    lists.give_grads()
    lists.model[1].data = lists.model[1].data.bfloat16()  # a model param made bf16 (its grad too)
    lists.model[1].grad = torch.randn(lists.model[1].shape, device=device).bfloat16()
    want = lists.model[1].grad.float() * 0.25
    assert plan.unscale(lists.flag, 0.25)
    assert torch.equal(lists.masters[1].grad, want)


def test_a_grad_of_the_wrong_size_raises_before_anything_changes(impl):
    device, factory = impl
    lists = Lists(device, torch.float16)
    plan = lists.plan(factory)
    lists.model[5].data = torch.zeros(1001, device=device, dtype=torch.float16)
    lists.model[5].grad = torch.zeros(1001, device=device, dtype=torch.float16)
    before = lists.state()
    with pytest.raises(ValueError, match="elements"):
        plan.unscale(lists.flag, 0.5)
    same_state(before, lists.state())


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_copy_back_matches_multi_tensor_scale(impl, dtype):
    device, factory = impl
    lists = Lists(device, dtype)
    plan = lists.plan(factory)
    for release in (False, True):
        with torch.no_grad():
            for m in lists.masters:
                m.add_(torch.randn_like(m))
        want = [torch.empty_like(p) for p in lists.model]
        ops.multi_tensor_scale(lists.masters, want, torch.zeros_like(lists.flag), 1.0)
        for m, v in zip(lists.masters, lists.views):
            m.grad = v
        versions = [p._version for p in lists.model]
        plan.copy_back(lists.flag, release)
        assert all(torch.equal(p, w) for p, w in zip(lists.model, want))
        written = [(p, v) for p, v in zip(lists.model, versions) if p.numel()]
        assert all(p._version > v for p, v in written)  # autograd sees the write
        assert all((m.grad is None) == release for m in lists.masters)


def test_bad_construction_is_refused(impl):
    device, factory = impl
    lists = Lists(device, torch.float16)
    with pytest.raises(ValueError, match="model_params has 6 tensors but masters and grad_views"):
        factory(lists.model, lists.masters[:-1], lists.views, lists.fp32)
    views = list(lists.views)
    views[2] = views[2].view(-1)
    with pytest.raises(ValueError, match=r"grad_views\[2\] must be a float32 tensor"):
        factory(lists.model, lists.masters, views, lists.fp32)


def test_amp_plan_picks_the_reference_on_cpu():
    lists = Lists("cpu", torch.float16)
    assert isinstance(lists.plan(ops.amp_plan), reference.AmpPlan)
    assert ops.amp_plan([], [], [], []) is None
