"""NVIDIA apex's ``apex_C`` module: flatten a list of dense tensors into one, and back."""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D tensor holding every tensor's elements in order (same dtype)."""
    return _flatten_dense_tensors(tensors)


def unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors``."""
    return list(_unflatten_dense_tensors(flat, tensors))
