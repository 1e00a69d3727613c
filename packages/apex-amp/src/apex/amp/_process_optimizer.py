"""What ``initialize`` does to each optimizer: ``optimizer._amp_stash`` and apex's bound methods
(``_lazy_init_maybe_master_weights``, ``_prepare_amp_backward``, ``_post_amp_backward``,
``_master_params_to_model_params``), and, with master weights, patched ``step``, ``zero_grad``
and ``add_param_group``.

Works on torch optimizers, apex.optimizers and anything shaped like apex's LARC (an object with
``optim``, ``param_groups`` and ``step``): nothing here checks a class.

Master weights (O2): at the first backward (or ``_lazy_init_maybe_master_weights``) each fp16 or
bf16 param in ``param_groups`` is replaced by an fp32 copy, so the optimizer, its state and its
``state_dict`` hold fp32; after ``step`` the masters are copied back into the model with
``multi_tensor_scale`` (one launch per device and dtype group).
"""

from __future__ import annotations

import types

import torch
from torch.utils.weak import WeakIdKeyDictionary

from apex.multi_tensor_apply import ops

LOW_PRECISION = (torch.float16, torch.bfloat16)

# Model param -> its fp32 master, for the model's state_dict hooks (O2 checkpoints hold the
# masters' exact values, and loading one restores them).
MASTERS = WeakIdKeyDictionary()
# Model param -> fp32 value loaded from a checkpoint before its master existed.
PENDING = WeakIdKeyDictionary()


class AmpOptimizerState:
    """``optimizer._amp_stash``: apex's attribute names."""

    def __init__(self) -> None:
        self.lazy_init_called = False
        self.already_patched = False
        self.params_have_scaled_gradients = False
        self.multi_tensor_scale = ops.multi_tensor_scale
        self.multi_tensor_l2norm = ops.multi_tensor_l2norm
        self.dummy_overflow_buf = None


def _by_device(*lists):
    groups: dict = {}
    for items in zip(*lists):
        dst = groups.setdefault(items[0].device, tuple([] for _ in lists))
        for d, x in zip(dst, items):
            d.append(x)
    return groups


@torch.no_grad()
def _copy(src: list, dst: list, flags: dict) -> None:
    """dst[i] = src[i] (dtype-converting), through multi_tensor_scale."""
    for device, (s, d) in _by_device(src, dst).items():
        flag = flags.get(device)
        if flag is None:
            flag = flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
        ops.multi_tensor_scale(s, d, flag, 1.0)


def _flags(stash) -> dict:
    flags = getattr(stash, "_flags", None)
    if flags is None:
        flags = stash._flags = {}
    return flags


def _is_fused_sgd(optimizer) -> bool:
    # apex-optim's FusedSGD reads the stash itself and writes the model params in its kernel.
    return hasattr(optimizer, "_step_amp_stash")


# ---- with master weights ------------------------------------------------------------------------


def _master_for(param: torch.Tensor) -> torch.Tensor:
    loaded = PENDING.pop(param, None)
    if loaded is not None and loaded.shape == param.shape:
        master = loaded.to(param.device, torch.float32, copy=True)
    else:
        master = param.detach().clone().float()
    MASTERS[param] = master
    master.requires_grad_(param.requires_grad)
    if hasattr(param, "shared"):  # apex's attribute for params shared across models
        master.shared = param.shared
    return master


def _rebuild_flat_lists(stash) -> None:
    stash.all_fp16_params = [p for g in stash.fp16_groups for p in g]
    stash.all_fp32_from_fp16_params = [p for g in stash.fp32_from_fp16_groups for p in g]
    stash.all_fp32_from_fp32_params = [p for g in stash.fp32_from_fp32_groups for p in g]
    stash.all_fp32_from_fp16_grad_stash = [None] * len(stash.all_fp32_from_fp16_params)
    stash.all_fp32_from_fp32_grad_stash = [None] * len(stash.all_fp32_from_fp32_params)


def _split_group(optimizer, group: dict):
    """Replace ``group``'s low-precision params by fp32 masters (moving their state); returns
    (model params, their masters, fp32 params)."""
    fp16, masters, fp32 = [], [], []
    for i, param in enumerate(group["params"]):
        if not param.requires_grad:
            continue
        if param.dtype in LOW_PRECISION:
            master = _master_for(param)
            group["params"][i] = master
            fp16.append(param)
            masters.append(master)
            if param in optimizer.state:
                optimizer.state[master] = optimizer.state.pop(param)
        elif param.dtype == torch.float32:
            fp32.append(param)
        else:
            raise TypeError(
                "amp with master weights handles float16, bfloat16 and float32 params; "
                f"got a param of dtype {param.dtype} (shape {tuple(param.shape)})"
            )
    return fp16, masters, fp32


def lazy_init_with_master_weights(self) -> None:
    stash = self._amp_stash
    if stash.lazy_init_called:
        return
    stash.fp16_groups, stash.fp32_from_fp16_groups, stash.fp32_from_fp32_groups = [], [], []
    for group in self.param_groups:
        fp16, masters, fp32 = _split_group(self, group)
        stash.fp16_groups.append(fp16)
        stash.fp32_from_fp16_groups.append(masters)
        stash.fp32_from_fp32_groups.append(fp32)
    _rebuild_flat_lists(stash)
    stash.lazy_init_called = True
    # Recast existing state (momenta...) to the masters' dtype, as apex does.
    if any(stash.fp16_groups) and len(self.state) > 0:
        self.load_state_dict(self.state_dict())


def prepare_backward_with_master_weights(self) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    for i, master in enumerate(stash.all_fp32_from_fp16_params):
        stash.all_fp32_from_fp16_grad_stash[i] = master.grad
        master.grad = None  # the unscale writes it afresh
    for i, param in enumerate(stash.all_fp32_from_fp32_params):
        stash.all_fp32_from_fp32_grad_stash[i] = param.grad
        param.grad = None  # so backward writes the new grads alone (no accumulation)
    for param in stash.all_fp16_params:
        param.grad = None


def post_backward_with_master_weights(self, scaler) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    plain_src, plain_dst = [], []
    acc_src, acc_stash, acc_dst = [], [], []
    pairs = zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params)
    for i, (model, master) in enumerate(pairs):
        stashed = stash.all_fp32_from_fp16_grad_stash[i]
        if stashed is None:
            # Unprepared (after delay_unscale): the master grad already holds unscaled grads.
            stashed = master.grad
        if model.grad is None:
            master.grad = stashed
            continue
        if stashed is None:
            master.grad = torch.empty_like(master)
            plain_src.append(model.grad)
            plain_dst.append(master.grad)
        else:
            master.grad = stashed
            acc_src.append(model.grad)
            acc_stash.append(stashed)
            acc_dst.append(stashed)
    for i, param in enumerate(stash.all_fp32_from_fp32_params):
        stashed = stash.all_fp32_from_fp32_grad_stash[i]
        if param.grad is None:
            param.grad = stashed
        elif stashed is None:
            plain_src.append(param.grad)
            plain_dst.append(param.grad)
        else:
            acc_src.append(param.grad)
            acc_stash.append(stashed)
            acc_dst.append(param.grad)
    if plain_src:
        scaler.unscale(plain_src, plain_dst, scaler.loss_scale(), models_are_masters=False)
    if acc_src:
        scaler.unscale_with_stashed(acc_src, acc_stash, acc_dst)
    for param in stash.all_fp16_params:
        param.grad = None
    stash.all_fp32_from_fp16_grad_stash = [None] * len(stash.all_fp32_from_fp16_params)
    stash.all_fp32_from_fp32_grad_stash = [None] * len(stash.all_fp32_from_fp32_params)


def master_params_to_model_params(self) -> None:
    stash = self._amp_stash
    if stash.lazy_init_called and stash.all_fp16_params:
        _copy(stash.all_fp32_from_fp16_params, stash.all_fp16_params, _flags(stash))


# ---- without master weights ---------------------------------------------------------------------


def lazy_init_no_master_weights(self) -> None:
    stash = self._amp_stash
    if stash.lazy_init_called:
        return
    params = [p for g in self.param_groups for p in g["params"]]
    stash.all_fp16_params = [p for p in params if p.dtype in LOW_PRECISION]
    stash.all_fp32_params = [p for p in params if p.dtype not in LOW_PRECISION]
    stash.all_fp16_grad_stash = [None] * len(stash.all_fp16_params)
    stash.all_fp32_grad_stash = [None] * len(stash.all_fp32_params)
    stash.lazy_init_called = True


def _no_master_lists(stash):
    return (
        (stash.all_fp16_params, stash.all_fp16_grad_stash),
        (stash.all_fp32_params, stash.all_fp32_grad_stash),
    )


def prepare_backward_no_master_weights(self) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    for params, grad_stash in _no_master_lists(stash):
        for i, param in enumerate(params):
            grad_stash[i] = param.grad
            param.grad = None


def post_backward_no_master_weights(self, scaler) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    plain = []
    acc_src, acc_stash = [], []
    for params, grad_stash in _no_master_lists(stash):
        for i, param in enumerate(params):
            stashed = grad_stash[i]
            grad_stash[i] = None
            if param.grad is None:
                param.grad = stashed
            elif stashed is None:
                plain.append(param.grad)
            else:
                acc_src.append(param.grad)
                acc_stash.append(stashed)
    if plain:
        scaler.unscale(plain, plain, scaler.loss_scale(), models_are_masters=True)
    if acc_src:
        scaler.unscale_with_stashed(acc_src, acc_stash, acc_src)


# ---- patching -----------------------------------------------------------------------------------


CLOSURE_MESSAGE = (
    "Currently, Amp does not support closure use with optimizers: call loss.backward() inside "
    "`with amp.scale_loss(loss, optimizer)`, then optimizer.step() without a closure."
)


def _patch_master_step(optimizer) -> None:
    old_step = optimizer.step
    writes_models = _is_fused_sgd(optimizer)

    def step(self, closure=None):
        if closure is not None:
            raise RuntimeError(CLOSURE_MESSAGE)
        stash = self._amp_stash
        self._amp_lazy_init()
        result = old_step()
        if not writes_models:
            self._master_params_to_model_params()
        # The master grads are done with; the next backward writes them afresh.
        for master in stash.all_fp32_from_fp16_params:
            master.grad = None
        return result

    optimizer.step = types.MethodType(step, optimizer)


def _patch_master_zero_grad(optimizer) -> None:
    def zero_grad(self, set_to_none: bool = True):
        stash = self._amp_stash
        self._amp_lazy_init()
        for param in stash.all_fp16_params:
            param.grad = None
        for master in stash.all_fp32_from_fp16_params:
            master.grad = None
        for param in stash.all_fp32_from_fp32_params:
            if set_to_none or param.grad is None:
                param.grad = None
            else:
                if param.grad.grad_fn is not None:
                    param.grad.detach_()
                else:
                    param.grad.requires_grad_(False)
                param.grad.zero_()
        stash.all_fp32_from_fp16_grad_stash = [None] * len(stash.all_fp32_from_fp16_params)
        stash.all_fp32_from_fp32_grad_stash = [None] * len(stash.all_fp32_from_fp32_params)
        stash.params_have_scaled_gradients = False

    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)


def _patch_master_load_state_dict(optimizer) -> None:
    """Masters first, so a checkpoint's fp32 state lands on fp32 params (torch optimizers cast
    loaded state to their params' dtype)."""
    old_load = optimizer.load_state_dict

    def load_state_dict(self, state_dict):
        self._amp_lazy_init()
        return old_load(state_dict)

    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)


def _patch_add_param_group(optimizer, master_weights: bool) -> None:
    old_add = getattr(optimizer, "add_param_group", None)
    if old_add is None:
        return

    def add_param_group(self, new_group):
        stash = self._amp_stash
        if not stash.lazy_init_called:
            old_add(new_group)
            return
        if not master_weights:
            old_add(new_group)
            stash.lazy_init_called = False
            self._amp_lazy_init()
            return
        group = dict(new_group)
        params = group["params"]
        group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        fp16, masters, fp32 = [], [], []
        new_params = []
        for param in group["params"]:
            if param.dtype in LOW_PRECISION and param.requires_grad:
                master = _master_for(param)
                fp16.append(param)
                masters.append(master)
                new_params.append(master)
            else:
                if param.requires_grad:
                    fp32.append(param)
                new_params.append(param)
        group["params"] = new_params
        old_add(group)
        stash.fp16_groups.append(fp16)
        stash.fp32_from_fp16_groups.append(masters)
        stash.fp32_from_fp32_groups.append(fp32)
        _rebuild_flat_lists(stash)

    optimizer.add_param_group = types.MethodType(add_param_group, optimizer)


def process_optimizer(optimizer, properties) -> None:
    """Attach ``_amp_stash`` and apex's methods to ``optimizer``."""
    if hasattr(optimizer, "_amp_stash"):
        raise RuntimeError(
            "A given optimizer should only be passed through amp.initialize once: this one "
            "already has _amp_stash. Pass each optimizer to a single amp.initialize call."
        )
    optimizer._amp_stash = AmpOptimizerState()
    bind = types.MethodType
    if properties.master_weights:
        if _is_fused_sgd(optimizer) and not getattr(optimizer, "materialize_master_grads", True):
            # amp always unscales into fp32 master grads and clears the fp16 model grads; a
            # FusedSGD left reading the model grads would skip every fp16 param (README).
            optimizer.materialize_master_grads = True
        optimizer._lazy_init_maybe_master_weights = bind(lazy_init_with_master_weights, optimizer)
        optimizer._master_params_to_model_params = bind(master_params_to_model_params, optimizer)
        optimizer._prepare_amp_backward = bind(prepare_backward_with_master_weights, optimizer)
        optimizer._post_amp_backward = bind(post_backward_with_master_weights, optimizer)
        optimizer._amp_lazy_init = optimizer._lazy_init_maybe_master_weights
        _patch_master_step(optimizer)
        _patch_master_zero_grad(optimizer)
        _patch_master_load_state_dict(optimizer)
    else:
        optimizer._lazy_init_maybe_master_weights = bind(lazy_init_no_master_weights, optimizer)
        optimizer._prepare_amp_backward = bind(prepare_backward_no_master_weights, optimizer)
        optimizer._post_amp_backward = bind(post_backward_no_master_weights, optimizer)
        optimizer._amp_lazy_init = optimizer._lazy_init_maybe_master_weights
    _patch_add_param_group(optimizer, bool(properties.master_weights))
