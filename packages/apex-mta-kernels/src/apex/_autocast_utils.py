"""apex's autocast helpers, kept for code that imports them (NeMo's fused bias-GeLU, ...).

Built on the public torch.autocast API instead of the deprecated ``torch.cuda.amp`` private one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _get_autocast_dtypes() -> Sequence[torch.dtype]:
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return [torch.half, torch.bfloat16]
    return [torch.half]


def _get_current_dtype(dtype: torch.dtype | None = None) -> torch.dtype:
    if not torch.is_autocast_enabled():
        return torch.float if dtype is None else dtype
    return _autocast_dtype()


def _autocast_dtype() -> torch.dtype:
    try:
        return torch.get_autocast_dtype("cuda")
    except AttributeError:  # torch < 2.4
        return torch.get_autocast_gpu_dtype()


def _cast(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.is_cuda and value.dtype != torch.float64:
            return value.to(dtype)
        return value
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, dict):
        return {_cast(k, dtype): _cast(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _cast_if_autocast_enabled(*args):
    """``args`` unchanged outside autocast; inside, every floating CUDA tensor (recursively in
    lists, tuples and dicts) cast to the autocast dtype, as apex did."""
    if not torch.is_autocast_enabled():
        return args
    return _cast(args, _autocast_dtype())
