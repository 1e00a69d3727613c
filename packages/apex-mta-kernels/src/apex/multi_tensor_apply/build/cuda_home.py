"""Finding a CUDA toolkit: CUDA_HOME, then nvcc on PATH, then pip's cuda-toolkit wheels, then
/usr/local/cuda. Each answer says which rule won, so the report can tell the user why."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import site
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

DEFAULT_CUDA_HOME = Path("/usr/local/cuda")


@dataclass(frozen=True)
class CudaToolkit:
    home: Path
    nvcc: Path
    version: str  # "13.0"
    reason: str  # which rule found it

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


class ToolkitError(RuntimeError):
    """No usable CUDA toolkit: the message says what was tried and how to fix it."""


def _nvcc_version(nvcc: Path) -> str:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60)
    m = re.search(r"release (\d+)\.(\d+)", out.stdout)
    if out.returncode != 0 or not m:
        raise ToolkitError(f"{nvcc} --version failed: {out.stdout}{out.stderr}".strip())
    return f"{m.group(1)}.{m.group(2)}"


def _site_dirs() -> list[Path]:
    dirs = [Path(p) for p in sys.path if p and p.endswith(("site-packages", "dist-packages"))]
    try:
        dirs += [Path(p) for p in site.getsitepackages()]
    except AttributeError:  # pragma: no cover - virtualenv's old site module
        pass
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def _pip_candidates(major: int | None) -> list[Path]:
    """``site-packages/nvidia/cuNN`` from ``pip install 'cuda-toolkit[nvcc,cccl]'`` (CUDA 13+).
    CUDA 12's PyPI wheels carry no nvcc, so there is nothing to find for 12."""
    out = []
    for d in _site_dirs():
        nv = d / "nvidia"
        if not nv.is_dir():
            continue
        for sub in sorted(nv.glob("cu[0-9]*"), reverse=True):
            if (sub / "bin" / "nvcc").is_file():
                if major is None or sub.name == f"cu{major}":
                    out.append(sub)
    return out


# The pip distributions that make up a pip toolkit's compiler. Their versions must agree to the
# minor: cuda-toolkit[nvcc]==13.0.x does not pin them, and a newer nvidia-nvvm (cicc) emits
# PTX that the toolkit's own ptxas rejects ("Unsupported .version 9.5; current version is '9.0'").
PIP_COMPILER_PARTS = ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt")


def pip_parts_skew(home: Path, lookup=None) -> str | None:
    """For a pip toolkit (``site-packages/nvidia/cuNN``): why its compiler pieces disagree, with
    the fix; None when they agree or ``home`` is no pip toolkit."""
    if home.parent.name != "nvidia":
        return None
    if lookup is None:
        import importlib.metadata

        # The distributions installed in the site-packages that holds this toolkit.
        site_dists = importlib.metadata.distributions(path=[str(home.parent.parent)])
        versions = {d.metadata["Name"].lower(): d.version for d in site_dists if d.metadata}
        lookup = versions.get

    found = {name: lookup(name) for name in PIP_COMPILER_PARTS}
    minors = {name: ".".join(v.split(".")[:2]) for name, v in found.items() if v}
    if len(set(minors.values())) <= 1:
        return None
    want = minors.get("nvidia-cuda-nvcc") or min(minors.values())
    have = ", ".join(f"{name} {found[name]}" for name in minors)
    pins = " ".join(f"'{name}=={want}.*'" for name in minors)
    return (
        f"pip's CUDA compiler pieces disagree ({have}): ptxas would reject the newer PTX. "
        f"Fix: `pip install {pins}`"
    )


def candidates(torch_cuda_major: int | None = None) -> list[tuple[Path, str]]:
    """Every toolkit root worth trying, in order, with the rule that proposes it."""
    out: list[tuple[Path, str]] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            out.append((Path(os.environ[var]), f"{var} is set"))
            return out  # an explicit choice is final
    nvcc = shutil.which("nvcc")
    if nvcc:
        out.append((Path(nvcc).resolve().parent.parent, f"nvcc on PATH ({nvcc})"))
    for p in _pip_candidates(torch_cuda_major):
        out.append((p, "pip wheel cuda-toolkit[nvcc] in site-packages"))
    out.append((DEFAULT_CUDA_HOME, f"default {DEFAULT_CUDA_HOME}"))
    return out


@cache
def find_toolkit(torch_cuda: str | None) -> CudaToolkit:
    """The first toolkit with a working nvcc whose major version matches torch's CUDA.

    Raises ToolkitError with the fix when none does.
    """
    want = int(torch_cuda.split(".")[0]) if torch_cuda else None
    if want is None:
        raise ToolkitError(
            "this torch is a CPU-only build (torch.version.cuda is None); install a CUDA build of "
            "torch to compile CUDA kernels"
        )
    tried = []
    mismatch = None
    skew_found = None
    for home, reason in candidates(want):
        nvcc = home / "bin" / ("nvcc.exe" if os.name == "nt" else "nvcc")
        if not nvcc.is_file():
            tried.append(f"{home} ({reason}): no bin/nvcc")
            continue
        if not (home / "include" / "cuda_runtime.h").is_file():
            # e.g. /usr/local/bin/nvcc as a wrapper script: not a toolkit root
            tried.append(f"{home} ({reason}): no include/cuda_runtime.h")
            continue
        try:
            version = _nvcc_version(nvcc)
        except (OSError, subprocess.SubprocessError, ToolkitError) as exc:
            tried.append(f"{home} ({reason}): {exc}")
            continue
        skew = pip_parts_skew(home)
        if skew:
            tried.append(f"{home} ({reason}): {skew}")
            skew_found = skew_found or skew
            continue
        tk = CudaToolkit(home=home, nvcc=nvcc, version=version, reason=reason)
        if tk.major != want:
            mismatch = mismatch or tk
            tried.append(f"{home} ({reason}): CUDA {version}, but torch needs CUDA {want}")
            if reason.endswith("is set"):
                break
            continue
        return tk
    fix = (
        f"install the toolkit that matches torch's CUDA {torch_cuda}: "
        f"`pip install 'cuda-toolkit[nvcc,cccl]=={torch_cuda}.*'`"
        if want >= 13
        else f"install a CUDA {want}.x toolkit (for example NVIDIA's installer, conda "
        f"`cuda-nvcc={torch_cuda}`, or Debian's nvidia-cuda-toolkit) and set CUDA_HOME to it"
    )
    if skew_found and not mismatch:
        raise ToolkitError(f"{skew_found}. Tried: {'; '.join(tried)}.")
    head = (
        f"nvcc at {mismatch.nvcc} is CUDA {mismatch.version} but torch was built with CUDA "
        f"{torch_cuda}; the major versions must match"
        if mismatch
        else "no CUDA compiler (nvcc) found"
    )
    raise ToolkitError(f"{head}. Tried: {'; '.join(tried)}. Fix: {fix}, or set CUDA_HOME.")


def cudart_link_dir(tk: CudaToolkit, scratch: Path) -> Path | None:
    """A directory holding ``libcudart.so`` for ``-lcudart``.

    pip's toolkit ships only ``libcudart.so.13``; then a symlink stands in for the missing
    development link. The link lives in a subdirectory of ``scratch`` named after the library it
    points to, so toolkits in different environments never share one, and a link left dangling
    (its venv deleted) is replaced atomically. Returns None when the toolkit already has it.
    """
    if os.name == "nt":  # pragma: no cover
        return None
    for sub in ("lib64", "lib"):
        if (tk.home / sub / "libcudart.so").exists():
            return None
    for sub in ("lib64", "lib"):
        versioned = sorted((tk.home / sub).glob("libcudart.so.*"))
        if versioned:
            target = versioned[0].resolve()
            where = scratch / hashlib.sha256(str(target).encode()).hexdigest()[:16]
            where.mkdir(parents=True, exist_ok=True)
            link = where / "libcudart.so"
            if not (link.is_symlink() and Path(os.readlink(link)) == target and link.exists()):
                tmp = where / f".libcudart.so.{os.getpid()}"
                tmp.unlink(missing_ok=True)
                tmp.symlink_to(target)
                os.replace(tmp, link)
            return where
    return None
