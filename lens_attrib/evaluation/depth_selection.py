"""Choosing Grad-ELLM's aggregation depth on a tuning split, as the π-Soft paper does.

Huang & Chan (Appendix I, "Layer Aggregation Analysis") run Grad-ELLM with the last
``n ∈ {1, 4, 8, 16, 32}`` layers aggregated, compute the AUCs of the π-Soft-NS and π-Soft-NC
curves with the protocol of their main experiments, and keep, per dataset and model, the depth
that performs best. :func:`select_grad_ellm_depth` does that on items the caller sets aside for
tuning (disjoint from the items it reports), and returns the chosen depth with every candidate's
score so that a table can state both.

Criterion (``metric``):

- ``"pi_soft"`` (default, the paper's): per item ``(π-Soft-NC + π-Soft-NS) / 2`` — the two AUCs,
  both higher-is-better, weighted equally (the paper reports both and picks one depth) — from
  :func:`lens_attrib.evaluation.soft_metrics` with ``soft_options`` (default: its π grid, 15
  draws, dynamic routing, as in the main tables);
- ``"pointing_game"``: the tie-aware pointing game against ``evidence`` (one list of evidence
  positions among the real tokens per item), for ground-truth agreement experiments;
- a callable ``metric(model, attribution) -> [n_items]`` (higher is better).

The depth's score is the mean over items, NaN items (e.g. a zero baseline distance) left out.
Candidates deeper than the model are clipped to its number of layers (the paper's 32 is "every
layer" on its 32-layer models) and repeated depths evaluated once. A tie goes to the shallower
depth (cheaper, and fewer layers of less task-relevant evidence, the paper's reason for not
always aggregating all layers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_attrib.attribution import Attribution
from lens_attrib.evaluation import plausibility, soft_metrics
from lens_attrib.methods import attribute
from lens_attrib.target import Target

PAPER_CANDIDATES = (1, 4, 8, 16, 32)
"""The depths Huang & Chan search (Appendix I)."""

Metric = Callable[[Any, Attribution], Tensor]


@dataclass
class DepthSelection:
    """The chosen depth and the evidence for it.

    ``depth``: the chosen ``n_layers``; ``scores``: candidate → mean criterion; ``per_item``:
    candidate → ``[n_items]`` criterion (NaN where undefined); ``candidates``: the depths
    evaluated (clipped to the model, deduplicated); ``metric``: the criterion's name.
    """

    depth: int
    scores: dict[int, float]
    per_item: dict[int, Float[Tensor, "n_items"]] = field(repr=False)
    candidates: list[int]
    metric: str
    n_items: int

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (for a table's notes or a run manifest)."""
        return {
            "depth": self.depth,
            "metric": self.metric,
            "n_items": self.n_items,
            "scores": {str(k): v for k, v in self.scores.items()},
        }


def pi_soft_criterion(soft_options: dict[str, Any]) -> Metric:
    """``(π-Soft-NC + π-Soft-NS) / 2`` per item."""

    def criterion(model: Any, attr: Attribution) -> Tensor:
        result = soft_metrics(model, attr, **soft_options)
        return (result.pi_soft_nc + result.pi_soft_ns).double() / 2

    return criterion


def pointing_game_criterion(evidence: Sequence[Any]) -> Metric:
    """The tie-aware pointing game against ``evidence`` per item."""

    def criterion(model: Any, attr: Attribution) -> Tensor:
        return plausibility(attr, evidence, ["pointing_game"])["pointing_game"].double()

    return criterion


def depth_candidates(model: Any, candidates: Sequence[int]) -> list[int]:
    """``candidates`` clipped to the model's layers, deduplicated, ascending."""
    if isinstance(candidates, str | bytes) or not candidates:
        raise ValueError(f"candidates must be a non-empty list of depths, got {candidates!r}.")
    bad = [c for c in candidates if not isinstance(c, int) or isinstance(c, bool) or c < 1]
    if bad:
        raise ValueError(f"candidates must be positive integers (layer counts), got {bad}.")
    total = int(model.cfg.n_layers)
    return sorted({min(int(c), total) for c in candidates})


def select_grad_ellm_depth(
    model: Any,
    items: Any,
    target: Target | None = None,
    *,
    candidates: Sequence[int] = PAPER_CANDIDATES,
    metric: str | Metric = "pi_soft",
    evidence: Sequence[Any] | None = None,
    soft_options: dict[str, Any] | None = None,
    grad_ellm_options: dict[str, Any] | None = None,
    attention_mask: Any = None,
) -> DepthSelection:
    """Grad-ELLM's ``n_layers`` that scores best on the tuning ``items`` (module docstring).

    ``items``/``target``/``attention_mask``: what :func:`lens_attrib.attribute` takes (the tuning
    split, with the target the reported runs explain); ``grad_ellm_options``: Grad-ELLM's other
    options (e.g. ``similarity``); ``soft_options``: keyword arguments of ``soft_metrics`` for
    ``metric="pi_soft"``; ``evidence``: per item, for ``metric="pointing_game"``.
    """
    options = dict(grad_ellm_options or {})
    if "n_layers" in options or "layers" in options:
        raise ValueError(
            "grad_ellm_options must not fix n_layers or layers: the depth is what is selected."
        )
    if metric == "pi_soft":
        criterion, name = pi_soft_criterion(dict(soft_options or {})), "pi_soft"
    elif metric == "pointing_game":
        if evidence is None:
            raise ValueError(
                "metric='pointing_game' needs evidence=[...] (one list of evidence positions "
                "among the real tokens per item)."
            )
        criterion, name = pointing_game_criterion(evidence), "pointing_game"
    elif callable(metric):
        criterion, name = metric, getattr(metric, "__name__", "custom")
    else:
        raise ValueError(
            f"metric must be 'pi_soft', 'pointing_game' or a callable(model, attribution), "
            f"got {metric!r}."
        )
    depths = depth_candidates(model, candidates)
    per_item: dict[int, Tensor] = {}
    scores: dict[int, float] = {}
    for depth in depths:
        attr = attribute(
            model,
            items,
            target,
            method="grad_ellm",
            attention_mask=attention_mask,
            n_layers=depth,
            **options,
        )
        values = torch.as_tensor(criterion(model, attr), dtype=torch.float64).reshape(-1).cpu()
        if values.numel() != len(attr):
            raise ValueError(
                f"the metric returned {values.numel()} values for {len(attr)} items; it must "
                "return one value per item."
            )
        per_item[depth] = values
        finite = values[~torch.isnan(values)]
        scores[depth] = float(finite.mean()) if finite.numel() else math.nan
    defined = [d for d in depths if not math.isnan(scores[d])]
    if not defined:
        raise ValueError(
            f"the {name} criterion is undefined (NaN) on every tuning item for every depth; "
            "check the items (e.g. evidence lists, a target the model can change)."
        )
    best = max(defined, key=lambda d: (scores[d], -d))  # ties: the shallower depth
    return DepthSelection(best, scores, per_item, depths, name, len(per_item[depths[0]]))


__all__ = [
    "PAPER_CANDIDATES",
    "DepthSelection",
    "depth_candidates",
    "pi_soft_criterion",
    "pointing_game_criterion",
    "select_grad_ellm_depth",
]
