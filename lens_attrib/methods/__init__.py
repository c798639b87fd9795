"""Attribution methods. Importing this package registers every method in ``METHODS``."""

from lens_attrib.methods import gradient
from lens_attrib.methods import lrp  # noqa: F401
from lens_attrib.methods import alti, attention, perturbation  # noqa: F401
from lens_attrib.methods import generation, grad_ellm, logit_lens  # noqa: F401
from lens_attrib.methods.registry import METHOD_INFO, METHODS, attribute, register

__all__ = ["METHODS", "METHOD_INFO", "attribute", "gradient", "register"]
