"""apex.fp16_utils: the model helpers, FP16_Optimizer and its loss scalers (CPU, fp16)."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from amp_testing import batches, loss_fn, make_model
from torch import nn

from apex import fp16_utils
from apex.fp16_utils import (
    BN_convert_float,
    DynamicLossScaler,
    FP16_Optimizer,
    FP16Model,
    LossScaler,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
)


def test_network_to_half_keeps_batchnorm_fp32():
    net = network_to_half(make_model())
    assert isinstance(net, nn.Sequential) and isinstance(net[0], fp16_utils.tofp16)
    inner = net[1]
    assert inner.net[0].weight.dtype == torch.float16
    assert inner.net[1].weight.dtype == torch.float32
    assert net(torch.randn(4, 8)).dtype == torch.float16


def test_convert_network_and_bn_convert_float():
    net = convert_network(make_model(), torch.bfloat16)
    assert net.net[0].weight.dtype == torch.bfloat16 and net.net[1].weight.dtype == torch.float32
    half = make_model().half()
    BN_convert_float(half)
    assert half.net[1].running_var.dtype == torch.float32
    assert half.net[0].weight.dtype == torch.float16


def test_fp16_model_casts_inputs():
    model = FP16Model(make_model())
    assert model(torch.randn(4, 8)).dtype == torch.float16


@pytest.mark.parametrize("flat", [False, True])
def test_param_lists_and_copies(flat):
    model = make_model().half()
    model_params, masters = prep_param_lists(model, flat_master=flat)
    assert all(m.dtype == torch.float32 for m in masters)
    assert len(masters) == (1 if flat else len(model_params))
    model(torch.randn(4, 8).half()).float().sum().backward()
    model_grads_to_master_grads(model_params, masters, flat_master=flat)
    got = masters[0].grad if flat else torch.cat([m.grad.view(-1) for m in masters])
    want = torch.cat([p.grad.float().view(-1) for p in model_params])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for m in masters:
        m.data.add_(1.0)
    master_params_to_model_params(model_params, masters, flat_master=flat)
    flat_model = torch.cat([p.float().view(-1) for p in model_params])
    flat_master = masters[0] if flat else torch.cat([m.view(-1) for m in masters])
    torch.testing.assert_close(flat_model, flat_master.half().float(), rtol=0, atol=0)


def test_flat_master_needs_one_dtype():
    with pytest.raises(TypeError, match="one dtype"):
        prep_param_lists(convert_network(make_model(), torch.float16), flat_master=True)


def test_to_python_float():
    assert to_python_float(torch.tensor([2.5])) == 2.5
    assert to_python_float([3.0]) == 3.0


def test_dynamic_loss_scaler():
    s = DynamicLossScaler(init_scale=8, scale_factor=2, scale_window=2)
    s.update_scale(True)
    assert s.loss_scale == 4
    for _ in range(2):
        s.update_scale(False)
    assert s.loss_scale == 8
    for _ in range(10):
        s.update_scale(True)
    assert s.loss_scale == 1  # floor
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    assert s.has_overflow([p]) and not LossScaler(4).has_overflow([p])


def train_fp16_optimizer(opt, model, data):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x.half()), y)
        opt.backward(loss)
        opt.clip_master_grads(5.0)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dynamic", [False, True])
def test_fp16_optimizer_trains(dynamic, caplog):
    model = convert_network(make_model(), torch.float16)
    with caplog.at_level(logging.WARNING, logger="apex.fp16_utils"):
        opt = FP16_Optimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            static_loss_scale=128.0,
            dynamic_loss_scale=dynamic,
            dynamic_loss_args={"init_scale": 2.0**16} if dynamic else None,
        )
    assert "deprecated" in caplog.text
    losses = train_fp16_optimizer(opt, model, batches(40))
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.dtype == torch.float32 for p in opt.param_groups[0]["params"])
    for p, m in zip(opt.all_fp16_params, opt.all_fp32_from_fp16_params):
        torch.testing.assert_close(p, m.half(), rtol=0, atol=0)


def test_fp16_optimizer_skips_overflow_and_round_trips():
    model = convert_network(make_model(), torch.float16)
    opt = FP16_Optimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**10},
    )
    train_fp16_optimizer(opt, model, batches(3))
    x, y = batches(1)[0]
    next(model.parameters()).register_hook(lambda g: torch.full_like(g, float("inf")))
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    opt.backward(loss_fn(model(x.half()), y))
    assert opt.overflow and opt.clip_master_grads(1.0) == -1
    assert opt.inspect_master_grad_data() is None
    opt.step()
    assert opt.loss_scale == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    sd = opt.state_dict()
    assert set(sd) == {
        "loss_scaler",
        "dynamic_loss_scale",
        "overflow",
        "first_closure_call_this_step",
        "optimizer_state_dict",
        "fp32_from_fp16",
    }
    model2 = convert_network(make_model(seed=3), torch.float16)
    opt2 = FP16_Optimizer(torch.optim.Adam(model2.parameters(), lr=1e-2), dynamic_loss_scale=True)
    opt2.load_state_dict(sd)
    assert opt2.loss_scale == 2.0**9
    for a, b in zip(opt2.all_fp32_from_fp16_params, opt.all_fp32_from_fp16_params):
        assert torch.equal(a, b)


def test_fp16_optimizer_with_closure():
    model = convert_network(make_model(), torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), static_loss_scale=64.0)
    x, y = batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = loss_fn(model(x.half()), y)
        opt.backward(loss)
        return loss

    first = opt.step(closure).item()
    assert loss_fn(model(x.half()), y).item() < first


def test_fp16_optimizer_is_not_picklable():
    import pickle

    model = convert_network(make_model(), torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    with pytest.raises(RuntimeError, match="state_dict"):
        pickle.dumps(opt)


def test_amp_refuses_fp16_optimizer():
    import apex.amp as amp

    model = convert_network(make_model(), torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    amp._amp_state.allow_incoming_model_not_fp32 = True
    with pytest.raises(RuntimeError, match="FP16_Optimizer"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)


@pytest.mark.skipif(
    not hasattr(torch.serialization, "add_safe_globals"), reason="torch < 2.4 has no safe globals"
)
@pytest.mark.parametrize("dynamic", [True, False])
def test_fp16_optimizer_checkpoint_loads_with_weights_only(dynamic):
    # torch.load's default is weights_only=True from torch 2.6; the state holds the scaler.
    model = network_to_half(make_model())
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=dynamic, verbose=False
    )
    train_fp16_optimizer(opt, model, batches(2))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    scaler = ckpt["optimizer"]["loss_scaler"]
    assert type(scaler) is type(opt.loss_scaler)
    assert vars(scaler) == vars(opt.loss_scaler)
    opt.load_state_dict(ckpt["optimizer"])
