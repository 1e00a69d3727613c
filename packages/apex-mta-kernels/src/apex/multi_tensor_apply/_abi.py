"""The check every feature package runs at import against the installed apex-mta-kernels."""

from __future__ import annotations

import os

from ._version import KERNEL_ABI, __version__


def require_kernel_abi(dist: str, lowest: int, highest: int) -> None:
    """Raise ImportError unless ``lowest <= KERNEL_ABI <= highest``.

    ``APEX_SKIP_ABI_CHECK=1`` turns the error off (for bisecting, at your own risk).
    """
    if lowest <= KERNEL_ABI <= highest or os.environ.get("APEX_SKIP_ABI_CHECK") == "1":
        return
    want = f"{lowest}" if lowest == highest else f"{lowest}..{highest}"
    raise ImportError(
        f"{dist} needs apex-mta-kernels with kernel ABI {want}, but the installed apex-mta-kernels "
        f"{__version__} has kernel ABI {KERNEL_ABI}. Install matching versions: "
        f"`pip install --upgrade {dist} apex-mta-kernels` (or pin apex-mta-kernels to the range "
        f"{dist} declares). Set APEX_SKIP_ABI_CHECK=1 to import anyway."
    )
