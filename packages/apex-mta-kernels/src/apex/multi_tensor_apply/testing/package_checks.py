"""The tests every feature package (apex-optim, apex-norm, apex-parallel, apex-amp) runs on
itself as a package: its version, the checks its import runs (kernel ABI, owner of
apex/__init__.py, foreign apex distributions, no other feature package loaded), and that its
C++/CUDA sources format no message through an ostream (csrc_messages).

A package's ``tests/test_<area>_package.py`` declares what it is and asks for the tests::

    DIST = "apex-optim"
    MODULES = ["apex.optimizers"]
    OTHER_FEATURES = ["apex.normalization", "apex.parallel", "apex.amp", "apex.fp16_utils"]
    PACKAGE_ROOT = Path(__file__).resolve().parents[1]

    add_package_checks(globals())

which puts the test functions (and their autouse fixture) into that module, where pytest
collects them under their own names. Tests specific to one package stay in its file.

For tests only: imports pytest (and tomli on Python 3.10, which pytest depends on there).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli on Python 3.10
    import tomli as tomllib

import apex
import apex.multi_tensor_apply._abi as kernel_abi
from apex.multi_tensor_apply.testing import csrc_messages

__all__ = ["DECLARED", "add_package_checks", "hatch_version", "reimport"]

# What the calling test module declares, and add_package_checks reads from its namespace.
DECLARED = ("DIST", "MODULES", "OTHER_FEATURES", "PACKAGE_ROOT")
# The pattern of hatchling's regex version source ([tool.hatch.version] path = ...).
HATCH_VERSION_PATTERN = r"(?im)^(__version__|VERSION) *= *([\'\"])v?(?P<version>.+?)\2"


def hatch_version(package_root: Path) -> str:
    """The version hatchling builds the package in ``package_root`` with."""
    config = tomllib.loads((package_root / "pyproject.toml").read_text())
    source = package_root / config["tool"]["hatch"]["version"]["path"]
    match = re.search(HATCH_VERSION_PATTERN, source.read_text())
    assert match, f"hatchling would find no version in {source}"
    return match["version"]


def reimport(monkeypatch, name: str):
    """Import ``name`` afresh; the module already loaded comes back after the test."""
    monkeypatch.setattr(apex, name.rpartition(".")[2], importlib.import_module(name))
    monkeypatch.delitem(sys.modules, name)
    return importlib.import_module(name)


def add_package_checks(namespace: MutableMapping[str, Any]) -> None:
    """Define the package tests in ``namespace`` (a test module's ``globals()``), for the
    ``DIST``, ``MODULES``, ``OTHER_FEATURES`` and ``PACKAGE_ROOT`` declared there."""
    missing = [name for name in DECLARED if name not in namespace]
    if missing:
        raise NameError(f"add_package_checks: the test module declares no {', '.join(missing)}")
    dist: str = namespace["DIST"]
    modules: list[str] = list(namespace["MODULES"])
    other_features: list[str] = list(namespace["OTHER_FEATURES"])
    package_root = Path(namespace["PACKAGE_ROOT"])

    @pytest.fixture(autouse=True)
    def no_escape_hatches(monkeypatch):
        monkeypatch.delenv("APEX_SKIP_ABI_CHECK", raising=False)
        monkeypatch.delenv("APEX_IGNORE_CONFLICTS", raising=False)

    @pytest.mark.parametrize("name", modules)
    def test_version_is_the_hatch_version_source(name):
        module = importlib.import_module(name)
        assert module.__version__ == hatch_version(package_root)
        assert "__version__" in module.__all__

    def test_installed_metadata_has_the_same_version():
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{dist} is not installed here (running from source)")
        assert installed == hatch_version(package_root)

    @pytest.mark.parametrize("abi", [0, 2])
    @pytest.mark.parametrize("name", modules)
    def test_kernel_abi_out_of_range_is_refused(monkeypatch, name, abi):
        monkeypatch.setattr(kernel_abi, "KERNEL_ABI", abi)
        with pytest.raises(ImportError) as info:
            reimport(monkeypatch, name)
        message = str(info.value)
        assert "apex-mta-kernels" in message
        assert dist in message
        assert f"kernel ABI {abi}" in message

    @pytest.mark.parametrize("name", modules)
    def test_kernel_abi_check_can_be_switched_off(monkeypatch, name):
        monkeypatch.setattr(kernel_abi, "KERNEL_ABI", 2)
        monkeypatch.setenv("APEX_SKIP_ABI_CHECK", "1")
        assert reimport(monkeypatch, name).__version__ == hatch_version(package_root)

    @pytest.mark.parametrize("name", modules)
    def test_apex_init_of_another_distribution_is_refused(monkeypatch, name):
        # What NVIDIA apex's setup.py leaves behind: its own apex/__init__.py in place of ours.
        monkeypatch.delattr(apex, "_NAMESPACE_OWNER")
        with pytest.raises(ImportError) as info:
            reimport(monkeypatch, name)
        message = str(info.value)
        assert f"{name} ({dist}) cannot be imported" in message
        assert "NVIDIA apex" in message
        assert "`pip uninstall apex`" in message
        assert f"pip install --force-reinstall apex-mta-kernels {dist}" in message

    @pytest.mark.parametrize("name", modules)
    def test_missing_apex_init_is_explained(monkeypatch, name):
        # What `pip uninstall apex` leaves after NVIDIA apex overwrote ours: a bare namespace.
        monkeypatch.delattr(apex, "_NAMESPACE_OWNER")
        monkeypatch.setattr(apex, "__file__", None)
        with pytest.raises(ImportError, match=r"apex/__init__\.py is missing") as info:
            reimport(monkeypatch, name)
        assert f"pip install --force-reinstall apex-mta-kernels {dist}" in str(info.value)

    @pytest.mark.parametrize("name", modules)
    def test_foreign_apex_distribution_is_refused(monkeypatch, name):
        fake = os.path.join("site-packages", "apex-0.1.dist-info")
        monkeypatch.setattr(apex, "foreign_apex_distributions", lambda: [fake])
        with pytest.raises(ImportError) as info:
            reimport(monkeypatch, name)
        message = str(info.value)
        assert fake in message
        assert "`pip uninstall apex`" in message
        assert name.rpartition(".")[2] in message

    def test_import_loads_no_other_feature_package():
        code = (
            "import sys\n"
            f"for name in {modules!r}:\n"
            "    __import__(name)\n"
            f"print([m for m in {other_features!r} if m in sys.modules])\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "[]"

    @pytest.mark.parametrize("name", modules)
    def test_csrc_formats_no_message_through_an_ostream(name):
        # ostream formatting (c10::str, TORCH_WARN, streams) crashed inside these libraries on
        # the GPU machine's toolchain (csrc_messages explains); messages are concatenated (each
        # package's fmt). The sources read are the imported module's (an installed wheel's
        # under the isolated sessions); a module with kernels (_kernels.py) must have some.
        root = Path(importlib.import_module(name).__file__).parent
        if not csrc_messages.sources(root):
            assert importlib.util.find_spec(f"{name}._kernels") is None, f"no sources in {root}"
            pytest.skip(f"{name} has no C++ or CUDA sources")
        assert csrc_messages.findings(root) == []

    checks = {
        name: obj
        for name, obj in locals().items()
        if name == "no_escape_hatches" or name.startswith("test_")
    }
    clashes = sorted(set(checks) & set(namespace))
    if clashes:
        raise NameError(f"add_package_checks: the test module already defines {clashes}")
    namespace.update(checks)
