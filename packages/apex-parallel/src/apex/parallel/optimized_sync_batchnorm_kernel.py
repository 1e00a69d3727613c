"""The autograd Function behind SyncBatchNorm: local Welford statistics, one all_gather of
``(mean, biased var, count)`` per call (so ranks may hold different batch sizes, or none), the
merge, the elementwise forward; in backward, the local reductions, one all_reduce of
``(sum_dy, sum_dy_xmu)`` and the elementwise input gradient.

Inputs arrive in a canonical layout, ``(N, C, L)`` or ``(M, C)`` contiguous (see ops.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import ops

_all_gather_flat = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None
)

_ops = torch.ops.apex_parallel

# torch.compile traces backward() too. Its dynamo reads ctx.needs_input_grad from torch 2.4 on
# (pytorch#123700); torch 2.3's raises Unsupported on it, so there forward() records the same
# tuple itself (needs_input_grad is each tensor input's requires_grad at apply()).
_DYNAMO_READS_NEEDS_INPUT_GRAD = torch.torch_version.TorchVersion(torch.__version__) >= (2, 4)


def gather_stats(mean, var, count: int, process_group, world_size: int):
    """``[W, C]`` means and variances and ``[W]`` counts of every rank in ``process_group``."""
    if world_size == 1:
        return mean.view(1, -1), var.view(1, -1), mean.new_full((1,), float(count))
    local = torch.cat([mean, var, mean.new_full((1,), float(count))])
    gathered = local.new_empty((world_size * local.numel(),))
    _all_gather_flat(gathered, local, group=process_group)
    gathered = gathered.view(world_size, -1)
    c = mean.numel()
    return gathered[:, :c].contiguous(), gathered[:, c : 2 * c].contiguous(), gathered[:, 2 * c]


class SyncBatchnormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        input,
        z,
        weight,
        bias,
        running_mean,
        running_var,
        eps,
        momentum,
        process_group,
        world_size,
        fuse_relu,
    ):
        count = input.numel() // input.shape[1]
        if count == 1 and world_size == 1:
            raise ValueError(
                "SyncBatchNorm: expected more than 1 value per channel when training, got an "
                f"input of canonical shape {tuple(input.shape)}"
            )
        mean, var = ops.welford_mean_var(input)
        means, vars_, counts = gather_stats(mean, var, count, process_group, world_size)
        mean, var_unbiased, inv_std = ops.welford_parallel(
            means.contiguous(), vars_.contiguous(), counts, eps
        )
        if running_mean is not None:
            with torch.no_grad():
                running_mean.lerp_(mean.to(running_mean.dtype), momentum)
                running_var.lerp_(var_unbiased.to(running_var.dtype), momentum)
        out = ops.batchnorm_forward(input, mean, inv_std, weight, bias, z, fuse_relu)
        ctx.save_for_backward(input, weight, mean, inv_std, counts, out if fuse_relu else None)
        ctx.process_group = process_group
        ctx.world_size = world_size
        ctx.fuse_relu = fuse_relu
        ctx.has_z = z is not None
        if not _DYNAMO_READS_NEEDS_INPUT_GRAD:
            ctx.grads_needed = tuple(
                t is not None and t.requires_grad for t in (input, z, weight, bias)
            )
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, inv_std, counts, out = ctx.saved_tensors
        dy = grad_output.contiguous()
        if ctx.fuse_relu:
            dy = dy.masked_fill(out <= 0, 0)
        needs = ctx.needs_input_grad if _DYNAMO_READS_NEEDS_INPUT_GRAD else ctx.grads_needed
        need_input, need_z, need_weight, need_bias = needs[:4]
        # The ops themselves, not ops.py's checked wrappers: forward() checked input, weight,
        # mean and inv_std, and dy is contiguous. torch 2.3's torch.compile traces backward()
        # in a strict mode that refuses the wrappers' is_contiguous() (later torch relaxes it).
        sum_dy, sum_dy_xmu, grad_weight, grad_bias = _ops.batchnorm_backward_reduce(
            dy, input, mean, inv_std
        )
        grad_input = None
        if need_input:
            if ctx.world_size > 1:
                both = torch.cat([sum_dy, sum_dy_xmu])
                dist.all_reduce(both, op=dist.ReduceOp.SUM, group=ctx.process_group)
                sum_dy, sum_dy_xmu = both.chunk(2)
            grad_input = _ops.batchnorm_backward(
                dy, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, counts.contiguous()
            )
        grad_z = dy if (ctx.has_z and need_z) else None
        if weight is None or not need_weight:
            grad_weight = None
        elif grad_weight.dtype != weight.dtype:
            grad_weight = grad_weight.to(weight.dtype)
        if ctx.bias_dtype is None or not need_bias:
            grad_bias = None
        elif grad_bias.dtype != ctx.bias_dtype:
            grad_bias = grad_bias.to(ctx.bias_dtype)
        return grad_input, grad_z, grad_weight, grad_bias, None, None, None, None, None, None, None
