"""Test helpers the apex-* packages' test suites share, shipped in the apex-mta-kernels wheel so
that a feature package's tests find them where only apex-mta-kernels and that package are
installed.

For tests only: nothing in apex imports this package, and it imports pytest (present wherever
tests run, not a dependency of apex-mta-kernels). Its modules are registered for pytest's assert
rewriting here, before they are imported, so their failed asserts explain themselves as a test
module's do.
"""

import pytest
import torch

from apex.multi_tensor_apply.build.oplib import functionalizes_lists, mutates_a_list

pytest.register_assert_rewrite(f"{__name__}.package_checks")


# torch.compile(fullgraph=True) of an op that mutates a Tensor[] argument (see build.oplib).
needs_list_functionalization = pytest.mark.skipif(
    not functionalizes_lists(),
    reason="torch 2.3 cannot functionalize ops that mutate Tensor[] arguments (torch.compile "
    "breaks the graph around them there); fullgraph=True needs torch >= 2.4",
)

try:  # torch >= 2.4
    from torch.library import opcheck
except ImportError:
    # torch 2.3 has opcheck only in its internal test utilities, which need the ``expecttest``
    # package: imported on first call, not with this module. Its aot_dispatch checks cannot
    # pass for ops that mutate Tensor[] arguments (see above): those ops get the other checks.
    NO_AOT = ("test_schema", "test_autograd_registration", "test_faketensor")

    def opcheck(op, args, kwargs=None, *, test_utils="ALL", raise_exception=True):
        from torch.testing._internal.optests import opcheck as internal

        if isinstance(op, torch._ops.OpOverloadPacket):  # torch.ops.ns.name, as 2.4's takes it
            op = op.default
        if test_utils == "ALL" and mutates_a_list(str(op._schema)):
            test_utils = list(NO_AOT)
        return internal(op, args, kwargs, test_utils=test_utils, raise_exception=raise_exception)


__all__ = ["needs_list_functionalization", "opcheck"]
