"""What every fused optimizer shares: argument checks, the cached per-group tensor lists, fp32
master weights, the GradScaler protocol, zero_grad and state_dict handling.

The per-step cost on the host is the point of this module. The tensor lists a kernel takes
(params, their state, fp32 masters), split by device and dtype, are built once per param group
and reused while the group's params, the set of params that have a grad, and the optimizer state
are unchanged; a step then only gathers the grads (and compares their strides with the ones the
plan was built for). Nothing here reads a device value on the host: no ``.item()``, no
``bool(tensor)``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from apex.multi_tensor_apply import ops

# The kernels' own rule (bit mask of the memory formats a tensor is dense in), checked here so
# that a bad grad is refused before any kernel runs.
from apex.multi_tensor_apply._checks import layouts as _layouts

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOW_PRECISION = (torch.float16, torch.bfloat16)
MASTER_KEY = "master_param"


def dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def opaque_to_dynamo(step):
    """``step`` as compiled code calls it without tracing it (torch.compiler.disable), made at
    the first call: torch's lazy form (torch._disable_dynamo, what torch.optim uses), since
    torch.compiler.disable at class definition imports torch._dynamo (~0.8 s at import)."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(step) if lazy is not None else torch.compiler.disable(step)


def _laid_out_like(t: torch.Tensor, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as ``dtype`` on p's device, with p's strides where it has p's shape and not its
    strides (a channels_last checkpoint in a contiguous model, a model made channels_last after
    a step): the kernels take each state tensor in its param's memory format."""
    if t.shape == p.shape and t.stride() != p.stride():
        return torch.empty_like(p, dtype=dtype).copy_(t)
    return t.to(device=p.device, dtype=dtype)


def _strides(tensors: list) -> list | None:
    """Every tensor's strides, or None where one has none (a sparse grad, a missing one): what a
    cached plan compares a step's grads with, in a C-level loop."""
    try:
        return list(map(torch.Tensor.stride, tensors))
    except (RuntimeError, TypeError):
        return None


def _contiguous(tensors: list) -> bool:
    """Every tensor is contiguous (False where one is sparse or missing), in a C-level loop."""
    try:
        return all(map(torch.Tensor.is_contiguous, tensors))
    except (RuntimeError, TypeError):
        return False


_DTYPE = operator.attrgetter("dtype")


def _weights_mark(p: torch.Tensor) -> tuple[int, int]:
    """What changes when p's values are written in place (its version) or replaced (``p.data =``,
    ``module.to(...)``: its storage)."""
    return p._version, p.data_ptr()


class VersionedState(defaultdict):
    """``optimizer.state``: torch's ``defaultdict(dict)``, counting the changes to its entries
    (one set, replaced or deleted, as in ``opt.state[p] = {}`` or ``del opt.state[p]``), so that
    a step tells in O(1) whether the cached plans still hold each param's state. Changes inside
    an entry (``opt.state[p]["exp_avg"] = t``) are not counted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.version = 0

    def __setitem__(self, key, value):
        self.version += 1
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.version += 1
        super().__delitem__(key)

    def pop(self, *args):
        self.version += 1
        return super().pop(*args)

    def popitem(self):
        self.version += 1
        return super().popitem()

    def clear(self):
        self.version += 1
        super().clear()

    def update(self, *args, **kwargs):
        self.version += 1
        super().update(*args, **kwargs)

    def setdefault(self, key, default=None):
        if key not in self:
            self.version += 1
        return super().setdefault(key, default)

    def __ior__(self, other):
        self.version += 1
        return super().__ior__(other)


def _state_version(state) -> int:
    """What a step compares to tell whether the state's entries changed: VersionedState's count;
    for a mapping the user assigned to ``opt.state`` (kept as it is, as torch keeps it: code may
    hold it), its length only."""
    return state.version if isinstance(state, VersionedState) else len(state)


def versioned_state(state) -> VersionedState:
    """``state`` itself if it is a VersionedState, else its entries in a new one."""
    if isinstance(state, VersionedState):
        return state
    return VersionedState(getattr(state, "default_factory", None) or dict, state)


class Bucket:
    """The params of one group that share a device and a dtype, and the tensors the kernels take
    for them, in the same order. ``start:stop`` is their slice of the group's grads list."""

    __slots__ = (
        "device", "dtype", "params", "work", "masters", "state", "fresh", "start", "stop", "native",
    )  # fmt: skip

    def __init__(self, device: torch.device, dtype: torch.dtype, start: int):
        self.device = device
        self.dtype = dtype
        self.params: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] | None = None  # fp32 masters of low-precision params
        self.work: list[torch.Tensor] = []  # what the kernel updates: masters, else params
        self.state: dict[str, list[torch.Tensor]] = {}
        self.fresh: list[bool] = []  # state created by this plan (SGD's first run)
        self.start = start
        self.stop = start
        self.native = None  # a C++ plan of these lists (ops.adam_plan), where the optimizer has one


class Plan:
    """One param group's buckets, valid while ``matches`` holds."""

    __slots__ = (
        "params_list", "params", "live", "dead", "buckets", "keys", "device", "scratch", "native",
        "strides", "dtypes", "param_dtypes", "shaped", "shaped_strides",
    )  # fmt: skip

    def matches(self, params: list, keys: tuple) -> bool:
        return (
            params is self.params_list
            and len(params) == len(self.params)
            and keys == self.keys
            and all(map(operator.is_, params, self.params))
        )

    def fetch_native(self) -> bool:
        """Every bucket's C++ plan fetched its grads (no live param lost its grad, no dead one
        gained one); then the step needs no Python list of grads at all."""
        if not self.native or any(p.grad is not None for p in self.dead):
            return False
        for i, b in enumerate(self.buckets):
            if not b.native.fetch():
                for done in self.buckets[:i]:
                    done.native.release()
                return False
        return True


class DeviceFlags:
    """Per-device scalars: ``zero`` (a noop flag nothing writes: kernels that honour the flag
    always run), ``skip`` (found_inf of the step being taken), ``scratch`` (for ops that only
    raise the flag, such as the master-to-param copy), ``one`` (an inv_scale of 1)."""

    __slots__ = ("zero", "skip", "keep", "scratch", "one", "inv")

    def __init__(self, device: torch.device):
        self.zero = torch.zeros(1, dtype=torch.int32, device=device)
        self.skip = torch.zeros(1, dtype=torch.int32, device=device)
        self.keep = torch.ones(1, dtype=torch.int32, device=device)
        self.scratch = torch.zeros(1, dtype=torch.int32, device=device)
        self.one = torch.ones(1, dtype=torch.float32, device=device)
        self.inv = self.one


class Scaling:
    """The GradScaler inputs of one step: ``grad_scale`` (None when the grads are already
    unscaled) and ``found_inf``, device tensors. ``flags(device)`` gives that device's noop flag
    (set when found_inf is nonzero), its complement and the inverse scale, computed once per
    device per step without a host sync."""

    def __init__(self, opt: FusedOptimizer, grad_scale, found_inf):
        self.opt = opt
        self.grad_scale = grad_scale
        self.found_inf = found_inf
        self._done: set = set()

    def flags(self, device: torch.device) -> DeviceFlags:
        f = self.opt._device_flags(device)
        if device not in self._done:
            self._done.add(device)
            if self.found_inf is None:
                f.skip.zero_()
            else:
                f.skip.copy_(self.found_inf.to(device, non_blocking=True).reshape(-1)[:1].ne(0))
            f.keep.fill_(1).sub_(f.skip)
            if self.grad_scale is None:
                f.inv = f.one
            else:
                scale = torch.as_tensor(self.grad_scale).to(device, non_blocking=True)
                f.inv = scale.double().reciprocal().float().reshape(1)
        return f


class FusedOptimizer(torch.optim.Optimizer):
    """Base class of the fused optimizers (not public API).

    Each subclass's ``step`` is wrapped in ``opaque_to_dynamo`` (torch.compiler.disable, lazily):
    compiled code calls it as an opaque function. Traced, its cached lists became guards and
    every step recompiled."""

    # Set by subclasses.
    _state_keys: tuple[str, ...] = ()
    _fp32_state = False  # state kept in float32 whatever the param dtype (apex FusedAdam)
    _single_device = False  # every param of the optimizer on one device (global norms)
    _group_single_device = False  # every param of a group on one device
    _supports_amp_scaling = False  # the GradScaler protocol is honoured without a host sync
    _sparse_hint = ""  # where sparse grads can go instead, for the error message

    def __init__(
        self,
        params,
        defaults: dict[str, Any],
        *,
        set_grad_none: bool | None,
        master_weights: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        # foreach / fused are accepted for code written against torch.optim and ignored: every
        # step is fused here.
        del foreach, fused
        self.set_grad_none = set_grad_none
        self.master_weights = bool(master_weights)
        self._plans: dict[int, Plan] = {}
        self._flags: dict[torch.device, DeviceFlags] = {}
        self._state_ref = None
        self._state_version = -1
        self._lr_bufs: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._step_bufs: dict[torch.device, torch.Tensor] = {}
        # Masters handed out (param_groups_master, param_groups_full_precision) before a step of
        # ours made them: kept here, not in self.state, whose emptiness subclasses with their own
        # step test to create their state (NeMo's MegatronFusedAdam: `if len(state) == 0`). Our
        # first step moves each into state[MASTER_KEY], the same tensor (refreshed from the param
        # in place if the param was written since: weights loaded after the masters were read).
        # Each is kept with the param's _weights_mark and its own version at the time.
        self._early_masters: dict[torch.Tensor, tuple[torch.Tensor, tuple[int, int], int]] = {}
        self._group_defaults = tuple(defaults)  # the keys this optimizer declares
        super().__init__(params, defaults)
        self.state = versioned_state(self.state)
        self._step_supports_amp_scaling = self._supports_amp_scaling
        first = self._first_param()
        device = first.device if first is not None else torch.device("cpu")
        # apex's public scratch flag; clients pass it to their own amp_C calls. The optimizer
        # itself never reads it, so a client that raises it cannot stall the steps.
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)

    # ---- construction and checks ---------------------------------------------------------------

    @property
    def _name(self) -> str:
        return type(self).__name__

    def _first_param(self):
        for group in self.param_groups:
            for p in group["params"]:
                return p
        return None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            self._check_group(index, self.param_groups[index])
        except Exception:
            self.param_groups.pop()
            raise
        self._invalidate()

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        """Refuses hyper-parameters and params the optimizer cannot serve, naming the group."""
        where = f"{self._name}: param group {index}"
        self._check_hyper(where, group)
        devices = set()
        for i, p in enumerate(group["params"]):
            if p.dtype not in self._param_dtypes():
                raise TypeError(
                    f"{where}: parameter {i} has dtype {p.dtype}; {self._name} supports "
                    f"{dtype_names(self._param_dtypes())}"
                )
            if p.is_sparse:
                raise RuntimeError(
                    f"{where}: parameter {i} is sparse; sparse params are not supported"
                )
            devices.add(p.device)
        if self._group_single_device and len(devices) > 1:
            raise ValueError(
                f"{where}: its parameters are on several devices ({_devices(devices)}); "
                f"{self._name}{self._single_device_reason()} needs every parameter of a group on "
                "one device"
            )
        if self._single_device:
            first = self._first_param()
            if first is not None:
                others = {d for d in devices if d != first.device}
                if others:
                    raise ValueError(
                        f"{where}: a parameter is on {_devices(others)} but the optimizer's first "
                        f"parameter is on {first.device}; {self._name} needs every parameter on "
                        "one device"
                    )

    def _single_device_reason(self) -> str:
        return ""

    def _make_capturable(self, group: dict[str, Any]) -> None:
        """A capturable group's lr as a 0-dim float32 tensor on the group's device, read there
        by the kernels (0-dim as in apex: torch < 2.7 LR schedulers fill_ it with a 0-dim
        value). Subclasses add their own device scalars."""
        device = group_device(group)
        if device is None:
            return
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor):
            group["lr"] = torch.tensor(lr, dtype=torch.float32, device=device)
        elif lr.device != device:
            group["lr"] = lr.to(device)

    def _param_dtypes(self) -> tuple[torch.dtype, ...]:
        return FLOAT_DTYPES

    def _check_hyper(self, where: str, group: dict[str, Any]) -> None:
        """Subclasses check their hyper-parameters here (see check_* below)."""

    # ---- the cached lists ----------------------------------------------------------------------

    def _invalidate(self) -> None:
        self._plans.clear()
        self._state_ref = None
        self._prune_early_masters()

    def _prune_early_masters(self) -> None:
        """Drops the early masters of params no longer in any group (replaced, removed)."""
        if self._early_masters:
            live = {p for g in self.param_groups for p in g["params"]}
            for p in [p for p in self._early_masters if p not in live]:
                del self._early_masters[p]

    def _device_flags(self, device: torch.device) -> DeviceFlags:
        f = self._flags.get(device)
        if f is None:
            f = self._flags[device] = DeviceFlags(device)
        return f

    def _state_keys_for(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._state_keys

    def _uses_master(self, p: torch.Tensor) -> bool:
        return self.master_weights and p.dtype in LOW_PRECISION

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        if self._fp32_state or self._uses_master(p):
            return torch.float32
        return p.dtype

    def _init_state(self, p: torch.Tensor, state: dict, key: str, group: dict) -> torch.Tensor:
        """A new state tensor (zeros unless a subclass says otherwise)."""
        return torch.zeros_like(p, dtype=self._state_dtype(p), memory_format=torch.preserve_format)

    def _begin_step(self) -> None:
        """Drops every plan when the state mapping was replaced, or one of its entries set,
        replaced or deleted, since the last step (``opt.state[p] = {}`` re-initialises p's state,
        as in torch)."""
        state = self.state
        if state is not self._state_ref or _state_version(state) != self._state_version:
            self._plans.clear()

    def _end_step(self) -> None:
        self._state_ref = self.state
        self._state_version = _state_version(self.state)

    def _prepare(self) -> list[tuple]:
        """(index, group, plan, grads) of every group, plan None for a group without grads. Every
        group's grads are checked, and every plan built, before the caller launches a kernel or
        counts a step: bad input (a sparse grad, a grad in another memory format than its
        param) raises with nothing changed. A cached C++ plan (CUDA) fetches its grads here and
        refuses any that differ from what it validated, so those take this check too."""
        self._begin_step()
        found = []
        try:
            for index, group in enumerate(self.param_groups):
                found.append(self._cached_plan(index, group))
            if None in found:
                self._prune_early_masters()
            for index, group in enumerate(self.param_groups):
                if found[index] is None:
                    self._check_grads(index, group["params"])
            work = []
            for index, group in enumerate(self.param_groups):
                plan, grads = found[index] or self._new_plan(index, group)
                work.append((index, group, plan, grads))
        except BaseException:
            self._release([f for f in found if f is not None])
            raise
        return work

    @contextlib.contextmanager
    def _stepping(self):
        """``with self._stepping() as work:`` the steps' frame: _prepare's work; on an error the
        grads the C++ plans fetched are dropped (none kept past the step), else the step ends."""
        work = self._prepare()
        try:
            yield work
        except BaseException:
            self._release(work)
            raise
        self._end_step()

    @staticmethod
    def _release(work) -> None:
        """Drops the grads the C++ plans of ``work`` fetched (a step that did not run them)."""
        for *_, plan, grads in work:
            if plan is not None and grads is None:
                for b in plan.buckets:
                    if b.native is not None:
                        b.native.release()

    def _cached_plan(self, index: int, group: dict[str, Any]):
        """(plan, grads) from the group's cached plan, (None, None) when none of its params has
        a grad, or None when the plan has to be rebuilt: the params, the state keys or the
        state changed, a grad came or went, or one is laid out differently (a sparse grad, a
        param made channels_last since). Per tensor, only the grads' gathering runs in Python;
        the checks are C-level loops."""
        plan = self._plans.get(index)
        if plan is None or not plan.matches(group["params"], self._state_keys_for(group)):
            return None
        # A param swapped for one of another memory format (p.data =, module.to()), for the
        # params where one can be (4-d and 5-d): its state must be rebuilt in that format.
        if _strides(plan.shaped) != plan.shaped_strides:
            return None
        if plan.fetch_native():
            return plan, None  # each bucket's C++ plan holds its (tested) grads until its step
        grads = [p.grad for p in plan.live]
        # A missing grad fails the layout test too (None has no strides).
        if plan.strides is None:
            same = _contiguous(grads)
        else:
            same = _strides(grads) == plan.strides
        # A param or grad of another dtype than the plan's: cast since (module.half(), .double(),
        # p.data =); the rebuilt plan's check refuses or takes the new dtype.
        if (
            not same
            or list(map(_DTYPE, grads)) != plan.dtypes
            or list(map(_DTYPE, plan.live)) != plan.param_dtypes
        ):
            return None
        if any(p.grad is not None for p in plan.dead):
            return None
        return (plan, grads) if grads else (None, None)

    def _new_plan(self, index: int, group: dict[str, Any]):
        """(plan, grads) from a plan built now (_prepare checked the grads), or (None, None)."""
        plan, grads = self._build_plan(index, group, group["params"], self._state_keys_for(group))
        self._plans[index] = plan
        if not plan.live:
            return None, None
        return plan, grads

    def _check_grads(self, index: int, params: list) -> None:
        """Refuses sparse grads and grads the kernels cannot take with their params, naming the
        group and the param."""
        where = f"{self._name}: param group {index}"
        allowed = self._param_dtypes()
        for i, p in enumerate(params):
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided:
                raise RuntimeError(
                    f"{where}: parameter {i} has a sparse gradient; {self._name} does not support "
                    f"sparse gradients{self._sparse_hint}"
                )
            # The group's params were checked when added; one cast since (module.double(),
            # p.data =), or its grad, is refused here, before any group steps.
            for what, t in (("parameter", p), ("grad of parameter", g)):
                if t.dtype not in allowed:
                    raise TypeError(
                        f"{where}: the {what} {i} has dtype {t.dtype} (cast after it was added "
                        f"to the optimizer?); {self._name} supports {dtype_names(allowed)}"
                    )
            for what, t in (("parameter", p), ("grad", g)):
                if not _layouts(t):
                    raise ValueError(
                        f"{where}: the {what} of parameter {i} is not contiguous (strides "
                        f"{list(t.stride())}); {self._name} needs the contiguous or channels_last "
                        "memory format"
                    )
            if g.numel() > 1 and not _layouts(g) & _layouts(p):
                raise ValueError(
                    f"{where}: the grad of parameter {i} has strides {list(g.stride())} but the "
                    f"parameter has {list(p.stride())}; a grad must share its parameter's memory "
                    "format"
                )

    def _build_plan(self, index: int, group: dict, params: list, keys: tuple) -> Plan:
        live = [p for p in params if p.grad is not None]
        dead = [p for p in params if p.grad is None]
        # Buckets by (device, dtype), in order of first appearance; params keep group order.
        order: dict[tuple, list[torch.Tensor]] = {}
        for p in live:
            order.setdefault((p.device, p.dtype), []).append(p)
        self._order_buckets(order)
        plan = Plan()
        plan.params_list = params
        plan.params = tuple(params)
        plan.keys = keys
        plan.dead = dead
        plan.live = []
        plan.buckets = []
        plan.device = live[0].device if live else None
        plan.scratch = {}
        for (device, dtype), members in order.items():
            b = Bucket(device, dtype, len(plan.live))
            b.state = {k: [] for k in keys}
            masters = [] if self._uses_master(members[0]) else None
            for p in members:
                state = self.state[p]
                fresh = False
                for k in keys:
                    t = state.get(k)
                    if t is None:
                        t = state[k] = self._init_state(p, state, k, group)
                        fresh = True
                    elif t.device != p.device or t.stride() != p.stride():
                        t = state[k] = _laid_out_like(t, p, t.dtype)
                    b.state[k].append(t)
                if masters is not None:
                    m = state.get(MASTER_KEY)
                    if m is None:
                        early = self._early_masters.pop(p, None)
                        if early is not None:
                            m, mark, m_version = early
                            # Weights loaded into the param since (and the master not written
                            # itself, as a restore from an fp32 checkpoint does): the same tensor
                            # takes them.
                            if (
                                _weights_mark(p) != mark
                                and m._version == m_version
                                and m.shape == p.shape
                            ):
                                m.copy_(p.detach())
                            state[MASTER_KEY] = m
                    if m is None:
                        m = state[MASTER_KEY] = p.detach().float()
                    elif (
                        m.device != p.device or m.dtype != torch.float32 or m.stride() != p.stride()
                    ):
                        m = state[MASTER_KEY] = _laid_out_like(m, p, torch.float32)
                    masters.append(m)
                else:
                    # A master left from a phase with master weights would be stale by now; were
                    # it kept, a later phase with them would step from it.
                    state.pop(MASTER_KEY, None)
                b.fresh.append(fresh)
                b.params.append(p)
            b.masters = masters
            b.work = masters if masters is not None else b.params
            plan.live.extend(members)
            b.stop = len(plan.live)
            plan.buckets.append(b)
        grads = [p.grad for p in plan.live]
        # What the next steps' grads are compared with: that each is contiguous (the usual
        # case, and the cheapest test), else their strides.
        plan.strides = None if _contiguous(grads) else _strides(grads)
        plan.dtypes = list(map(_DTYPE, grads))
        plan.param_dtypes = list(map(_DTYPE, plan.live))
        for b in plan.buckets:
            b.native = self._native_plan(group, b)
        plan.native = bool(plan.buckets) and all(b.native is not None for b in plan.buckets)
        # What every step compares: the strides of the params whose memory format can change
        # (4-d and 5-d), whose state would have to be rebuilt in the new one.
        plan.shaped = [p for p in plan.live if p.dim() >= 4]
        plan.shaped_strides = _strides(plan.shaped)
        return plan, grads

    def _native_plan(self, group: dict, bucket: Bucket):
        """A C++ plan of the bucket's lists (see ops.adam_plan), or None: the optimizers that have
        one say so. Plans are rebuilt whenever the Python plan is."""
        return None

    def _order_buckets(self, order: dict) -> None:
        """Subclasses may reorder the buckets in place (NovoGrad keeps apex's fp16, fp32 order)."""

    # ---- helpers for steps ---------------------------------------------------------------------

    def _scaling(self, grad_scaler=None) -> Scaling | None:
        """The GradScaler inputs of this step, or None. torch.amp.GradScaler sets the attributes
        ``grad_scale`` and ``found_inf`` on optimizers whose ``_step_supports_amp_scaling`` is
        True before calling ``step()`` (and deletes them after); apex's callers pass the scaler
        itself as ``step(grad_scaler=...)`` instead."""
        if grad_scaler is not None:
            if not self._supports_amp_scaling:
                raise TypeError(
                    f"{self._name}.step() does not take grad_scaler: its kernels cannot skip a step "
                    "on the device. Let GradScaler unscale and skip as usual: scaler.step(optimizer)"
                )
            first = self._first_param()
            device = first.device if first is not None else torch.device("cpu")
            stage = grad_scaler._per_optimizer_states.get(id(self), {})
            if getattr(stage.get("stage"), "name", None) == "UNSCALED":
                # scaler.unscale_(opt) ran (for clipping): the grads are unscaled already, and
                # the infs it found are the step's, as GradScaler.step's own protocol has it.
                found, scale = stage["found_inf_per_device"], None
            else:
                found, scale = (
                    grad_scaler._check_inf_per_device(self),
                    grad_scaler._get_scale_async(),
                )
            found_inf = sum(t.to(device, non_blocking=True) for t in found.values())
            return Scaling(self, scale, found_inf)
        grad_scale = self.__dict__.get("grad_scale")
        found_inf = self.__dict__.get("found_inf")
        if grad_scale is None and found_inf is None:
            return None
        if not self._supports_amp_scaling:
            raise RuntimeError(
                f"{self._name} does not take part in GradScaler's fused-optimizer protocol "
                "(_step_supports_amp_scaling is False) but grad_scale or found_inf is set on it"
            )
        return Scaling(self, grad_scale, found_inf)

    def _lr_tensor(self, index: int, group: dict, device: torch.device) -> torch.Tensor:
        """group['lr'] as a one-element float tensor on ``device``, without a host sync."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            if lr.device != device:
                lr = lr.to(device, non_blocking=True)
            if lr.dtype not in (torch.float32, torch.float64):
                lr = lr.float()
            return lr.reshape(1) if lr.dim() != 1 else lr
        buf = self._lr_bufs.get((index, device))
        if buf is None:
            buf = self._lr_bufs[(index, device)] = torch.empty(1, device=device)
        return buf.fill_(lr)

    def _step_tensor(self, step, device: torch.device) -> torch.Tensor:
        """An int32 one-element tensor holding ``step`` (an int, or a tensor) on ``device``."""
        if isinstance(step, torch.Tensor):
            return step if step.device == device else step.to(device, non_blocking=True)
        buf = self._step_bufs.get(device)
        if buf is None:
            buf = self._step_bufs[device] = torch.empty(1, dtype=torch.int32, device=device)
        return buf.fill_(step)

    def _copy_masters(self, bucket: Bucket) -> None:
        """Model params = fp32 masters rounded to the params' dtype."""
        flag = self._device_flags(bucket.device).scratch
        ops.multi_tensor_scale(bucket.masters, bucket.params, flag, 1.0)

    @staticmethod
    def _closure(closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    # ---- zero_grad -----------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clears the grads: ``set_to_none=True`` drops them (``p.grad = None``), False zeroes
        them in place. Left out, they are dropped whatever apex's ``set_grad_none`` says: apex
        set them to None with it and otherwise called ``Optimizer.zero_grad()``, whose default
        has been set_to_none=True since torch 2.0."""
        super().zero_grad(set_to_none=True if set_to_none is None else bool(set_to_none))

    # ---- master weights ------------------------------------------------------------------------

    @property
    def param_groups_master(self) -> list[dict[str, list]]:
        """apex's fp32 master copies, one list per param group in param order: the master of each
        fp16/bf16 param (created now if no step has created it yet, outside ``self.state``: see
        ``_early_masters``), and fp32 params themselves (they are their own masters). Empty
        lists' entries are None without master weights."""
        groups = []
        for group in self.param_groups:
            masters = []
            for p in group["params"]:
                masters.append(
                    self._master_of(p)
                    if self._uses_master(p)
                    else (p if self.master_weights else None)
                )
            groups.append({"params": masters})
        return groups

    @staticmethod
    def _count_idle_group(group: dict[str, Any]) -> None:
        """apex counts a step in every group with params, whether any has a grad or not (code
        reads ``group['step']`` of each group, e.g. Megatron's distributed optimizer): a group
        with nothing to update gets its count here (FusedAdam, whose step may live on the
        device, counts it with its own _advance_step)."""
        if not group["params"]:
            return
        step = group.get("step", 0)
        if isinstance(step, torch.Tensor):
            step.add_(1)
        else:
            group["step"] = step + 1

    def _master_of(self, p: torch.Tensor) -> torch.Tensor:
        """p's fp32 master: the one a step made (in state), else one made now and kept aside."""
        m = self.state[p].get(MASTER_KEY) if p in self.state else None
        if m is None:
            early = self._early_masters.get(p)
            if early is None:
                m = p.detach().float()
                early = self._early_masters[p] = (m, _weights_mark(p), m._version)
            m = early[0]
        return m

    # ---- state_dict ----------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_plans", "_flags", "_lr_bufs", "_step_bufs", "_state_ref", "_early_masters"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_flags", {})
        self.__dict__.setdefault("_lr_bufs", {})
        self.__dict__.setdefault("_step_bufs", {})
        self._early_masters = {}
        self._plans = {}
        self._state_ref = None
        self.__dict__.setdefault("_state_version", -1)
        self.state = versioned_state(self.state)

    def _normalize_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Subclasses convert foreign layouts (torch's, apex's) here; returns a new dict."""
        return state_dict

    def _saved_state_value(self, p: torch.Tensor, key, value):
        """How a saved state tensor is restored: on the param's device, in its saved dtype
        (torch would cast floating state to the param's dtype and lose fp32 moments and
        masters of fp16/bf16 params), in the param's memory format where it has its shape."""
        return _laid_out_like(value, p, torch.float32 if key == MASTER_KEY else value.dtype)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, keeping each state tensor's saved dtype (fp32 moments and
        masters of fp16/bf16 params stay fp32) and moving group tensors (lr, step when
        capturable) to the group's device. The state_dict pre-hooks see it in this optimizer's
        layout (a torch.optim.Adam checkpoint already converted); the post-hooks run after
        every change made here, so what they change stays."""
        state_dict = self._normalize_state_dict(dict(state_dict))
        loading = {}

        def capture(opt, final):  # the last pre-hook: the state_dict torch loads
            loading["state_dict"] = final

        def restore(opt):  # the first post-hook
            self._restore_loaded(loading["state_dict"])

        pre = self.register_load_state_dict_pre_hook(capture)
        post = self.register_load_state_dict_post_hook(restore, prepend=True)
        try:
            super().load_state_dict(state_dict)
        finally:
            pre.remove()
            post.remove()

    def _restore_loaded(self, state_dict: dict[str, Any]) -> None:
        """What load_state_dict adds to torch's: the saved dtypes, group defaults and devices,
        no master where a param uses none, no cached plan."""
        saved = state_dict["state"]
        self._early_masters.clear()  # as the state they stood in for: the loaded one decides
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            if i not in saved:
                continue
            entry = self.state[p]
            for key, value in saved[i].items():
                if isinstance(value, torch.Tensor):
                    entry[key] = self._saved_state_value(p, key, value)
            if not self._uses_master(p):
                entry.pop(MASTER_KEY, None)  # stale by the time a phase with masters uses it
        for group in self.param_groups:
            for key in self._group_defaults:  # not torch's own additions ("differentiable")
                group.setdefault(key, self.defaults[key])
            self._after_load_group(group)
        self._invalidate()

    def _after_load_group(self, group: dict[str, Any]) -> None:
        """Subclasses fix up a loaded group (device tensors, layout)."""


def group_device(group: dict[str, Any]):
    for p in group["params"]:
        return p.device
    return None


def _devices(devices) -> str:
    return ", ".join(sorted(str(d) for d in devices))


# ---- hyper-parameter checks (the message names the group) ----------------------------------------


def _value(x) -> float:
    return float(x) if not isinstance(x, torch.Tensor) else float(x.detach().reshape(-1)[0])


def check_lr(where: str, lr) -> None:
    # A number, a tensor, or anything float() takes but a string (a 0-d numpy array).
    if not isinstance(lr, (numbers.Real, torch.Tensor)) and (
        isinstance(lr, (str, bytes)) or not hasattr(lr, "__float__")
    ):
        raise TypeError(
            f"{where}: lr must be a number or a one-element tensor, got {type(lr).__name__} {lr!r}"
        )
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(
                f"{where}: lr must be a number or a one-element tensor, got shape {tuple(lr.shape)}"
            )
        if lr.device.type == "cpu" and not lr.is_floating_point():
            raise TypeError(f"{where}: lr tensor must be floating point, got {lr.dtype}")
        if lr.device.type != "cpu":
            return  # reading it would sync with the device
    if not _value(lr) >= 0.0:
        raise ValueError(f"{where}: invalid learning rate lr={_value(lr)} (must be >= 0)")


def check_nonneg(where: str, name: str, value) -> None:
    if not _value(value) >= 0.0:
        raise ValueError(f"{where}: invalid {name}={_value(value)} (must be >= 0)")


def check_betas(where: str, betas) -> None:
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}") from None
    for i, beta in enumerate((beta1, beta2)):
        b = _value(beta)
        if not 0.0 <= b < 1.0 or math.isnan(b):
            raise ValueError(f"{where}: invalid betas[{i}]={b} (must be in [0, 1))")


def check_eps(where: str, eps) -> None:
    if not _value(eps) >= 0.0:
        raise ValueError(f"{where}: invalid eps={_value(eps)} (must be >= 0)")


def new_state_dict_groups(state_dict: dict[str, Any]) -> list[dict[str, Any]]:
    """Shallow copies of the saved groups, safe to edit."""
    return [dict(g) for g in state_dict["param_groups"]]


def new_state(state_dict: dict[str, Any]) -> dict:
    return {k: dict(v) for k, v in state_dict["state"].items()}


__all__ = [
    "FLOAT_DTYPES",
    "LOW_PRECISION",
    "MASTER_KEY",
    "Bucket",
    "FusedOptimizer",
    "Plan",
    "Scaling",
    "check_betas",
    "check_eps",
    "check_lr",
    "check_nonneg",
    "group_device",
]
