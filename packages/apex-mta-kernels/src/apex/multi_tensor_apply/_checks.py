"""Argument checks of the reference path; the same rules, exception types and words as the CUDA
launcher's (csrc/checks.h), so both paths refuse the same input the same way."""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def layouts(t: torch.Tensor) -> int:
    """Bit mask of the memory formats ``t`` is dense in: 1 contiguous, 2 channels_last, 4 3d."""
    m = 1 if t.is_contiguous() else 0
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        m |= 2
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        m |= 4
    return m


def check_noop_flag(op: str, noop_flag: torch.Tensor) -> None:
    if noop_flag.dtype != torch.int32:
        raise TypeError(f"{op}: noop_flag must be an int32 tensor, got {noop_flag.dtype}")
    if noop_flag.numel() < 1:
        raise ValueError(f"{op}: noop_flag must have at least one element")


def check_lists(
    op: str,
    lists: dict[str, Sequence[torch.Tensor]],
    noop_flag: torch.Tensor,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
) -> None:
    """Every list the same length; every tensor on noop_flag's device, of a supported dtype,
    dense, and the same size and memory format as the tensor at its position in the first list."""
    check_noop_flag(op, noop_flag)
    dev = noop_flag.device
    names = list(lists)
    first = names[0]
    n = len(lists[first])
    for name in names:
        if len(lists[name]) != n:
            raise ValueError(
                f"{op}: {name} has {len(lists[name])} tensors but {first} has {n}; "
                "the lists must be the same length"
            )
    supported = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    for i in range(n):
        ref = lists[first][i]
        for name in names:
            t = lists[name][i]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: {name}[{i}] is a {type(t).__name__}, not a tensor")
            if t.device != dev:
                raise ValueError(
                    f"{op}: {name}[{i}] is on {t.device} but noop_flag is on {dev}; "
                    "every tensor must be on one device"
                )
            if t.dtype not in dtypes:
                raise TypeError(f"{op}: {name}[{i}] has dtype {t.dtype}; supported: {supported}")
            if t.numel() != ref.numel():
                raise ValueError(
                    f"{op}: {name}[{i}] has {t.numel()} elements but {first}[{i}] has {ref.numel()}"
                )
            fmt = layouts(t)
            if not fmt:
                raise ValueError(
                    f"{op}: {name}[{i}] is not contiguous "
                    "(contiguous or channels_last memory format required)"
                )
            if t.numel() > 1 and not fmt & layouts(ref):
                raise ValueError(
                    f"{op}: {name}[{i}] has strides {list(t.stride())} but {first}[{i}] has "
                    f"{list(ref.stride())}; tensors at one position must share a memory format"
                )
