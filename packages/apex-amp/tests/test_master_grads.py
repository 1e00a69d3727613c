"""O2 master grads in one persistent buffer (module docstring of _process_optimizer): the same
memory every step, never under a tensor someone still holds, bit-identical training to the
per-step allocation (APEX_AMP_PERSISTENT_MASTER_GRADS=0), and apex's None-after-step."""

from __future__ import annotations

import pytest
import torch
from amp_testing import batches, loss_fn, make_model
from torch import nn

import apex.amp as amp

FP16 = torch.float16


def init(persistent=True, seed=0, make_opt=None, monkeypatch=None, **kwargs):
    amp.reset()  # tests that compare two runs initialize twice
    if monkeypatch is not None:
        monkeypatch.setenv("APEX_AMP_PERSISTENT_MASTER_GRADS", "1" if persistent else "0")
    model = make_model(seed, **kwargs)
    make_opt = make_opt or (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    model, opt = amp.initialize(
        model, make_opt(model.parameters()), opt_level="O2", low_precision_dtype=FP16, verbosity=0
    )
    if monkeypatch is None:
        opt._amp_stash.persistent_master_grads = persistent
    return model, opt


def backward(model, opt, x, y, **kwargs):
    with amp.scale_loss(loss_fn(model(x), y), opt, **kwargs) as scaled:
        scaled.backward()


def masters(opt):
    return opt._amp_stash.all_fp32_from_fp16_params


def test_master_grads_live_in_one_buffer_reused_every_step():
    model, opt = init()
    ptrs = []
    for x, y in batches(3):
        opt.zero_grad()
        backward(model, opt, x, y)
        grads = [m.grad for m in masters(opt)]
        assert all(g is not None and g.dtype == torch.float32 for g in grads)
        assert all(g.shape == m.shape for g, m in zip(grads, masters(opt)))
        ptrs.append([g.data_ptr() for g in grads])
        ((buf, _),) = opt._amp_stash._grad_buffers
        assert all(g.untyped_storage().data_ptr() == buf.data_ptr() for g in grads)
        assert all(g.data_ptr() % 16 == 0 for g in grads)  # the kernels' vector path
        del grads
        opt.step()
        assert all(m.grad is None for m in masters(opt))  # apex: None after step
    assert ptrs[0] == ptrs[1] == ptrs[2]


def test_training_is_bit_identical_to_per_step_allocation():
    data = batches(6)
    results = []
    for persistent in (True, False):
        model, opt = init(persistent, make_opt=lambda ps: torch.optim.Adam(ps, lr=1e-2))
        hits = {"n": 0}

        def poison(grad, hits=hits):  # an overflow at the third backward: that step is skipped
            hits["n"] += 1
            return torch.full_like(grad, float("inf")) if hits["n"] == 3 else grad

        next(model.parameters()).register_hook(poison)
        for x, y in data:
            opt.zero_grad()
            backward(model, opt, x, y)
            opt.step()
        assert (opt._amp_stash._grad_views is not None) == persistent
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_grad_kept_from_an_earlier_step_is_not_overwritten():
    model, opt = init()
    (x0, y0), (x1, y1) = batches(2)
    backward(model, opt, x0, y0)
    kept = masters(opt)[0].grad
    kept_slice = masters(opt)[1].grad.view(-1)[:3]  # a tensor made from a view
    values, slice_values = kept.clone(), kept_slice.clone()
    opt.step()
    backward(model, opt, x1, y1)
    assert masters(opt)[0].grad is not kept
    assert torch.equal(kept, values) and torch.equal(kept_slice, slice_values)
    assert not torch.equal(masters(opt)[0].grad, values)  # the new step's grads
    del kept, kept_slice
    opt.step()
    backward(model, opt, x0, y0)  # nothing held any more: the buffer again
    ((buf, _),) = opt._amp_stash._grad_buffers
    assert masters(opt)[0].grad.untyped_storage().data_ptr() == buf.data_ptr()


def test_a_kept_grad_keeps_its_values_and_only_that_master_gets_fresh_memory():
    model, opt = init()
    (x0, y0), (x1, y1) = batches(2)
    backward(model, opt, x0, y0)
    kept = masters(opt)[0].grad
    values = kept.clone()
    opt.step()
    backward(model, opt, x1, y1)
    ((buf, _),) = opt._amp_stash._grad_buffers
    grads = [m.grad for m in masters(opt)]
    assert grads[0].untyped_storage().data_ptr() != buf.data_ptr()
    assert all(g.untyped_storage().data_ptr() == buf.data_ptr() for g in grads[1:])
    assert torch.equal(kept, values)


def test_accumulating_two_losses_into_the_buffer_matches_per_step_allocation():
    data = batches(4)
    results = []
    for persistent in (True, False):
        model, opt = init(persistent)
        head = nn.Linear(4, 4).half()  # a param that only the second loss reaches
        opt.add_param_group({"params": head.parameters()})
        for x, y in data:
            opt.zero_grad()
            backward(model, opt, x, y)
            out = head(model(x).half())
            with amp.scale_loss(loss_fn(out, y), opt) as scaled:
                scaled.backward()
            opt.step()
        results.append([p.detach().clone() for p in [*model.parameters(), *head.parameters()]])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_delay_unscale_accumulation_matches_per_step_allocation():
    data = batches(6)
    results = []
    for persistent in (True, False):
        model, opt = init(persistent)
        for i, (x, y) in enumerate(data):
            backward(model, opt, x, y, delay_unscale=i % 2 == 0)
            if i % 2:
                opt.step()
                opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_add_param_group_after_steps_makes_new_buffers():
    model, opt = init()
    x, y = batches(1)[0]
    backward(model, opt, x, y)
    opt.step()
    head = nn.Linear(4, 4).half()
    opt.add_param_group({"params": head.parameters()})
    assert opt._amp_stash._grad_views is None
    out = head(model(x).half())
    with amp.scale_loss(loss_fn(out, y), opt) as scaled:
        scaled.backward()
    assert len(opt._amp_stash._grad_views) == len(masters(opt))
    ((buf, _),) = opt._amp_stash._grad_buffers
    assert all(m.grad.untyped_storage().data_ptr() == buf.data_ptr() for m in masters(opt))


def test_a_channels_last_master_gets_a_grad_in_its_own_layout():
    x, y = torch.randn(2, 3, 6, 6), torch.randn(2, 4)
    grads = []
    for persistent in (True, False):
        amp.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(128, 4))
        model[0].to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(
            model, opt, opt_level="O2", low_precision_dtype=FP16, verbosity=0
        )
        opt._amp_stash.persistent_master_grads = persistent
        with amp.scale_loss(loss_fn(model(x), y), opt) as scaled:
            scaled.backward()
        conv_master = masters(opt)[0]
        assert conv_master.is_contiguous(memory_format=torch.channels_last)
        assert conv_master.grad.is_contiguous(memory_format=torch.channels_last)
        if persistent:
            assert opt._amp_stash._grad_views[0] is None  # not in the buffer
            assert opt._amp_stash._grad_views[2] is not None
        grads.append([m.grad.clone() for m in masters(opt)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_the_environment_switch_turns_persistence_off(monkeypatch):
    model, opt = init(persistent=False, monkeypatch=monkeypatch)
    assert not opt._amp_stash.persistent_master_grads
    x, y = batches(1)[0]
    backward(model, opt, x, y)
    assert opt._amp_stash._grad_views is None
    assert all(m.grad is not None for m in masters(opt))


def test_a_bad_environment_value_is_refused(monkeypatch):
    monkeypatch.setenv("APEX_AMP_PERSISTENT_MASTER_GRADS", "maybe")
    with pytest.raises(ValueError, match="APEX_AMP_PERSISTENT_MASTER_GRADS"):
        init(monkeypatch=None)


def test_zero_grad_clears_master_grads_and_the_buffer_is_reused():
    model, opt = init()
    x, y = batches(1)[0]
    backward(model, opt, x, y)
    first = [m.grad.data_ptr() for m in masters(opt)]
    opt.zero_grad()
    assert all(m.grad is None for m in masters(opt))
    backward(model, opt, x, y)
    assert [m.grad.data_ptr() for m in masters(opt)] == first


def test_zero_grad_without_set_to_none_zeroes_the_model_grads_in_place():
    """zero_grad(set_to_none=False) leaves the model's low-precision grads zero tensors, as
    torch's and apex's (which zeroed them in place) do; the masters still go to None."""
    model, opt = init()
    x, y = batches(1)[0]
    backward(model, opt, x, y, delay_unscale=True)  # the grads stay on the model, scaled
    model_grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in model_grads)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is g and not g.any() for p, g in zip(model.parameters(), model_grads))
    assert all(m.grad is None for m in masters(opt))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
