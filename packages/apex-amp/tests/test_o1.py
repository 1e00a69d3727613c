"""O1: the forward under torch.autocast, registered functions and decorators, the banned
binary_cross_entropy, disable_casts, and the old handle API."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import apex.amp as amp
from apex.amp._casting import autocast_on

BF16 = torch.bfloat16


def module_with(fn_name="fn"):
    """A throwaway module whose function reports the dtypes it was called with."""
    mod = types.ModuleType("fake_mod")
    seen = []

    def fn(a, b=None):
        seen.append((a.dtype, None if b is None else b.dtype, autocast_on("cpu")))
        return a if b is None else a + b

    setattr(mod, fn_name, fn)
    return mod, seen


class Calls(nn.Module):
    def __init__(self, call):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.call = call

    def forward(self, x):
        return self.call(self.lin(x), x)


def init_o1(model):
    return amp.initialize(model, opt_level="O1", low_precision_dtype=BF16, verbosity=0)


@pytest.mark.parametrize(
    "register, want",
    [
        (amp.register_half_function, (BF16, BF16, False)),
        (amp.register_float_function, (torch.float32, torch.float32, False)),
        (amp.register_promote_function, (torch.float32, torch.float32, False)),
    ],
)
def test_registered_functions_cast_inside_the_forward_only(register, want):
    mod, seen = module_with()
    register(mod, "fn")
    model = init_o1(Calls(lambda h, x: mod.fn(h, x)))
    model(torch.randn(2, 4))
    assert seen[-1] == want
    mod.fn(torch.randn(2, dtype=BF16), torch.randn(2))  # outside: untouched
    assert seen[-1] == (BF16, torch.float32, False)


def test_registry_is_consumed_by_initialize():
    mod, seen = module_with()
    amp.register_float_function(mod, "fn")
    assert amp.amp._USER_REGISTRY
    init_o1(Calls(lambda h, x: mod.fn(h)))
    assert not amp.amp._USER_REGISTRY
    amp.reset()
    assert not hasattr(mod.fn, "_amp_original")  # reset restores what init patched


def test_register_unknown_name():
    with pytest.raises(ValueError, match="No function named nope"):
        amp.register_half_function(torch, "nope")


def test_decorators():
    @amp.float_function
    def f(a):
        return a.dtype

    @amp.half_function
    def h(a):
        return a.dtype

    @amp.promote_function
    def p(a, b):
        return (a + b).dtype

    out = {}
    model = init_o1(Calls(lambda hid, x: out.update(f=f(hid), h=h(x), p=p(hid, x)) or hid))
    model(torch.randn(2, 4))
    assert out == {"f": torch.float32, "h": BF16, "p": torch.float32}
    assert f(torch.ones(1, dtype=BF16)) == BF16  # outside amp: as written


def test_o1_casts_like_autocast():
    model = init_o1(Calls(lambda h, x: (h, torch.softmax(h.float(), -1), h @ h.T)))
    h, soft, mm = model(torch.randn(2, 4))
    assert h.dtype == BF16 and soft.dtype == torch.float32 and mm.dtype == BF16


def test_binary_cross_entropy_is_banned_inside_o1():
    model = init_o1(
        Calls(lambda h, x: nn.functional.binary_cross_entropy(torch.sigmoid(h), torch.rand_like(h)))
    )
    with pytest.raises(RuntimeError, match="BCEWithLogitsLoss"):
        model(torch.randn(2, 4))
    # Outside the forward (no autocast) it is the plain function.
    nn.functional.binary_cross_entropy(torch.rand(3), torch.rand(3))
    with pytest.raises(RuntimeError, match="BCEWithLogitsLoss"):
        init_bce = Calls(lambda h, x: nn.BCELoss()(torch.sigmoid(h), torch.rand_like(h)))
        amp.reset()
        init_o1(init_bce)(torch.randn(2, 4))


def test_allow_banned_runs_it_in_fp32():
    model = init_o1(
        Calls(lambda h, x: nn.functional.binary_cross_entropy(torch.sigmoid(h), torch.rand_like(h)))
    )
    amp.init(allow_banned=True)
    assert model(torch.randn(2, 4)).dtype == torch.float32


def test_disable_casts():
    model = init_o1(Calls(lambda h, x: h))
    assert model(torch.randn(2, 4)).dtype == BF16
    with amp.disable_casts():
        assert model(torch.randn(2, 4)).dtype == torch.float32
        assert not amp._amp_state.handle.is_active()
    assert amp._amp_state.handle.is_active()


def test_init_returns_handles():
    assert isinstance(amp.init(enabled=False), amp.amp.NoOpHandle)
    handle = amp.init()
    assert isinstance(handle, amp.amp.AmpHandle) and handle.is_active()
    with pytest.raises(RuntimeError, match="needs amp.initialize"):
        handle.scale_loss(torch.tensor(1.0), None)
    with pytest.raises(RuntimeError, match="amp.initialize"):
        handle.wrap_optimizer(None)


def test_disabling_init_restores_the_o1_patches():
    init_o1(Calls(lambda h, x: h))
    assert hasattr(nn.functional.cross_entropy, "_amp_original")
    assert "sum" in vars(torch.Tensor)
    assert isinstance(amp.init(enabled=False), amp.amp.NoOpHandle)
    # The O1 handle's patches go with it (amp.reset could not restore them from the NoOpHandle).
    assert not hasattr(nn.functional.cross_entropy, "_amp_original")
    assert "sum" not in vars(torch.Tensor)


def test_handle_scale_loss_after_initialize():
    model = Calls(lambda h, x: h)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model, opt, opt_level="O1", low_precision_dtype=torch.float16, verbosity=0
    )
    with amp._amp_state.handle.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as s:
        assert s.dtype == torch.float32
        s.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_losses_run_in_fp32_outside_the_forward_too():
    model = init_o1(nn.Linear(4, 3))
    out = model(torch.randn(5, 4))
    assert out.dtype == BF16
    target = torch.tensor([0, 1, 2, 0, 1])
    loss = nn.functional.cross_entropy(out, target)
    assert loss.dtype == torch.float32
    assert nn.CrossEntropyLoss()(out, target).dtype == torch.float32
    assert nn.functional.mse_loss(out, torch.zeros(5, 3)).dtype == torch.float32
    assert nn.functional.kl_div(out, out.detach(), reduction="sum").dtype == torch.float32
    # log_softmax too, the first half of nll_loss(log_softmax(out)), as apex's FP32 list had it
    assert nn.functional.log_softmax(out, -1).dtype == torch.float32
    torch.testing.assert_close(loss, nn.functional.cross_entropy(out.float(), target))
    with amp.disable_casts():
        assert nn.functional.cross_entropy(out, target).dtype == BF16
    amp.reset()
    assert nn.functional.cross_entropy(out, target).dtype == BF16
    assert not hasattr(nn.functional.cross_entropy, "_amp_original")


def test_softmax_is_fp32_inside_the_forward_and_as_given_outside():
    seen = {}

    def call(h, x):
        seen["inside"] = (nn.functional.softmax(h, -1).dtype, torch.softmax(h, -1).dtype)
        return h

    model = init_o1(Calls(call))
    out = model(torch.randn(5, 4))
    assert seen["inside"] == (torch.float32, torch.float32)
    # Outside the forward softmax runs as given, as torch's own (not apex's fp32: that broke
    # fp16 code amp does not manage, see the teacher test below).
    soft = nn.functional.softmax(out, dim=-1)
    assert soft.dtype == BF16
    with amp.disable_casts():
        assert torch.equal(soft, nn.functional.softmax(out, dim=-1))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.v = nn.Linear(8, 8)
        self.o = nn.Linear(8, 8)

    def forward(self, x):
        a = nn.functional.softmax(self.q(x) @ x.transpose(-1, -2), dim=-1)
        return self.o(a @ self.v(x))


@pytest.mark.parametrize("dtype", [torch.float16, BF16], ids=str)
def test_a_half_teacher_outside_amp_keeps_working_next_to_an_o1_student(dtype):
    # transformers' distillation: a frozen .half() teacher beside an O1 student. apex's global
    # fp16 matmul patch made `softmax(...) @ v` work; with autocast only in the student's
    # forward, softmax must keep the teacher's dtype.
    torch.manual_seed(0)
    teacher = Attention().to(dtype).eval()
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        before = teacher(x.to(dtype))
    student = Attention()
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    student, opt = amp.initialize(
        student, opt, opt_level="O1", low_precision_dtype=dtype, verbosity=0
    )
    with torch.no_grad():
        after = teacher(x.to(dtype))
    assert after.dtype == dtype and torch.equal(after, before)
    out = student(x)
    loss = nn.functional.kl_div(
        nn.functional.log_softmax(out, -1), nn.functional.softmax(after, -1), reduction="sum"
    )
    assert loss.dtype == torch.float32
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def test_cpu_o1_runs_cuda_autocasts_fp32_list_in_fp32():
    # CPU autocast runs these in the low dtype; CUDA's (and apex's) run them in fp32.
    seen = {}

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.ln = nn.LayerNorm(8)
            self.gn = nn.GroupNorm(2, 8)

        def forward(self, x):
            h = self.lin(x)
            seen.update(
                linear=h.dtype,
                layer_norm=self.ln(h).dtype,
                group_norm=self.gn(h).dtype,
                exp=torch.exp(h).dtype,
                exp_method=h.exp().dtype,
                log=torch.log(h.abs() + 1).dtype,
                pow=h.pow(2).dtype,
                pow_op=(h**2).dtype,
                rpow=(2**h).dtype,
                sum=h.sum().dtype,
                sum_dtype=h.sum(dtype=h.dtype).dtype,
                norm=h.norm().dtype,
                vector_norm=torch.linalg.vector_norm(h).dtype,
                softmax=nn.functional.softmax(h, -1).dtype,
                log_softmax=h.log_softmax(-1).dtype,
                softmin=nn.functional.softmin(h, -1).dtype,
                normalize=nn.functional.normalize(h).dtype,
                interpolate=nn.functional.interpolate(h[None], scale_factor=2.0).dtype,
                matmul=(h @ h.T).dtype,
            )
            return h.sum(1)

    model = init_o1(M())
    model(torch.randn(4, 8))
    low = {"linear", "sum_dtype", "matmul"}
    assert seen == {k: BF16 if k in low else torch.float32 for k in seen}
    # fp16 sums past 65504 overflowed inside the forward; in fp32 they do not.
    amp.reset()
    counter = Calls(lambda h, x: h.sum())
    nn.init.eye_(counter.lin.weight)
    nn.init.zeros_(counter.lin.bias)
    counter = amp.initialize(
        counter, opt_level="O1", low_precision_dtype=torch.float16, verbosity=0
    )
    assert counter(torch.ones(20000, 4)).item() == 80000.0
    # Outside the forward, and after reset, they run as given.
    h = torch.randn(3, dtype=BF16)
    assert torch.exp(h).dtype == BF16 and h.sum().dtype == BF16
    amp.reset()
    assert "sum" not in vars(torch.Tensor) and not hasattr(torch.exp, "_amp_original")


def test_fp32_list_is_not_patched_outside_o1():
    amp.initialize(nn.Linear(4, 3), opt_level="O2", low_precision_dtype=BF16, verbosity=0)
    assert not hasattr(nn.functional.cross_entropy, "_amp_original")


@pytest.mark.skipif(not hasattr(torch.amp, "custom_fwd"), reason="torch.amp.custom_fwd: torch 2.4+")
@pytest.mark.parametrize("decorate", [False, True])
def test_custom_function_mixing_dtypes_in_backward_needs_custom_fwd_bwd(decorate):
    # The README's advice: autocast does not run in backward (apex's global patches did), so a
    # backward that mixes the low-precision incoming grad with fp32 saved tensors needs the
    # forward's autocast state back, which custom_fwd/custom_bwd restore.
    fwd = torch.amp.custom_fwd(device_type="cpu") if decorate else (lambda f: f)
    bwd = torch.amp.custom_bwd(device_type="cpu") if decorate else (lambda f: f)

    class MatmulFn(torch.autograd.Function):
        @staticmethod
        @fwd
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        @bwd
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w.t(), x.t() @ g

    model = init_o1(Calls(lambda h, x: MatmulFn.apply(x, h)))
    out = model(torch.randn(4, 4))
    assert out.dtype == BF16
    if decorate:
        out.float().sum().backward()
        assert model.lin.weight.grad.dtype == torch.float32
    else:
        with pytest.raises(RuntimeError, match="dtype"):
            out.float().sum().backward()
