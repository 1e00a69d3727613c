"""apex.normalization: apex's fused layer norm and RMS norm, from the distribution apex-norm.

FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm and MixedFusedRMSNorm are here; the functional
forms and the autograd Functions live in ``apex.normalization.fused_layer_norm``, the ops in
``apex.normalization.ops`` (torch.library namespace ``apex_norm``). Importing compiles nothing:
the CUDA kernels are loaded (or compiled, once) on first use on a GPU.

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
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "__version__",
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
            f"apex.normalization (apex-norm) cannot be imported: {problem}. "
            "To fix it, remove the other apex with `pip uninstall apex`, then reinstall the "
            "apex-* packages: `pip install --force-reinstall apex-mta-kernels apex-norm` "
            "(and any other apex-* package you use)."
        )
    _apex.check_namespace("normalization")

    from apex.multi_tensor_apply import require_kernel_abi

    require_kernel_abi("apex-norm", 1, 1)


_check_environment()

from .fused_layer_norm import (  # noqa: E402 - after the environment checks
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
)
