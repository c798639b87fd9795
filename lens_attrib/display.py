"""Display text for attributions: tokens made visible and HTML-safe, and what a result explains.

One place for the strings that the HTML token maps (:mod:`lens_attrib.report`, the Jupyter
view of an :class:`~lens_attrib.attribution.Attribution`) and the plotly figures
(:mod:`lens_attrib.plot`) show:

- :func:`visible_token` / :func:`escape_token`: whitespace shown as ``␣ ⏎ ⇥ ␍``; then
  HTML-escaped (also valid in plotly text, which reads HTML entities).
- :func:`token_axis_labels`: ``"pos:token"`` labels of a heatmap axis.
- :func:`is_target_free`, :func:`target_label`, :func:`explained_label`: what an item's scores
  explain, e.g. ``' were' − ' was'``, or that they are target-free. Target-freeness comes from
  the method's spec only (:attr:`lens_attrib.methods.registry.MethodSpec.target_free`), which
  the registry writes into every result's ``meta["target_free"]``.
- :func:`explained_title`, :func:`grid_title`, :func:`row_explains`: escaped figure titles and
  hover texts built from those labels.

This module imports nothing from the library at run time, so that every display module may
use it.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lens_attrib.attribution import Attribution

VISIBLE_WHITESPACE = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"}

TARGET_FREE_LABEL = "target-free (the same for any target token)"
"""What a target-free method's scores explain (they depend on the position only)."""


# --------------------------------------------------------------------------- tokens
def visible_token(token: str) -> str:
    """``token`` with spaces, newlines, tabs and carriage returns as ``␣ ⏎ ⇥ ␍`` (not escaped)."""
    return "".join(VISIBLE_WHITESPACE.get(ch, ch) for ch in token)


def escape_token(token: str) -> str:
    """HTML-safe, whitespace-visible token (also valid in plotly text, which reads entities)."""
    return html.escape(visible_token(token))


def token_axis_labels(tokens: Sequence[str]) -> list[str]:
    """``"pos:token"`` axis labels: escaped (plotly reads HTML entities), whitespace visible.

    The position prefix keeps repeated tokens apart (plotly merges equal category labels).
    """
    return [f"{i}:{escape_token(t)}" for i, t in enumerate(tokens)]


# --------------------------------------------------------------------------- targets
def is_target_free(attribution: Attribution) -> bool:
    """Whether the method's scores ignore the explained token and foil (position only).

    Read from ``meta["target_free"]``, which the registry copies from the method's spec into
    every result; a hand-made Attribution without that entry is not target-free.
    """
    return bool(attribution.meta.get("target_free", False))


def target_label(attribution: Attribution, item: int) -> str:
    """The explained output of ``item``: ``' were'``, ``' were' − ' was'`` (contrastive), a
    class name of a class head, or ``id N`` when no label was recorded (not escaped)."""
    tokens = attribution.meta.get("target_tokens")
    if tokens:
        label = repr(tokens[item])
        foils = attribution.meta.get("foil_tokens")
        if foils:
            label += f" − {foils[item]!r}"
        return label
    return f"id {int(attribution.target.token_ids[item])}"


def explained_label(attribution: Attribution, item: int) -> str:
    """What ``item``'s scores explain: :func:`target_label`, or :data:`TARGET_FREE_LABEL` for a
    target-free method (not escaped)."""
    if is_target_free(attribution):
        return TARGET_FREE_LABEL
    return target_label(attribution, item)


# --------------------------------------------------------------------------- figure text
def explained_title(prefix: str, attribution: Attribution, item: int) -> str:
    """A title: ``prefix`` + what ``item`` explains, escaped."""
    return html.escape(prefix + explained_label(attribution, item))


def row_explains(attribution: Attribution, item: int) -> str:
    """Hover text of a row of a methods × tokens map: ``explains …``, escaped."""
    return html.escape("explains " + explained_label(attribution, item))


def grid_title(named: Sequence[tuple[str, Attribution]], item: int) -> str:
    """What the rows of a methods × tokens map explain: the target they share, with the
    target-free rows named (or, when the targets differ, that they differ); escaped."""
    free = [label for label, attr in named if is_target_free(attr)]
    explained = sorted(
        {explained_label(attr, item) for _, attr in named if not is_target_free(attr)}
    )
    if not explained:
        title = "Methods × tokens, all target-free (the same for any target token)"
    elif len(explained) == 1:
        title = f"Methods × tokens → {explained[0]}"
    else:
        title = f"Methods × tokens → {len(explained)} different targets (hover a row to see it)"
    if free and explained:
        title += f"; target-free rows (the same for any target): {', '.join(free)}"
    return html.escape(title)


__all__ = [
    "TARGET_FREE_LABEL",
    "VISIBLE_WHITESPACE",
    "escape_token",
    "explained_label",
    "explained_title",
    "grid_title",
    "is_target_free",
    "row_explains",
    "target_label",
    "token_axis_labels",
    "visible_token",
]
