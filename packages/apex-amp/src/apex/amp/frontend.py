"""``amp.initialize``, ``amp.state_dict``, ``amp.load_state_dict``.

How the low-precision dtype is chosen (first that applies):

1. ``cast_model_type=torch.float16`` or ``torch.bfloat16`` (O2, O3 override);
2. ``low_precision_dtype=`` (an argument apex lacks; torch.float16 or torch.bfloat16);
3. the environment variable ``APEX_AMP_DTYPE`` (``fp16``/``float16`` or ``bf16``/``bfloat16``);
4. the models' device: fp16 on CUDA (apex's behaviour), bf16 on CPU.

With bf16, opt levels whose table says ``loss_scale="dynamic"`` (O1, O2) use a static scale of
1.0: bf16 has fp32's range, so there is nothing to scale and no overflow to check. An explicit
``loss_scale`` still applies.
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from collections import OrderedDict

import torch
from torch import nn

from ._amp_state import _amp_state, logger, maybe_print, warn_or_err
from ._casting import cast_tree
from ._process_optimizer import MASTERS, PENDING, pending, process_optimizer
from ._properties import DESCRIPTIONS, opt_level_properties
from .scaler import LossScaler

_DTYPE_NAMES = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def _as_list(value, what: str, check) -> tuple[list, bool]:
    if isinstance(value, list):
        items = value
        was_list = True
    elif isinstance(value, tuple):
        raise TypeError(
            f"amp.initialize takes {what} as one object or a list, not a tuple: pass "
            f"list({what}) instead."
        )
    else:
        items = [value]
        was_list = False
    for item in items:
        check(item)
    return items, was_list


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"amp.initialize expected a torch.nn.Module or a list of them, got "
            f"{type(model).__name__}"
        )
    parallel = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    if isinstance(model, parallel) or type(model).__name__ == "DistributedDataParallel":
        warn_or_err(
            "Incoming model is an instance of torch.nn.parallel.DistributedDataParallel (or "
            "DataParallel, or apex's DistributedDataParallel). Parallel wrappers should only "
            "be applied to the model(s) AFTER the model(s) have been returned from "
            "amp.initialize."
        )


def _check_optimizer(optimizer) -> None:
    if type(optimizer).__name__ == "FP16_Optimizer":
        raise RuntimeError(
            "An incoming optimizer is an instance of apex.fp16_utils.FP16_Optimizer. amp "
            "manages master weights and loss scaling itself: pass the plain optimizer "
            "(torch.optim, apex.optimizers or LARC) to amp.initialize."
        )
    if not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "step")):
        raise TypeError(
            "amp.initialize expected optimizers as torch.optim.Optimizer (or apex.optimizers, "
            f"or apex.parallel.LARC) objects or a list of them, got {type(optimizer).__name__}"
        )


def _model_device_type(models: list) -> str:
    types = set()
    for model in models:
        for t in list(model.parameters()) + list(model.buffers()):
            types.add(t.device.type)
    if len(types) > 1:
        raise RuntimeError(
            f"amp.initialize found params and buffers on several device types ({sorted(types)}):"
            " move every model to one device (model.to('cuda') or model.to('cpu')) first."
        )
    if types:
        return types.pop()
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_incoming_dtypes(models: list) -> None:
    """Refuse fp16/bf16 params and buffers, as apex refused half ones. float64 passes (a
    diffusion schedule's ``betas`` buffer): O0 casts it to fp32 and O2/O3 to the low dtype with
    the rest of the model, as apex's ``model.to``/``convert_network`` did; O1 leaves it."""
    if _amp_state.allow_incoming_model_not_fp32:
        return
    for model in models:
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.dtype in (torch.float16, torch.bfloat16):
                warn_or_err(
                    f"Found param or buffer {name} with type {t.dtype}, expected "
                    "torch.float32. When using amp.initialize, you do not need to call .half() "
                    "or .bfloat16() on your model before passing it, no matter what "
                    "optimization level you choose."
                )


def _low_precision_supported(dtype: torch.dtype, device_type: str) -> bool:
    if device_type == "cuda":
        if dtype == torch.bfloat16:
            return torch.cuda.is_bf16_supported()
        return True
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        torch.mm(a, a)
        # Older torch warns "...not supported. Disabling autocast." instead of raising.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast(device_type, dtype=dtype):
                pass
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return not any("not supported" in str(w.message) for w in caught)


def choose_low_precision(cast_model_type, low_precision_dtype, device_type: str) -> torch.dtype:
    """The low-precision dtype for this run (the order the module docstring gives)."""
    low = (torch.float16, torch.bfloat16)
    if low_precision_dtype is not None and low_precision_dtype not in low:
        raise ValueError(
            f"low_precision_dtype must be torch.float16 or torch.bfloat16, got "
            f"{low_precision_dtype!r}"
        )
    if cast_model_type in low:
        if low_precision_dtype is not None and low_precision_dtype != cast_model_type:
            raise ValueError(
                f"cast_model_type={cast_model_type} contradicts "
                f"low_precision_dtype={low_precision_dtype}: pass one of them."
            )
        chosen, source = cast_model_type, "cast_model_type"
    elif low_precision_dtype is not None:
        chosen, source = low_precision_dtype, "low_precision_dtype"
    elif os.environ.get("APEX_AMP_DTYPE"):
        name = os.environ["APEX_AMP_DTYPE"].strip().lower()
        if name not in _DTYPE_NAMES:
            raise ValueError(
                f"APEX_AMP_DTYPE={os.environ['APEX_AMP_DTYPE']!r} is not a low-precision dtype: "
                "use fp16 or bf16."
            )
        chosen, source = _DTYPE_NAMES[name], "APEX_AMP_DTYPE"
    else:
        chosen = torch.float16 if device_type == "cuda" else torch.bfloat16
        source = f"the default for {device_type}"
    if not _low_precision_supported(chosen, device_type):
        other = "bf16" if chosen == torch.float16 else "fp16"
        raise RuntimeError(
            f"amp: {chosen} (from {source}) is not supported for models on {device_type} on this "
            f"machine (torch {torch.__version__}). Choose {other} with "
            f"low_precision_dtype=torch.{'bfloat16' if other == 'bf16' else 'float16'} (or "
            f"APEX_AMP_DTYPE={other}), or move the model to a GPU that supports it."
        )
    return chosen


# ---- models -------------------------------------------------------------------------------------


def _patch_forward(model: nn.Module, input_dtype, output_dtype, autocast) -> None:
    """Replace ``model.forward`` by a method bound to the model (so ``copy.deepcopy`` rebinds
    it to the copy) that casts inputs, runs the original (under autocast for O1) and casts
    outputs."""
    previous = model.__dict__.get("forward")
    if previous is None:
        original = type(model).forward
    elif isinstance(previous, types.MethodType) and previous.__self__ is model:
        original = previous.__func__
    else:

        def original(self, *args, **kwargs):
            return previous(*args, **kwargs)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if input_dtype is not None:
            args = cast_tree(args, input_dtype)
            kwargs = cast_tree(kwargs, input_dtype)
        if autocast is not None:
            device_type, dtype = autocast
            handle = _amp_state.handle
            active = handle is None or handle.is_active()
            with torch.autocast(device_type, dtype=dtype, enabled=active):
                output = original(self, *args, **kwargs)
        else:
            output = original(self, *args, **kwargs)
        if output_dtype is not None:
            output = cast_tree(output, output_dtype)
        return output

    model.forward = types.MethodType(forward, model)


def _fp32_state_dict_hook(module, state_dict, prefix, local_metadata):
    """O2/O3 models save fp32: a param's fp32 master where it has one, else the value cast."""
    # remove_duplicate=False: each key of a tied param gets the master, not only the first.
    for name, param in module.named_parameters(remove_duplicate=False):
        master = MASTERS.get(param)
        if master is None:
            master = pending(param)  # loaded, masters not made yet, param untouched since
        if master is not None and prefix + name in state_dict:
            state_dict[prefix + name] = master.detach()
    for key, value in state_dict.items():
        if key.startswith(prefix) and isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.dtype != torch.float32:
                state_dict[key] = value.float()


def _load_masters_hook(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
):
    """Registered on every submodule of an O2 model (with_module=True: torch passes the module
    the state is loaded into, so a ``copy.deepcopy`` of the model loads into its own params, not
    the original's). The values loaded into ``module``'s own low-precision params go to their
    masters (or wait for them, made at the first backward): fp32 values as they are, fp16/bf16
    ones widened, so a param loaded after its master exists is not overwritten by the stale
    master at the next step."""
    with torch.no_grad():
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if param.dtype == torch.float32:
                continue
            value = state_dict.get(prefix + name)
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                continue
            if value.shape != param.shape:
                continue  # torch reports the mismatch
            master = MASTERS.get(param)
            if master is not None:
                master.copy_(value)
            else:
                # Its version is taken once the load has written the param (_loaded_hook).
                PENDING[param] = (value.detach().to(torch.float32, copy=True), None)


def _loaded_hook(module, incompatible_keys):
    """After a load into ``module``: the version of each of its own params that got a pending
    value, so that a later write into the param (an EMA update of a deep-copied model) makes the
    pending value stale rather than what the param saves or trains from."""
    for param in module.parameters(recurse=False):
        entry = PENDING.get(param)
        if entry is not None and entry[1] is None:
            PENDING[param] = (entry[0], param._version)


def _cast_model(model: nn.Module, props, low: torch.dtype, device_type: str) -> None:
    cast = props.cast_model_type
    if cast is not None:
        if props.keep_batchnorm_fp32:
            from apex.fp16_utils import convert_network

            convert_network(model, cast)
        else:
            model.to(cast)
    if cast is not None:
        # As apex, at every level that casts the model (O0's fp32 too): inputs to its dtype,
        # outputs to fp32.
        output_dtype = props_cast_outputs(props) or torch.float32
        _patch_forward(model, cast, output_dtype, None)
        if cast != torch.float32:
            model._register_state_dict_hook(_fp32_state_dict_hook)
            if props.master_weights:
                # On every submodule: model.backbone.load_state_dict(...) restores masters too.
                # The private form with with_module=True exists on every torch this package
                # supports (2.3+).
                for module in model.modules():
                    module._register_load_state_dict_pre_hook(_load_masters_hook, with_module=True)
                    module.register_load_state_dict_post_hook(_loaded_hook)
    elif props.patch_torch_functions:
        _patch_forward(model, None, props_cast_outputs(props), (device_type, low))
    elif props_cast_outputs(props) is not None:
        _patch_forward(model, None, props_cast_outputs(props), None)


def props_cast_outputs(props):
    return getattr(props, "_cast_model_outputs", None)


# ---- initialize ---------------------------------------------------------------------------------


def reset() -> None:
    """Forget a previous ``amp.initialize`` (extension, for tests and notebooks): restores the
    functions O1 patched. Models and optimizers already initialized stay as they are; build
    fresh ones before initializing again."""
    handle = _amp_state.handle
    if handle is not None:
        handle._deactivate()
    _amp_state.reset()


def initialize(
    models,
    optimizers=None,
    enabled=True,
    opt_level="O1",
    cast_model_type=None,
    patch_torch_functions=None,
    keep_batchnorm_fp32=None,
    master_weights=None,
    loss_scale=None,
    cast_model_outputs=None,
    num_losses=1,
    verbosity=1,
    min_loss_scale=None,
    max_loss_scale=2.0**24,
    *,
    low_precision_dtype=None,
    hysteresis=1,
    scale_window=2000,
):
    """Prepare models and optimizers for mixed precision at ``opt_level`` (O0-O3), apex's
    signature; returns them in the shape they came in (one or a list each; models alone when
    ``optimizers`` is None).

    Arguments beyond apex (keyword-only): ``low_precision_dtype`` (torch.float16 or
    torch.bfloat16, see the module docstring for the default), ``hysteresis`` (overflowing steps
    in a row before the dynamic scale backs off; 1 is apex's behaviour) and ``scale_window``
    (clean steps before it grows; apex's 2000). ``min_loss_scale`` None means a floor of 1.0.
    """
    _amp_state.verbosity = verbosity
    if not enabled:
        from ._properties import Properties

        _amp_state.opt_properties = Properties()
        return models if optimizers is None else (models, optimizers)

    # A second call starts over, as apex's did (a new Trainer per fold or sweep in one process):
    # once its models and optimizers are processed, the loss scalers, properties and O1's patches
    # of the first call are replaced; the first call's optimizers still work with scale_loss, as
    # in apex. Optimizers that went through a call before are refused below.
    restart = _amp_state.initialized
    if not torch.backends.cudnn.enabled:
        raise RuntimeError(
            "Amp requires torch.backends.cudnn.enabled = True: set it before amp.initialize."
        )
    # Validates opt_level first, with apex's message.
    opt_level_properties(opt_level, torch.float16)
    if not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"num_losses must be a positive int, got {num_losses!r}")
    if cast_model_outputs is not None and not (
        isinstance(cast_model_outputs, torch.dtype) and cast_model_outputs.is_floating_point
    ):
        raise TypeError(
            f"cast_model_outputs must be a floating-point torch.dtype or None, got "
            f"{cast_model_outputs!r}"
        )

    model_list, models_was_list = _as_list(models, "models", _check_model)
    if optimizers is None:
        opt_list, opts_was_list = [], False
    else:
        opt_list, opts_was_list = _as_list(optimizers, "optimizers", _check_optimizer)
    if len({id(o) for o in opt_list}) != len(opt_list):
        raise RuntimeError(
            "A given optimizer should only be passed through amp.initialize once: the list "
            "holds the same optimizer twice."
        )
    for opt in opt_list:
        if hasattr(opt, "_amp_stash"):
            raise RuntimeError(
                "A given optimizer should only be passed through amp.initialize once: this "
                "one already went through it (it has _amp_stash)."
            )

    device_type = _model_device_type(model_list)
    _check_incoming_dtypes(model_list)
    low = choose_low_precision(cast_model_type, low_precision_dtype, device_type)
    props = opt_level_properties(opt_level, low)

    if opt_level == "O1":
        for name, value in (
            ("cast_model_type", cast_model_type),
            ("keep_batchnorm_fp32", keep_batchnorm_fp32),
            ("master_weights", master_weights),
        ):
            if value is not None:
                warn_or_err(
                    f"{name}={value!r} was given with opt_level='O1'. O1 inserts casts around "
                    "Torch functions rather than model weights, so with O1 the model weights "
                    "themselves should remain FP32. To cast the model to a different type, use "
                    "opt_level='O2' or 'O3'."
                )
    elif patch_torch_functions:
        warn_or_err(
            f"patch_torch_functions=True was given with opt_level={opt_level!r}: only O1 "
            "patches Torch functions. Use opt_level='O1' for function casting."
        )
    overrides = {
        "cast_model_type": cast_model_type,
        "patch_torch_functions": patch_torch_functions,
        "keep_batchnorm_fp32": keep_batchnorm_fp32,
        "master_weights": master_weights,
        "loss_scale": loss_scale,
    }
    for name, value in overrides.items():
        if value is not None:
            setattr(props, name, value)
    props._cast_model_outputs = cast_model_outputs

    maybe_print(f"Selected optimization level {opt_level}:  {DESCRIPTIONS[opt_level]}", True)
    maybe_print(f"Low-precision dtype: {low}", True)
    maybe_print("Defaults for this optimization level are:", True)
    for k, v in opt_level_properties(opt_level, low).options.items():
        maybe_print(f"{k:22} : {v}", True)
    maybe_print("Processing user overrides (additional kwargs that are not None)...", True)
    maybe_print("After processing overrides, optimization options are:", True)
    for k, v in props.options.items():
        maybe_print(f"{k:22} : {v}", True)

    device = _scaler_device(model_list, device_type)
    scalers = [
        LossScaler(
            props.loss_scale,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            scale_window=scale_window,
            hysteresis=hysteresis,
            device=device,
        )
        for _ in range(num_losses)
    ]

    for model in model_list:
        _cast_model(model, props, low, device_type)
    for opt in opt_list:
        process_optimizer(opt, props)
        if props.cast_model_type not in (None, torch.float32) and len(opt.state) > 0:
            # Recast existing optimizer state to the new param dtypes, as apex does.
            opt.load_state_dict(opt.state_dict())

    if restart:
        # Only now, with this call's models and optimizers processed: a call that fails on the
        # way leaves the earlier one in place.
        logger.info("amp.initialize called again: starting over with the new models and optimizers")
        reset()
    _amp_state.opt_properties = props
    _amp_state.loss_scalers = scalers
    _amp_state.min_loss_scale = min_loss_scale
    _amp_state.max_loss_scale = max_loss_scale
    _amp_state.low_precision_dtype = low
    _amp_state.device_type = device_type
    _amp_state.optimizers = list(opt_list)
    _amp_state.models = list(model_list)
    _amp_state.initialized = True

    if props.patch_torch_functions:
        from .amp import init

        init(loss_scale=props.loss_scale, verbose=verbosity == 2)

    if optimizers is None:
        return model_list if models_was_list else model_list[0]
    out_models = model_list if models_was_list else model_list[0]
    out_opts = opt_list if opts_was_list else opt_list[0]
    return out_models, out_opts


def _scaler_device(models: list, device_type: str) -> torch.device:
    for model in models:
        for p in model.parameters():
            return p.device
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


# ---- checkpoints --------------------------------------------------------------------------------


def state_dict(destination=None):
    """The loss scalers' state: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int},
    ...}`` (plus ``"hysteresis_left"`` where hysteresis > 1)."""
    if destination is None:
        destination = OrderedDict()
    for idx, scaler in enumerate(_amp_state.loss_scalers):
        entry = {"loss_scale": scaler.loss_scale(), "unskipped": scaler._unskipped}
        if scaler._hysteresis > 1:
            entry["hysteresis_left"] = scaler._hysteresis_left
        destination[f"loss_scaler{idx}"] = entry
    return destination


def load_state_dict(state_dict) -> None:
    """Restore the loss scalers from ``amp.state_dict()`` (call after amp.initialize). A scale
    of 1.0 loaded into a dynamic scaler (a bf16 run's state into an fp16 run) is logged as a
    warning: the scale restarts there."""
    if not _amp_state.loss_scalers:
        raise RuntimeError(
            "amp.load_state_dict needs amp.initialize first: it restores the loss scalers "
            "initialize makes. Call amp.initialize(...), then amp.load_state_dict(...)."
        )
    unexpected = [k for k in state_dict if "loss_scaler" not in k]
    if unexpected:
        raise RuntimeError(
            f"Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
            f"{', '.join(repr(k) for k in unexpected)}. amp.load_state_dict takes what "
            "amp.state_dict() returned (keys loss_scaler0, loss_scaler1, ...)."
        )
    count = len(_amp_state.loss_scalers)
    if len(state_dict) != count:
        logger.warning(
            "Warning: state_dict contains %d entries, while %d loss_scalers are used",
            len(state_dict),
            count,
        )
    for key, entry in state_dict.items():
        try:
            idx = int(key.replace("loss_scaler", ""))
        except ValueError:
            raise RuntimeError(f"amp.load_state_dict: malformed key {key!r}") from None
        if idx >= count:
            continue
        scaler = _amp_state.loss_scalers[idx]
        loaded = float(entry["loss_scale"])
        if scaler.dynamic and loaded <= 1.0 < scaler._loss_scale:
            # A bf16 run's static 1.0 (or an fp16 run stuck at its floor): the dynamic scale
            # restarts there and needs log2(scale) x scale_window clean steps to grow back.
            logger.warning(
                "amp.load_state_dict: %s holds a loss scale of %s, loaded into a dynamic loss "
                "scaler (fresh scale %s). If the checkpoint comes from a run without loss "
                "scaling (bf16, or a static scale of 1.0), do not restore its amp state into "
                "this fp16 run: the scale would take %d clean steps per doubling to grow back.",
                key,
                loaded,
                scaler._loss_scale,
                scaler._scale_seq_len,
            )
        scaler._loss_scale = loaded
        scaler._unskipped = int(entry["unskipped"])
        if "hysteresis_left" in entry:
            scaler._hysteresis_left = int(entry["hysteresis_left"])
