"""Repository-wide pytest hooks for `pytest` run from the repository root.

The markers are registered in pyproject.toml ([tool.pytest.ini_options]); each package registers
them again in its own pyproject.toml and skips GPU tests in its own tests/conftest.py, so its
tests also run on their own.
"""

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
