"""amp.scale_loss: overflow skipping, checkpoints, several losses/models/optimizers, gradient
accumulation, add_param_group, zero_grad, master_params (CPU, fp16 where scaling applies)."""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
from amp_testing import LOW, batches, loss_fn, make_model, train_amp

import apex.amp as amp

FP16 = torch.float16
INF = float("inf")


def init(opt_level="O2", dtype=FP16, make_opt=None, seed=0, **kwargs):
    model = make_model(seed)
    make_opt = make_opt or (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    kwargs.setdefault("verbosity", 0)
    return amp.initialize(
        model,
        make_opt(model.parameters()),
        opt_level=opt_level,
        low_precision_dtype=dtype,
        **kwargs,
    )


def poison_once(param, when):
    """A grad hook that puts an inf into ``param``'s grad at the backward numbered ``when``."""
    count = {"n": 0}

    def hook(grad):
        n = count["n"]
        count["n"] += 1
        if n == when:
            grad = grad.clone()
            grad.view(-1)[0] = INF
        return grad

    param.register_hook(hook)


def snapshot(tensors):
    return [t.detach().clone() for t in tensors]


@pytest.mark.parametrize("when", [0, 2, 4])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_inf_skips_exactly_that_step_and_halves_the_scale(opt_level, when):
    model, opt = init(opt_level)
    poison_once(next(model.parameters()), when)
    scaler = amp._amp_state.loss_scalers[0]
    for i, (x, y) in enumerate(batches(6)):
        before = snapshot(model.parameters())
        scale = scaler.loss_scale()
        loss = loss_fn(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        after = list(model.parameters())
        if i == when:
            assert scaler.loss_scale() == scale / 2
            assert all(torch.equal(a, b) for a, b in zip(before, after))
            assert scaler._has_overflow
        else:
            assert scaler.loss_scale() == scale
            assert not all(torch.equal(a, b) for a, b in zip(before, after))
    assert scaler._unskipped == 5 - when


def test_skip_is_one_shot_and_restores_the_real_step():
    model, opt = init("O2")
    patched_step = opt.step
    poison_once(next(model.parameters()), 0)
    x, y = batches(1)[0]
    with amp.scale_loss(loss_fn(model(x), y), opt) as scaled:
        scaled.backward()
    assert opt._amp_stash.already_patched
    assert opt.step is not patched_step
    assert all(m.grad is not None for m in opt._amp_stash.all_fp32_from_fp16_params)
    opt.step()
    assert opt.step == patched_step
    assert not opt._amp_stash.already_patched
    assert all(m.grad is None for m in opt._amp_stash.all_fp32_from_fp16_params)


def test_closure_is_refused():
    model, opt = init("O2")
    with pytest.raises(RuntimeError, match="does not support closure"):
        opt.step(lambda: 0.0)


def test_overflow_messages_are_rate_limited(caplog):
    model, opt = init("O1")
    w = next(model.parameters())
    w.register_hook(lambda g: torch.full_like(g, INF))
    x, y = batches(1)[0]
    with caplog.at_level(logging.WARNING, logger="apex.amp"):
        for _ in range(30):
            with amp.scale_loss(loss_fn(model(x), y), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
    messages = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert len(messages) == 1
    assert "loss scaler 0 reducing loss scale to 32768.0" in messages[0]
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler.overflows == 30
    # The default floor: the scale never drops below min_loss_scale=1.0 (apex fell to ~0).
    assert scaler.loss_scale() == 1.0


def test_floor_message_names_the_likely_cause(caplog):
    model, opt = init("O1", min_loss_scale=2.0**15)
    next(model.parameters()).register_hook(lambda g: torch.full_like(g, INF))
    x, y = batches(1)[0]
    with caplog.at_level(logging.WARNING, logger="apex.amp"):
        with amp.scale_loss(loss_fn(model(x), y), opt) as scaled:
            scaled.backward()
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**15
    assert "floor min_loss_scale" in caplog.text


def test_hysteresis_backs_off_after_consecutive_overflows(caplog):
    """The scale backs off from the ``hysteresis``-th overflowing step in a row on; the message
    of an overflow that only spends hysteresis says the scale is kept; the saved count of
    overflows left never goes below 0."""
    model, opt = init("O1", hysteresis=2)
    bad = {"on": False}
    next(model.parameters()).register_hook(lambda g: torch.full_like(g, INF) if bad["on"] else g)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._message_interval = 0.0  # every overflow's message
    scales, left = [], []
    with caplog.at_level(logging.WARNING, logger="apex.amp"):
        for on in [True, False, True, True, True, False]:
            bad["on"] = on
            x, y = batches(1)[0]
            with amp.scale_loss(loss_fn(model(x), y), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
            scales.append(scaler.loss_scale())
            left.append(amp.state_dict()["loss_scaler0"]["hysteresis_left"])
    s = 2.0**16
    assert scales == [s, s, s, s / 2, s / 4, s / 4]
    assert left == [1, 2, 1, 0, 0, 2]
    messages = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert len(messages) == 4, messages
    for message, kept in zip(messages, [True, True, False, False]):
        assert ("keeping loss scale at 65536.0" in message) == kept, message
        assert ("reducing loss scale" in message) != kept, message


def test_scale_grows_after_scale_window_clean_steps_up_to_max():
    model, opt = init("O1", scale_window=3, max_loss_scale=2.0**17)
    scaler = amp._amp_state.loss_scalers[0]
    seen = []
    for x, y in batches(7):
        with amp.scale_loss(loss_fn(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        seen.append(scaler.loss_scale())
    assert seen == [2.0**16] * 2 + [2.0**17] * 5


def test_static_loss_scale_never_checks_or_skips():
    model, opt = init("O1", loss_scale=128.0)
    scaler = amp._amp_state.loss_scalers[0]
    assert not scaler.dynamic
    w = next(model.parameters())
    w.register_hook(lambda g: torch.full_like(g, INF))
    x, y = batches(1)[0]
    loss = loss_fn(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        torch.testing.assert_close(scaled, loss.float() * 128.0)
        scaled.backward()
    assert not opt._amp_stash.already_patched
    assert scaler.loss_scale() == 128.0


def test_static_scaler_counts_unskipped_steps_like_apex():
    """apex's update_scale adds 1 to _unskipped on every non-skipped step, static or dynamic
    (amp.state_dict()'s "unskipped"); only a dynamic scale grows from it."""
    model, opt = init("O2", loss_scale=128.0, scale_window=2)
    train_amp(model, opt, batches(5), amp)
    scaler = amp._amp_state.loss_scalers[0]
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 128.0, "unskipped": 5}
    assert not scaler.dynamic


def test_bf16_needs_no_scaling():
    model, opt = init("O1", dtype=torch.bfloat16)
    scaler = amp._amp_state.loss_scalers[0]
    assert not scaler.dynamic and scaler.loss_scale() == 1.0
    x, y = batches(1)[0]
    loss = loss_fn(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.dtype == torch.float32
        assert torch.equal(scaled, loss.float())
        scaled.backward()


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_checkpoint_mid_run_restores_bit_identically(opt_level, dtype):
    # eps within fp16's range: O3 keeps Adam's state in fp16 too.
    make_opt = lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-4)  # noqa: E731
    data = batches(12)
    model, opt = init(opt_level, dtype, make_opt)
    train_amp(model, opt, data[:6], amp)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}, buf)
    continued = train_amp(model, opt, data[6:], amp)
    final = snapshot(amp.master_params(opt))

    amp.reset()
    buf.seek(0)
    ckpt = torch.load(buf)
    model2, opt2 = init(opt_level, dtype, make_opt, seed=123)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    amp.load_state_dict(ckpt["amp"])
    resumed = train_amp(model2, opt2, data[6:], amp)
    assert all(torch.isfinite(torch.tensor(continued)))
    assert resumed == continued
    for a, b in zip(final, amp.master_params(opt2)):
        assert torch.equal(a, b)


def test_o2_model_state_dict_is_fp32_and_holds_the_masters():
    model, opt = init("O2")
    train_amp(model, opt, batches(3), amp)
    sd = model.state_dict()
    assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())
    assert model.net[0].weight.dtype == FP16
    master = opt._amp_stash.all_fp32_from_fp16_params[0]
    assert torch.equal(sd["net.0.weight"], master)
    assert not torch.equal(sd["net.0.weight"], model.net[0].weight.float())


def test_o2_state_dict_saved_again_before_training_keeps_fp32_values():
    model, opt = init("O2")
    # Values fp16 cannot hold exactly.
    fp32 = {k: v + 1e-4 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.load_state_dict(fp32)
    again = model.state_dict()
    assert all(torch.equal(again[k], fp32[k]) for k in fp32)
    train_amp(model, opt, batches(1)[:0], amp)
    opt._lazy_init_maybe_master_weights()
    assert torch.equal(opt._amp_stash.all_fp32_from_fp16_params[0], fp32["net.0.weight"])


def test_amp_state_dict_round_trip_and_bad_keys(caplog):
    init("O1", num_losses=2)
    amp._amp_state.loss_scalers[1]._loss_scale = 512.0
    amp._amp_state.loss_scalers[1]._unskipped = 7
    sd = amp.state_dict()
    assert list(sd) == ["loss_scaler0", "loss_scaler1"]
    assert sd["loss_scaler1"] == {"loss_scale": 512.0, "unskipped": 7}
    amp._amp_state.loss_scalers[1]._loss_scale = 1.0
    amp.load_state_dict(sd)
    assert amp._amp_state.loss_scalers[1].loss_scale() == 512.0
    assert amp._amp_state.loss_scalers[1]._unskipped == 7
    with caplog.at_level(logging.WARNING, logger="apex.amp"):
        amp.load_state_dict({"loss_scaler0": sd["loss_scaler0"]})
    assert "1 entries, while 2 loss_scalers" in caplog.text
    with pytest.raises(RuntimeError, match="Unexpected key.*'scale'"):
        amp.load_state_dict({"scale": 1.0})


def test_num_losses_have_their_own_scalers():
    model, opt = init("O1", num_losses=2)
    bad = {"on": False}
    next(model.parameters()).register_hook(lambda g: torch.full_like(g, INF) if bad["on"] else g)
    x, y = batches(1)[0]
    out = model(x)
    with amp.scale_loss(loss_fn(out, y), opt, loss_id=0) as scaled:
        scaled.backward(retain_graph=True)
    bad["on"] = True
    with amp.scale_loss(out.float().pow(2).mean(), opt, loss_id=1) as scaled:
        scaled.backward()
    s0, s1 = amp._amp_state.loss_scalers
    assert s0.loss_scale() == 2.0**16 and s1.loss_scale() == 2.0**15
    before = snapshot(model.parameters())
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(RuntimeError, match="num_losses"):
        with amp.scale_loss(loss_fn(model(x), y), opt, loss_id=2):
            pass


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_two_losses_accumulate_like_their_sum(opt_level):
    """Two scale_loss blocks before one step (each unscaled on exit, stashed grads added) give
    the grads of loss_a + loss_b."""
    model, opt = init(opt_level, num_losses=2)
    ref = copy.deepcopy(model)
    x, y = batches(1)[0]
    out = model(x)
    with amp.scale_loss(loss_fn(out, y), opt, loss_id=0) as scaled:
        scaled.backward(retain_graph=True)
    with amp.scale_loss(out.float().abs().mean(), opt, loss_id=1) as scaled:
        scaled.backward()
    ref_out = ref(x)
    (loss_fn(ref_out, y) + ref_out.float().abs().mean()).backward()
    grads = [p.grad for p in amp.master_params(opt)]
    ref_grads = [p.grad.float() for p in ref.parameters()]
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_delay_unscale_accumulates_scaled_grads(opt_level):
    """DeepSpeed's gradient accumulation: delay_unscale=True off the boundary."""
    model, opt = init(opt_level)
    ref = copy.deepcopy(model)
    data = batches(3)
    for i, (x, y) in enumerate(data):
        with amp.scale_loss(loss_fn(model(x), y), opt, delay_unscale=i < 2) as scaled:
            scaled.backward()
        assert opt._amp_stash.params_have_scaled_gradients == (i < 2)
    sum(loss_fn(ref(x), y) for x, y in data).backward()
    for g, r in zip([p.grad for p in amp.master_params(opt)], ref.parameters()):
        torch.testing.assert_close(g, r.grad.float(), rtol=2e-2, atol=1e-3)


def test_delay_overflow_check_leaves_update_to_the_caller():
    model, opt = init("O2")
    next(model.parameters()).register_hook(lambda g: torch.full_like(g, INF))
    x, y = batches(1)[0]
    scaler = amp._amp_state.loss_scalers[0]
    with amp.scale_loss(loss_fn(model(x), y), opt, delay_overflow_check=True) as scaled:
        scaled.backward()
    assert scaler.loss_scale() == 2.0**16 and not opt._amp_stash.already_patched
    assert scaler._overflow_buf.item() == 1
    assert scaler.update_scale() is True
    assert scaler.loss_scale() == 2.0**15


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_zero_grad_before_and_after(opt_level):
    model, opt = init(opt_level)
    data = batches(4)
    ref, ref_opt = None, None
    losses = []
    for x, y in data:
        opt.zero_grad()
        with amp.scale_loss(loss_fn(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        assert all(p.grad is None for p in amp.master_params(opt))
        losses.append(loss_fn(model(x), y).item())
    amp.reset()
    model2, opt2 = init(opt_level)
    for x, y in data:  # no zero_grad at all after the first: grads are set anew each backward
        with amp.scale_loss(loss_fn(model2(x), y), opt2) as scaled:
            scaled.backward()
        opt2.step()
        opt2.zero_grad()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    del ref, ref_opt, losses


@pytest.mark.parametrize("lazy_first", [False, True])
def test_add_param_group_after_initialize(lazy_first):
    model, opt = init("O2")
    extra = torch.nn.Linear(4, 4).half()
    if lazy_first:
        train_amp(model, opt, batches(1), amp)
    opt.add_param_group({"params": extra.parameters(), "lr": 0.1})
    assert len(opt.param_groups) == 2
    x, y = batches(1)[0]
    before = extra.weight.detach().clone()
    with amp.scale_loss(loss_fn(extra(model(x).half()), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert opt.param_groups[1]["params"][0].dtype == torch.float32
    assert not torch.equal(before, extra.weight)
    assert any(p is extra.weight for p in opt._amp_stash.all_fp16_params)
    torch.testing.assert_close(
        extra.weight, opt.param_groups[1]["params"][0].half(), rtol=0, atol=0
    )


def test_several_models_and_optimizers():
    torch.manual_seed(0)
    a, b = make_model(1), make_model(2)
    oa = torch.optim.SGD(a.parameters(), lr=0.05)
    ob = torch.optim.Adam(b.parameters(), lr=1e-2)
    (a, b), (oa, ob) = amp.initialize(
        [a, b], [oa, ob], opt_level="O2", low_precision_dtype=FP16, num_losses=2, verbosity=0
    )
    for x, y in batches(5):
        la, lb = loss_fn(a(x), y), loss_fn(b(x), y)
        with amp.scale_loss(la, oa, loss_id=0) as scaled:
            scaled.backward()
        with amp.scale_loss(lb, ob, loss_id=1) as scaled:
            scaled.backward()
        oa.step()
        ob.step()
        oa.zero_grad()
        ob.zero_grad()
    assert a.net[0].weight.dtype == FP16 and b.net[0].weight.dtype == FP16
    loss = loss_fn(a(x), y) + loss_fn(b(x), y)
    with amp.scale_loss(loss, [oa, ob]) as scaled:
        scaled.backward()
    assert all(p.grad is not None for p in amp.master_params(oa))
    assert all(p.grad is not None for p in amp.master_params(ob))


def test_overflow_with_a_list_of_optimizers_skips_every_one():
    torch.manual_seed(0)
    m = make_model()
    params = list(m.parameters())
    o1 = torch.optim.SGD(params[:2], lr=0.1)
    o2 = torch.optim.SGD(params[2:], lr=0.1)
    m, [o1, o2] = amp.initialize(m, [o1, o2], opt_level="O2", low_precision_dtype=FP16, verbosity=0)
    next(m.parameters()).register_hook(lambda g: torch.full_like(g, INF))
    x, y = batches(1)[0]
    with amp.scale_loss(loss_fn(m(x), y), [o1, o2]) as scaled:
        scaled.backward()
    before = snapshot(m.parameters())
    o1.step()
    o2.step()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_master_params_under_o2_are_fp32_and_clippable():
    model, opt = init("O2")
    lows = [p for p in model.parameters() if p.dtype == FP16]
    assert [p.dtype for p in amp.master_params(opt)].count(FP16) == len(lows)  # before lazy init
    x, y = batches(1)[0]
    with amp.scale_loss(loss_fn(model(x), y), opt) as scaled:
        scaled.backward()
    masters = list(amp.master_params(opt))
    assert all(p.dtype == torch.float32 for p in masters)
    norm = torch.nn.utils.clip_grad_norm_(masters, 1e-3)
    assert norm > 1e-3
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in masters]))
    torch.testing.assert_close(total, torch.tensor(1e-3), rtol=1e-3, atol=0)


def test_scale_loss_yields_fp32_loss_times_scale():
    model, opt = init("O2")
    x, y = batches(1)[0]
    loss = model(x).half().float().sum()
    with amp.scale_loss(loss.half(), opt) as scaled:
        assert scaled.dtype == torch.float32
        assert scaled.item() == pytest.approx(loss.half().float().item() * 2.0**16)
        scaled.backward()


def test_disabled_amp_yields_the_loss_untouched():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out_model, out_opt = amp.initialize(model, opt, enabled=False)
    assert out_model is model and out_opt is opt and not hasattr(opt, "_amp_stash")
    loss = torch.tensor(2.0, requires_grad=True)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss


def test_add_param_group_after_first_backward_o1():
    model, opt = init("O1")
    train_amp(model, opt, batches(1), amp)
    extra = torch.nn.Linear(4, 4)
    opt.add_param_group({"params": list(extra.parameters())})
    assert any(p is extra.weight for p in opt._amp_stash.all_fp32_params)
    x, y = batches(1)[0]
    before = extra.weight.detach().clone()
    with amp.scale_loss(loss_fn(extra(model(x).float()), y), opt) as scaled:
        scaled.backward()
    # Unscaled like the rest: the grad is the plain grad, not 2**16 times it.
    assert extra.weight.grad.abs().max() < 100
    opt.step()
    assert not torch.equal(before, extra.weight)


# torch warns as it does for a step GradScaler skips, and when a wrapper replaces step after the
# scheduler was made (amp.initialize does, as apex did).
@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
@pytest.mark.filterwarnings("ignore:Seems like:UserWarning")
@pytest.mark.parametrize("scheduler_first", [False, True])
def test_lr_scheduler_wrapping_step_before_or_after_initialize(scheduler_first):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if scheduler_first:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=FP16, verbosity=0)
    if not scheduler_first:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    bad = {"on": True}
    next(model.parameters()).register_hook(lambda g: torch.full_like(g, INF) if bad["on"] else g)
    for x, y in batches(3):
        with amp.scale_loss(loss_fn(model(x), y), opt) as scaled:
            scaled.backward()
        before = snapshot(model.parameters())
        opt.step()
        skipped = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert skipped == bad["on"]
        bad["on"] = False
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


# ---- O2 masters and model.load_state_dict ------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.backbone(x))


def o2_net(lr=0.0, seed=0):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return amp.initialize(
        model, opt, opt_level="O2", low_precision_dtype=FP16, loss_scale=128.0, verbosity=0
    )


def one_step(model, opt):
    opt.zero_grad()
    with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()


@pytest.mark.parametrize("copy_after_first_step", [True, False])
def test_loading_into_a_deepcopy_leaves_the_original_alone(copy_after_first_step):
    # An EMA / mean-teacher copy of an O2 model: loading its weights must not reach the
    # original's masters (or, before they exist, its pending values).
    model, opt = o2_net()
    if copy_after_first_step:
        one_step(model, opt)
    ema = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ema.load_state_dict({k: torch.full_like(v, 7.0) for k, v in ema.state_dict().items()})
    one_step(model, opt)  # lr 0: the weights stay what they were
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(torch.equal(p.float(), before[k]) for k, p in model.named_parameters())
    assert all(torch.equal(v, torch.full_like(v, 7.0)) for v in ema.state_dict().values())


def test_a_loaded_copy_saves_what_it_holds_after_an_update():
    """An EMA copy of an O2 model, loaded from a checkpoint (its params have no masters: their
    loaded fp32 values wait as pending) and then updated in place, saves its updated weights,
    not the values it loaded."""
    model, opt = o2_net()
    ema = copy.deepcopy(model)
    ema.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in ema.parameters():
            p.fill_(3.0)  # the EMA update
    assert all(torch.equal(v, torch.full_like(v, 3.0)) for v in ema.state_dict().values())


def test_loading_an_averaged_model_leaves_the_training_masters_alone():
    from torch.optim.swa_utils import AveragedModel

    model, opt = o2_net(lr=0.1)
    one_step(model, opt)
    swa = AveragedModel(model)  # deep-copies the model
    master = snapshot(amp.master_params(opt))
    saved = {
        k: v.clone().fill_(5.0) if v.is_floating_point() else v for k, v in swa.state_dict().items()
    }
    swa.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(master, amp.master_params(opt)))


PRETRAINED = 0.123456789  # fp16 holds 0.12347412...


@pytest.mark.parametrize("before_load", ["nothing", "optimizer.load_state_dict", "lazy_init"])
@pytest.mark.parametrize("checkpoint_dtype", [torch.float32, FP16], ids=str)
def test_a_submodule_load_is_what_trains(before_load, checkpoint_dtype):
    pretrained = torch.nn.Linear(4, 4)
    torch.nn.init.constant_(pretrained.weight, PRETRAINED)
    torch.nn.init.zeros_(pretrained.bias)
    model, opt = o2_net()
    if before_load == "optimizer.load_state_dict":  # makes the masters
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    elif before_load == "lazy_init":  # DeepLearningExamples BERT
        opt._lazy_init_maybe_master_weights()
    sd = {k: v.to(checkpoint_dtype) for k, v in pretrained.state_dict().items()}
    model.backbone.load_state_dict(sd)
    one_step(model, opt)  # lr 0
    master = list(amp.master_params(opt))[0]
    assert torch.equal(master, sd["weight"].float())
    assert torch.equal(model.backbone.weight, sd["weight"].half())
    assert torch.equal(model.state_dict()["backbone.weight"], sd["weight"].float())


def test_tied_weights_save_the_master_under_both_keys():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 8)
            self.head = torch.nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.emb(x))

    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=FP16, verbosity=0)
    x = torch.randint(0, 10, (16,))
    for _ in range(3):
        opt.zero_grad()
        with amp.scale_loss(torch.nn.functional.cross_entropy(model(x), x), opt) as scaled:
            scaled.backward()
        opt.step()
    sd = model.state_dict()
    master = list(amp.master_params(opt))[0]
    assert torch.equal(sd["emb.weight"], master) and torch.equal(sd["head.weight"], master)


def test_o3_saves_what_it_trained_not_what_it_loaded():
    # No master weights: a loaded fp32 value must not be kept aside and saved back later.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O3", low_precision_dtype=FP16, verbosity=0)
    model.load_state_dict({k: v + 0.3 for k, v in model.state_dict().items()})
    for _ in range(2):
        one_step(model, opt)
    assert torch.equal(model.state_dict()["weight"], model.weight.float())


def test_a_static_scale_loaded_into_a_dynamic_scaler_warns(caplog):
    init("O2", dtype=torch.bfloat16)
    from_bf16 = amp.state_dict()
    assert from_bf16["loss_scaler0"]["loss_scale"] == 1.0
    amp.reset()
    init("O2", dtype=FP16)
    with caplog.at_level(logging.WARNING, logger="apex.amp"):
        amp.load_state_dict(from_bf16)
    assert (
        "loss_scaler0 holds a loss scale of 1.0, loaded into a dynamic loss scaler" in caplog.text
    )
    assert "without loss scaling (bf16" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="apex.amp"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 3}})
    assert caplog.text == ""


def test_a_restored_count_beyond_a_smaller_scale_window_still_grows():
    model, opt = init("O2", scale_window=4)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 1500}})
    train_amp(model, opt, batches(2), amp)
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler.loss_scale() == 2048.0 and scaler._unskipped == 1
