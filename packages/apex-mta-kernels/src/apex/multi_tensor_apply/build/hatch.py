"""The opt-in hatchling build hook every apex package with kernels uses for a platform wheel.

Each such package has a few-line ``hatch_build.py`` that calls ``aot_wheel`` from its hook's
``initialize`` (off unless ``HATCH_BUILD_HOOK_ENABLE_CUSTOM=1``):

    HATCH_BUILD_HOOK_ENABLE_CUSTOM=1 APEX_CUDA_ARCHS="8.0;9.0" \\
        pip wheel --no-build-isolation --no-deps packages/apex-norm

The build environment needs torch (a CUDA build), nvcc and, for the feature packages,
apex-mta-kernels, hence --no-build-isolation. The wheel then carries ``<package>/_prebuilt/``
(the library and its build.json), is tagged for this interpreter and platform, and pins the
torch minor it was built against; at run time the loader takes the prebuilt library when torch,
CUDA, source hash and arch fit, and never compiles.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
from pathlib import Path

DEFAULT_ARCHS = "8.0;9.0"


def _specs(package_dir: Path):
    """The KernelSpecs of ``package_dir/_kernels.py``, pointed at the sources being built (the
    package under build need not be importable)."""
    path = package_dir / "_kernels.py"
    module_spec = importlib.util.spec_from_file_location(f"_apex_build_{package_dir.name}", path)
    if module_spec is None or module_spec.loader is None:
        raise FileNotFoundError(f"no kernels to build: {path} is missing")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return [dataclasses.replace(s, directory=str(package_dir)) for s in module.KERNELS]


def aot_wheel(hook, build_data: dict, package: str) -> list[Path]:
    """Compile every kernel of the package at ``package`` (e.g. ``src/apex/normalization``,
    relative to the project root) for ``APEX_CUDA_ARCHS`` into its ``_prebuilt/`` and make the
    wheel a platform wheel that carries them and pins torch's minor version."""
    import torch

    from . import aot

    package_dir = Path(hook.root, package)
    archs = os.environ.get("APEX_CUDA_ARCHS", DEFAULT_ARCHS)
    libs = aot.build(archs, specs=_specs(package_dir), into_package=True)
    hook.app.display_info(f"{hook.metadata.name}: prebuilt {', '.join(map(str, libs))}")
    build_data["artifacts"].append(f"{package}/_prebuilt/*")
    build_data["pure_python"] = False
    build_data["infer_tag"] = True
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    build_data["dependencies"].append(f"torch=={major}.{minor}.*")
    return libs


def clean(hook, package: str) -> None:
    shutil.rmtree(Path(hook.root, package, "_prebuilt"), ignore_errors=True)
