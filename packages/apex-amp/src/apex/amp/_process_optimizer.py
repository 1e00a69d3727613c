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

Master grads (O2): the unscale writes them into one persistent fp32 buffer per device that the
stash allocates at the first backward, each master's grad a view into it (created once, cached).
Observable behaviour is apex's: after backward the masters' ``.grad`` hold the unscaled grads,
after ``step``/``zero_grad`` they are None. What changes is where the next backward's grads live:
in the same memory, not in ~300 tensors allocated afresh each step (their allocation was about a
third of amp's per-step time on a 1.3 B model). A view is handed out again only if nothing else
still references it or its buffer (a master grad kept from an earlier step, or a view of one,
keeps its values: that master gets a fresh tensor, as in apex). The cost: the buffer stays
allocated between steps (4 bytes per low-precision param, also during the forward pass, where
apex had freed the master grads). ``APEX_AMP_PERSISTENT_MASTER_GRADS=0`` (read at
``amp.initialize``), or ``optimizer._amp_stash.persistent_master_grads = False`` before the first
backward, restores the per-step allocation.

The plan (O2 with persistent master grads, every param on one device): from the second step on,
the usual step's per-tensor work (clearing the model grads at ``scale_loss``'s enter; fetching
the model grads, launching the unscale, handing out the views and clearing the model grads at
its exit; the master copy and the release of the master grads in ``step``) runs on lists held in
C++ (``apex.multi_tensor_apply.ops.amp_plan``; ``reference.AmpPlan``, the same in Python, on
CPU), checked once rather than every step. Whatever differs from the usual step (a stashed grad,
a model param without a grad, a master grad still set or a view still held, several devices)
takes the general path below, which the plan's results match bit for bit.
"""

from __future__ import annotations

import itertools
import operator
import os
import sys
import types

import torch
from torch.utils.weak import WeakIdKeyDictionary

from apex.multi_tensor_apply import ops

from .scaler import by_device

LOW_PRECISION = (torch.float16, torch.bfloat16)

# Model param -> its fp32 master, for the model's state_dict hooks (O2 checkpoints hold the
# masters' exact values, and loading one restores them).
MASTERS = WeakIdKeyDictionary()
# Model param -> (fp32 value loaded from a checkpoint before its master existed, the param's
# _version once that load finished; None until then). Use pending() to read it.
PENDING = WeakIdKeyDictionary()


def pending(param: torch.Tensor, pop: bool = False) -> torch.Tensor | None:
    """The fp32 value loaded into ``param`` while it had no master, if the param was not written
    since that load (an EMA or SWA update of a deep-copied model, a user's own copy_): else None,
    and the stale entry is dropped."""
    entry = PENDING.get(param)
    if entry is None:
        return None
    value, version = entry
    if version is not None and version != param._version:
        del PENDING[param]
        return None
    if pop:
        del PENDING[param]
    return value


class AmpOptimizerState:
    """``optimizer._amp_stash``: apex's attribute names."""

    def __init__(self) -> None:
        self.lazy_init_called = False
        self.already_patched = False
        self.params_have_scaled_gradients = False
        self.multi_tensor_scale = ops.multi_tensor_scale
        self.multi_tensor_l2norm = ops.multi_tensor_l2norm
        self.dummy_overflow_buf = None
        # Extension: master grads as views of one persistent buffer per device (module docstring).
        self.persistent_master_grads = _env_flag("APEX_AMP_PERSISTENT_MASTER_GRADS", True)
        self._grad_views = None  # per master of all_fp32_from_fp16_params: a view, or None
        self._grad_buffers = ()  # (buffer, storage use count when nothing else holds it)
        self._device = None  # the one device of every param in the stash, None if several
        self._flags: dict = {}  # device -> int32 flag of the master copies (made at first use)
        self._plan = None  # the cached AmpPlan; False: none for these lists (module docstring)
        self._plan_refs = 0  # Python references the plan adds to each view it holds
        self.plan_unscales = 0  # unscales the plan ran, and why the others did not
        self.plan_misses: dict = {}


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1 or 0")


def _all_none(items) -> bool:
    # map in C: ~5x faster than a generator over ~300 grads, on every step
    return not any(map(operator.is_not, items, itertools.repeat(None)))


def _none_missing(items) -> bool:
    return all(map(operator.is_not, items, itertools.repeat(None)))


def _one_device(*lists):
    """The device every tensor of ``lists`` is on, None if they are on several (or none)."""
    device = None
    for tensors in lists:
        for t in tensors:
            if device is None:
                device = t.device
            elif t.device != device:
                return None
    return device


@torch.no_grad()
def _copy(src: list, dst: list, stash, device=None) -> None:
    """dst[i] = src[i] (dtype-converting), through multi_tensor_scale. ``device``: the one
    device of every tensor, when the caller knows it (skips the grouping)."""
    groups = {device: (src, dst)} if device is not None else by_device(src, dst)
    for device, (s, d) in groups.items():
        ops.multi_tensor_scale(s, d, _flag(stash, device), 1.0)


def _flag(stash, device) -> torch.Tensor:
    """The stash's int32 flag on ``device`` (made at first use)."""
    flag = stash._flags.get(device)
    if flag is None:
        flag = stash._flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


def _is_fused_sgd(optimizer) -> bool:
    # apex-optim's FusedSGD reads the stash itself and writes the model params in its kernel.
    return hasattr(optimizer, "_step_amp_stash")


# ---- with master weights ------------------------------------------------------------------------


def _master_for(param: torch.Tensor) -> torch.Tensor:
    loaded = pending(param, pop=True)
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
    stash._device = _one_device(stash.all_fp16_params, stash.all_fp32_from_fp32_params)
    # New masters (add_param_group): new buffers at the next backward; the old ones are freed
    # once no master grad still points into them.
    stash._grad_views = None
    stash._grad_buffers = ()
    _drop_plan(stash)


# Buffer slots start at multiples of 128 float32s (512 bytes, the caching allocator's alignment):
# the kernels' 16-byte vector path needs 16-byte aligned starts.
_SLOT_ALIGN = 128


def _storage_uses(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _buffers_free(stash) -> bool:
    """Nothing but the stash's views holds a master-grad buffer (no slice or reshape of a view
    is held)."""
    return all(_storage_uses(b) <= uses for b, uses in stash._grad_buffers)


def _view_refs(views: list) -> list:
    """sys.getrefcount of each view: above the calibrated count, someone else holds it."""
    return list(map(sys.getrefcount, views))


def _make_grad_views(stash) -> list:
    """One fp32 buffer per device for the contiguous masters, a view of it per master (None for
    a master in another memory format: its grad is allocated per step, shaped like it)."""
    masters = stash.all_fp32_from_fp16_params
    views: list = [None] * len(masters)
    slots: dict = {}
    for i, m in enumerate(masters):
        if m.is_contiguous():
            slots.setdefault(m.device, []).append(i)
    buffers = []
    for device, idx in slots.items():
        offsets, total = [], 0
        for i in idx:
            offsets.append(total)
            total += -(-masters[i].numel() // _SLOT_ALIGN) * _SLOT_ALIGN
        buf = torch.empty(total, dtype=torch.float32, device=device)
        for i, off in zip(idx, offsets):
            views[i] = buf[off : off + masters[i].numel()].view(masters[i].shape)
        buffers.append(buf)
    stash._grad_views = views
    stash._grad_buffers = tuple((b, _storage_uses(b)) for b in buffers)
    # What sys.getrefcount reports for a view that only the stash holds.
    refs = [r for r, v in zip(_view_refs(views), views) if v is not None]
    stash._grad_view_refs = min(refs, default=0)
    return views


def _plan_miss(stash, scaler, plan):
    """Runs the usual step's unscale through ``plan``: None when it did, else why the general path
    must (counted in ``stash.plan_misses``, for benchmarks and bug reports)."""
    if not (
        _all_none(stash.all_fp32_from_fp16_grad_stash)
        and _all_none(stash.all_fp32_from_fp32_grad_stash)
    ):
        return "stashed grads (delay_unscale or grads kept across scale_loss)"
    if not _buffers_free(stash):
        return "a tensor made from the master-grad buffer is held"
    refs, base = max(_view_refs(stash._grad_views), default=0), _view_base(stash)
    if refs > base:
        return f"a master-grad view is held (refcount {refs} > {base})"
    if not scaler._unscale_plan(plan, stash._device):
        return "the plan declined (a model grad missing, a master grad set, an overflow pending)"
    return None


def _view_base(stash) -> int:
    """sys.getrefcount of a view that nobody else holds: calibrated when the views were made,
    plus the references the plan holding them adds (measured by _make_plan)."""
    return stash._grad_view_refs + stash._plan_refs


def _drop_plan(stash) -> None:
    stash._plan = None
    stash._plan_refs = 0


def _amp_plan(stash):
    """The stash's AmpPlan, made at first use after the views exist; None where the general path
    runs: persistence off, params on several devices, a master outside the buffer, an
    apex-mta-kernels without ``amp_plan``."""
    if not stash.persistent_master_grads:
        return None
    if stash._plan is None:
        if stash._grad_views is None:
            return None  # no views yet: made by the first unscale
        made = _make_plan(stash)
        if made is None:
            return None
        stash._plan, stash._plan_refs = made if made is not False else (False, 0)
    return stash._plan if stash._plan is not False else None  # (a plan has a __len__)


def _make_plan(stash):
    """(a new plan, the Python references it adds to a view it holds); False where no plan fits
    these lists; None where none can be made now (while torch.compile traces)."""
    factory = getattr(ops, "amp_plan", None)
    if (
        factory is None
        or stash._device is None
        or not stash.all_fp16_params
        or not _none_missing(stash._grad_views)
    ):
        return False
    plan = factory(
        stash.all_fp16_params,
        stash.all_fp32_from_fp16_params,
        stash._grad_views,
        stash.all_fp32_from_fp32_params,
    )
    if plan is None:
        return None
    # Whether a view held by the plan has one more Python reference: on torch versions where a
    # tensor that C++ shares keeps its Python object alive by holding a reference to it (the
    # C++ plan; not the reference plan, which keeps the list it is given, nor torch before
    # that change). Measured on a probe plan of one expanded 0-byte "view", so that the base of
    # the free-view check stays exact.
    master = stash.all_fp32_from_fp16_params[0]
    probe = [torch.empty((), device=master.device).expand(master.shape)]
    before = sys.getrefcount(probe[0])
    probe_plan = factory(stash.all_fp16_params[:1], [master], probe, [])
    refs = sys.getrefcount(probe[0]) - before
    del probe_plan
    return plan, refs


def _fresh_master_grads(stash, indices: list) -> list:
    """Tensors to unscale the grads of masters ``indices`` into (each master's grad is None):
    the cached views of the persistent buffer, or ``empty_like`` where a view is still held by
    someone else (or persistence is off)."""
    masters = stash.all_fp32_from_fp16_params
    if not stash.persistent_master_grads or not hasattr(torch._C, "_storage_Use_Count"):
        return [torch.empty_like(masters[i]) for i in indices]
    views = stash._grad_views
    if views is None:
        views = _make_grad_views(stash)
    if _buffers_free(stash):
        base = _view_base(stash)
        refs = _view_refs(views)  # None (a master outside the buffer) counts far above base
        if len(indices) == len(views) and max(refs, default=0) <= base:
            return list(views)  # the usual step: every view free
        out = [views[i] if refs[i] <= base else None for i in indices]
    else:  # someone holds a tensor made from a view (a slice, a reshape): keep all of them intact
        out = [None] * len(indices)
    return [v if v is not None else torch.empty_like(masters[i]) for i, v in zip(indices, out)]


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
    plan = _amp_plan(stash)
    if plan is not None and plan.prepare():
        # No grad to stash: the plan cleared the model grads.
        stash.all_fp32_from_fp16_grad_stash = [None] * len(stash.all_fp32_from_fp16_params)
        stash.all_fp32_from_fp32_grad_stash = [None] * len(stash.all_fp32_from_fp32_params)
        return
    # Stash the existing grads; None them so backward (and the unscale) write the new ones alone.
    for params, name in (
        (stash.all_fp32_from_fp16_params, "all_fp32_from_fp16_grad_stash"),
        (stash.all_fp32_from_fp32_params, "all_fp32_from_fp32_grad_stash"),
    ):
        grads = [p.grad for p in params]
        setattr(stash, name, grads)
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = None
    for param in stash.all_fp16_params:
        param.grad = None


def post_backward_with_master_weights(self, scaler) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    plan = _amp_plan(stash)
    if plan is not None:
        why = _plan_miss(stash, scaler, plan)
        if why is None:
            stash.plan_unscales += 1
            return  # the usual step, done by the plan (the stashes are already empty)
        stash.plan_misses[why] = stash.plan_misses.get(why, 0) + 1
    masters = stash.all_fp32_from_fp16_params
    model_grads = [p.grad for p in stash.all_fp16_params]
    stashed = stash.all_fp32_from_fp16_grad_stash
    master_grads = [m.grad for m in masters]
    plain_src, plain_dst = [], []
    acc_src, acc_stash, acc_dst = [], [], []
    if _all_none(stashed) and _all_none(master_grads) and _none_missing(model_grads):
        # The usual step: every low-precision param has a grad, no master has one yet.
        plain_src = model_grads
        plain_dst = _fresh_master_grads(stash, range(len(masters)))
        for master, grad in zip(masters, plain_dst):
            master.grad = grad
    else:
        fresh = []
        for i, (model_grad, master) in enumerate(zip(model_grads, masters)):
            old = stashed[i]
            if old is None:
                # Unprepared (after delay_unscale): the master grad already holds unscaled grads.
                old = master_grads[i]
            if model_grad is None:
                master.grad = old
            elif old is None:
                fresh.append(i)
                plain_src.append(model_grad)
            else:
                master.grad = old
                acc_src.append(model_grad)
                acc_stash.append(old)
                acc_dst.append(old)
        plain_dst = _fresh_master_grads(stash, fresh)
        for i, grad in zip(fresh, plain_dst):
            masters[i].grad = grad
    for i, param in enumerate(stash.all_fp32_from_fp32_params):
        old = stash.all_fp32_from_fp32_grad_stash[i]
        if param.grad is None:
            param.grad = old
        elif old is None:
            plain_src.append(param.grad)
            plain_dst.append(param.grad)
        else:
            acc_src.append(param.grad)
            acc_stash.append(old)
            acc_dst.append(param.grad)
    device = stash._device
    if plain_src:
        scaler.unscale(
            plain_src, plain_dst, scaler.loss_scale(), models_are_masters=False, _device=device
        )
    if acc_src:
        scaler.unscale_with_stashed(acc_src, acc_stash, acc_dst, _device=device)
    for param in stash.all_fp16_params:
        param.grad = None
    stash.all_fp32_from_fp16_grad_stash = [None] * len(masters)
    stash.all_fp32_from_fp32_grad_stash = [None] * len(stash.all_fp32_from_fp32_params)


def _plan_copy_back(stash, release_grads: bool) -> bool:
    """The master -> model copy through the stash's AmpPlan (then, with ``release_grads``, every
    master grad cleared); False, nothing done, where there is no plan."""
    plan = _amp_plan(stash)
    if plan is None:
        return False
    plan.copy_back(_flag(stash, stash._device), release_grads)
    return True


def master_params_to_model_params(self) -> None:
    stash = self._amp_stash
    if stash.lazy_init_called and stash.all_fp16_params:
        if _plan_copy_back(stash, release_grads=False):
            return
        _copy(stash.all_fp32_from_fp16_params, stash.all_fp16_params, stash, stash._device)


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
    stash._device = _one_device(params)
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
    device = stash._device
    if plain:
        scaler.unscale(plain, plain, scaler.loss_scale(), models_are_masters=True, _device=device)
    if acc_src:
        scaler.unscale_with_stashed(acc_src, acc_stash, acc_src, _device=device)


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
        copy = self._master_params_to_model_params
        if not writes_models and getattr(copy, "__func__", None) is master_params_to_model_params:
            if _plan_copy_back(stash, release_grads=True):  # copy and release in one call
                return result
        if not writes_models:
            copy()
        # The master grads are done with; the next backward writes them afresh.
        for master in stash.all_fp32_from_fp16_params:
            master.grad = None
        return result

    optimizer.step = types.MethodType(step, optimizer)


def _patch_master_zero_grad(optimizer) -> None:
    def zero_grad(self, set_to_none: bool = True):
        stash = self._amp_stash
        self._amp_lazy_init()
        # The model's grads (its low-precision params and its float32 ones) as torch's
        # zero_grad(set_to_none) leaves them (apex zeroed both in place); the float32 masters of
        # low-precision params always go to None: the next backward writes them afresh.
        for param in (*stash.all_fp16_params, *stash.all_fp32_from_fp32_params):
            if set_to_none or param.grad is None:
                param.grad = None
            else:
                if param.grad.grad_fn is not None:
                    param.grad.detach_()
                else:
                    param.grad.requires_grad_(False)
                param.grad.zero_()
        for master in stash.all_fp32_from_fp16_params:
            master.grad = None
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
        _drop_plan(self._amp_stash)  # checked afresh at the next step
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
