"""The extension builder every apex package compiles its kernels with.

- ``KernelSpec``: what to compile (each package lists its specs in ``apex.<area>._kernels``);
- ``load(spec)``: prebuilt in the package, else cached, else compiled once under an OS file lock;
  returns None after one warning when no compiler can be had (``APEX_STRICT_KERNELS=1``: raise);
- ``oplib.define_ops(namespace, spec, schemas, references, fakes)``: a package's ops, with the
  reference on every device and the compiled kernels taking over on CUDA at first call;
- ``aot.build(archs)``: the same builder run ahead of time, for platform wheels and CI.

Environment: ``APEX_CACHE_DIR`` (cache root), ``APEX_CUDA_ARCHS`` ('8.0;9.0'),
``APEX_STRICT_KERNELS``, ``APEX_JIT_VERBOSE``, ``MAX_JOBS``, ``CUDA_HOME``.
"""

from .cuda_home import CudaToolkit, ToolkitError, find_toolkit
from .loader import Extension, KernelsUnavailable, load, status
from .spec import KernelSpec, cache_root, normalize_archs

__all__ = [
    "CudaToolkit",
    "Extension",
    "KernelSpec",
    "KernelsUnavailable",
    "ToolkitError",
    "cache_root",
    "find_toolkit",
    "load",
    "normalize_archs",
    "status",
]
