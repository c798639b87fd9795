"""Attribution methods: importing this package registers every module's methods in ``METHODS``.

Every module of this package is imported here (discovered, not listed), so a new method is one
new file with a ``@register(...)`` core function.
"""

import importlib
import pkgutil

from lens_attrib.methods.registry import METHODS, MethodSpec, attribute, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["METHODS", "MethodSpec", "attribute", "register"]
