"""The process-wide amp state that apex's clients read (``amp._amp_state``), and master_params.

Clients reach in here: DeepLearningExamples BERT sets ``_amp_state.loss_scalers[0]._loss_scale``
and swaps ``._overflow_buf``; Lightning and timm read ``opt_properties``; mmengine probes
``optimizer._amp_stash``. The names are apex's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger("apex.amp")


class AmpState:
    """What ``amp.initialize`` decided, for the rest of the process."""

    def __init__(self) -> None:
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1
        self.reset()

    def reset(self) -> None:
        """Forget everything ``initialize`` and ``init`` set up (the flags above stay)."""
        # opt_properties: absent until initialize sets it, as in apex (atorch tests
        # `hasattr(_amp_state, "opt_properties") and _amp_state.opt_properties.enabled`).
        self.__dict__.pop("opt_properties", None)
        self.loss_scalers: list = []
        self.handle = None
        self.min_loss_scale = None
        self.max_loss_scale = 2.0**24
        self.initialized = False
        # Extensions: the low-precision dtype chosen, the device type models live on, and the
        # models and optimizers the last initialize processed.
        self.low_precision_dtype = None
        self.device_type = None
        self.optimizers: list = []
        self.models: list = []


_amp_state = AmpState()


def warn_or_err(msg: str) -> None:
    """apex's helper: a RuntimeError, or only a warning under ``_amp_state.hard_override``."""
    if _amp_state.hard_override:
        logger.warning("Warning: %s", msg)
    else:
        raise RuntimeError(msg)


def _is_rank0() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def maybe_print(msg: str, rank0: bool = False) -> None:
    """Log ``msg`` at INFO when verbosity > 0 (only on rank 0 when ``rank0``).

    apex printed; a library logs instead (``logging.getLogger("apex.amp")``)."""
    if _amp_state.verbosity > 0 and (not rank0 or _is_rank0()):
        logger.info("%s", msg)


def master_params(optimizer) -> Iterator[torch.Tensor]:
    """The params ``optimizer`` updates: fp32 masters of the model's low-precision params under
    master weights (O2, once the first backward or ``_lazy_init_maybe_master_weights`` made
    them), else the model's params. Clip gradients and checkpoint masters through this."""
    for group in optimizer.param_groups:
        yield from group["params"]
