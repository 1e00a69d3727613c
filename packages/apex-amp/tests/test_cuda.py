"""apex.amp on a CUDA GPU: O1/O2 with fp16 and bf16, the fused unscale's one sync per step,
overflow skipping and checkpoints (skipped cleanly without a GPU)."""

from __future__ import annotations

import io
import traceback
import warnings

import pytest
import torch
from amp_testing import LOW, batches, loss_fn, make_model

import apex.amp as amp

pytestmark = pytest.mark.cuda


def cuda_batches(n):
    return [(x.cuda(), y.cuda()) for x, y in batches(n)]


def train(model, opt, data):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def make_opt(name, params):
    if name == "FusedAdam":
        FusedAdam = pytest.importorskip("apex.optimizers", exc_type=ImportError).FusedAdam  # noqa: N806

        return FusedAdam(params, lr=1e-2)
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


@pytest.mark.parametrize("opt_name", ["FusedAdam", "AdamW-fused"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_trains_on_cuda(opt_level, dtype, opt_name):
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    data = cuda_batches(60)
    ref = make_model().cuda()
    ref_opt = make_opt(opt_name, ref.parameters())
    ref_losses = []
    for x, y in data:
        ref_opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    model = make_model().cuda()
    model, opt = amp.initialize(
        model,
        make_opt(opt_name, model.parameters()),
        opt_level=opt_level,
        low_precision_dtype=dtype,
        verbosity=0,
    )
    losses = train(model, opt, data)
    assert losses[-1] < 0.5 * losses[0]
    assert abs(losses[-1] - ref_losses[-1]) <= 0.05 * ref_losses[-1] + 2e-3
    if opt_level == "O2":
        stash = opt._amp_stash
        assert all(m.is_cuda and m.dtype == torch.float32 for m in amp.master_params(opt))
        for p, m in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
            torch.testing.assert_close(p, m.to(dtype), rtol=0, atol=0)


def test_o1_fp16_is_autocast_plus_gradscaler_bit_for_bit():
    data = cuda_batches(30)
    ref = make_model().cuda()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    ref_losses = []
    for x, y in data:
        ref_opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            out = ref(x)
        loss = loss_fn(out, y)
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_losses.append(loss.item())
    model = make_model().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    assert amp._amp_state.low_precision_dtype == torch.float16  # CUDA's default
    assert train(model, opt, data) == ref_losses


def syncs(fn) -> list[str]:
    """Where ``fn`` synchronized with the GPU: for each synchronizing call, the file:line chain
    of the Python frames that led to it, innermost first (torch's own frames included, so that a
    sync inside torch is traced back to the caller here)."""
    torch.cuda.synchronize()
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            stack = traceback.extract_stack()[:-1]  # without record() itself
            frames = [f for f in stack if not f.filename.endswith("warnings.py")][-8:]
            found.append(" <- ".join(f"{f.filename}:{f.lineno}" for f in reversed(frames)))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def test_scale_loss_exit_syncs_once_and_master_copy_never():
    model = make_model().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp.initialize(
        model, opt, opt_level="O2", low_precision_dtype=torch.float16, verbosity=0
    )
    x, y = cuda_batches(1)[0]
    train(model, opt, [(x, y)])  # masters made, allocator warm

    # The model's own backward may synchronize (seen on torch 2.11: one sync inside backward);
    # what amp adds is counted: the exit of the block, where it unscales and checks overflow.
    def exit_syncs(**kwargs) -> list[str]:
        loss = loss_fn(model(x), y)
        block = amp.scale_loss(loss, opt, **kwargs)
        block.__enter__().backward()
        torch.cuda.synchronize()
        return syncs(lambda: block.__exit__(None, None, None))

    where = exit_syncs()
    assert len(where) == 1, where  # the overflow flag, read once
    assert syncs(opt._master_params_to_model_params) == []
    assert exit_syncs(delay_overflow_check=True) == []


def test_inf_on_cuda_skips_the_step_and_halves_the_scale():
    model = make_model().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp.initialize(
        model, opt, opt_level="O2", low_precision_dtype=torch.float16, verbosity=0
    )
    next(model.parameters()).register_hook(lambda g: torch.full_like(g, float("inf")))
    x, y = cuda_batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(loss_fn(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_checkpoint_round_trip_on_cuda(dtype):
    FusedAdam = pytest.importorskip("apex.optimizers", exc_type=ImportError).FusedAdam  # noqa: N806

    data = cuda_batches(10)
    model = make_model().cuda()
    model, opt = amp.initialize(
        model,
        FusedAdam(model.parameters(), lr=1e-2),
        opt_level="O2",
        low_precision_dtype=dtype,
        verbosity=0,
    )
    train(model, opt, data[:5])
    buf = io.BytesIO()
    torch.save({"m": model.state_dict(), "o": opt.state_dict(), "a": amp.state_dict()}, buf)
    continued = train(model, opt, data[5:])
    amp.reset()
    buf.seek(0)
    ckpt = torch.load(buf)
    model2 = make_model(seed=9).cuda()
    model2, opt2 = amp.initialize(
        model2,
        FusedAdam(model2.parameters(), lr=1e-2),
        opt_level="O2",
        low_precision_dtype=dtype,
        verbosity=0,
    )
    model2.load_state_dict(ckpt["m"])
    opt2.load_state_dict(ckpt["o"])
    amp.load_state_dict(ckpt["a"])
    assert train(model2, opt2, data[5:]) == continued
