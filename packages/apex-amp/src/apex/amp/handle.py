"""``amp.scale_loss`` and ``amp.disable_casts``."""

from __future__ import annotations

import contextlib
import types

import torch

from ._amp_state import _amp_state
from ._process_optimizer import CLOSURE_MESSAGE


def _as_list(optimizers) -> list:
    if isinstance(optimizers, (list, tuple)):
        return list(optimizers)
    return [optimizers]


def _check_optimizers(optimizers: list) -> None:
    # Any optimizer that went through amp.initialize, this call's or an earlier one's (apex looked
    # only for _amp_stash, and a GAN's two optimizers may come from two calls).
    for opt in optimizers:
        if not hasattr(opt, "_amp_stash"):
            raise RuntimeError(
                f"amp.scale_loss got an optimizer ({type(opt).__name__}) that was not passed to "
                "amp.initialize. Pass every optimizer through initialize and use the ones it "
                "returns: `model, [opt_a, opt_b] = amp.initialize(model, [opt_a, opt_b], ...)`."
            )


def _patch_skip_step(optimizer) -> None:
    """apex's one-shot skip: the next ``optimizer.step()`` does nothing but clear the fp32
    master grads, then the real step comes back."""
    stash = optimizer._amp_stash
    real_step = optimizer.step

    def skip_step(self, closure=None):
        if closure is not None:
            raise RuntimeError(CLOSURE_MESSAGE)
        for master in getattr(stash, "all_fp32_from_fp16_params", ()):
            master.grad = None
        if hasattr(optimizer, "most_recent_scale"):
            optimizer.most_recent_scale = 1.0
            optimizer.scale_set_by_backward = False
        optimizer.step = real_step
        stash.already_patched = False

    optimizer.step = types.MethodType(skip_step, optimizer)
    stash.already_patched = True


@contextlib.contextmanager
def scale_loss(
    loss, optimizers, loss_id=0, model=None, delay_unscale=False, delay_overflow_check=False
):
    """Yield ``loss`` (as fp32) times the current loss scale of loss ``loss_id``; call
    ``backward()`` on it inside the block.

    On exit (unless ``delay_unscale``) the grads are unscaled, into the fp32 master grads under
    master weights, in one fused pass per dtype group that also checks them for inf/nan; then
    (unless ``delay_overflow_check``) the scaler reads that flag once and, on an overflow, lowers
    the scale and makes the next ``optimizer.step()`` of each of ``optimizers`` a no-op.

    ``delay_unscale=True`` leaves the grads scaled (accumulate several backwards, then exit one
    block without it). ``model`` is accepted and unused, as in apex.
    """
    if getattr(_amp_state, "opt_properties", None) is None:
        raise RuntimeError(
            "Invoked `with amp.scale_loss`, but internal Amp state has not been initialized. "
            "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called "
            "before `with amp.scale_loss`."
        )
    if not _amp_state.opt_properties.enabled:
        yield loss
        return
    if isinstance(loss, torch.Tensor) is False:
        raise TypeError(f"amp.scale_loss needs the loss as a tensor, got {type(loss).__name__}")
    optimizers = _as_list(optimizers)
    if not 0 <= loss_id < len(_amp_state.loss_scalers):
        raise RuntimeError(
            f"loss_id {loss_id} is out of range: amp.initialize made "
            f"{len(_amp_state.loss_scalers)} loss scaler(s). Pass num_losses=<number of losses> "
            "to amp.initialize and loss_id=0..num_losses-1 to scale_loss."
        )
    scaler = _amp_state.loss_scalers[loss_id]
    loss_scale = scaler.loss_scale()
    handle = _amp_state.handle
    if not _amp_state.opt_properties.master_weights and not scaler.dynamic and loss_scale == 1.0:
        # Nothing to scale: the optimizers are not touched, so (as in apex) any may be passed,
        # one amp.initialize never saw (a scheduler wrapper) or None included.
        yield loss.float()
        if handle is not None and getattr(handle, "has_cache", False):
            handle._clear_cache()
        return

    _check_optimizers(optimizers)
    if not delay_unscale:
        for opt in optimizers:
            if not opt._amp_stash.params_have_scaled_gradients:
                opt._prepare_amp_backward()

    yield loss.float() * loss_scale

    if delay_unscale:
        for opt in optimizers:
            opt._amp_stash.params_have_scaled_gradients = True
    else:
        scaler.clear_overflow_state()
        for opt in optimizers:
            opt._post_amp_backward(scaler)
            opt._amp_stash.params_have_scaled_gradients = False
        should_skip = False if delay_overflow_check else scaler.update_scale()
        if should_skip:
            for opt in optimizers:
                if not opt._amp_stash.already_patched:
                    _patch_skip_step(opt)
            scaler._report_overflow(loss_id)
    if handle is not None and getattr(handle, "has_cache", False):
        handle._clear_cache()


@contextlib.contextmanager
def disable_casts():
    """Inside the block, O1 casts nothing: autocast is off and registered functions run as
    they are."""
    handle = _amp_state.handle
    was_active = getattr(handle, "_is_active", None)
    if handle is not None and was_active is not None:
        handle._is_active = False
    device_type = _amp_state.device_type or "cpu"
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        if handle is not None and was_active is not None:
            handle._is_active = was_active
