"""O1's function registry and handle: ``amp.init``, ``register_{half,float,promote}_function``,
the ``half_function``/``float_function``/``promote_function`` decorators.

O1 runs the model's forward under ``torch.autocast`` (initialize patches ``forward``), which casts
torch's own functions by its op lists, close to apex's lists: matmul, conv and linear in the low
precision dtype; softmax, losses, norms, exp/log/pow/sum in fp32; mixed inputs promoted to the
widest. CPU autocast runs some of those in the low dtype: for models on the CPU, the functions of
``CPU_FP32_FUNCTIONS`` (CUDA autocast's fp32 list) are wrapped where they live and cast fp16/bf16
arguments to fp32 while autocast is on. On top of that, functions registered here are wrapped
where they live (as apex patched them): while autocast is on (and casts are not disabled), their
floating-point arguments are cast by their policy and they run with autocast off; elsewhere they
run untouched. ``torch.nn.functional.binary_cross_entropy`` (and so ``nn.BCELoss``) is refused
inside an O1 forward unless ``amp.init(allow_banned=True)`` (then it runs in fp32). The losses of
``torch.nn.functional`` (``FP32_FUNCTIONS``) run in fp32 on fp16/bf16 input wherever they are
called while O1 is active, as apex's global patches did (a loss computed outside the forward on
its low-precision output included), log_softmax too. softmax and softmin are fp32 inside the
forward only: outside it, code amp does not manage (a ``.half()`` distillation teacher) keeps its
dtypes (apex's global fp16 matmul patch made such code work; autocast does not reach it).
"""

from __future__ import annotations

import functools
import logging

import torch

from ._amp_state import _amp_state
from ._casting import autocast_on, cast_tree, widest_dtype

logger = logging.getLogger("apex.amp")

HALF, FLOAT, PROMOTE = "half", "float", "promote"

# (module, name, policy): consumed and cleared by the next amp.init (apex's registry).
_USER_REGISTRY: list[tuple[object, str, str]] = []

BANNED_MESSAGE = (
    "amp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss`: it "
    "needs its input already in fp32, and in low precision the result can be wrong. Use "
    "`torch.nn.BCEWithLogitsLoss` / `F.binary_cross_entropy_with_logits` (safe under amp), or, "
    "if you know the input is fp32 and accept the risk, call "
    "`amp.register_float_function(torch.nn.functional, 'binary_cross_entropy')` before "
    "amp.initialize, or `amp.init(allow_banned=True)`."
)


def _casts_active() -> bool:
    handle = _amp_state.handle
    device_type = _amp_state.device_type
    if handle is None or device_type is None or not handle.is_active():
        return False
    return autocast_on(device_type)


def _target_dtype(policy: str, args, kwargs):
    if policy == HALF:
        return _amp_state.low_precision_dtype
    if policy == FLOAT:
        return torch.float32
    return widest_dtype(args, kwargs)


def _call_cast(fn, dtype, args, kwargs):
    """``fn(*args, **kwargs)`` with their floating tensors cast to ``dtype`` (None: as given) and
    autocast off for amp's device type: what every wrapper below runs once it casts."""
    if dtype is not None:
        args, kwargs = cast_tree(args, dtype), cast_tree(kwargs, dtype)
    with torch.autocast(_amp_state.device_type or "cpu", enabled=False):
        return fn(*args, **kwargs)


def _tagged(wrapper, fn, policy: str):
    """``wrapper`` marked as amp's (the original and the policy, which unpatching and a second
    ``_wrap`` read)."""
    wrapper._amp_original = fn
    wrapper._amp_policy = policy
    return wrapper


def _wrap(fn, policy: str):
    if (
        getattr(fn, "_amp_original", None) is not None
        and getattr(fn, "_amp_policy", None) == policy
    ):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _casts_active():
            return fn(*args, **kwargs)
        return _call_cast(fn, _target_dtype(policy, args, kwargs), args, kwargs)

    return _tagged(wrapper, fn, policy)


def _banned(fn, allow: bool):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _casts_active():
            return fn(*args, **kwargs)
        if not allow:
            raise RuntimeError(BANNED_MESSAGE)
        return _call_cast(fn, torch.float32, args, kwargs)

    return _tagged(wrapper, fn, "banned")


# apex's FP32 list for losses: O1 ran them in fp32 wherever they were called (apex patched them
# globally), so a loss computed outside the model's forward on its fp16 output is still computed
# in fp32. Inside the forward autocast does the same already. (softmax and softmin are not here:
# outside the forward they run as given, so fp16 code amp does not manage, such as a .half()
# distillation teacher's attention, keeps its dtypes; see CPU_FP32_FUNCTIONS for the forward.)
FP32_FUNCTIONS = (
    "log_softmax",  # the loss pipeline's first half (nll_loss(log_softmax(out)))
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "kl_div",
    "binary_cross_entropy_with_logits",
    "poisson_nll_loss",
    "gaussian_nll_loss",
    "cosine_embedding_loss",
    "hinge_embedding_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "multilabel_soft_margin_loss",
    "multi_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "ctc_loss",
)

# What CUDA's autocast runs in fp32 (its fp32, fp32_set_opt_dtype and fp32_append_dtype lists,
# close to apex's FP32 list) and CPU autocast runs in the low dtype. For CPU models O1 wraps these
# where they live: while autocast is on (inside the forward) and no dtype= is given, they cast
# fp16/bf16 arguments to fp32, so norms, softmax, exp/log/pow/sum run fp32 on both devices;
# elsewhere they run untouched. Tensor.__rpow__ and Tensor.norm call torch.pow and torch.norm;
# F.softmin and F.normalize call the Tensor methods.
CPU_FP32_FUNCTIONS = (
    (
        torch,
        (
            "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow "
            "dist cdist pdist renorm logsumexp prod cumprod cumsum sum norm softmax log_softmax "
            "layer_norm group_norm cosine_similarity"
        ).split(),
    ),
    (
        torch.Tensor,
        (
            "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow "
            "__pow__ dist renorm logsumexp prod cumprod cumsum sum softmax log_softmax"
        ).split(),
    ),
    (torch.linalg, ("vector_norm", "matrix_norm", "norm")),
    # Not F.layer_norm, F.group_norm, F.softmax, F.log_softmax: they call torch.layer_norm,
    # torch.group_norm and the Tensor methods, wrapped above (a second wrapper would only cost).
    # F.cosine_similarity and F.pdist are torch's own builtins, bound before any patch.
    (
        torch.nn.functional,
        (
            "softplus",
            "cosine_similarity",
            "pdist",
            "interpolate",  # CUDA runs the upsample kernels in fp32
        ),
    ),
)
LOW_PRECISION = (torch.float16, torch.bfloat16)


def _has_low_precision(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype in LOW_PRECISION
    if isinstance(value, dict):
        return any(_has_low_precision(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_low_precision(v) for v in value)
    return False


def _fp32_everywhere(fn):
    """``fn`` in fp32 whenever O1 is active and an argument is fp16/bf16, inside or outside
    the forward."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        handle = _amp_state.handle
        if handle is None or not handle.is_active():
            return fn(*args, **kwargs)
        if not (_has_low_precision(args) or _has_low_precision(kwargs)):
            return fn(*args, **kwargs)
        return _call_cast(fn, torch.float32, args, kwargs)

    return _tagged(wrapper, fn, "fp32")


def _fp32_in_forward(fn):
    """``fn`` with fp16/bf16 arguments cast to fp32 while O1's casts are active (autocast on,
    casts not disabled) and no ``dtype=`` is given; untouched elsewhere."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if (
            _casts_active()
            and kwargs.get("dtype") is None
            and (_has_low_precision(args) or _has_low_precision(kwargs))
        ):
            args, kwargs = cast_tree(args, torch.float32), cast_tree(kwargs, torch.float32)
        return fn(*args, **kwargs)

    return _tagged(wrapper, fn, "fp32")


def _register(module, name: str, policy: str) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    _USER_REGISTRY.append((module, name, policy))


def register_half_function(module, name: str) -> None:
    """Run ``module.name`` in the low-precision dtype inside O1 forwards (call before
    ``amp.initialize``; no effect for O0, O2, O3)."""
    _register(module, name, HALF)


def register_float_function(module, name: str) -> None:
    """Run ``module.name`` in fp32 inside O1 forwards (call before ``amp.initialize``)."""
    _register(module, name, FLOAT)


def register_promote_function(module, name: str) -> None:
    """Run ``module.name`` in the widest dtype of its arguments inside O1 forwards."""
    _register(module, name, PROMOTE)


def half_function(fn):
    """Decorator: ``fn`` runs in the low-precision dtype inside O1 forwards."""
    return _wrap(fn, HALF)


def float_function(fn):
    """Decorator: ``fn`` runs in fp32 inside O1 forwards."""
    return _wrap(fn, FLOAT)


def promote_function(fn):
    """Decorator: ``fn`` runs in the widest dtype of its arguments inside O1 forwards."""
    return _wrap(fn, PROMOTE)


class AmpHandle:
    """apex's handle (``_amp_state.handle``) for O1: whether casts are active, and the patches
    it made (restored by ``_deactivate``)."""

    def __init__(self, loss_scale="dynamic", enable_caching=True, verbose=False):
        self._enable_caching = enable_caching
        self._verbose = verbose
        self._cache: dict = {}
        self._default_scaler_spec = loss_scale
        self._is_active = True
        self._all_wrappers: list[tuple[object, str, object]] = []

    def is_active(self) -> bool:
        return self._is_active

    def _disable_casts(self):
        from .handle import disable_casts

        return disable_casts()

    def wrap_optimizer(self, optimizer, num_loss=1):
        raise RuntimeError(
            "The old Amp API (amp_handle.wrap_optimizer) is not supported: use "
            "`model, optimizer = amp.initialize(model, optimizer, opt_level='O1')` and "
            "`with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`."
        )

    def scale_loss(self, loss, optimizer, **kwargs):
        """The old handle API: ``amp.scale_loss`` once ``amp.initialize`` has run."""
        if getattr(_amp_state, "opt_properties", None) is None:
            raise RuntimeError(
                "amp_handle.scale_loss needs amp.initialize: call `model, optimizer = "
                "amp.initialize(model, optimizer, opt_level='O1')`, then use "
                "`with amp.scale_loss(loss, optimizer) as scaled_loss`."
            )
        from .handle import scale_loss

        return scale_loss(loss, optimizer, **kwargs)

    def _clear_cache(self) -> None:
        self._cache.clear()

    def _save_func(self, mod, fn, func) -> None:
        self._all_wrappers.append((mod, fn, func))

    def _deactivate(self) -> None:
        for mod, name, original in reversed(self._all_wrappers):
            if original is _INHERITED:
                delattr(mod, name)  # a torch.Tensor method that lives on its C base class
            else:
                setattr(mod, name, original)
        self._all_wrappers = []
        self._is_active = False

    @property
    def has_cache(self) -> bool:
        return self._enable_caching

    @property
    def cache(self) -> dict:
        return self._cache

    def remove_cache(self, param) -> None:
        if self.has_cache and param in self.cache:
            del self.cache[param]

    @property
    def verbose(self) -> bool:
        return self._verbose


class NoOpHandle:
    def is_active(self) -> bool:
        return False

    def _disable_casts(self):
        from .handle import disable_casts

        return disable_casts()

    def wrap_optimizer(self, optimizer, num_loss=1):
        return optimizer

    def _clear_cache(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass

    @property
    def has_cache(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return False


_INHERITED = object()  # _deactivate deletes the patch: the original is found on a base class


def _patch(handle: AmpHandle, module, name: str, new) -> None:
    original = getattr(module, name)
    if isinstance(module, type) and name not in vars(module):
        original = _INHERITED
    handle._save_func(module, name, original)
    setattr(module, name, new)


def init(
    enabled=True, loss_scale="dynamic", enable_caching=True, verbose=False, allow_banned=False
):
    """Set up O1's function patches (``amp.initialize`` calls it for O1); returns the handle.

    Applies and clears the functions registered with ``register_*_function``; refuses
    ``F.binary_cross_entropy`` inside O1 forwards unless ``allow_banned``.
    """
    if isinstance(_amp_state.handle, AmpHandle):
        _amp_state.handle._deactivate()
    if not enabled:
        handle = NoOpHandle()
        _amp_state.handle = handle
        _USER_REGISTRY.clear()
        return handle
    handle = AmpHandle(loss_scale, enable_caching, verbose)
    registered = {(id(m), n) for m, n, _ in _USER_REGISTRY}
    bce = (id(torch.nn.functional), "binary_cross_entropy")
    if bce not in registered:
        fn = torch.nn.functional.binary_cross_entropy
        _patch(handle, torch.nn.functional, "binary_cross_entropy", _banned(fn, allow_banned))
    functional = torch.nn.functional
    for name in FP32_FUNCTIONS:
        if hasattr(functional, name) and (id(functional), name) not in registered:
            fn = getattr(functional, name)
            _patch(handle, functional, name, _fp32_everywhere(getattr(fn, "_amp_original", fn)))
    if _amp_state.device_type == "cpu":
        for module, names in CPU_FP32_FUNCTIONS:
            for name in names:
                if hasattr(module, name) and (id(module), name) not in registered:
                    fn = getattr(module, name)
                    fn = getattr(fn, "_amp_original", fn)
                    _patch(handle, module, name, _fp32_in_forward(fn))
    for module, name, policy in _USER_REGISTRY:
        original = getattr(module, name)
        original = getattr(original, "_amp_original", original)
        _patch(handle, module, name, _wrap(original, policy))
        if verbose:
            logger.info("amp: %s.%s runs as %s", getattr(module, "__name__", module), name, policy)
    _USER_REGISTRY.clear()
    _amp_state.handle = handle
    return handle
