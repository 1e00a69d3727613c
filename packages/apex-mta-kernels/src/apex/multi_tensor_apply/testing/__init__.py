"""Test helpers the apex-* packages' test suites share, shipped in the apex-mta-kernels wheel so
that a feature package's tests find them where only apex-mta-kernels and that package are
installed.

For tests only: nothing in apex imports this package, and it imports pytest (present wherever
tests run, not a dependency of apex-mta-kernels). Its modules are registered for pytest's assert
rewriting here, before they are imported, so their failed asserts explain themselves as a test
module's do.
"""

import pytest

pytest.register_assert_rewrite(f"{__name__}.package_checks")

try:  # torch >= 2.4
    from torch.library import opcheck
except ImportError:

    def opcheck(op, args, kwargs=None, *, test_utils="ALL", raise_exception=True):
        """torch 2.3 has opcheck only in its internal test utilities (same signature), which
        need the ``expecttest`` package: imported on first call, not with this module."""
        from torch.testing._internal.optests import opcheck as internal

        return internal(op, args, kwargs, test_utils=test_utils, raise_exception=raise_exception)


__all__ = ["opcheck"]
