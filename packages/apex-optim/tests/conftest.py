"""Tests marked ``cuda`` skip cleanly where torch sees no GPU (markers: pyproject.toml); every
test starts from a seed derived from its name, with one intra-op thread."""

import zlib

import pytest


def pytest_collection_modifyitems(config, items):
    needs_gpu = [item for item in items if item.get_closest_marker("cuda")]
    if not needs_gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in needs_gpu:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_threads(request):
    """Fresh random inputs per test, reproducible from the test's name; one intra-op thread,
    as these tests run many steps of tiny tensors, where threads only add overhead."""
    import torch

    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
