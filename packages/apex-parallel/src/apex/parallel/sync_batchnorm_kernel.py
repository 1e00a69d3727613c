"""apex's autograd Function of its pure-Python SyncBatchNorm, with that Function's argument list:
``SyncBatchnormFunction.apply(input, weight, bias, mean, var, eps, process_group=None,
world_size=None)``.

The caller gives the statistics (in apex, the module's batch mean and biased variance, already
averaged over the ranks); the input ``(N, C, *)`` is normalised by them. The backward treats them
as the batch's: the input gradient keeps the batch-mean terms, their sums all-reduced over
``process_group`` (the default group for None) when torch.distributed is initialised (as apex's,
which averaged the ranks' means and so assumed equal batch sizes; here the sums and the element
counts are reduced, exact for any sizes, so ``world_size`` is not needed and only accepted).
Weight and bias gradients are this rank's, as any parameter's before DDP reduces them. The
module itself, apex.parallel.SyncBatchNorm, runs optimized_sync_batchnorm_kernel's Function;
this one is for code that calls apex's directly. Same kernels (the apex_parallel ops).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .optimized_sync_batchnorm_kernel import (
    _DYNAMO_READS_NEEDS_INPUT_GRAD,
    _backward,
    _backward_reduce,
    _check_channel_vectors,
    _direct,
    _forward,
    _not_twice,
    _param_grads,
    _running_stats,
)

__all__ = ["SyncBatchnormFunction"]


def _check(input, weight, bias, mean, var) -> None:
    if input.dim() < 2:
        raise ValueError(
            f"SyncBatchnormFunction: expected an (N, C, *) input, got shape {tuple(input.shape)}"
        )
    c = input.shape[1]
    for name, t in (("running_mean", mean), ("running_variance", var)):
        if t is None or t.shape != (c,):
            raise ValueError(
                f"SyncBatchnormFunction: {name} must be a tensor of the {c} channels' values, "
                f"got {None if t is None else tuple(t.shape)}"
            )
    _check_channel_vectors({"weight": weight, "bias": bias}, c)


class SyncBatchnormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, input, weight, bias, running_mean, running_variance, eps, process_group=None,
        world_size=None,
    ):  # fmt: skip
        """``running_mean`` / ``running_variance`` (apex's names): the statistics ``input`` is
        normalised by, treated by the backward as the batch's (see the module docstring)."""
        _check(input, weight, bias, running_mean, running_variance)
        ctx.process_group = process_group
        if not _DYNAMO_READS_NEEDS_INPUT_GRAD:
            ctx.grads_needed = tuple(
                t is not None and t.requires_grad for t in (input, weight, bias)
            )
        stats = _running_stats(input, running_mean, running_variance)
        with _direct():
            out, saved = _forward(
                input, stats, None, weight, bias, None, None, None, eps, 0.0, False
            )
        ctx.save_for_backward(input, weight, saved)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, saved = ctx.saved_tensors
        c = x.shape[1]
        needs = ctx.needs_input_grad if _DYNAMO_READS_NEEDS_INPUT_GRAD else ctx.grads_needed
        need_input, need_weight, need_bias = needs[:3]
        with _direct():
            sums, grad_weight, grad_bias = _backward_reduce(grad_output, x, saved, weight, None)
        grad_input = None
        if need_input:
            if dist.is_available() and dist.is_initialized():
                # The sums and the element counts of every rank, in one all_reduce.
                both = torch.cat([sums, saved[2 * c :].float()])
                dist.all_reduce(both, op=dist.ReduceOp.SUM, group=ctx.process_group)
                sums = both[: 2 * c]
                saved = torch.cat([saved[: 2 * c], both[2 * c :].to(saved.dtype)])
            with _direct():
                grad_input = _backward(grad_output, x, saved, weight, sums, None)
        grad_weight, grad_bias = _param_grads(
            ctx, weight, grad_weight, grad_bias, need_weight, need_bias
        )
        grads = (grad_input, grad_weight, grad_bias, None, None, None, None, None)
        return _not_twice(grads) if torch.is_grad_enabled() else grads
