"""apex.amp: apex's automatic mixed precision, from the distribution apex-amp.

apex's amp API on torch.autocast and the multi-tensor kernels: ``initialize`` (O0-O3, fp16 or
bf16), ``scale_loss``, dynamic loss scaling, fp32 master weights, ``master_params``,
``state_dict``/``load_state_dict``, O1's function registry (``register_*_function``, the
``*_function`` decorators, ``init``, ``disable_casts``) and ``_amp_state``. README.md has the
details and what differs from apex.

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
    "_amp_state",
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "reset",
    "scale_loss",
    "state_dict",
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
            f"apex.amp (apex-amp) cannot be imported: {problem}. "
            "To fix it, remove the other apex with `pip uninstall apex`, then reinstall the "
            "apex-* packages: `pip install --force-reinstall apex-mta-kernels apex-amp` "
            "(and any other apex-* package you use)."
        )
    _apex.check_namespace("amp")

    from apex.multi_tensor_apply import require_kernel_abi

    require_kernel_abi("apex-amp", 1, 1)


_check_environment()

# The API, after the check (E402).
from ._amp_state import _amp_state, master_params  # noqa: E402
from .amp import (  # noqa: E402
    float_function,
    half_function,
    init,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from .frontend import initialize, load_state_dict, reset, state_dict  # noqa: E402
from .handle import disable_casts, scale_loss  # noqa: E402
