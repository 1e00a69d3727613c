import fcntl
import gc
import os
import sys
import tempfile
import zlib

import pytest
import torch

# Per-dtype (atol, rtol) of a kernel against its float32-math reference.
TOLERANCES = {
    torch.float32: (1e-6, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line(
        "markers", "big_memory: holds about 26 GB of GPU memory (one such test at a time)"
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random inputs per test, reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _one_big_test_at_a_time(request):
    """Tests marked big_memory (tensors of 2^31 + 17 elements, about 26 GB each) run one at a
    time across pytest-xdist's workers, which share the GPU: three at once ran an 80 GB H100 out
    of memory (12-05 13:5x). An exclusive lock on a file in the temporary folder, held until the
    test's memory has gone back to the driver (the caching allocator would keep it)."""
    if "big_memory" not in request.keywords:
        yield
        return
    path = os.path.join(tempfile.gettempdir(), "apex-mta-kernels-big-memory.lock")
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            # A failed test's frames (and its tensors) stay referenced from sys.last_* until the
            # worker's next test: let them go first (a review found the 26 GB kept).
            for name in ("last_type", "last_value", "last_traceback", "last_exc"):
                sys.__dict__.pop(name, None)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def strict_kernels(monkeypatch):
    """GPU tests must exercise the compiled kernels, never a silent fallback."""
    monkeypatch.setenv("APEX_STRICT_KERNELS", "1")


def devices():
    out = ["cpu"]
    if torch.cuda.is_available() or os.environ.get("APEX_TEST_CUDA") == "1":
        out.append(pytest.param("cuda", marks=pytest.mark.cuda))
    return out
