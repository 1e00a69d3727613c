"""``clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_`` with the L2 norm on the multi-tensor kernel
(``apex.contrib.clip_grad.clip_grad_norm_``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from apex.multi_tensor_apply import ops

__all__ = ["clip_grad_norm_"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clips the gradient norm of ``parameters`` in place; returns the total norm.

    The norm is taken over all gradients together, as if concatenated into one vector, and the
    grads are multiplied by ``min(1, max_norm / (total_norm + 1e-6))``, exactly as
    ``torch.nn.utils.clip_grad_norm_`` does. For ``norm_type=2`` the norms come from the fused
    ``multi_tensor_l2norm`` kernel, one launch per device for float32, float16 and bfloat16 grads
    together (math in float32), and the scaling from one foreach multiply per device: no host
    sync, unless ``error_if_nonfinite`` asks to check the norm. Other norm types, and grads of
    other dtypes, go to ``torch.nn.utils.clip_grad_norm_``. ``foreach`` is accepted for torch's
    signature and ignored.

    Returns the total norm as a float32 0-dim tensor on the first grad's device (apex returned
    it on the first CUDA grad's device); ``torch.tensor(0.)`` when no param has a grad.
    """
    del foreach
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if not parameters:
        return torch.tensor(0.0)
    grads = [p.grad.detach() for p in parameters]
    if norm_type != 2.0 or any(g.dtype not in _KERNEL_DTYPES or g.is_sparse for g in grads):
        return torch.nn.utils.clip_grad_norm_(
            parameters, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    first = grads[0].device
    norms = []
    for device, group in by_device.items():
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        total, _ = ops.multi_tensor_l2norm(group, flag, False)
        norms.append(total.to(first, non_blocking=True))
    if len(norms) == 1:
        total_norm = norms[0].reshape(())
    else:
        total_norm = torch.linalg.vector_norm(torch.cat(norms))
    if error_if_nonfinite and bool(torch.logical_or(total_norm.isnan(), total_norm.isinf())):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
            "it cannot be clipped. To disable this error and scale the gradients by the non-finite "
            "norm anyway, set `error_if_nonfinite=False`"
        )
    clip_coef = max_norm / (total_norm + 1e-6)
    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    coefs = {}
    for (device, _), group in by_kind.items():
        if device not in coefs:
            coefs[device] = clip_coef_clamped.to(device, non_blocking=True)
        torch._foreach_mul_(group, coefs[device])
    return total_norm
