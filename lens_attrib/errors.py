"""The library's exception and warning types (one leaf module, so that every other module can
raise them)."""

from __future__ import annotations


class ModelError(ValueError):
    """Raised when a model cannot be loaded or a method does not apply to it."""


class InputError(ValueError):
    """Raised for inputs a method cannot explain (empty, too long, malformed)."""


class TargetError(ValueError):
    """Raised for a target that cannot be explained as given."""


class OptionError(ValueError):
    """Raised for an unknown method option or a value it does not allow."""


class NonFiniteError(FloatingPointError):
    """Raised when a weight or an activation of the model holds NaN/inf; the message names it."""


class InputWarning(UserWarning):
    """Warned for inputs that run but very likely explain something else than meant (a target
    without the leading space its word has after the prompt, a prompt ending in a space)."""


__all__ = [
    "InputError",
    "InputWarning",
    "ModelError",
    "NonFiniteError",
    "OptionError",
    "TargetError",
]
