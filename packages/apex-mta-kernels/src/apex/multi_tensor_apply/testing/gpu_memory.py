"""One test at a time among those that hold tens of GB of GPU memory (marker ``big_memory``:
tensors of more than 2^31 elements), across pytest-xdist's workers and across the packages'
pytest runs side by side on one GPU: three at once ran an 80 GB H100 out of memory (12-05 13:5x).

A package's conftest asks for it as an autouse fixture::

    from apex.multi_tensor_apply.testing.gpu_memory import one_big_test_at_a_time

    _one_big_test_at_a_time = pytest.fixture(autouse=True)(one_big_test_at_a_time)

For tests only (imports pytest's request object's API, torch lazily).
"""

from __future__ import annotations

import fcntl
import gc
import os
import sys
import tempfile

__all__ = ["LOCK_NAME", "MARKER", "one_big_test_at_a_time"]

MARKER = "big_memory"
LOCK_NAME = "apex-big-memory.lock"  # one file for every package's tests


def one_big_test_at_a_time(request):
    """A generator fixture: for a test marked big_memory, an exclusive lock on a file in the
    temporary folder, held until the test's memory has gone back to the driver (the caching
    allocator would keep it); other tests pass straight through."""
    if MARKER not in request.keywords:
        yield
        return
    with open(os.path.join(tempfile.gettempdir(), LOCK_NAME), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            # A failed test's frames (and its tensors) stay referenced from sys.last_* until the
            # worker's next test: let them go first (a review found the 26 GB kept).
            for name in ("last_type", "last_value", "last_traceback", "last_exc"):
                sys.__dict__.pop(name, None)
            gc.collect()
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)
