"""The big_memory lock (testing.gpu_memory): held for a marked test, by one process at a time,
and a failed test's memory let go before it is released."""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import types

import pytest

from apex.multi_tensor_apply.testing import gpu_memory


def request(*markers):
    return types.SimpleNamespace(keywords={name: True for name in markers})


def lock_is_free() -> bool:
    """Whether another open file description can take the lock now (flock locks belong to the
    open file description, so this stands for another process)."""
    with open(os.path.join(tempfile.gettempdir(), gpu_memory.LOCK_NAME), "a") as other:
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(other, fcntl.LOCK_UN)
        return True


def test_a_marked_test_holds_the_lock_until_it_ends():
    fixture = gpu_memory.one_big_test_at_a_time(request("big_memory", "cuda"))
    next(fixture)
    assert not lock_is_free()
    with pytest.raises(StopIteration):
        next(fixture)
    assert lock_is_free()


def test_an_unmarked_test_takes_no_lock():
    fixture = gpu_memory.one_big_test_at_a_time(request("cuda", "slow"))
    next(fixture)
    assert lock_is_free()
    with pytest.raises(StopIteration):
        next(fixture)


def test_a_failed_test_lets_go_of_its_frames_and_the_lock():
    saved = {k: sys.__dict__[k] for k in ("last_value", "last_traceback") if k in sys.__dict__}
    fixture = gpu_memory.one_big_test_at_a_time(request("big_memory"))
    next(fixture)
    try:
        sys.last_value, sys.last_traceback = ValueError("kept"), None  # as pytest leaves them
        fixture.close()  # as pytest's teardown: the generator's finally runs
        assert not hasattr(sys, "last_value") and not hasattr(sys, "last_traceback")
        assert lock_is_free()
    finally:
        sys.__dict__.update(saved)
