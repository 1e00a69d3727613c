"""apex's LossScaler: dynamic or static loss scaling, unscaling through the multi-tensor kernels.

The overflow check rides on the unscale: ``multi_tensor_scale`` / ``multi_tensor_axpby`` raise an
int32 flag on the device (``_overflow_buf``) when an input is inf or nan, for all tensors of a
dtype in one launch; ``update_scale`` reads that flag once per step (the step's one sync).

Beyond apex: a floor for the scale by default (``min_loss_scale`` None means 1.0, where apex let
the scale decay towards 0), optional hysteresis (back off only after ``hysteresis`` overflowing
steps in a row, as NeMo's GradScaler), and overflow messages rate-limited (the first, then at
most one per ``message_interval`` seconds with a count) instead of one per skipped step.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from apex.multi_tensor_apply import ops

logger = logging.getLogger("apex.amp")

DEFAULT_MIN_LOSS_SCALE = 1.0


def _flag_for(tensor: torch.Tensor, flags: dict, main: torch.Tensor) -> torch.Tensor:
    """The overflow flag for ``tensor``'s device: the main flag on its own device, else a
    scratch flag that ``_merge_flags`` folds in."""
    if tensor.device == main.device:
        return main
    flag = flags.get(tensor.device)
    if flag is None:
        flag = flags[tensor.device] = torch.zeros(1, dtype=torch.int32, device=tensor.device)
    return flag


def by_device(*lists) -> dict:
    """{device: lists' items whose first-list tensor is on it}, each a tuple of lists in the
    order given (one multi-tensor launch per device)."""
    groups: dict = {}
    for items in zip(*lists):
        dst = groups.setdefault(items[0].device, tuple([] for _ in lists))
        for d, x in zip(dst, items):
            d.append(x)
    return groups


def _merge_flags(flags: dict, main: torch.Tensor) -> None:
    for flag in flags.values():
        main.add_(flag.to(main.device, non_blocking=True))


class LossScaler:
    """One loss's scale (``_amp_state.loss_scalers[loss_id]``), with apex's attributes:
    ``dynamic``, ``_loss_scale``, ``_unskipped``, ``_overflow_buf``, ``_has_overflow``,
    ``_min_loss_scale``, ``_max_loss_scale``, ``_scale_seq_len``.

    ``loss_scale`` is "dynamic" or a number (static: never checked, never changed).
    """

    warned_no_fused_kernel = False
    warned_unscaling_non_fp32_grad = False
    has_fused_kernel = True

    def __init__(
        self,
        loss_scale,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
        *,
        hysteresis: int = 1,
        device=None,
        message_interval: float = 60.0,
    ):
        if scale_factor <= 1:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor}")
        if int(scale_window) < 1:
            raise ValueError(f"scale_window must be >= 1, got {scale_window}")
        if int(hysteresis) < 1:
            raise ValueError(f"hysteresis must be >= 1 (1 is apex's behaviour), got {hysteresis}")
        if max_loss_scale is None:
            max_loss_scale = 2.0**24
        if min_loss_scale is None:
            min_loss_scale = DEFAULT_MIN_LOSS_SCALE
        if not 0 <= min_loss_scale <= max_loss_scale:
            raise ValueError(
                f"need 0 <= min_loss_scale <= max_loss_scale, got {min_loss_scale} and "
                f"{max_loss_scale}"
            )
        if loss_scale == "dynamic":
            self.dynamic = True
            self._loss_scale = min(max_loss_scale, init_scale)
        else:
            self.dynamic = False
            self._loss_scale = float(loss_scale)
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = int(scale_window)
        self._scale_factor = float(scale_factor)
        self._unskipped = 0
        self._has_overflow = False
        self._hysteresis = int(hysteresis)
        self._hysteresis_left = int(hysteresis)
        device = torch.device(device) if device is not None else _default_device()
        self._overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        self._scratch_flags: dict = {}
        # Rate-limited overflow messages.
        self._message_interval = float(message_interval)
        self._last_message = -math.inf
        self._overflows_unreported = 0
        self.overflows = 0  # total overflowing steps seen (extension)

    def loss_scale(self) -> float:
        return self._loss_scale

    # ---- unscale -------------------------------------------------------------------------------

    def clear_overflow_state(self) -> None:
        self._has_overflow = False
        if self.has_fused_kernel:
            self._overflow_buf.zero_()

    def _flag(self, t: torch.Tensor) -> torch.Tensor:
        return _flag_for(t, self._scratch_flags, self._overflow_buf)

    def _groups(self, lists, device):
        """(flag, lists) per device: one group, the main flag, when the caller knows every tensor
        is on the flag's device (``device``); else split by the first list's devices."""
        if device is not None and device == self._overflow_buf.device:
            return [(self._overflow_buf, lists)]
        return [(self._flag(g[0][0]), g) for g in by_device(*lists).values()]

    def _merge(self) -> None:
        if self._scratch_flags:
            _merge_flags(self._scratch_flags, self._overflow_buf)
            self._scratch_flags.clear()

    @torch.no_grad()
    def unscale(
        self,
        model_grads,
        master_grads,
        unused_scale,
        models_are_masters=False,
        scale_override=None,
        *,
        _device=None,
    ) -> None:
        """master_grads[i] = model_grads[i] / scale (in place when they are the same tensors),
        raising ``_overflow_buf`` if a model grad is inf or nan. One launch per device and dtype
        group. ``_device`` (amp's own callers): the one device every tensor is on."""
        if self._has_overflow:
            return
        scale = self._loss_scale if scale_override is None else scale_override
        if models_are_masters and scale == 1.0 and not self.dynamic:
            return
        for flag, (src, dst) in self._groups((list(model_grads), list(master_grads)), _device):
            ops.multi_tensor_scale(src, dst, flag, 1.0 / scale)
        self._merge()

    @torch.no_grad()
    def unscale_with_stashed(
        self, model_grads, stashed_master_grads, master_grads, scale_override=None, *, _device=None
    ) -> None:
        """master_grads[i] = model_grads[i] / scale + stashed_master_grads[i] (gradient
        accumulation across losses); only the model grads are checked for inf/nan."""
        if self._has_overflow:
            return
        scale = self._loss_scale if scale_override is None else scale_override
        lists = (list(model_grads), list(stashed_master_grads), list(master_grads))
        for flag, (src, stashed, dst) in self._groups(lists, _device):
            ops.multi_tensor_axpby(src, stashed, dst, flag, 1.0 / scale, 1.0, 0)
        self._merge()

    def _unscale_plan(self, plan, device) -> bool:
        """``unscale`` of amp's usual O2 step through its AmpPlan (``_process_optimizer``), all
        tensors on ``device``; False, with nothing done, where ``unscale`` must run instead."""
        if self._has_overflow or device != self._overflow_buf.device:
            return False
        return plan.unscale(self._overflow_buf, 1.0 / self._loss_scale)

    # ---- update --------------------------------------------------------------------------------

    def update_scale(self) -> bool:
        """Read the overflow flag (one sync) and adjust the scale; True means skip this step."""
        if self.has_fused_kernel and self.dynamic and not self._has_overflow:
            self._has_overflow = bool(self._overflow_buf.item())
        if not (self._has_overflow and self.dynamic):
            self._unskipped += 1  # static scalers count their steps too, as apex's
            if self.dynamic:
                self._hysteresis_left = self._hysteresis
                # >=: a restored count (amp.load_state_dict) may exceed a smaller window.
                if self._unskipped >= self._scale_seq_len:
                    self._loss_scale = min(
                        self._max_loss_scale, self._loss_scale * self._scale_factor
                    )
                    self._unskipped = 0
            return False
        self.overflows += 1
        self._unskipped = 0
        # Held at 0 once spent: every further overflow in the row backs off, as before it.
        self._hysteresis_left = max(self._hysteresis_left - 1, 0)
        if self._hysteresis_left == 0:
            self._loss_scale = max(self._min_loss_scale, self._loss_scale / self._scale_factor)
        return True

    def _report_overflow(self, loss_id: int) -> None:
        """apex's "Gradient overflow" message, at most once per ``message_interval`` seconds."""
        self._overflows_unreported += 1
        now = time.monotonic()
        if now - self._last_message < self._message_interval:
            return
        more = self._overflows_unreported - 1
        tail = f" ({more} more skipped steps since the last message)" if more > 0 else ""
        at_floor = (
            " The scale is at its floor min_loss_scale: the model likely produces inf/nan "
            "itself; check inputs, learning rate and the loss."
            if self._loss_scale <= self._min_loss_scale
            else ""
        )
        if self._hysteresis_left > 0:  # this overflow spent hysteresis, not scale
            logger.warning(
                "Gradient overflow.  Skipping step, loss scaler %d keeping loss scale at %s "
                "(hysteresis: it backs off after %d more overflowing step(s) in a row)%s.",
                loss_id,
                self._loss_scale,
                self._hysteresis_left,
                tail,
            )
        else:
            logger.warning(
                "Gradient overflow.  Skipping step, loss scaler %d reducing loss scale to %s%s.%s",
                loss_id,
                self._loss_scale,
                tail,
                at_floor,
            )
        self._last_message = now
        self._overflows_unreported = 0


def _default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else (torch.device("cpu"))
    )
