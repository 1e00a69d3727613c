"""Fixtures of the integration tests: the apex-* packages installed three ways, in subprocesses.

Every check runs in a fresh interpreter (``sys.executable`` or a virtual environment made from
it), never in the pytest process, whose own ``sys.path`` may already hold every apex package:

- **source**: a bare venv and PYTHONPATH set to some packages' ``src/`` folders, in either order;
- **wheel**: a venv with some packages' wheels, built once per session, installed by pip;
- **editable**: a venv with some packages installed by ``pip install -e``.

None of these venvs installs torch: a ``.pth`` file points each at a folder of links to what the
running interpreter has installed (torch, ninja, hatchling...), less anything of apex's. That
costs no download, no disk and no time, and pip sees torch and ninja there as installed, so
wheels install with ``--no-index`` and their dependencies are still resolved.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
MTA = "apex-mta-kernels"
# Each distribution and the apex subpackages it provides (DESIGN.md).
AREAS = {
    MTA: ["multi_tensor_apply"],
    "apex-optim": ["optimizers"],
    "apex-norm": ["normalization"],
    "apex-parallel": ["parallel"],
    "apex-amp": ["amp", "fp16_utils"],
}
FEATURES = [d for d in AREAS if d != MTA]
ALL = [MTA, *FEATURES]
SHORT = {MTA: "mta", "apex-optim": "optim", "apex-norm": "norm", "apex-parallel": "parallel",
         "apex-amp": "amp"}  # fmt: skip
TIMEOUT = 300


def src(dist: str) -> Path:
    return REPO / "packages" / dist / "src"


# Every set of packages pip can install: apex-mta-kernels with any subset of the features.
SUBSETS = [
    (MTA, *combo) for n in range(len(FEATURES) + 1) for combo in itertools.combinations(FEATURES, n)
]
# What the wheel and editable modes install (a venv each): mta alone, each feature alone, all.
WHEEL_SUBSETS = [(MTA,), *[(MTA, f) for f in FEATURES], tuple(ALL)]
EDITABLE_SUBSETS = [(MTA, "apex-optim"), tuple(ALL)]


def subset_id(dists) -> str:
    return "+".join(SHORT[d] for d in dists)


@dataclass(frozen=True)
class Case:
    """One interpreter set-up: how the packages got there and which are there."""

    mode: str  # "source", "wheel" or "editable"
    dists: tuple[str, ...]
    mta_last: bool = False  # source mode: apex-mta-kernels' src/ last on PYTHONPATH

    @property
    def id(self) -> str:
        order = "-mta-last" if self.mta_last else ""
        return f"{self.mode}{order}:{subset_id(self.dists)}"


CASES = (
    [Case("source", d) for d in SUBSETS]
    + [Case("source", d, mta_last=True) for d in SUBSETS if len(d) > 1]
    + [Case("wheel", d) for d in WHEEL_SUBSETS]
    + [Case("editable", d) for d in EDITABLE_SUBSETS]
)


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", CASES, ids=[c.id for c in CASES])


# --- running things ---------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess: none of our knobs, no PYTHONPATH, no user site."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "__PYVENV_LAUNCHER__")
        and not k.startswith("APEX_")
    }
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    env.update(extra)
    return env


def run(cmd, *, env=None, cwd=None, check=True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(c) for c in cmd],
        env=env if env is not None else clean_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} exited {done.returncode}\n"
            f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        )
    return done


# Runs in each interpreter under test and prints one JSON object. Lazy attributes are looked at
# first, before anything imports the subpackages by name.
PROBE = r"""
import json, os, sys, importlib

def error(exc):
    return {"types": [t.__name__ for t in type(exc).__mro__], "message": str(exc)}

import apex

areas = sorted(apex.SUBPACKAGES)
out = {"apex_file": apex.__file__, "apex_path": list(apex.__path__), "areas": {}}
for area in areas:
    info = out["areas"][area] = {}
    try:
        module = getattr(apex, area)
        info["attr"] = {"ok": True, "file": getattr(module, "__file__", None)}
    except AttributeError as exc:
        info["attr"] = {"ok": False, **error(exc)}
    info["hasattr"] = hasattr(apex, area)
    info["in_dir"] = area in dir(apex)
    try:
        exec(f"from apex import {area}")
        info["from_import"] = {"ok": True}
    except ImportError as exc:
        info["from_import"] = {"ok": False, **error(exc)}
    try:
        module = importlib.import_module(f"apex.{area}")
        info["import"] = {"ok": True, "file": module.__file__}
    except ImportError as exc:
        info["import"] = {"ok": False, **error(exc)}
for name in ("amp_C", "apex_C"):
    try:
        out[name] = {"ok": True, "file": importlib.import_module(name).__file__}
    except ImportError as exc:
        out[name] = {"ok": False, **error(exc)}
print(json.dumps(out))
"""


@dataclass
class Interpreter:
    """A Python to run code in, and the PYTHONPATH it runs with."""

    python: Path
    pythonpath: list[Path] = field(default_factory=list)
    site_packages: Path | None = None

    def env(self, **extra: str) -> dict[str, str]:
        env = clean_env(**extra)
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(map(str, self.pythonpath))
        return env

    def run(self, code: str, *args, cwd: Path, check: bool = True, **extra_env: str):
        cmd = [self.python, "-c", code, *args]
        return run(cmd, env=self.env(**extra_env), cwd=cwd, check=check)

    def pip(self, *args, check: bool = True) -> subprocess.CompletedProcess:
        return run([self.python, bundled_pip(), "--quiet", *args], env=self.env(), check=check)

    def probe(self, cwd: Path) -> dict:
        return json.loads(self.run(PROBE, cwd=cwd).stdout)


# --- the environments ---------------------------------------------------------------------------

APEX_NAMES = ("apex", "_apex", "amp_c", "__editable__", "_editable_impl_", "fused_layer_norm_cuda",
              "syncbn")  # fmt: skip


@pytest.fixture(scope="session")
def torch_site(tmp_path_factory) -> Path:
    """A folder of links to what this interpreter has installed, with nothing of apex's in it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"the integration tests need torch installed beside pytest ({sys.executable})")
    roots = [Path(next(iter(spec.submodule_search_locations))).parent]
    roots += [Path(p) for p in site.getsitepackages()]
    shim = tmp_path_factory.mktemp("torch-site")
    for root in roots:
        if not root.is_dir():
            continue
        for entry in root.iterdir():
            name = entry.name.lower()
            if name.startswith(APEX_NAMES) or name.endswith(".pth") or (shim / entry.name).exists():
                continue
            (shim / entry.name).symlink_to(entry)
    return shim


def bundled_pip() -> Path:
    """The pip wheel inside ensurepip: pip runs from it into any venv (``python pip.whl/pip``).

    Our venvs get no pip of their own: ensurepip takes seconds, and on Python < 3.12 it also
    installs an old setuptools that would hide the one torch needs.
    """
    import ensurepip

    wheels = sorted((Path(ensurepip.__file__).parent / "_bundled").glob("pip-*.whl"))
    if not wheels:
        pytest.skip(
            f"{sys.executable} has no ensurepip wheels (on Debian: apt-get install python3-venv)"
        )
    return wheels[-1] / "pip"


def make_venv(path: Path, torch_site: Path) -> Interpreter:
    done = run([sys.executable, "-m", "venv", "--without-pip", path], check=False)
    if done.returncode != 0:
        pytest.skip(
            f"`python -m venv` does not work for {sys.executable} (on Debian: apt-get install "
            f"python3-venv), so no environment can be made to test in:\n{done.stderr[-2000:]}"
        )
    site_dir = Path(sysconfig.get_path("purelib", vars={"base": path, "platbase": path}))
    (site_dir / "_apex_tests_torch_site.pth").write_text(f"{torch_site}\n")
    return Interpreter(python=path / "bin" / "python", site_packages=site_dir)


@pytest.fixture(scope="session")
def bare_python(tmp_path_factory, torch_site) -> Interpreter:
    """A venv that sees torch and no apex package: the interpreter of the source mode."""
    return make_venv(tmp_path_factory.mktemp("venvs") / "bare", torch_site)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Each package's wheel and sdist, built once per session: {dist: {"wheel": .., "sdist": ..}}."""
    out = tmp_path_factory.mktemp("dist")
    dirs = [REPO / "packages" / d for d in ALL]
    if _has("hatchling"):
        # The PEP 517 hooks of the build backend, called directly: no build env, no network.
        code = (
            "import os, sys\n"
            "from hatchling.build import build_sdist, build_wheel\n"
            "for d in sys.argv[2:]:\n"
            "    os.chdir(d)\n"
            "    build_wheel(sys.argv[1])\n"
            "    build_sdist(sys.argv[1])\n"
        )
        run([sys.executable, "-c", code, out, *dirs])
    elif shutil.which("uv"):
        for d in dirs:
            run(["uv", "build", "--quiet", "--out-dir", out, d])
    elif _has("build"):
        for d in dirs:
            run([sys.executable, "-m", "build", "--outdir", out, d])
    else:
        pytest.skip("no way to build wheels here: install hatchling (or uv, or build)")
    result = {}
    for dist in ALL:
        stem = dist.replace("-", "_")
        wheels = sorted(out.glob(f"{stem}-*.whl"))
        sdists = sorted(out.glob(f"{stem}-*.tar.gz"))
        assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
        result[dist] = {"wheel": wheels[0], "sdist": sdists[0]}
    return result


class Environments:
    """Makes each environment the first time a test asks for it, and keeps it for the session."""

    def __init__(self, root: Path, torch_site: Path, bare: Interpreter, request):
        self.root = root
        self.torch_site = torch_site
        self.bare = bare
        self.request = request
        self.cwd = root / "cwd"  # an empty working directory: '' on sys.path finds nothing
        self.cwd.mkdir()

    def source(self, dists, *, mta_last: bool = False) -> Interpreter:
        others = [d for d in dists if d != MTA]
        order = [*others, MTA] if mta_last else [MTA, *others]
        return Interpreter(python=self.bare.python, pythonpath=[src(d) for d in order])

    def empty(self, tag: str) -> Interpreter:
        """A new venv with nothing of apex's in it."""
        return make_venv(self.root / f"empty-{tag}", self.torch_site)

    @functools.cache  # noqa: B019  (one instance per session)
    def wheel(self, dists: tuple[str, ...], tag: str = "") -> Interpreter:
        """A venv with these wheels; another ``tag`` gives another venv (for tests that alter it)."""
        built = self.request.getfixturevalue("built")
        name = f"wheel-{subset_id(dists)}{'-' + tag if tag else ''}"
        env = make_venv(self.root / name, self.torch_site)
        # --no-index: the wheels given, plus what is installed (torch, ninja via the .pth), must
        # satisfy every dependency, so a feature wheel's dependency on apex-mta-kernels is checked.
        wheels = [built[d]["wheel"] for d in dists]
        env.pip("install", "--no-index", *wheels)
        return env

    @functools.cache  # noqa: B019
    def editable(self, dists: tuple[str, ...]) -> Interpreter:
        env = make_venv(self.root / f"editable-{subset_id(dists)}", self.torch_site)
        # hatchling reaches the venv through the .pth when this interpreter has it: no build env.
        offline = ["--no-index", "--no-build-isolation"] if _has("hatchling") else []
        args = [a for d in dists for a in ("-e", REPO / "packages" / d)]
        env.pip("install", *offline, *args)
        return env

    def get(self, case: Case) -> Interpreter:
        if case.mode == "source":
            return self.source(case.dists, mta_last=case.mta_last)
        return getattr(self, case.mode)(case.dists)

    def location(self, case: Case, dist: str) -> Path:
        """The folder that ``dist``'s import paths come from in this case."""
        if case.mode == "wheel":
            return self.get(case).site_packages
        return src(dist)


@pytest.fixture(scope="session")
def layout() -> SimpleNamespace:
    """The repository's packages, for tests (test modules do not import conftest)."""
    return SimpleNamespace(
        REPO=REPO, MTA=MTA, AREAS=AREAS, FEATURES=FEATURES, ALL=ALL, src=src, run=run,
        clean_env=clean_env, Interpreter=Interpreter,
    )  # fmt: skip


@pytest.fixture(scope="session")
def envs(tmp_path_factory, torch_site, bare_python, request) -> Environments:
    return Environments(tmp_path_factory.mktemp("envs"), torch_site, bare_python, request)


@pytest.fixture(scope="session")
def probes(envs):
    """probes(case): what PROBE printed in that case's interpreter (run once per case)."""

    @functools.cache
    def probe(case: Case) -> dict:
        return envs.get(case).probe(envs.cwd)

    return probe
