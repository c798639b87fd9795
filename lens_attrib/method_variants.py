"""Method variants on the command line: ``name[option=value,…]`` as one method of a sweep.

A table may hold the same method under two settings, e.g. Gradient×Input with its signed sum
and with the ℓ1 pooling of the NormXLogit paper:
``--methods grad_x_input,grad_x_input[pooling=l1]``.
The text is the variant's *label* (records, journal keys and table rows carry it, written
canonically by :func:`variant_label`: options sorted, values as parsed); :func:`split_variant`
gives the registered name and the options it is called with. Values parse as ``none``/``true``/
``false``, an integer, a float, else the text itself, and are checked against the method's options
before any model is loaded.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from .attribution import Attribution

VARIANT = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\[(.*)\])?\s*$")


def parse_value(text: str) -> Any:
    """``none`` -> None, ``true``/``false`` -> bool, an int, a float, else the stripped text."""
    value = text.strip()
    lowered = value.lower()
    if lowered == "none":
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def split_variant(label: str) -> tuple[str, dict[str, Any]]:
    """``"grad_x_input[pooling=l1]"`` -> ``("grad_x_input", {"pooling": "l1"})``; a plain
    name -> ``(name, {})``. Malformed text raises ``ValueError`` naming the expected form."""
    match = VARIANT.match(label)
    if match is None:
        raise ValueError(
            f"method {label!r}: expected a method name, optionally with options as "
            "name[option=value,...], e.g. grad_x_input[pooling=l1]"
        )
    name, inner = match.group(1), match.group(2)
    options: dict[str, Any] = {}
    if inner is None:
        return name, options
    if not inner.strip():
        raise ValueError(f"method {label!r}: empty brackets; drop them or give option=value")
    for part in inner.split(","):
        key, eq, value = part.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(
                f"method {label!r}: option {part.strip()!r} is not option=value "
                "(e.g. grad_x_input[pooling=l1])"
            )
        if key.strip() in options:
            raise ValueError(f"method {label!r}: option {key.strip()!r} is given twice")
        options[key.strip()] = parse_value(value)
    return name, options


def variant_label(name: str, options: dict[str, Any]) -> str:
    """The canonical label: ``name`` alone, or ``name[k=v,…]`` with the options sorted."""
    if not options:
        return name
    parts = ",".join(f"{k}={'none' if v is None else v}" for k, v in sorted(options.items()))
    return f"{name}[{parts}]"


def base_method(label: str) -> str:
    """The registered method name of a variant label."""
    return split_variant(label)[0]


def split_method_list(text: str) -> list[str]:
    """``"a,b[x=1,y=2],c"`` -> ``["a", "b[x=1,y=2]", "c"]`` (commas inside brackets stay)."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"methods {text!r}: ']' without '['")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ValueError(f"methods {text!r}: '[' without ']'")
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def signed_variant(attribution: Attribution) -> Attribution:
    """The ``pooling="sum"`` Attribution carried by a pooled one.

    Integrated Gradients with ``pooling="l1"``/``"l2"`` integrates the signed scores
    ``R_i = Σ_d (x − b)_{i,d} ∫ ∂f/∂x_{i,d}`` on its way to the per-dimension vectors, and keeps
    them in ``meta["signed_scores"]``. This returns them as the Attribution of the same call with
    ``pooling="sum"`` (its ``meta["options"]["pooling"]`` says so; gaps and values are those of
    the one pass), so a table holding both variants pays for one path integral. Equal, up to
    floating-point rounding, to calling the method with ``pooling="sum"``.
    """
    signed = attribution.meta.get("signed_scores")
    if not isinstance(signed, Tensor):
        raise ValueError(
            f"{attribution.method}: this Attribution has no meta['signed_scores']; only "
            "integrated_gradients with pooling='l1' or 'l2' records them. Call the method with "
            "pooling='sum' for its signed scores."
        )
    meta = {k: v for k, v in attribution.meta.items() if k != "signed_scores"}
    meta["options"] = {**meta.get("options", {}), "pooling": "sum"}
    return replace(attribution, scores=signed, meta=meta)


__all__ = [
    "base_method",
    "parse_value",
    "signed_variant",
    "split_method_list",
    "split_variant",
    "variant_label",
]
