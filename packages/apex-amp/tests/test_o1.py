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


def test_losses_and_softmax_run_in_fp32_outside_the_forward_too():
    model = init_o1(nn.Linear(4, 3))
    out = model(torch.randn(5, 4))
    assert out.dtype == BF16
    target = torch.tensor([0, 1, 2, 0, 1])
    loss = nn.functional.cross_entropy(out, target)
    assert loss.dtype == torch.float32
    assert nn.CrossEntropyLoss()(out, target).dtype == torch.float32
    assert nn.functional.softmax(out, dim=-1).dtype == torch.float32
    assert nn.functional.mse_loss(out, torch.zeros(5, 3)).dtype == torch.float32
    torch.testing.assert_close(loss, nn.functional.cross_entropy(out.float(), target))
    with amp.disable_casts():
        assert nn.functional.softmax(out, dim=-1).dtype == BF16
    amp.reset()
    assert nn.functional.softmax(out, dim=-1).dtype == BF16
    assert not hasattr(nn.functional.cross_entropy, "_amp_original")


def test_fp32_list_is_not_patched_outside_o1():
    amp.initialize(nn.Linear(4, 3), opt_level="O2", low_precision_dtype=BF16, verbosity=0)
    assert not hasattr(nn.functional.cross_entropy, "_amp_original")
