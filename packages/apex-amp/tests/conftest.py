"""Tests marked ``cuda`` skip cleanly where torch sees no GPU (markers: pyproject.toml)."""

import pytest
import torch

# Tiny models: threads only add contention on shared CI machines.
torch.set_num_threads(1)


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
def fresh_amp_state():
    """Each test starts with amp uninitialized and leaves no O1 patch behind."""
    import apex.amp as amp

    amp.reset()
    amp._amp_state.hard_override = False
    amp._amp_state.allow_incoming_model_not_fp32 = False
    yield
    amp.reset()
