"""Loading an extension: prebuilt in the package, else cached, else compiled once under a lock.

Never called at import: ops call ``load(spec)`` the first time they run on a CUDA tensor.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from .cuda_home import CudaToolkit, ToolkitError, cudart_link_dir, find_toolkit
from .lock import FileLock
from .spec import KernelSpec, arch_covers, build_key, cache_root, normalize_archs

log = logging.getLogger("apex.multi_tensor_apply.build")

LIB_SUFFIX = ".pyd" if os.name == "nt" else ".so"
MARKER = "build.json"


class KernelsUnavailable(RuntimeError):
    """Raised instead of falling back when ``APEX_STRICT_KERNELS=1``."""


@dataclass(frozen=True)
class Extension:
    spec: KernelSpec
    path: Path  # the shared library
    origin: str  # "prebuilt", "cache" or "compiled"
    archs: tuple[str, ...]


_lock = threading.Lock()
_loaded: dict[str, Extension] = {}
_failed: dict[str, Exception] = {}
_warned: set[str] = set()  # failures warned about (once each, whenever the first lenient call)
_pre_load: dict[str, list] = {}
_post_load: dict[str, list] = {}


def register_pre_load(name: str, hook) -> None:
    """Run ``hook()`` right before the library ``name`` is opened (its static initialisers then
    register kernels; the hook lets Python stand-ins step aside first)."""
    _pre_load.setdefault(name, []).append(hook)


def _run_pre_load(name: str) -> None:
    for hook in _pre_load.get(name, ()):
        hook()


@contextlib.contextmanager
def _pre_load_at_open(name: str):
    """While cpp_extension builds and opens the library ``name`` (one call), its pre-load hooks
    run right before the open rather than before the compile: torch.ops.load_library, which
    cpp_extension opens it with, is wrapped meanwhile. Until then the Python stand-ins stay, so
    another thread's first call meets them and waits on the loader's lock for the compiled
    kernels (strict mode holds) instead of finding the reference for the minutes nvcc runs.
    Should cpp_extension open it another way, the hooks run once it returns."""
    import torch

    ops = torch.ops
    shadowed = "load_library" in vars(ops)  # already an instance attribute (a test's stand-in)
    previous = ops.load_library
    ran = []

    def load_library(path):
        # cpp_extension names a rebuild in the same process with other arguments name_v1, ...
        if not ran and re.fullmatch(
            re.escape(name) + r"(?:_v\d+)?" + re.escape(LIB_SUFFIX), Path(path).name
        ):
            ran.append(True)
            _run_pre_load(name)
        return previous(path)

    ops.load_library = load_library
    try:
        yield
    finally:
        if vars(ops).get("load_library") is load_library:
            if shadowed:
                ops.load_library = previous
            else:
                del ops.load_library
    if not ran:
        _run_pre_load(name)


def register_post_load(name: str, hook) -> None:
    """Run ``hook(extension)`` once the library ``name`` is loaded, before the call that loaded it
    goes on (apex-norm reads there what its library has to say about the environment). Every hook
    runs; the first error raised reaches that call, and the library stays loaded."""
    _post_load.setdefault(name, []).append(hook)


def loaded(spec: KernelSpec) -> Extension | None:
    return _loaded.get(spec.name)


def strict() -> bool:
    return os.environ.get("APEX_STRICT_KERNELS", "0") not in ("", "0", "false", "False")


def _torch_info() -> tuple[str, str | None]:
    import torch

    return torch.__version__, torch.version.cuda


def device_archs() -> tuple[str, ...]:
    """``APEX_CUDA_ARCHS`` if set, else the capability of every visible GPU."""
    env = os.environ.get("APEX_CUDA_ARCHS")
    if env:
        return normalize_archs(env)
    import torch

    if not torch.cuda.is_available():
        return ()
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return normalize_archs([f"{a}.{b}" for a, b in caps])


def _read_marker(d: Path) -> dict | None:
    try:
        return json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _covers(built: tuple[str, ...], wanted: tuple[str, ...]) -> bool:
    return all(arch_covers(built, w) for w in wanted)


def find_prebuilt(spec: KernelSpec, archs: tuple[str, ...]) -> Path | None:
    """A library built ahead of time into the package (platform wheel), if it fits this torch."""
    meta = _read_marker(spec.prebuilt_dir)
    lib = spec.prebuilt_dir / f"{spec.name}{LIB_SUFFIX}"
    if not meta or not lib.is_file():
        return None
    tv, cuda = _torch_info()
    same_torch = (
        meta.get("torch", "").split("+")[0].rsplit(".", 1)[0] == tv.split("+")[0].rsplit(".", 1)[0]
    )
    if (
        same_torch
        and meta.get("cuda") == cuda
        and meta.get("source_hash") == spec.source_hash()
        and _covers(tuple(meta.get("archs", ())), archs)
    ):
        return lib
    return None


def find_cached(spec: KernelSpec, archs: tuple[str, ...]) -> Path | None:
    """A finished build in the cache whose archs cover ``archs`` (an AOT build for 8.0;9.0 serves
    a 9.0 device)."""
    tv, cuda = _torch_info()
    prefix = build_key(spec, tv, cuda, ()).rsplit("-", 1)[0] + "-"
    root = cache_root()
    if not root.is_dir():
        return None
    for d in sorted(root.glob(prefix + "*")):
        meta = _read_marker(d)
        lib = d / f"{spec.name}{LIB_SUFFIX}"
        if meta and lib.is_file() and _covers(tuple(meta.get("archs", ())), archs):
            return lib
    return None


def _max_jobs() -> str:
    if os.environ.get("MAX_JOBS"):
        return os.environ["MAX_JOBS"]
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        mem_gb = 8
    # nvcc takes up to ~4 GB per job on these sources; flash-attn sizes MAX_JOBS the same way.
    return str(max(1, min(os.cpu_count() or 1, int(mem_gb // 4))))


def _nvcc_threads(sources: list[str], archs: tuple[str, ...]) -> list[str]:
    """nvcc's ``--threads`` for the cores that ninja's one job per source leaves idle: a spec of
    one large .cu compiled for two archs (apex-norm, apex-parallel) builds each arch on its own
    core, which halves its wall time on a 2-core machine. The objects are the same either way."""
    n_cuda = sum(s.endswith(".cu") for s in sources)
    if len(archs) < 2 or n_cuda == 0:
        return []
    spare = int(_max_jobs()) // n_cuda
    threads = min(len(archs), spare)
    return [f"--threads={threads}"] if threads > 1 else []


def _unity_sources(sources: list[str], out: Path, jobs: int) -> list[str]:
    """The .cu files as at most ``jobs`` unity translation units where ninja has fewer jobs
    than .cu files. Each .cu file here parses torch's headers first: 85 s of the ~115 s that one
    of apex-mta-kernels' nine took for sm_80 + sm_90 on a 2-core machine (572 s for the whole
    library), so on few cores most of a build went into parsing the same headers again. A unit
    is a file in the build directory that #includes a group of the sources, groups balanced by
    size; the code compiled is the same, and so is the cache key (it hashes the sources). With
    as many jobs as .cu files (16 cores), every file stays its own unit. APEX_UNITY_BUILD=0 keeps
    every file its own unit anyway (one nvcc process per unit needs more memory)."""
    cu = [s for s in sources if s.endswith(".cu")]
    if jobs >= len(cu) or os.environ.get("APEX_UNITY_BUILD") == "0":
        return sources
    groups: list[list[str]] = [[] for _ in range(max(1, jobs))]
    load = [0] * len(groups)
    for src in sorted(cu, key=lambda s: (-Path(s).stat().st_size, s)):
        k = load.index(min(load))
        groups[k].append(src)
        load[k] += Path(src).stat().st_size
    units = [s for s in sources if not s.endswith(".cu")]
    for k, group in enumerate(groups):
        if len(group) == 1:
            units.append(group[0])
            continue
        unit = out / f"unity_{k}.cu"
        text = "".join(f'#include "{Path(s).resolve().as_posix()}"\n' for s in sorted(group))
        if not unit.is_file() or unit.read_text() != text:  # ninja rebuilds on a new mtime
            unit.write_text(text)
        units.append(str(unit))
    return units


def compile_spec(spec: KernelSpec, archs: tuple[str, ...]) -> Path:
    """Compile ``spec`` for ``archs`` into its cache directory and load it (caller holds the lock).

    Raises ToolkitError when no usable nvcc exists, or the compiler's error.
    """
    tv, cuda = _torch_info()
    tk: CudaToolkit | None = find_toolkit(cuda) if spec.needs_cuda else None
    if spec.needs_cuda and not archs:
        raise ToolkitError(
            f"{spec.name}: no CUDA arch to compile for (no GPU visible); "
            "set APEX_CUDA_ARCHS, e.g. '8.0;9.0'"
        )
    out = cache_root() / build_key(spec, tv, cuda, archs)
    out.mkdir(parents=True, exist_ok=True)
    # torch <= 2.13 guards its own build with an O_EXCL file that a killed build leaves behind,
    # after which every later build waits forever. We hold our flock, so nobody else is building.
    (out / "lock").unlink(missing_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    where = f"for sm_{', sm_'.join(a.replace('.', '') for a in archs)}" if archs else "(C++ only)"
    log.warning("apex: compiling %s %s (first use; cached in %s)", spec.name, where, out)
    t0 = time.perf_counter()

    from torch.utils import cpp_extension

    ldflags: list[str] = []
    saved = {k: os.environ.get(k) for k in ("TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "CUDA_HOME")}
    saved_home = getattr(cpp_extension, "CUDA_HOME", None)
    try:
        os.environ["MAX_JOBS"] = _max_jobs()
        if tk is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
            os.environ["CUDA_HOME"] = str(tk.home)
            cpp_extension.CUDA_HOME = str(tk.home)
            shim = cudart_link_dir(tk, cache_root() / f"cudart_shim_cu{tk.major}")
            if shim is not None:
                ldflags.append(f"-L{shim}")
        verbose = os.environ.get("APEX_JIT_VERBOSE") == "1"
        sources = _unity_sources([str(p) for p in spec.source_paths], out, int(_max_jobs()))
        cuda_flags = list(spec.extra_cuda_cflags)
        if tk is not None:
            cuda_flags += _nvcc_threads(sources, archs)
        with _pre_load_at_open(spec.name):
            cpp_extension.load(
                name=spec.name,
                sources=sources,
                extra_cflags=list(spec.extra_cflags),
                extra_cuda_cflags=cuda_flags,
                extra_ldflags=ldflags,
                build_directory=str(out),
                verbose=verbose,
                is_python_module=False,
            )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        cpp_extension.CUDA_HOME = saved_home
    seconds = time.perf_counter() - t0
    lib = out / f"{spec.name}{LIB_SUFFIX}"
    meta = {
        "name": spec.name,
        "archs": list(archs),
        "torch": tv,
        "cuda": cuda,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "source_hash": spec.source_hash(),
        "nvcc": str(tk.nvcc) if tk else None,
        "nvcc_version": tk.version if tk else None,
        "toolkit_reason": tk.reason if tk else None,
        "seconds": round(seconds, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        # Whole or not at all (a full disk leaves no empty marker): written aside, then renamed.
        (out / f"{MARKER}.tmp").write_text(json.dumps(meta, indent=1))
        os.replace(out / f"{MARKER}.tmp", out / MARKER)
    except OSError as exc:
        # The library is open and its kernels are registered: it serves this process all the
        # same (failing here would put the reference back over them). Unmarked, the cache entry
        # is not reused, and an AOT build refuses it (aot.build).
        log.warning("apex: built %s but could not mark it in the cache (%s)", spec.name, exc)
    log.warning("apex: built %s in %.1f s", spec.name, seconds)
    return lib


def _load_library(lib: Path, name: str) -> None:
    import torch

    _run_pre_load(name)
    torch.ops.load_library(str(lib))


def _load(spec: KernelSpec) -> Extension:
    archs = device_archs() if spec.needs_cuda else ()
    lib = find_prebuilt(spec, archs)
    if lib is not None:
        _load_library(lib, spec.name)
        return Extension(spec, lib, "prebuilt", archs)
    lib = find_cached(spec, archs)
    if lib is not None:
        _load_library(lib, spec.name)
        return Extension(spec, lib, "cache", archs)
    with FileLock(cache_root() / f"{spec.name}.lock"):
        lib = find_cached(spec, archs)  # another process may have built it while we waited
        if lib is not None:
            _load_library(lib, spec.name)
            return Extension(spec, lib, "cache", archs)
        lib = compile_spec(spec, archs)
        return Extension(spec, lib, "compiled", archs)


def fallback_message(spec: KernelSpec, exc: BaseException) -> str:
    return (
        f"apex: {spec.name} is unavailable ({exc}); its ops run on the plain-torch reference path, "
        "which is correct but slow. To get the fast path install a CUDA toolkit matching torch "
        "(for CUDA 13: `pip install 'cuda-toolkit[nvcc,cccl]'`), or a platform wheel with "
        "prebuilt kernels; `python -m apex.multi_tensor_apply` shows what was found. "
        "Set APEX_STRICT_KERNELS=1 to make this an error."
    )


def load(spec: KernelSpec) -> Extension | None:
    """The loaded extension, or None when it cannot be had (after one warning per extension).

    With ``APEX_STRICT_KERNELS=1`` a failure raises KernelsUnavailable instead.
    """
    ext = _loaded.get(spec.name)
    if ext is not None:
        return ext
    with _lock:
        if spec.name in _loaded:
            return _loaded[spec.name]
        if spec.name not in _failed:
            try:
                ext = _loaded[spec.name] = _load(spec)
            except Exception as exc:  # compiler errors come in many types
                _failed[spec.name] = exc
        if ext is None:
            exc = _failed[spec.name]
            is_strict = strict()
            warn = not is_strict and spec.name not in _warned
            if warn:
                _warned.add(spec.name)
    if ext is not None:
        # Outside the lock (a hook may load another library) and after the library counts as
        # loaded: every hook runs; the first error one raises (a warning made an error) reaches
        # this caller and leaves the library loaded.
        errors = []
        for hook in _post_load.get(spec.name, ()):
            try:
                hook(ext)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return ext
    if is_strict:
        raise KernelsUnavailable(fallback_message(spec, exc)) from exc
    if warn:
        warnings.warn(fallback_message(spec, exc), RuntimeWarning, stacklevel=3)
    return None


def status(spec: KernelSpec) -> tuple[str, str]:
    """For the report: (state, detail) without compiling or loading anything."""
    if spec.name in _loaded:
        e = _loaded[spec.name]
        return "loaded", f"{e.origin}: {e.path}"
    try:
        archs = device_archs() if spec.needs_cuda else ()
    except Exception as exc:  # noqa: BLE001 - report what broke
        return "fallback", f"cannot query the GPU: {exc}"
    lib = find_prebuilt(spec, archs)
    if lib:
        return "prebuilt", str(lib)
    lib = find_cached(spec, archs)
    if lib:
        return "cached", str(lib)
    if spec.needs_cuda:
        _, cuda = _torch_info()
        try:
            tk = find_toolkit(cuda)
        except ToolkitError as exc:
            return "fallback", str(exc)
        if not archs:
            return "fallback", "no GPU visible and APEX_CUDA_ARCHS unset (AOT: use `build`)"
        return "would compile", f"with {tk.nvcc} (CUDA {tk.version}) for {';'.join(archs)}"
    return "would compile", "C++ only"


def reset_for_tests() -> None:
    """Forget what this process loaded or failed (libraries stay loaded)."""
    _loaded.clear()
    _failed.clear()
    _warned.clear()
    find_toolkit.cache_clear()
