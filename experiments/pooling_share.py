"""One Integrated Gradients pass per batch for a table's signed IG and its pooled variant.

A faithfulness table may hold ``integrated_gradients`` next to
``integrated_gradients[pooling=l1]`` (the NormXLogit paper scores IG both ways). Both integrate
the same path with the same adaptive panels, since the panels are decided by the signed gap;
the pooled call also keeps the signed scores (``meta["signed_scores"]``), which
:func:`lens_attrib.method_variants.signed_variant` turns into the signed variant's Attribution.
So when a batch's two units are both still to be computed, :class:`PoolingShare` runs the
pooled call once and hands each unit its Attribution; a unit whose sibling is already in the
journal is computed alone, as before. The records are those of two separate calls, up to
floating-point rounding; the journal books the pass's cost under the unit computed first and
about none under the other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from typing import Any

from lens_attrib.attribution import Attribution
from lens_attrib.method_variants import signed_variant, split_variant

SIGNED_RECORDERS = ("integrated_gradients",)
"""Methods whose pooled calls record ``meta["signed_scores"]``."""

Call = Callable[[str, dict[str, Any]], Attribution]
"""``call(method_label, options)``: the Attribution of one unit's method on the batch."""


def sibling_group(method: str, options: Mapping[str, Any]) -> str | None:
    """Methods in one group integrate the same path: the same registered method, every option
    but ``pooling`` equal. ``None`` for methods that record no signed scores."""
    name, _ = split_variant(method)
    if name not in SIGNED_RECORDERS:
        return None
    rest = {k: v for k, v in options.items() if k != "pooling"}
    return name + json.dumps(rest, sort_keys=True, default=repr)


def is_pooled(options: Mapping[str, Any]) -> bool:
    """``pooling`` is ``"l1"``/``"l2"`` (not the signed default)."""
    return options.get("pooling", "sum") != "sum"


class PoolingShare:
    """The Attributions of one batch's units, sharing a pooled IG call with its signed sibling.

    ``options``: every method label's options; ``pending``: the labels whose units this batch
    still computes (the others come from the journal)."""

    def __init__(self, options: Mapping[str, Mapping[str, Any]], pending: Collection[str]):
        self.options = {m: dict(o) for m, o in options.items()}
        self.pending = set(pending)
        self.kept: dict[str, Attribution] = {}

    def _siblings(self, method: str) -> list[str]:
        group = sibling_group(method, self.options[method])
        if group is None:
            return []
        return sorted(
            m for m in self.pending if m != method and sibling_group(m, self.options[m]) == group
        )

    def attribution(self, method: str, call: Call) -> Attribution:
        """``method``'s Attribution: kept from a sibling's pass, else computed by ``call`` (a
        pooled sibling's call when one is pending, whose signed scores serve ``method``)."""
        self.pending.discard(method)
        if method in self.kept:
            return self.kept.pop(method)
        options = self.options[method]
        siblings = self._siblings(method)
        if not is_pooled(options):
            pooled = [m for m in siblings if is_pooled(self.options[m])]
            if not pooled:
                return call(method, options)
            self.kept[pooled[0]] = call(pooled[0], self.options[pooled[0]])
            return signed_variant(self.kept[pooled[0]])
        attr = call(method, options)
        for m in siblings:
            if not is_pooled(self.options[m]) and m not in self.kept:
                self.kept[m] = signed_variant(attr)
        return attr


__all__ = ["SIGNED_RECORDERS", "PoolingShare", "is_pooled", "sibling_group"]
