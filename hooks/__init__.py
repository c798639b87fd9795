"""Hook functions and the model guard (installed as ``lens_attrib.hooks``).

Every hook is a TransformerLens forward hook, ``HookFn``: it receives the activation and the
``HookPoint`` and returns a replacement activation (or ``None`` to leave it unchanged).
"""

from collections.abc import Callable
from typing import Any

from torch import Tensor

HookFn = Callable[[Tensor, Any], Tensor | None]
"""A TransformerLens forward hook: ``(activation, hook) -> activation or None``."""

__all__ = ["HookFn"]
