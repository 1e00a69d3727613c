"""The ``apex`` namespace, shared by the apex-* distributions.

Only apex-mta-kernels ships this file. It does three cheap things and nothing else:

1. extends ``apex.__path__`` over every ``apex/`` directory on ``sys.path``, so installed wheels,
   editable installs and several ``src/`` folders on PYTHONPATH merge in any order;
2. resolves installed subpackages lazily on attribute access (PEP 562), so ``import apex;
   apex.optimizers.FusedAdam`` and ``hasattr(apex, "amp")`` tell the truth about what is installed;
3. turns ``import apex.<area>`` of an area that is not installed into a plain ImportError naming the
   distribution to install, and spots a foreign distribution called ``apex`` (NVIDIA apex, or the
   unrelated PyPI project) sharing a directory with ours.

It imports no torch, compiles nothing and touches no GPU.
"""

from __future__ import annotations

import os
import sys
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

# Feature packages check this marker: when it is missing, another distribution's apex/__init__.py
# (NVIDIA apex) has replaced this file.
_NAMESPACE_OWNER = "apex-mta-kernels"

# Every subpackage this project provides, and the distribution that provides it.
SUBPACKAGES = {
    "multi_tensor_apply": "apex-mta-kernels",
    "_autocast_utils": "apex-mta-kernels",
    "optimizers": "apex-optim",
    "normalization": "apex-norm",
    "parallel": "apex-parallel",
    "amp": "apex-amp",
    "fp16_utils": "apex-amp",
}


def __getattr__(name: str):
    if name not in SUBPACKAGES:
        raise AttributeError(f"module 'apex' has no attribute {name!r}")
    import importlib

    try:
        return importlib.import_module(f"apex.{name}")
    except _MissingSubpackage as exc:
        raise AttributeError(str(exc)) from None


def __dir__():
    return sorted(set(globals()) | {n for n in SUBPACKAGES if _installed(n)})


def _installed(name: str) -> bool:
    return any(
        os.path.isdir(os.path.join(p, name)) or os.path.isfile(os.path.join(p, name + ".py"))
        for p in __path__
    )


class _MissingSubpackage(ImportError):
    """``import apex.<area>`` where the distribution providing <area> is not installed."""


class _MissingSubpackageFinder:
    """Last entry of ``sys.meta_path``: reached only when no other finder found ``apex.<area>``."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        head, _, area = fullname.partition(".")
        if head != "apex" or "." in area or area not in SUBPACKAGES:
            return None
        dist = SUBPACKAGES[area]
        # A plain ImportError (not ModuleNotFoundError): `from apex import amp` then reports this
        # message instead of Python's generic "cannot import name".
        raise _MissingSubpackage(
            f"apex.{area} is not installed: it is provided by the distribution {dist!r}; "
            f"install it with `pip install {dist}` (never `pip install apex`, an unrelated project)",
            name=fullname,
        )

    @staticmethod
    def invalidate_caches():
        pass


if not any(isinstance(f, type) and f.__name__ == "_MissingSubpackageFinder" for f in sys.meta_path):
    sys.meta_path.append(_MissingSubpackageFinder)


def foreign_apex_distributions() -> list[str]:
    """Metadata folders of distributions named ``apex`` beside our ``apex/`` directories.

    NVIDIA apex installs a distribution ``apex`` (version 0.1) with its own ``apex/__init__.py``;
    PyPI's ``apex`` is an unrelated 2013 Pyramid toolkit. Either one overwrites files of ours.
    """
    found = []
    for parent in {os.path.dirname(p) for p in __path__}:
        try:
            entries = os.listdir(parent)
        except OSError:
            continue
        for entry in entries:
            low = entry.lower()
            if low.endswith((".dist-info", ".egg-info")) and (
                low.startswith("apex-") or low == "apex.egg-info"
            ):
                found.append(os.path.join(parent, entry))
    return sorted(found)


def check_namespace(area: str) -> None:
    """Called by each subpackage at import: refuse to run mixed with a foreign ``apex``.

    Set ``APEX_IGNORE_CONFLICTS=1`` to import anyway (at your own risk).
    """
    if os.environ.get("APEX_IGNORE_CONFLICTS") == "1":
        return
    foreign = foreign_apex_distributions()
    if foreign:
        raise ImportError(
            f"apex.{area}: a distribution named 'apex' is installed in the same place as the apex-* "
            f"packages ({', '.join(foreign)}). It is NVIDIA apex or the unrelated PyPI project 'apex', "
            "and it overwrites files of ours. Run `pip uninstall apex`, then reinstall the apex-* "
            "packages (`pip install --force-reinstall apex-mta-kernels ...`). "
            "Set APEX_IGNORE_CONFLICTS=1 to import anyway."
        )
