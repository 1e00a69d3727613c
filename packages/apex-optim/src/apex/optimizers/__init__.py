"""apex.optimizers: apex's fused optimizers, from the distribution apex-optim.

FusedAdam, FusedLAMB, FusedSGD, FusedNovoGrad, FusedAdagrad and FusedMixedPrecisionLamb with
apex's constructors, on the multi-tensor kernels of apex-mta-kernels (any device: CPU runs their
plain-torch reference), and ``clip_grad_norm_``, torch.nn.utils.clip_grad_norm_ on the fused
L2-norm kernel. README.md says what each adds to apex (bf16, fp32 master weights in state_dict,
GradScaler's fused protocol, capturable steps, torch checkpoint conversion).

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
    "FusedAdagrad",
    "FusedAdam",
    "FusedLAMB",
    "FusedMixedPrecisionLamb",
    "FusedNovoGrad",
    "FusedSGD",
    "__version__",
    "clip_grad_norm_",
    "fused_adam_state_to_torch",
    "torch_state_to_fused_adam",
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
            f"apex.optimizers (apex-optim) cannot be imported: {problem}. "
            "To fix it, remove the other apex with `pip uninstall apex`, then reinstall the "
            "apex-* packages: `pip install --force-reinstall apex-mta-kernels apex-optim` "
            "(and any other apex-* package you use)."
        )
    _apex.check_namespace("optimizers")

    from apex.multi_tensor_apply import require_kernel_abi

    require_kernel_abi("apex-optim", 1, 1)


_check_environment()

from .clip_grad import clip_grad_norm_  # noqa: E402
from .fused_adagrad import FusedAdagrad  # noqa: E402
from .fused_adam import FusedAdam, fused_adam_state_to_torch, torch_state_to_fused_adam  # noqa: E402
from .fused_lamb import FusedLAMB  # noqa: E402
from .fused_mixed_precision_lamb import FusedMixedPrecisionLamb  # noqa: E402
from .fused_novograd import FusedNovoGrad  # noqa: E402
from .fused_sgd import FusedSGD  # noqa: E402
