"""Ahead-of-time builds: the JIT builder run for a list of archs, with no GPU needed."""

from __future__ import annotations

import importlib
import json
import logging
import pkgutil
import shutil
from pathlib import Path

from .loader import LIB_SUFFIX, MARKER, _read_marker, compile_spec, find_cached
from .lock import FileLock
from .spec import KernelSpec, cache_root, normalize_archs

log = logging.getLogger("apex.multi_tensor_apply.build")


def discover_specs() -> list[KernelSpec]:
    """Every KernelSpec of every installed apex package (each lists them in ``apex.<area>._kernels``)."""
    import apex

    specs: list[KernelSpec] = []
    for info in sorted(pkgutil.iter_modules(apex.__path__), key=lambda m: m.name):
        if not info.ispkg:
            continue
        try:
            mod = importlib.import_module(f"apex.{info.name}._kernels")
        except ModuleNotFoundError as exc:
            if exc.name == f"apex.{info.name}._kernels":
                continue
            raise
        specs.extend(getattr(mod, "KERNELS", ()))
    return specs


def build(
    archs: str | list[str], specs: list[KernelSpec] | None = None, into_package: bool = False
) -> list[Path]:
    """Compile every spec for ``archs`` into the cache (reusing a finished build), and with
    ``into_package`` copy each library into its package's ``_prebuilt/`` for a platform wheel."""
    archs_t = normalize_archs(archs)
    out = []
    for spec in specs if specs is not None else discover_specs():
        wanted = archs_t if spec.needs_cuda else ()
        with FileLock(cache_root() / f"{spec.name}.lock"):
            lib = find_cached(spec, wanted)
            if lib is None or json.loads((lib.parent / MARKER).read_text())["archs"] != list(
                wanted
            ):
                lib = compile_spec(spec, wanted)
                if _read_marker(lib.parent) is None:  # its marker could not be written
                    raise OSError(f"{spec.name}: built at {lib.parent} but not marked there")
        if into_package:
            dest = spec.prebuilt_dir
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(lib, dest / f"{spec.name}{LIB_SUFFIX}")
            shutil.copy2(lib.parent / MARKER, dest / MARKER)
            lib = dest / f"{spec.name}{LIB_SUFFIX}"
        log.warning("apex: %s ready at %s", spec.name, lib)
        out.append(lib)
    return out


def clean_package(specs: list[KernelSpec] | None = None) -> None:
    for spec in specs if specs is not None else discover_specs():
        shutil.rmtree(spec.prebuilt_dir, ignore_errors=True)
