"""apex.amp on a CUDA GPU: O1/O2 with fp16 and bf16, the fused unscale's one sync per step,
overflow skipping and checkpoints (skipped cleanly without a GPU)."""

from __future__ import annotations

import contextlib
import io
import traceback

import pytest
import torch
from amp_testing import LOW, batches, loss_fn, make_model

import apex.amp as amp
from apex.amp.scaler import LossScaler

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


@contextlib.contextmanager
def sync_mode(mode: str):
    """torch's sync debug mode inside the block ("error": a synchronizing call raises there)."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def test_scale_loss_exit_syncs_once_and_master_copy_never(monkeypatch):
    """Syncs made errors, so that each is caught where it happens (torch's sync warnings can
    surface at a later call, which made counting them unreliable): the exit's first sync is the
    overflow flag's read in update_scale; with that read allowed, the exit makes no other; the
    master copy and an exit with delay_overflow_check make none."""
    model = make_model().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp.initialize(
        model, opt, opt_level="O2", low_precision_dtype=torch.float16, verbosity=0
    )
    x, y = cuda_batches(1)[0]
    train(model, opt, [(x, y)])  # masters made, allocator warm

    def block_after_backward(**kwargs):
        loss = loss_fn(model(x), y)
        block = amp.scale_loss(loss, opt, **kwargs)
        block.__enter__().backward()
        torch.cuda.synchronize()
        return block

    block = block_after_backward()
    with sync_mode("error"), pytest.raises(RuntimeError, match="synchroniz") as info:
        block.__exit__(None, None, None)
    apex_frames = [f for f in traceback.extract_tb(info.tb) if "/apex/amp/" in f.filename]
    assert apex_frames[-1].name == "update_scale", apex_frames

    read_flag = LossScaler.update_scale

    def update_scale_read_allowed(self):
        with sync_mode("default"):
            return read_flag(self)

    monkeypatch.setattr(LossScaler, "update_scale", update_scale_read_allowed)
    block = block_after_backward()
    with sync_mode("error"):
        block.__exit__(None, None, None)
        opt._master_params_to_model_params()
    block = block_after_backward(delay_overflow_check=True)
    with sync_mode("error"):
        block.__exit__(None, None, None)


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
