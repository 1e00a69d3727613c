"""apex-amp as a package: its version and the checks its import runs (apex.amp, apex.fp16_utils).

The tests are apex-mta-kernels' shared package checks (apex.multi_tensor_apply.testing), made
for what this module declares; tests specific to apex-amp go below them.
"""

from __future__ import annotations

from pathlib import Path

from apex.multi_tensor_apply.testing.package_checks import add_package_checks

DIST = "apex-amp"
MODULES = ["apex.amp", "apex.fp16_utils"]
OTHER_FEATURES = ["apex.optimizers", "apex.normalization", "apex.parallel"]
PACKAGE_ROOT = Path(__file__).resolve().parents[1]

add_package_checks(globals())
