"""apex.parallel: apex's data-parallel tools, from the distribution apex-parallel.

SyncBatchNorm (own Welford CUDA kernels, plain-torch references on CPU), convert_syncbn_model,
create_syncbn_process_group, DistributedDataParallel, Reducer, flat_dist_call (in
``apex.parallel.distributed``) and LARC (``apex.parallel.LARC``), on torch.distributed.

Importing it first checks that:

- ``apex/__init__.py`` is the one apex-mta-kernels ships (NVIDIA apex installed over it replaces
  it, and uninstalling NVIDIA apex deletes it);
- no distribution named ``apex`` (NVIDIA apex, or the unrelated PyPI project) shares a directory
  with the apex-* packages;
- the installed apex-mta-kernels has a kernel ABI this package was built for.
"""

from __future__ import annotations

import apex as _apex

from ._version import __version__

__all__ = [
    "__version__",
    "ReduceOp",
    "DistributedDataParallel",
    "Reducer",
    "SyncBatchNorm",
    "convert_syncbn_model",
    "create_syncbn_process_group",
]


def _check_environment() -> None:
    owner = getattr(_apex, "_NAMESPACE_OWNER", None)
    if owner != "apex-mta-kernels":
        init = getattr(_apex, "__file__", None)
        if init is None:
            problem = (
                "apex/__init__.py is missing: apex-mta-kernels is not installed, or uninstalling "
                "NVIDIA apex (`pip uninstall apex`) deleted the file apex-mta-kernels ships"
            )
        else:
            problem = (
                f"{init} is not the apex/__init__.py that apex-mta-kernels ships: NVIDIA apex (or "
                "the unrelated PyPI project 'apex') was installed over it"
            )
        raise ImportError(
            f"apex.parallel (apex-parallel) cannot be imported: {problem}. "
            "To fix it, remove the other apex with `pip uninstall apex`, then reinstall the "
            "apex-* packages: `pip install --force-reinstall apex-mta-kernels apex-parallel` "
            "(and any other apex-* package you use)."
        )
    _apex.check_namespace("parallel")

    from apex.multi_tensor_apply import require_kernel_abi

    require_kernel_abi("apex-parallel", 1, 1)


_check_environment()


import torch  # noqa: E402
import torch.distributed as _dist  # noqa: E402

from . import LARC  # noqa: E402, F401  (the submodule, as apex: apex.parallel.LARC.LARC(opt))
from .distributed import DistributedDataParallel, Reducer  # noqa: E402
from .optimized_sync_batchnorm import SyncBatchNorm  # noqa: E402

ReduceOp = _dist.ReduceOp if _dist.is_available() else None


def convert_syncbn_model(module, process_group=None, channel_last=False):
    """``module`` with every BatchNorm1d/2d/3d (any ``_BatchNorm``, torch's SyncBatchNorm
    included) replaced by apex.parallel.SyncBatchNorm; InstanceNorm layers stay.

    The new layers share the running statistics and ``num_batches_tracked`` tensors of the old
    ones, copy their weights and biases (and ``requires_grad``) and training mode, and get
    ``process_group`` and ``channel_last``. Returns the converted module (a new one when
    ``module`` itself is a BatchNorm).
    """
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.instancenorm import _InstanceNorm

    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, _InstanceNorm):
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            channel_last=channel_last,
        )
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        if module.affine:
            with torch.no_grad():
                converted.weight = torch.nn.Parameter(
                    module.weight.detach().clone(), requires_grad=module.weight.requires_grad
                )
                converted.bias = torch.nn.Parameter(
                    module.bias.detach().clone(), requires_grad=module.bias.requires_grad
                )
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return converted


def create_syncbn_process_group(group_size):
    """The process group of this rank when the world is split into groups of ``group_size``
    consecutive ranks (every rank creates every group, as torch requires); ``None`` (the whole
    world) for ``group_size`` 0."""
    if group_size == 0:
        return None
    if not (_dist.is_available() and _dist.is_initialized()):
        raise RuntimeError(
            "create_syncbn_process_group needs torch.distributed initialised first "
            "(torch.distributed.init_process_group)"
        )
    world_size = _dist.get_world_size()
    if group_size < 0 or group_size > world_size or world_size % group_size != 0:
        raise ValueError(
            f"create_syncbn_process_group: group_size {group_size} must divide the world size "
            f"{world_size}"
        )
    rank = _dist.get_rank()
    mine = None
    for first in range(0, world_size, group_size):
        ranks = list(range(first, first + group_size))
        group = _dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine
