"""What to compile: one KernelSpec per extension library."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

_SOURCE_SUFFIXES = (".cpp", ".cu", ".cuh", ".h", ".hpp")


@dataclass(frozen=True)
class KernelSpec:
    """An extension library: ``name`` (``apex_<area>_C``), the package that owns it, and its
    sources relative to that package's directory. Every ``.cpp``/``.cu`` file is compiled; headers
    next to them count towards the cache key."""

    name: str
    package: str
    sources: tuple[str, ...]
    # The C++ standard is left to torch (C++17 up to 2.13, C++20 from 2.14).
    extra_cflags: tuple[str, ...] = ("-O3",)
    extra_cuda_cflags: tuple[str, ...] = (
        "-O3",
        "--use_fast_math",
        "-lineinfo",
        "--expt-relaxed-constexpr",
    )
    # Sources outside any package (tests): a directory that stands in for the package's.
    directory: str = field(default="")

    @property
    def package_dir(self) -> Path:
        if self.directory:
            return Path(self.directory)
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"{self.name}: package {self.package} not found")
        return Path(list(spec.submodule_search_locations)[0])

    @property
    def source_paths(self) -> list[Path]:
        return [self.package_dir / s for s in self.sources]

    @property
    def needs_cuda(self) -> bool:
        return any(s.endswith(".cu") for s in self.sources)

    @property
    def prebuilt_dir(self) -> Path:
        return self.package_dir / "_prebuilt"

    def source_hash(self) -> str:
        """sha256 over every source and header beside the sources, and the flags."""
        h = hashlib.sha256()
        files: set[Path] = set()
        for src in self.source_paths:
            files.update(p for p in src.parent.iterdir() if p.suffix in _SOURCE_SUFFIXES)
        for path in sorted(files):
            h.update(path.name.encode())
            h.update(path.read_bytes())
        h.update(repr((self.extra_cflags, self.extra_cuda_cflags)).encode())
        return h.hexdigest()[:16]


def normalize_archs(archs: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """'8.0;9.0' or ['80', 'sm_90'] -> ('8.0', '9.0'), sorted, unique."""
    if isinstance(archs, str):
        archs = [a for a in archs.replace(",", ";").replace(" ", ";").split(";") if a]
    out = set()
    for a in archs:
        a = a.strip().lower().removeprefix("sm_").removeprefix("sm")
        if "." not in a:
            a = f"{a[:-1]}.{a[-1]}"
        major, minor = a.split(".")
        int(major), int(minor.rstrip("a"))  # validate
        out.add(f"{int(major)}.{minor}")
    return tuple(sorted(out, key=lambda s: (int(s.split(".")[0]), s.split(".")[1])))


def arch_covers(built: tuple[str, ...], device: str) -> bool:
    """True when machine code built for ``built`` runs on a device of capability ``device``:
    the same major with a minor no higher (sm_80 code runs on 8.6 and 8.9, not on 9.0)."""
    dmaj, dmin = (int(x) for x in device.split("."))
    for a in built:
        maj, minor = a.split(".")
        if int(maj) == dmaj and int(minor.rstrip("a")) <= dmin and not minor.endswith("a"):
            return True
        if a == device:
            return True
    return False


def cache_root() -> Path:
    """``APEX_CACHE_DIR``, else ``$XDG_CACHE_HOME/apex``, else ``~/.cache/apex``."""
    env = os.environ.get("APEX_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "apex"


def build_key(
    spec: KernelSpec, torch_version: str, cuda_version: str | None, archs: tuple[str, ...]
) -> str:
    """Directory name of one build: source hash, torch, CUDA, Python and archs."""
    tv = torch_version.split("+")[0]
    cu = f"cu{cuda_version.replace('.', '')}" if cuda_version else "cpu"
    sm = "sm" + "_".join(a.replace(".", "") for a in archs) if archs else "nosm"
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"{spec.name}-{spec.source_hash()}-torch{tv}-{cu}-{py}-{sm}"
