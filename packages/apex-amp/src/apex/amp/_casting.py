"""Casting helpers: inputs and outputs of patched forwards, and the cast policies of O1's
registered functions (half, float, promote) applied while autocast is on."""

from __future__ import annotations

import torch


def is_floating(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def cast_tree(value, dtype: torch.dtype):
    """``value`` with every floating-point tensor inside (tensors, and dicts, lists and tuples of
    them, recursively) cast to ``dtype``; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, dict):
        return type(value)((k, cast_tree(v, dtype)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(cast_tree(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_tree(v, dtype) for v in value)
    return value


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


def autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 took no device
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled()
        return torch.is_autocast_enabled()
