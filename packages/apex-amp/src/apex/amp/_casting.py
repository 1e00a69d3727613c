"""Casting helpers: inputs and outputs of patched forwards, and the cast policies of O1's
registered functions (half, float, promote) applied while autocast is on."""

from __future__ import annotations

import copy

import torch


def is_floating(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def cast_tree(value, dtype: torch.dtype):
    """``value`` with every floating-point tensor inside (tensors, and dicts, lists and tuples of
    them, recursively) cast to ``dtype``; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, dict):
        return _cast_dict(value, dtype)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(cast_tree(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_tree(v, dtype) for v in value)
    return value


def _cast_dict(value: dict, dtype: torch.dtype) -> dict:
    """A dict of the same type with its values cast: built from the pairs where the type's
    constructor takes them (dict, OrderedDict, transformers' ModelOutput); else (defaultdict, a
    subclass with its own arguments) a shallow copy with the items replaced; else a plain dict
    (apex's result for every mapping)."""
    items = [(k, cast_tree(v, dtype)) for k, v in value.items()]
    kind = type(value)
    if kind is dict:
        return dict(items)
    try:
        out = kind(items)
    except (TypeError, ValueError):
        out = None
    if out is not None and len(out) == len(items):
        return out
    try:
        out = copy.copy(value)
        for k, v in items:
            out[k] = v
    except (TypeError, ValueError, AttributeError, copy.Error):
        return dict(items)
    return out


def _floats(value, found: list) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            found.append(value.dtype)
    elif isinstance(value, dict):
        for v in value.values():
            _floats(v, found)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _floats(v, found)


def widest_dtype(args, kwargs) -> torch.dtype | None:
    found: list = []
    _floats(args, found)
    _floats(kwargs, found)
    if not found:
        return None
    widest = found[0]
    for dtype in found[1:]:
        widest = torch.promote_types(widest, dtype)
    return widest


def _autocast_on_legacy(device_type: str) -> bool:  # torch < 2.4 took no device
    if device_type == "cpu":
        return torch.is_autocast_cpu_enabled()
    return torch.is_autocast_enabled()


def _pick_autocast_on():
    try:
        torch.is_autocast_enabled("cpu")
    except TypeError:
        return _autocast_on_legacy
    return torch.is_autocast_enabled  # takes the device type itself (torch >= 2.4)


# Chosen once: O1's wrapped functions ask on every call.
autocast_on = _pick_autocast_on()
