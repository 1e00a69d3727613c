"""apex.parallel.SyncBatchNorm: batch normalisation with statistics over every rank of a
process group, on this package's Welford kernels (CUDA) or their plain-torch references (CPU).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm

from .optimized_sync_batchnorm_kernel import SyncBatchnormFunction

__all__ = ["SyncBatchNorm"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_dist_available = dist.is_available()
_apply = SyncBatchnormFunction.apply
# Process group (None: the default one) -> world size, for the default group in "default";
# cleared when torch.distributed is initialised again. Held here, not on the modules, so that
# they still deepcopy and pickle.
_WORLD_SIZES: dict = {}


def _channels_last_format(x: torch.Tensor) -> bool:
    if x.dim() == 4:
        return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    if x.dim() == 5:
        return x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()
    return False


def _to_canonical(x: torch.Tensor, layout: str, c: int) -> torch.Tensor:
    """``x`` as the contiguous ``(N, C, L)`` or ``(M, C)`` tensor the kernels take."""
    if layout == "ncl":
        return x.contiguous().view(x.shape[0], c, math.prod(x.shape[2:]))
    if layout == "torch_cl":  # (N, C, *spatial) in channels_last memory format
        perm = (0, *range(2, x.dim()), 1)
        return x.permute(perm).reshape(x.numel() // c, c).contiguous()
    return x.reshape(x.numel() // c, c).contiguous()  # "mc": (..., C) with C last


def _from_canonical(y: torch.Tensor, layout: str, shape: torch.Size) -> torch.Tensor:
    if layout == "torch_cl":
        nhwc = (shape[0], *shape[2:], shape[1])
        inverse = (0, len(shape) - 1, *range(1, len(shape) - 1))
        return y.view(nhwc).permute(inverse)
    return y.view(shape)


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation whose batch statistics span every rank of ``process_group``.

    Arguments are apex's: ``num_features``, ``eps``, ``momentum`` (``None``: cumulative average
    over ``num_batches_tracked``, as torch does), ``affine``, ``track_running_stats``,
    ``process_group`` (``None``: the default group), ``channel_last`` and ``fuse_relu``.

    Input is ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)``, in float32,
    float16 or bfloat16 (statistics in float32). A 4-D/5-D input in torch's channels_last
    memory format is handled in place and returned in that format. ``channel_last=True``
    additionally accepts apex's layout: a contiguous tensor with the channels last, ``(N, H, W,
    C)``. ``forward(input, z=None)`` adds ``z`` (same shape as ``input``) after the
    normalisation and before the ReLU of ``fuse_relu``.

    Ranks may hold different batch sizes, or an empty batch. Every rank of the group must call
    forward (and backward) in training mode together. In eval mode with running statistics
    the running estimates are used; with ``track_running_stats=False`` each rank normalises by
    its own batch statistics, with no communication (as torch.nn.SyncBatchNorm, so evaluating on
    one rank alone never hangs).
    """

    def __init__(
        self,
        num_features,
        eps=1e-5,
        momentum=0.1,
        affine=True,
        track_running_stats=True,
        process_group=None,
        channel_last=False,
        fuse_relu=False,
    ):
        super().__init__(
            num_features,
            eps=eps,
            momentum=momentum,
            affine=affine,
            track_running_stats=track_running_stats,
        )
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _specify_process_group(self, process_group):
        self.process_group = process_group

    def _specify_channel_last(self, channel_last):
        self.channel_last = channel_last

    def extra_repr(self):
        return (
            super().extra_repr() + f", channel_last={self.channel_last}, fuse_relu={self.fuse_relu}"
        )

    def _check_input_dim(self, input):
        if input.dim() < 2 or input.dim() > 5:
            raise ValueError(
                "SyncBatchNorm: expected a 2-D to 5-D input ((N, C), (N, C, L), (N, C, H, W) or "
                f"(N, C, D, H, W)), got {input.dim()}-D input of shape {tuple(input.shape)}"
            )

    def _layout(self, input) -> str:
        c = self.num_features
        if input.dim() == 2:
            if input.shape[1] != c:
                raise ValueError(
                    f"SyncBatchNorm: expected input of shape (N, {c}), got {tuple(input.shape)}"
                )
            return "mc"
        if self.channel_last:
            if input.shape[-1] == c and input.is_contiguous():
                return "mc"
            if input.shape[1] == c and _channels_last_format(input):
                return "torch_cl"
            raise ValueError(
                f"SyncBatchNorm(channel_last=True): expected a contiguous input with the {c} "
                "channels last, (N, ..., C), or an (N, C, ...) tensor in torch.channels_last "
                f"memory format; got shape {tuple(input.shape)} with strides {input.stride()}"
                + (" (a contiguous NCHW tensor)" if input.is_contiguous() else "")
            )
        if input.shape[1] != c:
            raise ValueError(
                f"SyncBatchNorm: expected {c} channels in dimension 1, got input of shape "
                f"{tuple(input.shape)}"
            )
        return "nc"  # channels in dimension 1, any memory format ("torch_cl" or "ncl")

    def _group(self):
        """(process group, world size) of the synchronisation; world size 1 without one.

        Looked up once per group (_WORLD_SIZES): a group's size and this rank's membership never
        change, so no torch.distributed calls are made per step."""
        if not (_dist_available and dist.is_initialized()):
            return None, 1
        group = self.process_group
        if _WORLD_SIZES.get("default") is not dist.GroupMember.WORLD:  # (re)initialised
            _WORLD_SIZES.clear()
            _WORLD_SIZES["default"] = dist.GroupMember.WORLD
        world = _WORLD_SIZES.get(group)
        if world is not None:
            return group, world
        non_member = getattr(dist.GroupMember, "NON_GROUP_MEMBER", object())
        if group is not None and (group is non_member or dist.get_rank(group) < 0):
            raise ValueError(
                "SyncBatchNorm: process_group does not include this rank "
                f"(rank {dist.get_rank()}); every rank that runs this layer must be a member"
            )
        world = _WORLD_SIZES[group] = dist.get_world_size(group)
        return group, world

    def _tensors(self):
        """(weight, bias, running_mean, running_var, num_batches_tracked) from the module's own
        dicts (nn.Module.__getattr__ is a Python call per name); by attribute where something
        replaced one (torch.nn.utils.parametrize makes ``weight`` a property)."""
        p, b = self._parameters, self._buffers
        if "weight" in p and "bias" in p and "running_mean" in b and "running_var" in b:
            return (
                p["weight"],
                p["bias"],
                b["running_mean"],
                b["running_var"],
                b.get("num_batches_tracked"),
            )
        nbt = getattr(self, "num_batches_tracked", None)
        return self.weight, self.bias, self.running_mean, self.running_var, nbt

    def forward(self, input, z=None):
        if (
            not self.training
            and self.track_running_stats
            and not self.channel_last
            and not self.fuse_relu
            and z is None
        ):
            # apex's eval path: torch's batch_norm with the running estimates, which takes any
            # floating dtype (float64 too) and any rank; its own errors for the rest.
            weight, bias, running_mean, running_var, _ = self._tensors()
            return torch.nn.functional.batch_norm(
                input, running_mean, running_var, weight, bias, False, 0.0, self.eps
            )
        self._check_input_dim(input)
        layout = self._layout(input)
        if z is not None and z.shape != input.shape:
            raise ValueError(
                f"SyncBatchNorm: z must have the input's shape {tuple(input.shape)}, got {tuple(z.shape)}"
            )
        if input.dtype not in _FLOATS:
            raise TypeError(
                f"SyncBatchNorm: input dtype {input.dtype} is not supported (float32, float16, bfloat16)"
            )
        weight, bias, running_mean, running_var, nbt = self._tensors()
        if not self.training and running_mean is not None:
            return self._eval_forward(input, z, layout, weight, bias, running_mean, running_var)
        # The ops read (N, C, *) input in its own layout, contiguous or channels_last; apex's
        # (..., C) layout is flattened inside the Function (no autograd view nodes either way).
        flat = layout == "mc" and input.dim() > 2
        if not self.training:
            # No running statistics in eval: this rank's own batch statistics, no communication.
            return _apply(
                input, z, weight, bias, None, None, self.eps, True, 0.0, None, flat,
                self.fuse_relu, 1, None,
            )  # fmt: skip
        group, world = self._group()
        # num_batches_tracked is incremented, and momentum=None's factor 1 / num_batches_tracked
        # taken, on the device by the forward op: no host sync, no extra launch.
        if not self.track_running_stats:
            nbt = None
        momentum = self.momentum
        if momentum is None and nbt is None:
            momentum = 0.0
        return _apply(
            input, z, weight, bias, running_mean, running_var, self.eps, True, momentum, group,
            flat, self.fuse_relu, world, nbt,
        )  # fmt: skip

    def _eval_forward(self, input, z, layout, weight, bias, running_mean, running_var):
        """Normalisation by the running estimates (differentiable, local): torch's batch_norm,
        which takes the canonical (N, C, L) and (M, C) layouts as they are."""
        c = self.num_features
        if layout == "nc":
            layout = "torch_cl" if _channels_last_format(input) else "ncl"
        x = _to_canonical(input, layout, c)
        z = None if z is None else _to_canonical(z, layout, c)
        y = torch.nn.functional.batch_norm(
            x, running_mean, running_var, weight, bias, False, 0.0, self.eps
        )
        if z is not None:
            y = y + z
        if self.fuse_relu:
            y = torch.relu(y)
        return _from_canonical(y.contiguous(), layout, input.shape)
