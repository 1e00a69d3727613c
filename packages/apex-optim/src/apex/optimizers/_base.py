"""What every fused optimizer shares: argument checks, the cached per-group tensor lists, fp32
master weights, the GradScaler protocol, zero_grad and state_dict handling.

The per-step cost on the host is the point of this module. The tensor lists a kernel takes
(params, their state, fp32 masters), split by device and dtype, are built once per param group
and reused while the group's params, the set of params that have a grad, and the optimizer state
are unchanged; a step then only gathers the grads. Nothing here reads a device value on the host:
no ``.item()``, no ``bool(tensor)``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any

import torch

from apex.multi_tensor_apply import ops

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOW_PRECISION = (torch.float16, torch.bfloat16)
MASTER_KEY = "master_param"


def dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


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
    """Base class of the fused optimizers (not public API)."""

    # Set by subclasses.
    _state_keys: tuple[str, ...] = ()
    _fp32_state = False  # state kept in float32 whatever the param dtype (apex FusedAdam)
    _single_device = False  # every param of the optimizer on one device (global norms)
    _group_single_device = False  # every param of a group on one device
    _supports_amp_scaling = False  # the GradScaler protocol is honoured without a host sync

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
        self._state_len = -1
        self._lr_bufs: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._step_bufs: dict[torch.device, torch.Tensor] = {}
        # Masters handed out (param_groups_master, param_groups_full_precision) before a step of
        # ours made them: kept here, not in self.state, whose emptiness subclasses with their own
        # step test to create their state (NeMo's MegatronFusedAdam: `if len(state) == 0`). Our
        # first step moves each into state[MASTER_KEY], the same tensor.
        self._early_masters: dict[torch.Tensor, torch.Tensor] = {}
        self._group_defaults = tuple(defaults)  # the keys this optimizer declares
        super().__init__(params, defaults)
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
        """Drops every plan when the state was replaced or resized since the last step."""
        if self.state is not self._state_ref or len(self.state) != self._state_len:
            self._plans.clear()

    def _end_step(self) -> None:
        self._state_ref = self.state
        self._state_len = len(self.state)

    def _plan(self, index: int, group: dict[str, Any]):
        """(plan, grads) for the group, or (None, None) when no param of it has a grad."""
        params = group["params"]
        keys = self._state_keys_for(group)
        plan = self._plans.get(index)
        if plan is not None and plan.matches(params, keys):
            if plan.fetch_native():
                return plan, None  # each bucket's C++ plan holds its grads until its step
            grads = [p.grad for p in plan.live]
            if all(g is not None for g in grads) and all(p.grad is None for p in plan.dead):
                return (plan, grads) if grads else (None, None)
        plan = self._build_plan(index, group, params, keys)
        self._plans[index] = plan
        if not plan.live:
            return None, None
        return plan, [p.grad for p in plan.live]

    def _build_plan(self, index: int, group: dict, params: list, keys: tuple) -> Plan:
        self._prune_early_masters()
        where = f"{self._name}: param group {index}"
        live, dead = [], []
        for i, p in enumerate(params):
            g = p.grad
            if g is None:
                dead.append(p)
                continue
            if g.is_sparse:
                raise RuntimeError(
                    f"{where}: parameter {i} has a sparse gradient; {self._name} does not support "
                    "sparse gradients (torch.optim.SparseAdam does)"
                )
            live.append(p)
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
                    elif t.device != p.device:
                        t = state[k] = t.to(p.device)
                    b.state[k].append(t)
                if masters is not None:
                    m = state.get(MASTER_KEY)
                    if m is None:
                        m = self._early_masters.pop(p, None)
                        if m is not None:
                            state[MASTER_KEY] = m
                    if m is None or m.device != p.device or m.dtype != torch.float32:
                        m = state[MASTER_KEY] = (
                            p.detach().float() if m is None else m.to(p.device, torch.float32)
                        )
                    masters.append(m)
                b.fresh.append(fresh)
                b.params.append(p)
            b.masters = masters
            b.work = masters if masters is not None else b.params
            plan.live.extend(members)
            b.stop = len(plan.live)
            plan.buckets.append(b)
        for b in plan.buckets:
            b.native = self._native_plan(group, b)
        plan.native = bool(plan.buckets) and all(b.native is not None for b in plan.buckets)
        return plan

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
            found = grad_scaler._check_inf_per_device(self)
            found_inf = sum(t.to(device, non_blocking=True) for t in found.values())
            return Scaling(self, grad_scaler._get_scale_async(), found_inf)
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
            m = self._early_masters.get(p)
            if m is None:
                m = self._early_masters[p] = p.detach().float()
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
        self.__dict__.setdefault("_state_len", -1)

    def _normalize_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Subclasses convert foreign layouts (torch's, apex's) here; returns a new dict."""
        return state_dict

    def _saved_state_value(self, p: torch.Tensor, key, value):
        """How a saved state tensor is restored: on the param's device, in its saved dtype
        (torch would cast floating state to the param's dtype and lose fp32 moments and
        masters of fp16/bf16 params)."""
        if key == MASTER_KEY:
            return value.to(device=p.device, dtype=torch.float32)
        return value.to(device=p.device)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, keeping each state tensor's saved dtype (fp32 moments and
        masters of fp16/bf16 params stay fp32) and moving group tensors (lr, step when
        capturable) to the group's device."""
        state_dict = self._normalize_state_dict(dict(state_dict))
        saved = state_dict["state"]
        saved_groups = state_dict["param_groups"]
        super().load_state_dict(state_dict)
        self._early_masters.clear()  # as the state they stood in for: the loaded one decides
        ids = [i for g in saved_groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            if i not in saved:
                continue
            entry = self.state[p]
            for key, value in saved[i].items():
                if isinstance(value, torch.Tensor):
                    entry[key] = self._saved_state_value(p, key, value)
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
