"""apex.multi_tensor_apply: multi-tensor-apply kernels, their plain-torch references, and the
extension builder every apex package compiles its kernels with.

Importing this package registers the ``apex_mta::*`` op schemas with torch.library and nothing
more: no compile, no subprocess, no CUDA initialisation. Kernels are compiled on first use.
"""

from __future__ import annotations

import apex as _apex

from . import ops  # noqa: F401  (registers the apex_mta:: schemas, fakes and reference kernels)
from ._abi import require_kernel_abi
from ._version import KERNEL_ABI, __version__

__all__ = [
    "KERNEL_ABI",
    "MultiTensorApply",
    "__version__",
    "multi_tensor_applier",
    "ops",
    "require_kernel_abi",
]

if getattr(_apex, "_NAMESPACE_OWNER", None) != "apex-mta-kernels":  # pragma: no cover
    import warnings

    warnings.warn(
        "apex/__init__.py is not apex-mta-kernels' own (NVIDIA apex was probably installed over it); "
        "run `python -m apex.multi_tensor_apply` for a report",
        RuntimeWarning,
        stacklevel=2,
    )


class MultiTensorApply:
    """apex's launcher object: ``applier(op, noop_flag, tensor_lists, *args)`` calls
    ``op(chunk_size, noop_flag, tensor_lists, *args)``.

    ``available`` is the probe clients use to ask whether fused kernels can run. Here it is True
    whenever ``amp_C`` imports, which it always does: with no compiler the ops run their
    plain-torch reference (see ``python -m apex.multi_tensor_apply``).
    """

    available = False
    warned = False
    import_err: Exception | None = None

    def __init__(self, chunk_size: int):
        try:
            import amp_C  # noqa: F401

            MultiTensorApply.available = True
            self.chunk_size = chunk_size
        except ImportError as err:  # pragma: no cover - only when amp_C is shadowed or missing
            MultiTensorApply.available = False
            MultiTensorApply.import_err = err

    def check_avail(self) -> None:
        if not MultiTensorApply.available:
            raise RuntimeError(
                "Attempted to call MultiTensorApply method, but MultiTensorApply is not available: "
                "the top-level module amp_C could not be imported. Original import error message:",
                MultiTensorApply.import_err,
            )

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        self.check_avail()
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)
