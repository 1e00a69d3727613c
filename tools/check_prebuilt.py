"""Run in a fresh environment with no CUDA toolkit: every apex extension installed from a
platform wheel loads from the wheel, and nothing is compiled.

    python tools/check_prebuilt.py        # exit 0, one line per extension; else the reason

Expects APEX_CUDA_ARCHS (the GPU the wheel must serve; no GPU is needed) and an empty
APEX_CACHE_DIR; APEX_STRICT_KERNELS=1 turns any fallback into an error.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def main() -> int:
    problems = []
    if shutil.which("nvcc"):
        problems.append(
            f"nvcc is on PATH ({shutil.which('nvcc')}): this check needs a machine without one"
        )
    import torch

    import amp_C  # noqa: F401 - the legacy module imports without compiling anything
    from apex.multi_tensor_apply.build import aot, cache_root, cuda_home, loader

    # A machine without a toolkit: hide /usr/local/cuda too (the builder's last resort), so any
    # attempt to compile fails instead of quietly succeeding.
    cuda_home.DEFAULT_CUDA_HOME = Path("/nonexistent/cuda")
    cuda_home.find_toolkit.cache_clear()
    try:
        tk = cuda_home.find_toolkit(torch.version.cuda)
        problems.append(f"a CUDA toolkit is visible ({tk.home}, {tk.reason})")
    except cuda_home.ToolkitError:
        print("no CUDA toolkit visible, as on a machine without one")

    specs = aot.discover_specs()
    if not specs:
        problems.append("no apex package with kernels is installed")
    for spec in specs:
        state, detail = loader.status(spec)
        ext = loader.load(spec)
        origin = ext.origin if ext is not None else "fallback"
        where = Path(ext.path) if ext is not None else None
        inside = where is not None and "site-packages" in where.parts
        print(f"{spec.name}: status {state}, loaded from {origin}: {where}")
        if state != "prebuilt" or origin != "prebuilt" or not inside:
            problems.append(f"{spec.name} did not load from its wheel ({state}; {detail})")
    cache = cache_root()
    built = sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []
    if any(not name.endswith(".lock") for name in built):
        problems.append(f"something was compiled into {cache}: {built}")
    # The CPU path still works beside the prebuilt CUDA kernels.
    from apex.multi_tensor_apply import ops

    x = [torch.ones(5)]
    out = [torch.empty(5)]
    flag = torch.zeros(1, dtype=torch.int32)
    ops.multi_tensor_scale(x, out, flag, 2.0)
    if not torch.equal(out[0], torch.full((5,), 2.0)):
        problems.append("multi_tensor_scale on CPU gave a wrong answer")
    for p in problems:
        print("FAIL:", p, file=sys.stderr)
    if not problems:
        print(
            f"ok: {len(specs)} extension(s) prebuilt, nothing compiled, torch {torch.__version__}, "
            f"APEX_CUDA_ARCHS={os.environ.get('APEX_CUDA_ARCHS')}"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
