"""The exceptions of bad arguments to the norms: TypeError (a non-tensor, an unsupported dtype) or
ValueError (shapes, devices), each also a RuntimeError: apex's checks (TORCH_CHECK) and torch's
own layer_norm raise RuntimeError, and code written against them catches that."""

from __future__ import annotations


class NormTypeError(TypeError, RuntimeError):
    """A norm's argument of the wrong type or dtype."""


class NormValueError(ValueError, RuntimeError):
    """A norm's argument of the wrong shape, size or device."""
