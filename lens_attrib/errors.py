"""The library's exception types (one leaf module, so that every other module can raise them)."""

from __future__ import annotations


class ModelError(ValueError):
    """Raised when a model cannot be loaded or a method does not apply to it."""


class InputError(ValueError):
    """Raised for inputs a method cannot explain (empty, too long, malformed)."""


class TargetError(ValueError):
    """Raised for a target that cannot be explained as given."""


class OptionError(ValueError):
    """Raised for an unknown method option or a value it does not allow."""


__all__ = ["InputError", "ModelError", "OptionError", "TargetError"]
