"""The environment report users paste into bug reports: ``python -m apex.multi_tensor_apply``."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import os
import platform
import sys
from pathlib import Path


def _dist_version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def namespace_problems() -> list[str]:
    """What is wrong with the ``apex`` namespace, as sentences; empty when it is healthy."""
    problems = []
    import apex

    if getattr(apex, "_NAMESPACE_OWNER", None) != "apex-mta-kernels":
        problems.append(
            f"apex/__init__.py at {getattr(apex, '__file__', None)} is not apex-mta-kernels' own "
            "(NVIDIA apex installed over it?): `pip uninstall apex`, then reinstall the apex-* packages"
        )
        return problems
    dirs = {str(Path(p, "apex").resolve()) for p in sys.path if p and Path(p, "apex").is_dir()}
    merged = {str(Path(p).resolve()) for p in apex.__path__}
    for d in sorted(dirs - merged):
        problems.append(f"{d} is on sys.path but not merged into apex.__path__")
    for area in sorted(apex.SUBPACKAGES):
        if not apex._installed(area):
            continue
        try:
            importlib.import_module(f"apex.{area}")
        except Exception as exc:  # noqa: BLE001 - the report names whatever broke
            problems.append(
                f"apex.{area} is present but fails to import: {type(exc).__name__}: {exc}"
            )
    for path in apex.foreign_apex_distributions():
        problems.append(f"foreign distribution named 'apex' at {path}: {_foreign_kind(Path(path))}")
    return problems


def _foreign_kind(meta_dir: Path) -> str:
    version = ""
    for name in ("METADATA", "PKG-INFO"):
        f = meta_dir / name
        if f.is_file():
            for line in f.read_text(errors="replace").splitlines():
                if line.startswith("Version:"):
                    version = line.split(":", 1)[1].strip()
    if version.startswith("0.1"):
        return f"NVIDIA apex {version}; `pip uninstall apex` (our packages replace it)"
    return (
        f"PyPI's unrelated 'apex' {version or '?'} (a 2013 Pyramid toolkit); `pip uninstall apex`"
    )


def _legacy_module(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        return "missing"
    origin = spec.origin
    if origin.endswith((".so", ".pyd")):
        return f"{origin}  <- a compiled module, NVIDIA apex's: it shadows ours"
    return origin


def report(out=sys.stdout) -> int:
    """Print the report; return 1 when the namespace is broken, else 0."""
    import torch

    from . import cuda_home, loader
    from .aot import discover_specs
    from .spec import cache_root

    def line(key: str, value: object) -> None:
        print(f"{key:<28} {value}", file=out)

    print("apex environment report", file=out)
    line("python", f"{sys.version.split()[0]} ({sys.executable})")
    line("platform", platform.platform())
    line("torch", f"{torch.__version__} (CUDA {torch.version.cuda})")
    try:
        tk = cuda_home.find_toolkit(torch.version.cuda)
        line("CUDA toolkit", f"{tk.home} (CUDA {tk.version}); chosen because: {tk.reason}")
        line("nvcc", tk.nvcc)
    except cuda_home.ToolkitError as exc:
        line("CUDA toolkit", f"none usable: {exc}")
    for home, reason in cuda_home.candidates(
        int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None
    ):
        line("  candidate", f"{home} ({reason})")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            line(f"GPU {i}", f"{torch.cuda.get_device_name(i)} (sm_{cap[0]}{cap[1]})")
    else:
        line("GPU", "none visible (kernels run on the reference path; AOT builds still work)")
    line("APEX_CUDA_ARCHS", os.environ.get("APEX_CUDA_ARCHS", "(unset: the visible GPUs')"))
    line("APEX_STRICT_KERNELS", os.environ.get("APEX_STRICT_KERNELS", "0"))
    line("cache dir", cache_root())

    import apex

    print("packages", file=out)
    for area, dist in sorted(apex.SUBPACKAGES.items(), key=lambda kv: kv[1]):
        if not apex._installed(area):
            line(f"  {dist}", f"apex.{area}: not installed (pip install {dist})")
            continue
        installed = _dist_version(dist)
        try:
            mod = importlib.import_module(f"apex.{area}")
            version = getattr(mod, "__version__", "")
            where = Path(getattr(mod, "__file__", "") or "").parent
        except Exception as exc:  # noqa: BLE001
            version, where = f"import fails: {exc}", ""
        how = f"installed {installed}" if installed else "from source"
        line(f"  {dist}", f"apex.{area} {version} ({how}; {where})")
    line("  amp_C", _legacy_module("amp_C"))
    line("  apex_C", _legacy_module("apex_C"))

    print("extensions", file=out)
    try:
        specs = discover_specs()
    except Exception as exc:  # noqa: BLE001
        specs = []
        line("  (discovery failed)", exc)
    for spec in specs:
        state, detail = loader.status(spec)
        line(f"  {spec.name}", f"{state}: {detail}")

    problems = namespace_problems()
    print("namespace", file=out)
    line("  apex.__path__", list(apex.__path__))
    if problems:
        for p in problems:
            line("  PROBLEM", p)
        print("apex namespace is broken; see PROBLEM lines above", file=out)
        return 1
    line("  status", "ok")
    return 0
