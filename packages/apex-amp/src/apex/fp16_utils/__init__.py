"""apex.fp16_utils: apex's fp16 helpers, from the distribution apex-amp.

Apex's deprecated fp16 helpers, kept for old scripts: FP16_Optimizer, network_to_half,
FP16Model, convert_network, the master-parameter helpers (copies through the multi-tensor
kernels) and the loss scalers. New code uses ``apex.amp`` or torch.autocast.

Importing it first checks that:

- ``apex/__init__.py`` is the one apex-mta-kernels ships (NVIDIA apex installed over it replaces
  it, and uninstalling NVIDIA apex deletes it);
- no distribution named ``apex`` (NVIDIA apex, or the unrelated PyPI project) shares a directory
  with the apex-* packages;
- the installed apex-mta-kernels has a kernel ABI this package was built for.
"""

from __future__ import annotations

import apex as _apex

__all__ = [
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Optimizer",
    "LossScaler",
    "__version__",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
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
            f"apex.fp16_utils (apex-amp) cannot be imported: {problem}. "
            "To fix it, remove the other apex with `pip uninstall apex`, then reinstall the "
            "apex-* packages: `pip install --force-reinstall apex-mta-kernels apex-amp` "
            "(and any other apex-* package you use)."
        )
    _apex.check_namespace("fp16_utils")

    from apex.multi_tensor_apply import require_kernel_abi

    require_kernel_abi("apex-amp", 1, 1)


_check_environment()

from apex.amp._version import __version__  # noqa: E402  (after the check)

from .fp16_optimizer import FP16_Optimizer  # noqa: E402
from .fp16util import (  # noqa: E402
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from .loss_scaler import DynamicLossScaler, LossScaler  # noqa: E402
