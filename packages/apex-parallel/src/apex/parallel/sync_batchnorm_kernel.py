"""apex's module name for the Python SyncBatchNorm's autograd Function; same Function as the
optimized one."""

from .optimized_sync_batchnorm_kernel import SyncBatchnormFunction

__all__ = ["SyncBatchnormFunction"]
