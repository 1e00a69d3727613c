"""NVIDIA apex beside or over the apex-* packages is refused at import, with the fix.

NVIDIA apex installs a distribution named ``apex`` with a regular ``apex/__init__.py`` into the
same site-packages; pip then overwrites ours with it, and `pip uninstall apex` deletes it.
"""

from __future__ import annotations

import json
import shutil

import pytest

# Tries each module named on the command line; prints {name: null or the ImportError's text}.
TRY_IMPORTS = r"""
import importlib, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        out[name] = None
    except ImportError as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""

FEATURE_MODULES = {
    "apex.optimizers": "apex-optim",
    "apex.normalization": "apex-norm",
    "apex.parallel": "apex-parallel",
    "apex.amp": "apex-amp",
    "apex.fp16_utils": "apex-amp",
}

# The start of NVIDIA apex's apex/__init__.py (25.x): a regular package that imports torch,
# with no pkgutil.extend_path and no _NAMESPACE_OWNER.
NVIDIA_APEX_INIT = """\
import logging
import warnings

# May help avoid undefined symbol errors https://pytorch.org/cppdocs/notes/faq.html#undefined-symbol-errors-from-pytorch-aten
import torch

__all__ = ["optimizers", "normalization", "transformer"]

_library_root_logger = logging.getLogger(__name__)
"""


def try_imports(interpreter, cwd, *names, **env) -> dict:
    return json.loads(interpreter.run(TRY_IMPORTS, *names, cwd=cwd, **env).stdout)


def fake_nvidia_dist_info(site_dir):
    info = site_dir / "apex-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: apex\nVersion: 0.1\n")
    (info / "RECORD").write_text("")
    return info


def copy_sources(layout, dists, into):
    """Every package's src/ merged into one folder, as pip lays them out in site-packages."""
    for dist in dists:
        shutil.copytree(
            layout.src(dist),
            into,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("__pycache__", "_prebuilt"),
        )
    return into


def test_nvidia_apex_distribution_beside_installed_wheels(envs, layout):
    env = envs.wheel((layout.MTA, "apex-optim"), tag="nvidia-dist")
    info = fake_nvidia_dist_info(env.site_packages)
    out = try_imports(env, envs.cwd, "apex.optimizers")
    message = out["apex.optimizers"]
    assert message is not None, "apex.optimizers imported beside NVIDIA apex"
    assert "`pip uninstall apex`" in message
    assert str(info) in message
    # The documented escape hatch still works.
    out = try_imports(env, envs.cwd, "apex.optimizers", APEX_IGNORE_CONFLICTS="1")
    assert out == {"apex.optimizers": None}


def test_nvidia_apex_distribution_beside_sources(envs, layout, tmp_path):
    site_dir = copy_sources(layout, [layout.MTA], tmp_path / "site")
    info = fake_nvidia_dist_info(site_dir)
    env = layout.Interpreter(
        python=envs.bare.python, pythonpath=[site_dir, *map(layout.src, layout.FEATURES)]
    )
    out = try_imports(env, envs.cwd, *FEATURE_MODULES)
    for name, message in out.items():
        assert message is not None, f"{name} imported beside NVIDIA apex"
        assert "`pip uninstall apex`" in message, message
        assert str(info) in message, message


def test_nvidia_apex_init_over_ours(envs, layout, tmp_path):
    site_dir = copy_sources(layout, layout.ALL, tmp_path / "site")
    (site_dir / "apex" / "__init__.py").write_text(NVIDIA_APEX_INIT)
    env = layout.Interpreter(python=envs.bare.python, pythonpath=[site_dir])
    out = try_imports(env, envs.cwd, *FEATURE_MODULES)
    for name, message in out.items():
        assert message is not None, f"{name} imported under NVIDIA apex's apex/__init__.py"
        dist = FEATURE_MODULES[name]
        assert f"{name} ({dist}) cannot be imported" in message
        assert "is not the apex/__init__.py that apex-mta-kernels ships" in message
        assert "`pip uninstall apex`" in message
        assert f"pip install --force-reinstall apex-mta-kernels {dist}" in message


def test_apex_init_deleted_by_uninstalling_nvidia_apex(envs, layout, tmp_path):
    site_dir = copy_sources(layout, layout.ALL, tmp_path / "site")
    (site_dir / "apex" / "__init__.py").unlink()
    env = layout.Interpreter(python=envs.bare.python, pythonpath=[site_dir])
    out = try_imports(env, envs.cwd, *FEATURE_MODULES)
    for name, message in out.items():
        assert message is not None, f"{name} imported without apex/__init__.py"
        assert "apex/__init__.py is missing" in message
        assert f"pip install --force-reinstall apex-mta-kernels {FEATURE_MODULES[name]}" in message


@pytest.mark.parametrize("dist", ["apex-optim", "apex-amp"])
def test_feature_wheel_alone_does_not_install(envs, layout, dist):
    """pip refuses a feature package without apex-mta-kernels: the dependency is declared."""
    built = envs.request.getfixturevalue("built")
    env = envs.empty(f"alone-{dist}")
    done = env.pip("install", "--no-index", built[dist]["wheel"], check=False)
    assert done.returncode != 0
    assert "apex-mta-kernels" in done.stderr
    assert not (env.site_packages / "apex").exists()
