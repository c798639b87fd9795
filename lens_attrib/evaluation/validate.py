"""Checks shared by the metrics: scores they can rank, attributions they can perturb, counts.

A metric given NaN scores, or a batch where it expects one item, would otherwise return a
plausible-looking number (NaN sorts like a large value; a ``[batch, pos]`` tensor would be
flattened into one long item). Every public metric calls these first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from lens_attrib.attribution import Attribution


def check_scores(scores: Any, who: str) -> Float[Tensor, "pos"]:
    """``scores`` as a 1-D float64 CPU tensor; a clear error for other shapes or NaN/inf."""
    if isinstance(scores, Attribution):
        raise TypeError(
            f"{who} takes one item's scores [pos], got a whole Attribution: use "
            "plausibility(attr, evidence) for a batch, or attr.scores[b][attr.mask[b]] for item b."
        )
    try:
        s = torch.as_tensor(scores.detach() if isinstance(scores, Tensor) else np.asarray(scores))
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"{who}: scores must be a 1-D tensor, array or list of numbers, got "
            f"{type(scores).__name__}."
        ) from err
    if s.dtype == torch.bool or s.dtype.is_complex:
        raise TypeError(f"{who}: scores must be numbers, got {s.dtype}.")
    if s.ndim != 1:
        raise ValueError(
            f"{who} scores one item: scores must be 1-D [pos], got shape {tuple(s.shape)}. For "
            "item b of an Attribution pass attr.scores[b][attr.mask[b]]; for a batch use "
            "plausibility(attr, evidence)."
        )
    s = s.cpu().to(torch.float64)
    bad = ~torch.isfinite(s)
    if bool(bad.any()):
        where = torch.nonzero(bad).flatten().tolist()
        raise ValueError(
            f"{who}: scores hold NaN/inf at positions {where[:10]} of {s.numel()} ({s.tolist()[:8]}"
            f"{' …' if s.numel() > 8 else ''}). A metric cannot rank them: find where the NaN "
            "came from (attribute() never returns one), or drop the item."
        )
    return s


def check_attribution(attribution: Any, who: str) -> None:
    """An :class:`Attribution` whose real positions are finite."""
    if not isinstance(attribution, Attribution):
        raise TypeError(
            f"{who} takes an Attribution (the result of attribute(...)), got "
            f"{type(attribution).__name__}."
        )
    for name in ("scores", "layer_scores"):
        t = getattr(attribution, name)
        if t is None:
            continue
        mask = attribution.mask.to(t.device)
        if name == "layer_scores":
            mask = mask[:, None, :].expand_as(t)
        bad = ~torch.isfinite(t.detach()) & mask
        if bool(bad.any()):
            item = int(torch.nonzero(bad)[0][0])
            raise ValueError(
                f"{who}: attribution.{name} hold NaN/inf at real positions (first in item "
                f"{item}); a metric cannot rank them. Recompute the attribution or drop the item."
            )


def check_count(value: Any, name: str, who: str, minimum: int = 1) -> int:
    """An integer ``>= minimum`` (bools and floats refused), with an error naming it."""
    ok = isinstance(value, int | np.integer) and not isinstance(value, bool) and value >= minimum
    if not ok:
        raise ValueError(f"{who}: {name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def check_fractions(values: Sequence[float], name: str, who: str, *, open_: bool = False) -> None:
    """A non-empty list of numbers in [0, 1] (``open_``: in (0, 1))."""
    try:
        vals = [float(v) for v in values]
    except (TypeError, ValueError) as err:
        raise ValueError(f"{who}: {name} must be a list of numbers, got {values!r}.") from err
    if not vals:
        raise ValueError(f"{who}: {name} is empty; give at least one value.")
    inside = [(0 < v < 1) if open_ else (0 <= v <= 1) for v in vals]
    if not all(inside):
        span = "(0, 1)" if open_ else "[0, 1]"
        raise ValueError(f"{who}: every {name} must lie in {span}, got {vals}.")


__all__ = ["check_attribution", "check_count", "check_fractions", "check_scores"]
