"""The autograd Function behind SyncBatchNorm.

Forward: one op for this rank's statistics, packed as ``[mean, biased var, count]`` in one
float32 buffer (so ranks may hold different batch sizes, or none); one all_gather of that buffer;
one op that merges the ranks, updates the running estimates and ``num_batches_tracked`` on the
device (no host sync, also for ``momentum=None``) and normalises. Backward: one op for the local
reductions, packed as ``[sum_dy, sum_dy_xmu]``; one all_reduce of that buffer; one op for the
input gradient. With one rank there is nothing to exchange: one op per direction
(``syncbn_forward`` takes the statistics itself, ``syncbn_backward_local`` reduces and computes
the input gradient), the same kernels.

The ops take ``(N, C, *)`` tensors as they come, contiguous or channels_last (the CUDA kernels
read both in place); apex's ``channel_last`` layout ``(..., C)`` is flattened to ``(M, C)``
here, inside the Function, so autograd sees no extra view nodes. Inside the Function the ops
dispatch below the Autograd key (``_direct``): the Function is their autograd.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from . import ops  # noqa: F401 - defines the apex_parallel ops

_all_gather_flat = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None
)

_ops = torch.ops.apex_parallel
# The overloads themselves: calling them skips the packets' overload resolution on every call.
_stats = _ops.syncbn_stats.default
_forward = _ops.syncbn_forward.default
_backward_reduce = _ops.syncbn_backward_reduce.default
_backward = _ops.syncbn_backward.default
_backward_local = _ops.syncbn_backward_local.default

# torch.compile traces backward() too. Its dynamo reads ctx.needs_input_grad from torch 2.4 on
# (pytorch#123700); torch 2.3's raises Unsupported on it, so there forward() records the same
# tuple itself (needs_input_grad is each tensor input's requires_grad at apply()).
_DYNAMO_READS_NEEDS_INPUT_GRAD = torch.torch_version.TorchVersion(torch.__version__) >= (2, 4)

_is_compiling = torch.compiler.is_compiling
_below_autograd = torch._C._AutoDispatchBelowAutograd


def _direct():
    """The ops below the Autograd key (as apex-norm's Functions call theirs): its fallback would
    only redispatch. Not while dynamo traces, which does not know that context."""
    return contextlib.nullcontext() if _is_compiling() else _below_autograd()


_NOT_TWICE = (
    b"apex.parallel.SyncBatchNorm: its backward is not differentiable, so its gradients cannot "
    b"be differentiated again (create_graph=True); torch.nn.SyncBatchNorm's cannot either"
)


def _not_twice(grads: tuple) -> tuple:
    """The backward's gradients under create_graph=True (grad mode on there): raising when they
    are differentiated again, as torch's SyncBatchNorm does, instead of counting as constants
    (its kernels have no derivative) and leaving second-order terms silently out."""
    err = torch._C._functions.DelayedError(_NOT_TWICE, len(grads))
    return err(*[g.detach().requires_grad_() if g is not None else None for g in grads])


def gather_stats(stats: torch.Tensor, process_group, world_size: int) -> torch.Tensor:
    """Every rank's packed ``[mean, var, count]`` buffer, ``[W * (2C + 1)]`` (one all_gather)."""
    if world_size == 1:
        return stats
    gathered = stats.new_empty((world_size * stats.numel(),))
    _all_gather_flat(gathered, stats, group=process_group)
    return gathered


def _check_group_count(gathered: torch.Tensor, c: int, shape, world_size: int) -> None:
    """Not exactly one value per channel over the whole group, as torch's BatchNorm asks of one
    process (one value gives an unbiased variance of 0/0: NaN in running_var for good; none at
    all leaves the running statistics, as an empty batch does). Asked only by a rank with at
    most one value of its own (the host reads the gathered counts: a sync, on CUDA); where the
    group's total is one every rank has at most one, so every rank asks and raises alike: no
    rank is left waiting in the backward's all_reduce."""
    total = float(gathered.view(world_size, 2 * c + 1)[:, 2 * c].sum())
    if total == 1:
        raise ValueError(
            "SyncBatchNorm: expected more than 1 value per channel when training, got "
            f"{int(total)} over the process group's {world_size} ranks (an input of shape "
            f"{tuple(shape)} here)"
        )


def _world_size(process_group) -> int:
    """The group's size for a caller that gave none (apex's argument list): 1 without
    torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    size = dist.get_world_size(process_group)
    if size < 1:
        raise ValueError(
            "SyncBatchnormFunction: process_group does not include this rank "
            f"(rank {dist.get_rank()}); every rank that runs it must be a member"
        )
    return size


def _check_channel_vectors(vectors: dict, c: int) -> None:
    """Each given per-channel tensor of ``vectors`` (name -> tensor or None) holds C values."""
    for name, t in vectors.items():
        if t is not None and t.shape != (c,):
            raise ValueError(
                f"SyncBatchnormFunction: {name} must have shape ({c},) for the input's {c} "
                f"channels, got {tuple(t.shape)}"
            )


def _check_call(input, z, channel_last, vectors) -> None:
    """The arguments of a direct call (apex's list; the module checks its own): the input's
    rank, z of the input's shape, and the per-channel vectors of C values, running_mean and
    running_var both or neither."""
    if input.dim() < 2:
        raise ValueError(
            f"SyncBatchnormFunction: expected an input of 2 or more dims, got shape {tuple(input.shape)}"
        )
    if z is not None and z.shape != input.shape:
        raise ValueError(
            f"SyncBatchnormFunction: z must have the input's shape {tuple(input.shape)}, got "
            f"{tuple(z.shape)}"
        )
    _check_channel_vectors(vectors, input.shape[-1] if channel_last else input.shape[1])
    if (vectors["running_mean"] is None) != (vectors["running_var"] is None):
        raise ValueError(
            "SyncBatchnormFunction: give both running_mean and running_var, or neither"
        )


def _running_stats(x, running_mean, running_var) -> torch.Tensor:
    """``[running_mean, running_var, count]`` packed as one rank's statistics of ``x``
    ``(M, C, *)``: the forward op normalises by them."""
    if running_mean is None or running_var is None:
        raise ValueError(
            "SyncBatchnormFunction: track_running_stats=False normalises by the running "
            "estimates, so running_mean and running_var must be given"
        )
    count = x.new_full((1,), x.numel() // max(x.shape[1], 1), dtype=torch.float32)
    return torch.cat([running_mean.float(), running_var.float(), count])


def _param_grads(ctx, weight, grad_weight, grad_bias, need_weight: bool, need_bias: bool):
    """The weight and bias gradients the backward returns: None where there is no such input or
    none is needed; the bias's in its own dtype (without a weight the ops give float32)."""
    if weight is None or not need_weight:
        grad_weight = None
    if ctx.bias_dtype is None or not need_bias:
        grad_bias = None
    elif grad_bias.dtype != ctx.bias_dtype:
        grad_bias = grad_bias.to(ctx.bias_dtype)
    return grad_weight, grad_bias


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
        track_running_stats=True,
        momentum=1.0,
        process_group=None,
        channel_last=False,
        fuse_relu=False,
        world_size=None,
        num_batches_tracked=None,
    ):
        """apex's argument list, then two of this package's. ``track_running_stats`` (apex's
        name; its module passes ``training or not track_running_stats``): True normalises by
        the batch statistics of every rank in ``process_group`` and updates the running
        estimates when given; False normalises by ``running_mean`` / ``running_var``, locally,
        and its backward is that of the fixed affine map (torch's eval batch_norm; apex's
        subtracted batch-mean terms there). ``momentum``: the running-average factor, or None
        for ``1 / num_batches_tracked`` (``num_batches_tracked``, when given, is incremented on
        the device). ``channel_last``: ``input`` (and ``z``) are ``(..., C)``, else
        ``(N, C, *)`` in any memory format. ``world_size``: the group's size, looked up when
        None."""
        if world_size is None:  # a direct call: apex's argument list
            _check_call(input, z, channel_last, {
                "weight": weight, "bias": bias, "running_mean": running_mean,
                "running_var": running_var,
            })  # fmt: skip
        shape = input.shape
        x = input
        if channel_last and input.dim() != 2:
            x = input.reshape(-1, shape[-1])
            if z is not None:
                z = z.reshape(x.shape)
        c = x.shape[1]
        if not track_running_stats:
            # The running estimates as the one rank's statistics: no update, no exchange.
            stats, world_size = _running_stats(x, running_mean, running_var), 1
            running_mean = running_var = num_batches_tracked = None
            momentum = 0.0
        else:
            if world_size is None:
                world_size = _world_size(process_group)
            if world_size == 1 and c and x.numel() == c:
                raise ValueError(
                    "SyncBatchNorm: expected more than 1 value per channel when training, got an "
                    f"input of shape {tuple(shape)}"
                )
            if world_size == 1:
                stats = None  # syncbn_forward takes this rank's statistics itself
            else:
                with _direct():
                    stats = _stats(x)
                stats = gather_stats(stats, process_group, world_size)
                if c and x.numel() <= c:
                    _check_group_count(stats, c, shape, world_size)
        with _direct():
            out, saved = _forward(
                x, stats, z, weight, bias, running_mean, running_var, num_batches_tracked,
                eps, momentum, fuse_relu,
            )  # fmt: skip
        ctx.save_for_backward(x, weight, saved, out if fuse_relu else None)
        ctx.process_group = process_group
        ctx.world_size = world_size
        ctx.fixed = not track_running_stats
        ctx.has_z = z is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.shape = shape if x is not input else None
        if not _DYNAMO_READS_NEEDS_INPUT_GRAD:
            ctx.grads_needed = tuple(
                t is not None and t.requires_grad for t in (input, z, weight, bias)
            )
        return out if x is input else out.view(shape)

    @staticmethod
    def backward(ctx, grad_output):
        grads = SyncBatchnormFunction._grads(ctx, grad_output)
        return _not_twice(grads) if torch.is_grad_enabled() else grads

    @staticmethod
    def _grads(ctx, grad_output):
        x, weight, saved, out = ctx.saved_tensors
        dy = grad_output if ctx.shape is None else grad_output.reshape(x.shape)
        needs = ctx.needs_input_grad if _DYNAMO_READS_NEEDS_INPUT_GRAD else ctx.grads_needed
        need_input, need_z, need_weight, need_bias = needs[:4]
        grad_input = grad_weight = grad_bias = None
        if ctx.fixed:
            # Normalised by constants: the input gradient has no batch-mean terms (zero sums).
            if not (need_input or need_weight or need_bias):
                return (None,) * 14
            with _direct():
                sums, grad_weight, grad_bias = _backward_reduce(dy, x, saved, weight, out)
                if need_input:
                    grad_input = _backward(dy, x, saved, weight, torch.zeros_like(sums), out)
        elif need_input and ctx.world_size == 1:
            with _direct():
                grad_input, grad_weight, grad_bias = _backward_local(dy, x, saved, weight, out)
        elif need_input or (need_weight and weight is not None) or (need_bias and ctx.bias_dtype):
            with _direct():
                sums, grad_weight, grad_bias = _backward_reduce(dy, x, saved, weight, out)
            if need_input:
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=ctx.process_group)
                with _direct():
                    grad_input = _backward(dy, x, saved, weight, sums, out)
        if grad_input is not None and ctx.shape is not None:
            grad_input = grad_input.view(ctx.shape)
        grad_z = None
        if ctx.has_z and need_z:
            grad_z = dy if out is None else dy.masked_fill(out <= 0, 0)
            if ctx.shape is not None:
                grad_z = grad_z.view(ctx.shape)
        grad_weight, grad_bias = _param_grads(
            ctx, weight, grad_weight, grad_bias, need_weight, need_bias
        )
        return (
            grad_input, grad_z, grad_weight, grad_bias,
            None, None, None, None, None, None, None, None, None, None,
        )  # fmt: skip
