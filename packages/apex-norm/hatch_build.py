"""Opt-in ahead-of-time build hook: a platform wheel with apex_norm_C compiled inside.

    HATCH_BUILD_HOOK_ENABLE_CUSTOM=1 APEX_CUDA_ARCHS="8.0;9.0" \\
        pip wheel --no-build-isolation --no-deps packages/apex-norm

The work is done by ``apex.multi_tensor_apply.build.hatch`` from the installed apex-mta-kernels
(hence --no-build-isolation; read there what it needs and makes). Without the environment
variable the hook is off and the wheel is pure Python, compiling on first use.
"""

from __future__ import annotations

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PACKAGE = "src/apex/normalization"


def _hatch():
    try:
        from apex.multi_tensor_apply.build import hatch
    except ImportError as exc:
        raise RuntimeError(
            "building apex-norm with its kernels needs apex-mta-kernels and torch installed in "
            "the build environment: pip install apex-mta-kernels, then pip wheel "
            "--no-build-isolation --no-deps packages/apex-norm"
        ) from exc
    return hatch


class AotBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name == "wheel" and version != "editable":
            _hatch().aot_wheel(self, build_data, PACKAGE)

    def clean(self, versions: list[str]) -> None:
        _hatch().clean(self, PACKAGE)
