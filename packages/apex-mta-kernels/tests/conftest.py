import os
import zlib

import pytest
import torch

from apex.multi_tensor_apply.testing.gpu_memory import one_big_test_at_a_time

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
        "markers", "big_memory: holds tens of GB of GPU memory (one such test at a time)"
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


_one_big_test_at_a_time = pytest.fixture(autouse=True)(one_big_test_at_a_time)


@pytest.fixture
def strict_kernels(monkeypatch):
    """GPU tests must exercise the compiled kernels, never a silent fallback."""
    monkeypatch.setenv("APEX_STRICT_KERNELS", "1")


def devices():
    out = ["cpu"]
    if torch.cuda.is_available() or os.environ.get("APEX_TEST_CUDA") == "1":
        out.append(pytest.param("cuda", marks=pytest.mark.cuda))
    return out
