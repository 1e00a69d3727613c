"""FusedAdam against torch.optim.Adam/AdamW and a for-loop oracle, and apex's API around it."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from optim_testing import (
    LOW,
    STEPS,
    assert_close,
    clone_params,
    deepcopy,
    fp32_copies,
    max_err,
    model,
    params,
    roundtrip,
    run_synthetic,
    train,
)

import amp_C
from apex.multi_tensor_apply import multi_tensor_applier
from apex.optimizers import FusedAdam, fused_adam_state_to_torch, torch_state_to_fused_adam


def torch_adam(ps, adam_w_mode=True, weight_decay=0.0, **kw):
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return cls(ps, weight_decay=weight_decay, foreach=False, **kw)


# ---- numerics against torch ----------------------------------------------------------------------


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_torch_adam(adam_w_mode, weight_decay, amsgrad):
    net, ref = model(), model()
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=weight_decay, amsgrad=amsgrad)
    train(net, FusedAdam(net.parameters(), adam_w_mode=adam_w_mode, **kw))
    train(ref, torch_adam(ref.parameters(), adam_w_mode, **kw))
    if amsgrad:  # torch ops in torch's order: the same bits
        for a, b in zip(net.parameters(), ref.parameters()):
            assert torch.equal(a, b)
    assert_close(net.parameters(), ref.parameters())


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_capturable_matches_torch(adam_w_mode, amsgrad):
    net, ref = model(), model()
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    opt = FusedAdam(net.parameters(), adam_w_mode=adam_w_mode, capturable=True, **kw)
    train(net, opt)
    train(ref, torch_adam(ref.parameters(), adam_w_mode, **kw))
    assert_close(net.parameters(), ref.parameters())
    group = opt.param_groups[0]
    assert isinstance(group["lr"], torch.Tensor) and group["lr"].dtype == torch.float32
    assert group["step"].dtype == torch.int32 and group["step"].tolist() == [STEPS]


def oracle_adam(ps, steps, lr, betas, eps, wd, adam_w_mode, bias_correction):
    """apex's FusedAdam, one param at a time in float64."""
    ws = [p.detach().double().clone() for p in ps]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    from optim_testing import grads

    b1, b2 = betas
    for t in range(1, steps + 1):
        for w, m, v, g in zip(ws, ms, vs, grads(t - 1, [tuple(p.shape) for p in ps])):
            g = g.double()
            if not adam_w_mode:
                g = g + wd * w
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            bc1 = 1 - b1**t if bias_correction else 1.0
            bc2 = 1 - b2**t if bias_correction else 1.0
            update = (m / bc1) / ((v / bc2).sqrt() + eps)
            if adam_w_mode:
                update = update + wd * w
            w.sub_(lr * update)
    return ws


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_bias_correction_against_oracle(bias_correction, capturable):
    ps = params()
    expected = oracle_adam(ps, STEPS, 1e-3, (0.9, 0.999), 1e-8, 0.05, True, bias_correction)
    opt = FusedAdam(
        ps, lr=1e-3, bias_correction=bias_correction, weight_decay=0.05, capturable=capturable
    )
    run_synthetic(opt, ps)
    assert_close(ps, expected)


@pytest.mark.parametrize("dtype", LOW)
def test_master_weights_follow_fp32_torch(dtype):
    """fp16/bf16 params with fp32 masters step like fp32 params fed the same (rounded) grads."""
    ps = params(dtype)
    ref = fp32_copies(ps)
    opt = FusedAdam(ps, lr=1e-2, weight_decay=0.1, master_weights=True)
    run_synthetic(opt, ps)
    run_synthetic(torch_adam(ref, lr=1e-2, weight_decay=0.1), ref, grad_dtype=dtype)
    masters = [opt.state[p]["master_param"] for p in ps]
    assert all(m.dtype == torch.float32 for m in masters)
    assert_close(masters, ref)
    for p, m in zip(ps, masters):
        assert torch.equal(p, m.to(dtype))


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_params_2x_rule(dtype, capturable):
    """Without masters, fp16/bf16 params stay within twice torch's own error (vs fp32)."""
    ps = params(dtype)
    ref32, ref_low = fp32_copies(ps), clone_params(ps)
    opt = FusedAdam(ps, lr=1e-3, capturable=capturable)
    run_synthetic(opt, ps)
    run_synthetic(torch_adam(ref32, lr=1e-3), ref32)
    run_synthetic(torch_adam(ref_low, lr=1e-3), ref_low)
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in ps)
    assert max_err(ps, ref32) <= 2 * max_err(ref_low, ref32) + 1e-6


@pytest.mark.parametrize("master_weights", [False, True])
def test_capturable_master_matches_plain_master(master_weights):
    ps = params(torch.bfloat16)
    ps2 = clone_params(ps)
    a = FusedAdam(ps, lr=1e-2, master_weights=master_weights)
    b = FusedAdam(ps2, lr=1e-2, master_weights=master_weights, capturable=True)
    run_synthetic(a, ps, steps=20)
    run_synthetic(b, ps2, steps=20)
    assert_close(ps, ps2, torch.bfloat16)


def test_param_groups_and_add_param_group():
    """Groups with their own hyper-parameters, one added after construction, a frozen param."""
    ps = params()
    ref = clone_params(ps)
    frozen, frozen_ref = ps[4], ref[4]
    frozen.requires_grad_(False)

    def groups(q):
        return [
            {"params": q[:2], "lr": 1e-2, "weight_decay": 0.1},
            {"params": q[2:3], "betas": (0.5, 0.9), "eps": 1e-6},
        ]

    opt = FusedAdam(groups(ps), lr=3e-3)
    opt.add_param_group({"params": ps[3:], "lr": 5e-3, "weight_decay": 0.01})
    t = torch.optim.AdamW(groups(ref), lr=3e-3, weight_decay=0.0, foreach=False)
    t.add_param_group({"params": ref[3:], "lr": 5e-3, "weight_decay": 0.01})
    run_synthetic(opt, ps, skip={4})
    run_synthetic(t, ref, skip={4})
    assert_close(ps, ref)
    assert frozen not in opt.state and torch.equal(frozen, frozen_ref)
    assert [g.get("step") for g in opt.param_groups] == [STEPS, STEPS, STEPS]


def test_param_gaining_a_grad_later():
    ps = params()
    opt = FusedAdam(ps, lr=1e-2)
    run_synthetic(opt, ps, steps=3, skip={1})
    assert ps[1] not in opt.state
    run_synthetic(opt, ps, steps=2)
    assert opt.state[ps[1]]["exp_avg"].abs().sum() > 0
    assert opt.param_groups[0]["step"] == 5  # apex: one counter per group


def test_channels_last_param():
    p = torch.nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))
    ref = torch.nn.Parameter(p.detach().clone())
    opt, t = FusedAdam([p], lr=1e-2), torch_adam([ref], lr=1e-2)
    for _ in range(5):
        g = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        t.step()
    assert opt.state[p]["exp_avg"].is_contiguous(memory_format=torch.channels_last)
    assert_close([p], [ref])


# ---- GradScaler ---------------------------------------------------------------------------------


def scaled_run(opt, net, steps=10, inf_at=(), scale=2.0**12):
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000)
    dtype = next(net.parameters()).dtype
    x, y = torch.randn(8, 7, dtype=dtype), torch.randn(8, 3, dtype=dtype)
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


@pytest.mark.parametrize("capturable", [False, True])
def test_grad_scaler_protocol(capturable):
    """GradScaler hands scale and found_inf to step() (no unscale_ pass, no FutureWarning);
    the result is the unscaled run's, bit for bit."""
    net, ref = model(), model()
    opt = FusedAdam(net.parameters(), lr=1e-2, capturable=capturable)
    assert opt._step_supports_amp_scaling
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler = scaled_run(opt, net)
    assert opt.__dict__.get("grad_scale") is None and "found_inf" not in opt.__dict__
    torch.manual_seed(3)
    ref_opt = FusedAdam(ref.parameters(), lr=1e-2, capturable=True)
    x, y = torch.randn(8, 7), torch.randn(8, 3)
    for _ in range(10):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert scaler.get_scale() == 2.0**12


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("master_weights", [False, True])
def test_grad_scaler_overflow_leaves_everything(master_weights, amsgrad):
    net = model().to(torch.bfloat16)
    opt = FusedAdam(net.parameters(), lr=1e-2, master_weights=master_weights, amsgrad=amsgrad)
    scaled_run(opt, net, steps=3)
    before = deepcopy(opt.state_dict())
    params_before = [p.detach().clone() for p in net.parameters()]
    scaler = scaled_run(opt, net, steps=1, inf_at={0})
    assert scaler.get_scale() == 2.0**11
    for p, q in zip(net.parameters(), params_before):
        assert torch.equal(p, q)
    after = opt.state_dict()
    assert int(after["param_groups"][0]["step"]) == int(before["param_groups"][0]["step"]) == 3
    for i, entry in before["state"].items():
        for k, v in entry.items():
            assert torch.equal(after["state"][i][k], v), k


def test_unscale_then_step_with_grad_scaler():
    """scaler.unscale_(opt) for clipping first: step() then only honours found_inf."""
    net, ref = model(), model()
    opt = FusedAdam(net.parameters(), lr=1e-2)
    ref_opt = FusedAdam(ref.parameters(), lr=1e-2, capturable=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x, y = torch.randn(8, 7), torch.randn(8, 3)
    for _ in range(5):
        opt.zero_grad()
        ref_opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(net(x), y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
        scaler.step(opt)
        scaler.update()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
    assert_close(net.parameters(), ref.parameters())


def test_apex_grad_scaler_keyword():
    """apex's capturable protocol: step(grad_scaler=scaler), grads unscaled in place."""
    net = model()
    opt = FusedAdam(net.parameters(), lr=1e-2, capturable=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x, y = torch.randn(8, 7), torch.randn(8, 3)
    scaler.scale(torch.nn.functional.mse_loss(net(x), y)).backward()
    grads = [p.grad.clone() for p in net.parameters()]
    opt.step(grad_scaler=scaler)
    for p, g in zip(net.parameters(), grads):
        assert torch.equal(p.grad, g / 4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        opt.step(bogus=1)


@pytest.mark.cuda
def test_cuda_graph_capture():
    """capturable=True: a captured step replays with new grads and a new lr."""
    torch.manual_seed(0)
    net = model().cuda()
    ref = deepcopy(net)
    opt = FusedAdam(net.parameters(), lr=1e-2, capturable=True, weight_decay=0.1)
    ref_opt = FusedAdam(ref.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = torch.randn(32, 7, device="cuda"), torch.randn(32, 3, device="cuda")
    static_x = x.clone()

    def fwd_bwd(m, inp):
        torch.nn.functional.mse_loss(m(inp), y).backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up: state, flags and buffers exist before capture
            opt.zero_grad(set_to_none=False)
            fwd_bwd(net, static_x)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        ref_opt.zero_grad(set_to_none=False)
        fwd_bwd(ref, x)
        ref_opt.step()
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        fwd_bwd(net, static_x)
        opt.step()
    for i in range(5):
        lr = 1e-2 / (i + 1)
        opt.param_groups[0]["lr"].fill_(lr)
        ref_opt.param_groups[0]["lr"] = lr
        for p in net.parameters():
            p.grad.zero_()
        graph.replay()
        ref_opt.zero_grad(set_to_none=False)
        fwd_bwd(ref, x)
        ref_opt.step()
    torch.cuda.synchronize()
    assert_close(net.parameters(), ref.parameters(), scale=10)


# ---- checkpoints --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"capturable": True},
        {"master_weights": True},
        {"amsgrad": True},
        {"capturable": True, "master_weights": True},
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_resumes_bit_identically(dtype, kw):
    ps = params(dtype)
    opt = FusedAdam(ps, lr=1e-2, weight_decay=0.1, **kw)
    run_synthetic(opt, ps, steps=10)
    saved = roundtrip({"params": [p.detach() for p in ps], "opt": opt.state_dict()})
    ps2 = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    # The hyper-parameters come from the checkpoint.
    opt2 = FusedAdam(ps2, lr=0.5, weight_decay=0.0, **kw)
    opt2.load_state_dict(saved["opt"])
    if kw.get("master_weights") and dtype != torch.float32:
        assert "master_param" in saved["opt"]["state"][0]
        assert opt2.state[ps2[0]]["master_param"].dtype == torch.float32
    run_synthetic(opt, ps, steps=10, seed=7)
    run_synthetic(opt2, ps2, steps=10, seed=7)
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)
    for a, b in zip(ps, ps2):
        for k, v in opt.state[a].items():
            assert torch.equal(v, opt2.state[b][k]) and v.dtype == opt2.state[b][k].dtype


def test_apex_layout_state_dict_loads():
    """A checkpoint as apex's FusedAdam wrote it: group-level int step, fp32 moments, no
    masters (they are rebuilt from the params on the next step)."""
    ps = params(torch.float16)
    apex_sd = {
        "state": {
            i: {"exp_avg": torch.randn(p.shape) * 1e-3, "exp_avg_sq": torch.rand(p.shape) * 1e-6}
            for i, p in enumerate(ps)
        },
        "param_groups": [
            {
                "lr": 1e-3,
                "bias_correction": True,
                "betas": (0.9, 0.999),
                "eps": 1e-8,
                "weight_decay": 0.0,
                "step": 42,
                "params": list(range(len(ps))),
            }
        ],
    }
    opt = FusedAdam(ps, master_weights=True)
    opt.load_state_dict(deepcopy(apex_sd))
    assert opt.param_groups[0]["step"] == 42 and opt.param_groups[0]["amsgrad"] is False
    assert set(opt.state_dict()["param_groups"][0]) == set(apex_sd["param_groups"][0]) | {"amsgrad"}
    assert opt.state[ps[0]]["exp_avg"].dtype == torch.float32  # torch would cast it to fp16
    run_synthetic(opt, ps, steps=1)
    assert opt.param_groups[0]["step"] == 43
    assert opt.state[ps[0]]["master_param"].dtype == torch.float32


@pytest.mark.parametrize("amsgrad", [False, True])
def test_torch_adamw_state_round_trip(amsgrad):
    """torch AdamW -> FusedAdam -> torch AdamW: training continues as if never converted."""
    net, ref = model(), model()
    t = torch.optim.AdamW(
        ref.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, foreach=False
    )
    train(ref, t, steps=20)
    net.load_state_dict(ref.state_dict())
    fused_sd = torch_state_to_fused_adam(roundtrip(t.state_dict()))
    assert fused_sd["param_groups"][0]["step"] == 20
    assert all("step" not in s for s in fused_sd["state"].values())
    opt = FusedAdam(net.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    opt.load_state_dict(fused_sd)
    train(net, opt, steps=20, seed=2)
    train(ref, t, steps=20, seed=2)
    assert_close(net.parameters(), ref.parameters())
    back = fused_adam_state_to_torch(roundtrip(opt.state_dict()))
    t2 = torch.optim.AdamW(model().parameters(), lr=0.5, foreach=False)
    t2.load_state_dict(back)
    assert t2.state_dict()["state"][0]["step"].item() == 40
    assert t2.param_groups[0]["lr"] == 1e-2 and t2.param_groups[0]["amsgrad"] == amsgrad


def test_torch_state_dict_loads_directly():
    net, ref = model(), model()
    t = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    train(ref, t, steps=5)
    net.load_state_dict(ref.state_dict())
    opt = FusedAdam(net.parameters(), lr=1e-2)
    opt.load_state_dict(roundtrip(t.state_dict()))
    assert opt.param_groups[0]["step"] == 5
    assert "maximize" not in opt.param_groups[0] and "step" not in opt.state[next(net.parameters())]
    train(net, opt, steps=10, seed=2)
    train(ref, t, steps=10, seed=2)
    assert_close(net.parameters(), ref.parameters())


def test_conversion_refuses_what_the_other_side_cannot_do():
    net = model()
    t = torch.optim.AdamW(net.parameters(), maximize=True)
    with pytest.raises(ValueError, match="param group 0 has maximize=True"):
        torch_state_to_fused_adam(t.state_dict())
    opt = FusedAdam(net.parameters(), bias_correction=False)
    with pytest.raises(ValueError, match="param group 0 has bias_correction=False"):
        fused_adam_state_to_torch(opt.state_dict())


# ---- apex's API ---------------------------------------------------------------------------------


def test_constructor_matches_apex_positionally():
    ps = params()
    opt = FusedAdam(ps, 1e-2, False, (0.8, 0.9), 1e-6, False, 0.1, False, False, True, True)
    g = opt.param_groups[0]
    assert (g["lr"].item(), g["bias_correction"], g["betas"], g["eps"], g["weight_decay"]) == (
        pytest.approx(1e-2),
        False,
        (0.8, 0.9),
        1e-6,
        0.1,
    )
    assert opt.adam_w_mode == 0 and opt.set_grad_none is False
    assert opt.capturable is True and opt.master_weights is True
    # The old client bug apex users carry: betas passed third land in bias_correction.
    opt = FusedAdam(ps, 1e-3, [0.5, 0.6])
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert set(FusedAdam(ps).defaults) == {
        "lr",
        "bias_correction",
        "betas",
        "eps",
        "weight_decay",
        "amsgrad",
    }


def test_legacy_attributes():
    ps = params(torch.float16)
    opt = FusedAdam(ps, master_weights=True)
    assert opt._dummy_overflow_buf.dtype == torch.int32 and opt._dummy_overflow_buf.numel() == 1
    assert opt.multi_tensor_adam is amp_C.multi_tensor_adam
    assert opt.multi_tensor_adam_capturable_master is amp_C.multi_tensor_adam_capturable_master
    assert opt.adam_w_mode == 1 and opt.capturable is False and opt.master_weights is True
    masters = opt.param_groups_master
    assert len(masters) == 1 and all(m.dtype == torch.float32 for m in masters[0]["params"])
    assert torch.equal(masters[0]["params"][0].half(), ps[0])
    run_synthetic(opt, ps, steps=2)
    assert opt.param_groups_master[0]["params"][0] is opt.state[ps[0]]["master_param"]
    assert set(opt.state[ps[0]]) == {"exp_avg", "exp_avg_sq", "master_param"}
    assert opt.param_groups[0]["step"] == 2


def test_legacy_step_arguments_raise():
    opt = FusedAdam(params())
    with pytest.raises(RuntimeError, match="FusedAdam has been updated"):
        opt.step(grads=[torch.zeros(1)])


def test_fairseq_style_subclass():
    """fairseq's FusedAdamV2 drives self.multi_tensor_adam through multi_tensor_applier."""

    class FusedAdamV2(FusedAdam):
        def step(self, closure=None):
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1
                g, p, m, v = [], [], [], []
                for q in group["params"]:
                    st = self.state[q]
                    if not st:
                        st["exp_avg"] = torch.zeros_like(q)
                        st["exp_avg_sq"] = torch.zeros_like(q)
                    g.append(q.grad)
                    p.append(q.data)
                    m.append(st["exp_avg"])
                    v.append(st["exp_avg_sq"])
                beta1, beta2 = group["betas"]
                bias_correction = 1 if group["bias_correction"] else 0
                multi_tensor_applier(
                    self.multi_tensor_adam,
                    self._dummy_overflow_buf,
                    [g, p, m, v],
                    group["lr"],
                    beta1,
                    beta2,
                    group["eps"],
                    group["step"],
                    self.adam_w_mode,
                    bias_correction,
                    group["weight_decay"],
                )

    ps, ps2 = params(), params()
    run_synthetic(FusedAdamV2(ps, lr=1e-2), ps, steps=10)
    run_synthetic(FusedAdam(ps2, lr=1e-2), ps2, steps=10)
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)


def test_megatron_prepopulated_state_and_extra_group_keys():
    ps = params()
    groups = [
        {"params": ps[:2], "wd_mult": 1.0, "is_expert_parallel": False},
        {"params": ps[2:], "wd_mult": 0.0, "max_lr": 1e-2},
    ]
    opt = FusedAdam(groups, lr=1e-3, weight_decay=0.1)
    for p in ps:  # Megatron's init_state_fn
        opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
        opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
    run_synthetic(opt, ps, steps=3)
    sd = roundtrip(opt.state_dict())
    assert sd["param_groups"][0]["wd_mult"] == 1.0 and sd["param_groups"][1]["max_lr"] == 1e-2
    assert sd["param_groups"][1]["step"] == 3
    opt.param_groups[0]["step"] = 100  # what distrib_optimizer does on load
    run_synthetic(opt, ps, steps=1)
    assert opt.param_groups[0]["step"] == 101


def test_state_reset_is_noticed():
    """Clearing or replacing the state between steps rebuilds the cached lists."""
    ps = params()
    opt = FusedAdam(ps, lr=1e-2)
    run_synthetic(opt, ps, steps=2)
    opt.state.clear()
    run_synthetic(opt, ps, steps=1)
    assert opt.state[ps[0]]["exp_avg"].abs().sum() > 0
    from collections import defaultdict

    opt.state = defaultdict(dict)
    run_synthetic(opt, ps, steps=1)
    assert len(opt.state) == len(ps)


def test_lr_scheduler_and_pickle():
    net = model()
    opt = FusedAdam(net.parameters(), lr=1e-2, capturable=True, master_weights=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(net, opt, steps=1)
    sched.step()
    assert opt.param_groups[0]["lr"].item() == pytest.approx(5e-3)
    clone = deepcopy(opt)
    assert clone.capturable and clone.master_weights and clone.adam_w_mode == 1
    train(net, clone, steps=1)


@pytest.mark.parametrize("kw", [{}, {"capturable": True}])
def test_tensor_lr_without_sync(kw):
    ps, ps2 = params(), params()
    a = FusedAdam(ps, lr=torch.tensor(1e-2), **kw)
    b = FusedAdam(ps2, lr=1e-2, capturable=True)
    run_synthetic(a, ps, steps=5)
    run_synthetic(b, ps2, steps=5)
    assert_close(ps, ps2)
    assert math.isclose(float(a.param_groups[0]["lr"]), 1e-2, rel_tol=1e-6)
