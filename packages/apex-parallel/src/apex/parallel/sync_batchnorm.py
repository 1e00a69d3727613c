"""apex's module of the pure-Python SyncBatchNorm; the one implementation now lives in
optimized_sync_batchnorm (it runs on CPU through the plain-torch references)."""

from .optimized_sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
