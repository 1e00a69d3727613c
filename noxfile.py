"""The sessions of the apex-* monorepo.

    nox -l                          # every session, with its tags
    nox -s lint tests build         # what a change must pass
    nox -t isolated                 # each package alone with apex-mta-kernels, from its wheel
    nox -s cuda13_torch214          # one cell of the CUDA x torch matrix (kernels built AOT)
    nox -t cuda12                   # every CUDA 12 cell
    nox -s tests -- -k adam         # arguments after -- go to pytest

Environments come from uv when it is there (uv does not read pip.conf: the local wheel folders
in APEX_FIND_LINKS, by default /opt/wheels where it exists, are passed to it by hand).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import nox
import nox.command
import tomllib

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.error_on_external_run = True

ROOT = Path(__file__).resolve().parent
PYTHON = "3.11"
MTA = "apex-mta-kernels"
# Short name (session ids, tags) -> distribution.
PACKAGES = {
    "mta": MTA,
    "optim": "apex-optim",
    "norm": "apex-norm",
    "parallel": "apex-parallel",
    "amp": "apex-amp",
}
# Distribution -> the modules it provides.
MODULES = {
    MTA: ["apex.multi_tensor_apply"],
    "apex-optim": ["apex.optimizers"],
    "apex-norm": ["apex.normalization"],
    "apex-parallel": ["apex.parallel"],
    "apex-amp": ["apex.amp", "apex.fp16_utils"],
}
TORCH_CPU = "torch==2.13.0"  # the CPU build lies in /opt/wheels; PyPI has only the CUDA one
# numpy: torch warns at import without it.
# expecttest: torch 2.3's opcheck (torch.testing._internal.optests) imports it.
TEST_TOOLS = ["pytest", "pytest-timeout", "pytest-xdist", "numpy", "expecttest"]
# What demo/run_demo.py needs beside torch and the packages (tests-integration runs it too).
DEMO_TOOLS = ["numpy", "matplotlib", "tqdm"]
PYTEST_ARGS = ["-p", "no:cacheprovider", "--timeout=900"]
# One OpenMP thread per test process (and per process a test starts): xdist's workers already
# fill the cores, and threads spinning on an oversubscribed 2-core machine made CPU tests up to
# 100x slower (apex-mta-kernels' suite: 397 s -> 81 s).
PYTEST_ENV = {"OMP_NUM_THREADS": "1"}
LINT_PATHS = ["packages", "tests-integration", "tools", "scripts", "noxfile.py", "conftest.py"]
FIND_LINKS = [
    d
    for d in os.environ.get("APEX_FIND_LINKS", "/opt/wheels").split(os.pathsep)
    if os.path.isdir(d)
]


def install(session: nox.Session, *args: str) -> None:
    session.install(*[a for d in FIND_LINKS for a in ("--find-links", d)], *args)


def package_dir(dist: str) -> Path:
    return ROOT / "packages" / dist


def build_dists(session: nox.Session, dists, out: Path, *, wheel_only: bool) -> None:
    """sdist and wheel (the wheel built from the sdist) of each package, or the wheel alone."""
    uv = _uv()
    for dist in dists:
        if uv:
            only = ["--wheel"] if wheel_only else []
            session.run(uv, "build", "--quiet", *only, "--out-dir", str(out), str(package_dir(dist)),
                        external=True)  # fmt: skip
        else:
            session.install("build")
            only = ["--wheel"] if wheel_only else []
            session.run(
                "python", "-m", "build", *only, "--outdir", str(out), str(package_dir(dist))
            )


def _uv() -> str | None:
    try:
        from nox.virtualenv import find_uv

        has_uv, uv, _ = find_uv()
        return uv if has_uv else None
    except ImportError:
        return shutil.which("uv")


def run_tests(session: nox.Session) -> None:
    """Each package's tests, then tests-integration: one pytest run each.

    One run per folder, each under the configuration of the package it tests, because each
    package's tests must pass on their own, and test modules that import their own conftest
    (`from conftest import ...`) cannot share one pytest process with other conftest.py files.
    """
    # With a -k or a path in posargs, a folder where nothing matches is no failure.
    # Every folder runs even after one fails, so that one run shows every problem.
    codes = [0, 5] if session.posargs else [0]
    failed = []
    for folder in [*sorted(ROOT.glob("packages/*/tests")), ROOT / "tests-integration"]:
        args = [*PYTEST_ARGS, *xdist(folder), str(folder), *session.posargs]
        try:
            session.run("pytest", *args, success_codes=codes, env=PYTEST_ENV)
        except nox.command.CommandFailed:
            failed.append(str(folder.relative_to(ROOT)))
    if failed:
        session.error(f"tests failed in {', '.join(failed)}")


def xdist(folder: Path) -> list[str]:
    """pytest-xdist for the larger suites: each worker pays for its own torch import."""
    return ["-n", "auto"] if len(list(folder.glob("test_*.py"))) >= 3 else []


# --- everyday sessions ------------------------------------------------------------------------


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff")
    paths = [p for p in LINT_PATHS if (ROOT / p).exists()]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Every package's tests and tests-integration, all five packages installed editable."""
    # onnxscript: apex-norm's ONNX export test (it skips where onnxscript is absent).
    install(session, TORCH_CPU, *TEST_TOOLS, *DEMO_TOOLS, "onnxscript", "hatchling")
    # hatchling is installed: no build environment, so no download, for the editable installs.
    editable = [a for d in PACKAGES.values() for a in ("-e", str(package_dir(d)))]
    install(session, "--no-build-isolation", *editable)
    run_tests(session)


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """sdist and wheel of every package into dist/, then their contents and metadata checked."""
    out = ROOT / "dist"
    shutil.rmtree(out, ignore_errors=True)
    build_dists(session, PACKAGES.values(), out, wheel_only=False)
    wheels = sorted(str(p) for p in out.glob("*.whl"))
    sdists = sorted(str(p) for p in out.glob("*.tar.gz"))
    if len(wheels) != len(PACKAGES) or len(sdists) != len(PACKAGES):
        session.error(f"expected {len(PACKAGES)} wheels and sdists in dist/, got {wheels + sdists}")
    session.install("packaging", "check-wheel-contents")
    session.run("python", "tools/check_wheels.py", *wheels, *sdists)
    # W009 (several top-level names): apex-mta-kernels ships apex/, amp_C.py and apex_C.py by
    # design, for code that imports NVIDIA apex's extension modules by name.
    session.run("check-wheel-contents", "--ignore", "W009", *wheels)


@nox.session(python=PYTHON, tags=["isolated"])
@nox.parametrize("pkg", [nox.param(short, id=short, tags=[short]) for short in PACKAGES])
def isolated(session: nox.Session, pkg: str) -> None:
    """One package and apex-mta-kernels, from their wheels; the others provably absent."""
    dist = PACKAGES[pkg]
    dists = [MTA] if dist == MTA else [MTA, dist]
    tmp = Path(session.create_tmp()).resolve()
    wheels_dir = tmp / "wheels"
    shutil.rmtree(wheels_dir, ignore_errors=True)
    build_dists(session, dists, wheels_dir, wheel_only=True)
    install(session, TORCH_CPU, *TEST_TOOLS)
    install(session, *sorted(str(p) for p in wheels_dir.glob("*.whl")))

    present = [m for d in dists for m in MODULES[d]]
    absent = [f"{m}={d}" for d in PACKAGES.values() if d not in dists for m in MODULES[d]]
    check = str(ROOT / "tools" / "check_installed.py")
    session.run("python", check, "--present", *present, "--absent", *absent)

    # From a folder outside the repository, so that no src/ can be on sys.path, under the
    # package's own pytest configuration.
    session.chdir(tmp)
    here = package_dir(dist)
    session.run(
        "pytest", *PYTEST_ARGS, *xdist(here / "tests"), "-c", str(here / "pyproject.toml"),
        "--rootdir", str(here), str(here / "tests"), *session.posargs,
        env=PYTEST_ENV,
    )  # fmt: skip


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The Sphinx site (MyST, furo, API reference from docstrings) into docs/_build/html,
    warnings as errors. Runs from source: no apex package is installed."""
    install(session, TORCH_CPU, "numpy", "sphinx>=7", "furo", "myst-parser>=2")
    out = ROOT / "docs" / "_build" / "html"
    shutil.rmtree(out, ignore_errors=True)
    session.run(
        "sphinx-build", "-W", "--keep-going", "-q", "-b", "html", str(ROOT / "docs"), str(out),
    )  # fmt: skip
    session.log(f"docs: {out / 'index.html'}")


# --- pins ---------------------------------------------------------------------------------------


def release_tags(dist: str) -> list[tuple[str, str]]:
    """(tag, version) of every release of ``dist``, oldest first."""
    out = subprocess.run(
        ["git", "tag", "--list", f"{dist}/v*", "--sort=version:refname"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    return [(t, t.split("/v", 1)[1]) for t in out]


def tree_at(session: nox.Session, tag: str, dist: str) -> Path:
    """packages/<dist> as it was at ``tag``, in a scratch folder."""
    dst = Path(session.create_tmp()).resolve() / tag.replace("/", "-")
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", tag, f"packages/{dist}"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dst)], input=archive, check=True)
    return dst / "packages" / dist


def wheel_of(session: nox.Session, project: Path, out: Path) -> None:
    uv = _uv()
    if uv:
        session.run(uv, "build", "--quiet", "--wheel", "--out-dir", str(out), str(project),
                    external=True)  # fmt: skip
    else:
        session.install("build")
        session.run("python", "-m", "build", "--wheel", "--outdir", str(out), str(project))


def head_version(dist: str) -> str:
    text = next(package_dir(dist).glob("src/apex/*/_version.py")).read_text()
    return text.split('"')[1]


@nox.session(python=PYTHON, default=False)
def pinned(session: nox.Session) -> None:
    """One package at an older release, built from its tag, beside every other package built
    from this tree; that release's own tests pass. APEX_PINNED=<dist>/vX.Y.Z chooses the
    release (default: apex-optim's oldest)."""
    tag = os.environ.get("APEX_PINNED")
    if not tag:
        tags = release_tags("apex-optim")
        if not tags:
            session.error("apex-optim has no release tag yet: make one with tools/release.py")
        tag = tags[0][0]
    dist, version = tag.split("/v", 1)
    old = tree_at(session, tag, dist)
    wheels = Path(session.create_tmp()).resolve() / "pinned-wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheel_of(session, old, wheels)
    for other in PACKAGES.values():
        if other != dist:
            wheel_of(session, package_dir(other), wheels)
    install(session, TORCH_CPU, *TEST_TOOLS)
    install(session, *sorted(str(p) for p in wheels.glob("*.whl")))
    session.log(f"{dist} pinned at {tag}; the others at this tree's versions")
    versions = [f"{dist}={version}"]
    versions += [f"{d}={head_version(d)}" for d in PACKAGES.values() if d != dist]
    present = [m for d in PACKAGES.values() for m in MODULES[d]]
    check = str(ROOT / "tools" / "check_installed.py")
    session.run("python", check, "--present", *present, "--version", *versions)
    session.chdir(old.parent)
    session.run(
        "pytest", *PYTEST_ARGS, *xdist(old / "tests"), "-c", str(old / "pyproject.toml"),
        "--rootdir", str(old), str(old / "tests"), *session.posargs,
        env=PYTEST_ENV,
    )  # fmt: skip


LOWEST_TORCH = "torch==2.3.0"  # the oldest release of torch>=2.3


@nox.session(python=PYTHON, default=False)
@nox.parametrize(
    "pkg", [nox.param(s, id=s) for s, d in PACKAGES.items() if d != MTA]
)  # fmt: skip
def lowest(session: nox.Session, pkg: str) -> None:
    """A feature package with the lowest torch and the oldest apex-mta-kernels release its
    metadata allows (torch from PyPI), then its tests."""
    from packaging.requirements import Requirement

    dist = PACKAGES[pkg]
    meta = tomllib.loads((package_dir(dist) / "pyproject.toml").read_text())
    reqs = [Requirement(r) for r in meta["project"]["dependencies"]]
    mta_req = next(r for r in reqs if r.name == MTA)
    torch_req = next(r for r in reqs if r.name == "torch")
    lowest_torch = LOWEST_TORCH.split("==")[1]
    if not torch_req.specifier.contains(lowest_torch) or torch_req.specifier.contains("2.2.99"):
        session.error(f"{dist} asks for {torch_req}, whose lowest release is not {lowest_torch}")
    allowed = [(t, v) for t, v in release_tags(MTA) if mta_req.specifier.contains(v)]
    if not allowed:
        session.error(f"no {MTA} release satisfies {mta_req}: tag one with tools/release.py")
    tag, version = allowed[0]
    wheels = Path(session.create_tmp()).resolve() / "lowest-wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheel_of(session, tree_at(session, tag, MTA), wheels)
    wheel_of(session, package_dir(dist), wheels)
    install(session, LOWEST_TORCH, "numpy<2", *TEST_TOOLS)
    install(session, *sorted(str(p) for p in wheels.glob("*.whl")))
    check = str(ROOT / "tools" / "check_installed.py")
    session.run(
        "python", check, "--present", *MODULES[dist], "--version", f"{MTA}={version}",
        f"torch={lowest_torch}",
    )  # fmt: skip
    here = package_dir(dist)
    session.chdir(session.create_tmp())
    session.run(
        "pytest", *PYTEST_ARGS, *xdist(here / "tests"), "-c", str(here / "pyproject.toml"),
        "--rootdir", str(here), str(here / "tests"), *session.posargs,
        env=PYTEST_ENV,
    )  # fmt: skip


@nox.session(python=PYTHON, default=False, venv_params=["--system-site-packages"])
def bench(session: nox.Session) -> None:
    """Every package's benchmarks on this machine's GPU, from source (torch, triton and a CUDA
    toolkit come from the system site-packages), then the docs' tables and plots
    (docs/benchmark-results.md, docs/bench/*.png). Refuses to run without a GPU."""
    probe = (
        "try:\n import torch; print('gpu' if torch.cuda.is_available() else 'no GPU')\n"
        "except ImportError: print('no torch')"
    )
    found = (session.run("python", "-c", probe, silent=True) or "").strip()
    if found != "gpu":
        session.error(
            f"nox -s bench needs a CUDA GPU and a CUDA build of torch ({found} here): the "
            "benchmarks time CUDA kernels against torch's on the device. Run it on a GPU machine."
        )
    install(session, "matplotlib")
    out = Path(session.create_tmp()).resolve() / "bench-run"
    shutil.rmtree(out, ignore_errors=True)
    session.run(
        "bash", str(ROOT / "scripts" / "gpu_run.sh"), external=True,
        env={"OUT": str(out), "SKIP_TESTS": "1", "PYTHON": "python"},
    )  # fmt: skip
    session.run("python", str(ROOT / "tools" / "bench_report.py"), str(out / "bench"))


# --- platform wheels --------------------------------------------------------------------------

# Packages that compile kernels: those with an apex/<area>/_kernels.py.
KERNEL_PACKAGES = [
    d for d in PACKAGES.values() if list(package_dir(d).glob("src/apex/*/_kernels.py"))
]


@nox.session(python=PYTHON, default=False, tags=["wheels"])
def platform_wheels(session: nox.Session) -> None:
    """Platform wheels with the kernels inside (the opt-in build hook; torch 2.14 + CUDA 13 from
    PyPI, sm_80 and sm_90), then installed into a fresh venv with no CUDA toolkit, where every
    extension must load from its wheel and nothing may compile."""
    install(session, MATRIX[("13", "2.14")], "ninja", "setuptools>=64", "hatchling", "pip")
    session.env["CUDA_HOME"] = cuda13_toolkit(session)
    out = ROOT / "dist-platform"
    shutil.rmtree(out, ignore_errors=True)
    # The feature packages' hooks build with the apex-mta-kernels of this tree.
    install(session, "--no-build-isolation", "--no-deps", str(package_dir(MTA)))
    env = {"HATCH_BUILD_HOOK_ENABLE_CUSTOM": "1", "APEX_CUDA_ARCHS": AOT_ARCHS}
    for dist in PACKAGES.values():
        hook = env if dist in KERNEL_PACKAGES else {}
        session.run(
            "python", "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
            "-w", str(out), str(package_dir(dist)), env=hook,
        )  # fmt: skip
    wheels = sorted(str(p) for p in out.glob("*.whl"))
    session.log("built: " + ", ".join(Path(w).name for w in wheels))

    fresh = Path(session.create_tmp()).resolve() / "fresh"
    shutil.rmtree(fresh, ignore_errors=True)
    session.run("python", "-m", "venv", str(fresh))
    py = str(fresh / "bin" / "python")
    # torch of the same minor and nothing else: no cuda-toolkit, no nvcc.
    session.run(py, "-m", "pip", "install", "-q", MATRIX[("13", "2.14")], *wheels, external=True)
    cache = Path(session.create_tmp()).resolve() / "empty-cache"
    shutil.rmtree(cache, ignore_errors=True)
    clean_env = {
        "PATH": f"{fresh / 'bin'}:/usr/bin:/bin",
        "CUDA_HOME": "",
        "APEX_CACHE_DIR": str(cache),
        "APEX_CUDA_ARCHS": "9.0",
        "APEX_STRICT_KERNELS": "1",
    }
    session.chdir(session.create_tmp())  # no src/ of this tree on sys.path
    session.run(py, str(ROOT / "tools" / "check_prebuilt.py"), env=clean_env, external=True)


def cuda13_toolkit(session: nox.Session) -> str:
    """Installs PyPI's CUDA 13 toolkit at the CUDA minor of the installed torch; its CUDA_HOME."""
    pinned = session.run_install(
        "python", "-c", "import importlib.metadata as m; print(m.version('cuda-toolkit'))",
        silent=True,
    ).strip()  # fmt: skip
    # cuda-toolkit's extras leave the compiler's pieces unpinned: pin them to the same minor, or
    # a newer nvidia-nvvm emits PTX this ptxas rejects (seen: 13.5 beside torch 2.11's 13.0).
    minor = ".".join(pinned.split(".")[:2])
    parts = [
        f"{part}=={minor}.*" for part in ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt")
    ]
    install(session, f"cuda-toolkit[nvcc,cccl]=={pinned}", *parts)
    return session.run_install(
        "python", "-c", "import nvidia, os; print(os.path.join(nvidia.__path__[0], 'cu13'))",
        silent=True,
    ).strip()  # fmt: skip


# --- the demo ---------------------------------------------------------------------------------


@nox.session(python=PYTHON, default=False)
def demo(session: nox.Session) -> None:
    """demo/run_demo.py: a small GPT and a 2-process ResNet, each trained with the apex-* stack
    and with plain torch in the same run; losses, throughputs, the speed ratio and a plot in
    demo-out/. Arguments after -- go to the script (--quick, --steps N, --device, --out DIR).
    APEX_DEMO_TORCH=<requirement> installs another torch (a CUDA one on a GPU machine)."""
    install(session, os.environ.get("APEX_DEMO_TORCH", TORCH_CPU), *DEMO_TOOLS, "hatchling")
    editable = [a for d in PACKAGES.values() for a in ("-e", str(package_dir(d)))]
    install(session, "--no-build-isolation", *editable)
    session.run("python", "demo/run_demo.py", *session.posargs)


# --- the CUDA x torch matrix ------------------------------------------------------------------

# (CUDA major, torch release) -> the torch requirement. CUDA 13 cells take nvcc from PyPI's
# cuda-toolkit wheels, at the version that torch itself pins; CUDA 12 cells need a local toolkit.
MATRIX = {
    ("13", "2.14"): "torch==2.14.1",
    ("13", "2.11"): "torch==2.11.*",
    ("12", "2.3"): "torch==2.3.*",
    ("12", "2.6"): "torch==2.6.*",
    ("12", "2.8"): "torch==2.8.*",
}
AOT_ARCHS = "8.0;9.0"
CUDA12_PREFIX = ROOT / ".nox" / "_toolkits" / "cuda12"
CUDA12_HOWTO = f"""no CUDA 12 toolkit (nvcc 12.x), and PyPI has none that builds extensions. Either
  - set CUDA_HOME to a CUDA 12 toolkit (bin/nvcc, include/, lib64/), or
  - run `bash scripts/get_cuda12_toolkit.sh`: it unpacks Debian trixie's non-free
    nvidia-cuda-toolkit 12.4.131 (about 1 GB, with apt-get and a private package list; the
    system's apt and packages are not touched) into {CUDA12_PREFIX.relative_to(ROOT)}"""


def nvcc_major(cuda_home: Path) -> str | None:
    nvcc = cuda_home / "bin" / "nvcc"
    if not nvcc.is_file():
        return None
    try:
        text = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    marker = "release "
    if marker not in text:
        return None
    return text.split(marker, 1)[1].split(".", 1)[0]


def cuda12_home(session: nox.Session) -> Path:
    """CUDA_HOME if it is a CUDA 12 toolkit, else the private one, fetched on first use."""
    for candidate in [os.environ.get("CUDA_HOME"), str(CUDA12_PREFIX)]:
        if candidate and nvcc_major(Path(candidate)) == "12":
            return Path(candidate)
    script = ROOT / "scripts" / "get_cuda12_toolkit.sh"
    session.log(f"no CUDA 12 toolkit yet: fetching Debian's with {script.relative_to(ROOT)}")
    done = subprocess.run(["bash", str(script), str(CUDA12_PREFIX)], check=False)
    if done.returncode == 0 and nvcc_major(CUDA12_PREFIX) == "12":
        return CUDA12_PREFIX
    session.skip(f"the download failed (exit {done.returncode}); {CUDA12_HOWTO}")


def matrix_cell(session: nox.Session, cuda: str, torch_spec: str) -> None:
    if cuda == "12":
        session.env["CUDA_HOME"] = str(cuda12_home(session))  # skips before any install
    install(session, torch_spec, "ninja", *TEST_TOOLS, *DEMO_TOOLS, "hatchling")
    if cuda == "13":
        # The toolkit of this cell, not whatever nvcc is on PATH.
        session.env["CUDA_HOME"] = cuda13_toolkit(session)
    editable = [a for d in PACKAGES.values() for a in ("-e", str(package_dir(d)))]
    install(session, "--no-build-isolation", *editable)
    session.run("python", "-m", "apex.multi_tensor_apply", "build", "--archs", AOT_ARCHS)
    session.run("python", "-m", "apex.multi_tensor_apply")
    run_tests(session)


def _register_cell(cuda: str, torch_version: str, torch_spec: str) -> None:
    tv = torch_version.replace(".", "")
    name = f"cuda{cuda}_torch{tv}"

    def cell(session: nox.Session) -> None:
        matrix_cell(session, cuda, torch_spec)

    cell.__doc__ = f"{torch_spec} with CUDA {cuda}: kernels compiled for sm {AOT_ARCHS}, tests."
    nox.session(
        cell,
        name=name,
        python=PYTHON,
        default=False,
        tags=[f"cuda{cuda}", f"torch{tv}", "gpu-matrix"],
    )


for (_cuda, _torch), _spec in MATRIX.items():
    _register_cell(_cuda, _torch, _spec)
