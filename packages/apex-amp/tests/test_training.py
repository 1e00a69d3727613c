"""O0-O3 x fp16/bf16 training on CPU against torch's own mixed precision and an fp32 reference."""

from __future__ import annotations

import pytest
import torch
from amp_testing import LOW, batches, make_model, train_amp, train_reference

import apex.amp as amp

STEPS = 200
# Final loss vs the fp32 run, relative: O3 trains in pure low precision (bf16's 8-bit mantissa
# drifts furthest), the others keep fp32 where it matters.
REL = {
    ("O0", torch.bfloat16): 1e-6,
    ("O0", torch.float16): 1e-6,
    ("O1", torch.bfloat16): 0.01,
    ("O1", torch.float16): 0.01,
    ("O2", torch.bfloat16): 0.01,
    ("O2", torch.float16): 0.01,
    ("O3", torch.bfloat16): 0.2,
    ("O3", torch.float16): 0.05,
}


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@pytest.fixture(scope="module")
def fp32_losses():
    data = batches(STEPS)
    model = make_model()
    return train_reference(model, sgd(model), data)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_trains_like_fp32(opt_level, dtype, fp32_losses):
    data = batches(STEPS)
    model = make_model()
    model, opt = amp.initialize(
        model, sgd(model), opt_level=opt_level, low_precision_dtype=dtype, verbosity=0
    )
    losses = train_amp(model, opt, data, amp)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.25 * losses[0]
    rel = abs(losses[-1] - fp32_losses[-1]) / fp32_losses[-1]
    assert rel <= REL[opt_level, dtype], (losses[-1], fp32_losses[-1])


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_o1_is_autocast_plus_gradscaler_bit_for_bit(dtype):
    """O1 = the forward under torch.autocast; with fp16, dynamic scaling from 2**16 like a
    GradScaler (bf16: no scaling). Same losses, same weights."""
    data = batches(60)
    ref = make_model()
    ref_opt = sgd(ref)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if dtype == torch.float16 else None
    ref_losses = train_reference(ref, ref_opt, data, dtype=dtype, scaler=scaler)
    model = make_model()
    model, opt = amp.initialize(
        model, sgd(model), opt_level="O1", low_precision_dtype=dtype, verbosity=0
    )
    losses = train_amp(model, opt, data, amp)
    assert losses == ref_losses
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_o2_matches_autocast_gradscaler_reference(dtype):
    data = batches(120)
    ref = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if dtype == torch.float16 else None
    ref_losses = train_reference(ref, sgd(ref), data, dtype=dtype, scaler=scaler)
    model = make_model()
    model, opt = amp.initialize(
        model, sgd(model), opt_level="O2", low_precision_dtype=dtype, verbosity=0
    )
    losses = train_amp(model, opt, data, amp)
    torch.testing.assert_close(
        torch.tensor(losses[-20:]), torch.tensor(ref_losses[-20:]), rtol=0.02, atol=1e-3
    )
    # The fp32 masters track the reference's fp32 weights.
    for master, p in zip(amp.master_params(opt), ref.parameters()):
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, p, rtol=0.05, atol=0.02)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.Adam(ps, lr=1e-2),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    ],
    ids=["Adam", "AdamW", "SGD-nesterov", "RMSprop"],
)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_torch_optimizers_train(opt_level, make_opt):
    data = batches(40)
    ref = make_model()
    ref_losses = train_reference(ref, make_opt(ref.parameters()), data)
    model = make_model()
    model, opt = amp.initialize(
        model, make_opt(model.parameters()), opt_level=opt_level, verbosity=0
    )
    losses = train_amp(model, opt, data, amp)
    assert losses[-1] < 0.7 * losses[0]
    assert abs(losses[-1] - ref_losses[-1]) <= 0.05 * ref_losses[-1] + 2e-3


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD", "FusedLAMB"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_apex_optimizers_train(name, opt_level, dtype):
    optimizers = pytest.importorskip("apex.optimizers", exc_type=ImportError)
    cls = getattr(optimizers, name)
    kwargs = {"lr": 0.05, "momentum": 0.9} if name == "FusedSGD" else {"lr": 1e-2}
    data = batches(40)
    model = make_model()
    model, opt = amp.initialize(
        model,
        cls(model.parameters(), **kwargs),
        opt_level=opt_level,
        low_precision_dtype=dtype,
        verbosity=0,
    )
    first = [p.detach().clone() for p in model.parameters()]
    losses = train_amp(model, opt, data, amp)
    assert losses[-1] < 0.7 * losses[0], losses[::10]
    if opt_level == "O2":
        # The model params are the masters rounded, after every step.
        lows = [p for p in model.parameters() if p.dtype == dtype]
        assert lows
        masters = [m for m in amp.master_params(opt) if m.shape in {p.shape for p in lows}]
        for p, m in zip(lows, opt._amp_stash.all_fp32_from_fp16_params):
            torch.testing.assert_close(p, m.to(dtype), rtol=0, atol=0)
        assert masters
    assert any(not torch.equal(a, b) for a, b in zip(first, model.parameters()))


def test_fused_sgd_o2_writes_model_params_itself():
    optimizers = pytest.importorskip("apex.optimizers", exc_type=ImportError)
    model = make_model()
    opt = optimizers.FusedSGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.initialize(
        model, opt, opt_level="O2", low_precision_dtype=torch.float16, verbosity=0
    )
    calls = []
    original = opt._master_params_to_model_params
    opt._master_params_to_model_params = lambda: calls.append(1) or original()
    train_amp(model, opt, batches(3), amp)
    assert calls == []  # FusedSGD's kernel wrote the fp16 params in the same pass
    for p, m in zip(opt._amp_stash.all_fp16_params, opt._amp_stash.all_fp32_from_fp16_params):
        torch.testing.assert_close(p, m.half(), rtol=0, atol=0)


def test_fused_sgd_o2_without_materialized_master_grads_still_trains():
    """materialize_master_grads=False: amp still unscales into the fp32 master grads (README),
    so FusedSGD's amp path must read those, not the (cleared) fp16 model grads."""
    optimizers = pytest.importorskip("apex.optimizers", exc_type=ImportError)
    model = make_model()
    opt = optimizers.FusedSGD(
        model.parameters(), lr=0.05, momentum=0.9, materialize_master_grads=False
    )
    model, opt = amp.initialize(
        model, opt, opt_level="O2", low_precision_dtype=torch.float16, verbosity=0
    )
    weights = [p for p in model.parameters() if p.dim() == 2]  # fp16, with nonzero grads
    first = [p.detach().clone() for p in weights]
    losses = train_amp(model, opt, batches(40), amp)
    assert losses[-1] < 0.7 * losses[0], losses[::10]
    assert all(not torch.equal(a, b) for a, b in zip(first, weights))
    for p, m in zip(opt._amp_stash.all_fp16_params, opt._amp_stash.all_fp32_from_fp16_params):
        torch.testing.assert_close(p, m.half(), rtol=0, atol=0)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_larc_wrapped_optimizer(opt_level):
    from amp_testing import LARC

    data = batches(60)
    model = make_model()
    opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), clip=False)
    model, opt = amp.initialize(
        model, opt, opt_level=opt_level, low_precision_dtype=torch.float16, verbosity=0
    )
    assert hasattr(opt, "_amp_stash") and not hasattr(opt.optim, "_amp_stash")
    losses = train_amp(model, opt, data, amp)
    assert losses[-1] < 0.7 * losses[0]
    if opt_level == "O2":
        assert all(p.dtype == torch.float32 for p in opt.optim.param_groups[0]["params"])
