"""Opt-in ahead-of-time build hook: a platform wheel with the kernels compiled inside.

    HATCH_BUILD_HOOK_ENABLE_CUSTOM=1 APEX_CUDA_ARCHS="8.0;9.0" \\
        pip wheel --no-build-isolation --no-deps packages/apex-mta-kernels

The work is done by ``apex.multi_tensor_apply.build.hatch`` (read there what it needs and makes),
taken from this source tree: the package builds itself. Without the environment variable the
hook is off and the wheel is pure Python.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PACKAGE = "src/apex/multi_tensor_apply"


def _hatch():
    sys.path.insert(0, str(Path(__file__).parent / "src"))
    try:
        from apex.multi_tensor_apply.build import hatch
    finally:
        sys.path.pop(0)
    return hatch


class AotBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name == "wheel" and version != "editable":
            _hatch().aot_wheel(self, build_data, PACKAGE)

    def clean(self, versions: list[str]) -> None:
        _hatch().clean(self, PACKAGE)
