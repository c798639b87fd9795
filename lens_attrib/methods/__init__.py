"""Attribution methods. Importing this package registers every method in ``METHODS``."""

from lens_attrib.methods import (  # noqa: F401  (importing registers the methods)
    alti,
    attention,
    generation,
    grad_ellm,
    gradient,
    logit_lens,
    lrp,
    perturbation,
)
from lens_attrib.methods.registry import METHOD_INFO, METHODS, attribute, register

__all__ = ["METHODS", "METHOD_INFO", "attribute", "gradient", "register"]
