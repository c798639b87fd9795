"""The METHODS registry and ``attribute()``, the one entry point that dispatches to a method."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from lens_attrib.attribution import Attribution
from lens_attrib.models import ModelError, is_encoder
from lens_attrib.target import Target


class MethodFn(Protocol):
    def __call__(
        self, model: Any, inputs: Any, target: Target | None = None, **options: Any
    ) -> Attribution: ...


METHODS: dict[str, MethodFn] = {}
METHOD_INFO: dict[str, dict[str, Any]] = {}


def register(
    name: str,
    *,
    decoder: bool = True,
    encoder: bool = True,
    per_layer: bool = False,
    uses_gradient: bool = False,
    instead: str | None = None,
) -> Callable[[Callable[..., Attribution]], Callable[..., Attribution]]:
    """Register a method under ``name``.

    ``decoder``/``encoder`` say where it applies; ``instead`` names the method to use where it
    does not (quoted in the error).
    """

    def wrap(fn: Callable[..., Attribution]) -> Callable[..., Attribution]:
        METHODS[name] = fn  # type: ignore[assignment]
        METHOD_INFO[name] = {
            "decoder": decoder,
            "encoder": encoder,
            "per_layer": per_layer,
            "uses_gradient": uses_gradient,
            "instead": instead,
        }
        return fn

    return wrap


def check_applies(name: str, model: Any) -> None:
    """Raise a ModelError naming the right method when ``name`` does not fit the architecture."""
    info = METHOD_INFO.get(name)
    if info is None:
        return
    enc = is_encoder(model)
    if (enc and not info["encoder"]) or (not enc and not info["decoder"]):
        kind = "encoder (HookedEncoder)" if enc else "decoder (HookedTransformer)"
        hint = f" Use {info['instead']!r} instead." if info["instead"] else ""
        raise ModelError(f"Method {name!r} does not apply to a {kind} model.{hint}")


def attribute(
    model: Any,
    inputs: Any,
    target: Target | None = None,
    method: str = "grad_x_input",
    **options: Any,
) -> Attribution:
    """Explain ``target`` for ``inputs`` with the registered ``method``.

    ``inputs``: a prompt, a list of prompts, or token ids; ``target``: a :class:`Target`
    (default: the model's prediction at the last real token). Options go to the method.
    """
    if method not in METHODS:
        raise KeyError(f"Unknown method {method!r}. Registered: {sorted(METHODS)}")
    check_applies(method, model)
    return METHODS[method](model, inputs, target, **options)
