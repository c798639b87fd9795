"""Ground-truth (plausibility) metrics: agreement of token scores with evidence positions.

Pure functions take one item's scores ``s`` (``[pos]``, real tokens only) and its evidence ``E``
(positions into ``s``, or a boolean mask of the same length as ``s``), optionally a ``valid``
mask of the positions that take part (e.g. special tokens excluded); the Attribution-level wrapper
:func:`plausibility` applies them to every item (and every layer of ``layer_scores``).

Definitions (``n`` valid positions, ``g_i = 1[i ∈ E]``, a ranking ``π`` = positions by
descending score):

- **pointing game** (Zhang et al. 2018): ``1[π_1 ∈ E]``.
- **MRR** (reciprocal rank of the best-ranked evidence token, Ferrando et al. 2023):
  ``1 / min_{e∈E} rank_π(e)``.
- **per-token accuracy (PTA)**, the decomposition paper's (Arras et al. 2025, Section 4): each
  token is classified by the sign of its relevance, evidence tokens as ``s_i > 0`` and the others
  as ``s_i ≤ 0``; ``PTA = (1/n) Σ_i 1[(s_i > 0) = g_i]``. It needs no ranking. A constant score
  vector carries no information and scores ``|E|/n``, what every non-negative method scores
  (the paper's rule would give a zero vector ``1 − |E|/n``, rewarding a method that says
  nothing).
- **top-|E| (rank) accuracy**: ``|{π_1..π_k} ∩ E| / k`` with ``k = |E|`` (R-precision; not the
  paper's PTA).
- **average precision**: ``AP = (1/|E|) Σ_{j : π_j ∈ E} precision@j``; e.g.
  ``s = [0.3, 0.1, 0.5, 0.1]``, ``E = {0}`` gives ``AP = 0.5`` (NormXLogit appendix example).
- **relevance mass accuracy** (Arras et al. 2022): ``Σ_{i∈E} max(s_i,0) / Σ_i max(s_i,0)``;
  negative relevance is clipped to zero (Arras et al. count positive relevance only); 0 when no
  relevance is positive.
- **dot product**: ``DP = Σ_i ŝ_i g_i`` with ``ŝ = s`` (``"raw"``), ``ŝ = s / Σ_j |s_j|``
  (``"l1"``: sums to one for non-negative scores) or ``ŝ = softmax(s)`` (``"softmax"``).

**Ties.** The four rank metrics (all but RMA, PTA and DP) need ``π``, which is not unique when
scores tie (a method that gives every real token 0 ties them all). ``ties`` chooses how:

- ``"expected"`` (default): the expectation over uniformly random tie-breaking, in closed form.
  Sort the distinct score values descending into tie groups ``G_1, G_2, …`` with sizes ``m_j``,
  evidence counts ``e_j``, ``r_j = Σ_{i<j} m_i`` tokens strictly above and ``R_j = Σ_{i<j} e_i``
  evidence tokens strictly above. Then

  - ``PG = e_1 / m_1`` (the share of the tied maxima that are evidence);
  - ``MRR = Σ_{k=1}^{m-e+1} P(k) / (r + k)`` for the first group with evidence (size ``m``, ``e``
    evidence, ``r`` above), ``P(k) = C(m-k, e-1) / C(m, e)`` the chance that its first evidence
    token lands in slot ``k``;
  - top-|E| accuracy ``= (1/k) Σ_j e_j · clip((k - r_j) / m_j, 0, 1)`` (each member of the
    group straddling rank ``k`` is in the top ``k`` with probability ``(k - r_j)/m_j``);
  - ``AP = (1/|E|) Σ_j e_j (1/m_j) Σ_{t=1}^{m_j} (R_j + 1 + (t-1)(e_j-1)/(m_j-1)) / (r_j + t)``
    (an evidence token of ``G_j`` sits at a uniform slot ``t``; the other evidence of its group
    before it is hypergeometric with mean ``(t-1)(e_j-1)/(m_j-1)``, and precision is linear in
    it).

  A constant score vector is one group, so it scores exactly the expectation of a uniformly
  random ranking — what the ``random`` method (i.i.d. uniform scores) scores in expectation, e.g.
  ``PG = |E|/n``. A method is never rewarded for saying nothing.
- ``"first"``: ties keep sequence order (a stable descending sort; the pointing game's "first
  among tied maxima"). ``"ferrando"`` is the same rule under the name of Ferrando et al. (2023),
  whose MRR ranks tied tokens in sequence order, so a zero-relevance evidence token tied with
  earlier zero-relevance tokens is ranked after them.
- ``"optimistic"``: ties resolved in favour of evidence (``rank(e) = 1 + |{j : s_j > s_e}|``);
  an upper bound that rewards ties.
- ``"pessimistic"``: ties resolved against evidence; a lower bound.

:func:`is_degenerate` flags score vectors that are constant over two or more valid tokens (they
carry no ranking; under ``"expected"`` they score the random baseline).

Items with no (valid) evidence get NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from math import comb

import numpy as np
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lens_attrib.attribution import Attribution
from lens_attrib.evaluation.validate import check_attribution, check_scores

Evidence = Sequence[int] | Sequence[bool] | Tensor | np.ndarray
"""Evidence positions (indices into the scores) or a boolean mask as long as the scores."""

TIE_RULES = ("expected", "first", "ferrando", "optimistic", "pessimistic")
"""Names accepted by the ``ties`` option of the rank metrics."""


def _evidence_mask(evidence: Evidence, n: int) -> Tensor:
    """Boolean ``[n]`` evidence vector from positions or from a boolean mask."""
    items = None if isinstance(evidence, Tensor | np.ndarray) else list(evidence)
    if items is not None and items and all(isinstance(x, Tensor | np.generic) for x in items):
        evidence = torch.stack([torch.as_tensor(x).reshape(()) for x in items])
        items = None
    if items is None:
        ev = torch.as_tensor(evidence).reshape(-1).cpu()
        is_mask = ev.dtype == torch.bool
    else:
        is_mask = bool(items) and all(isinstance(x, bool | np.bool_) for x in items)
        if not is_mask and any(isinstance(x, bool | np.bool_) for x in items):
            raise TypeError(f"evidence mixes booleans and positions: {items}")
        ev = torch.tensor(items, dtype=torch.bool if is_mask else torch.long)
    if is_mask:
        if ev.numel() != n:
            raise ValueError(
                f"boolean evidence mask has {ev.numel()} entries for {n} scores; pass a mask as "
                "long as the scores, or a list of positions"
            )
        return ev.clone()
    if ev.is_floating_point() and ev.numel():
        raise TypeError(f"evidence positions must be integers or a boolean mask, got {ev.dtype}")
    g = torch.zeros(n, dtype=torch.bool)
    if ev.numel():
        ev = ev.long()
        if bool(((ev < 0) | (ev >= n)).any()):
            raise IndexError(f"Evidence positions {ev.tolist()} outside {n} tokens.")
        g[ev] = True
    return g


def _prepare(
    scores: Tensor, evidence: Evidence, valid: Tensor | None, who: str = "metric"
) -> tuple[Tensor, Tensor] | None:
    """Scores and boolean evidence vector restricted to valid positions (None if E is empty).

    ``scores`` must be one item's finite ``[pos]`` vector (:func:`check_scores`).
    """
    s = check_scores(scores, who)
    g = _evidence_mask(evidence, s.numel())
    if valid is not None:
        keep = torch.as_tensor(valid, dtype=torch.bool).reshape(-1).cpu()
        if keep.numel() != s.numel():
            raise ValueError(f"valid mask has {keep.numel()} entries for {s.numel()} scores")
        s, g = s[keep], g[keep]
    if not bool(g.any()):
        return None
    return s, g


def _check_ties(ties: str) -> None:
    if ties not in TIE_RULES:
        raise ValueError(f"ties must be one of {TIE_RULES}, got {ties!r}")


def _hits(s: Tensor, g: Tensor, ties: str) -> Tensor:
    """Evidence indicator along the ranking chosen by a deterministic tie rule."""
    if ties in ("first", "ferrando"):
        order = torch.argsort(s, descending=True, stable=True)
    else:
        # evidence before (optimistic) or after (pessimistic) non-evidence within a tie group
        sign = 1.0 if ties == "optimistic" else -1.0
        primary = torch.argsort(g.to(torch.float64) * sign, descending=True, stable=True)
        order = primary[torch.argsort(s[primary], descending=True, stable=True)]
    return g[order].to(torch.float64)


def _tie_groups(s: Tensor, g: Tensor) -> list[tuple[int, int, int, int]]:
    """``(m_j, e_j, r_j, R_j)`` per tie group, in descending score order."""
    values, inverse = torch.unique(s, sorted=True, return_inverse=True)
    sizes = torch.bincount(inverse, minlength=values.numel()).flip(0).tolist()
    hits = torch.bincount(inverse, weights=g.to(torch.float64), minlength=values.numel())
    evid = [round(h) for h in hits.flip(0).tolist()]
    groups, r, big_r = [], 0, 0
    for m, e in zip(sizes, evid):
        groups.append((m, e, r, big_r))
        r, big_r = r + m, big_r + e
    return groups


def is_degenerate(scores: Float[Tensor, "pos"], valid: Bool[Tensor, "pos"] | None = None) -> bool:
    """True when the scores are constant over two or more valid positions (no ranking at all).

    An item with a single valid token is not flagged: every method ties there.
    """
    s = check_scores(scores, "is_degenerate")
    if valid is not None:
        s = s[torch.as_tensor(valid, dtype=torch.bool).reshape(-1).cpu()]
    return s.numel() > 1 and bool((s == s[0]).all())


def pointing_game(
    scores: Float[Tensor, "pos"],
    evidence: Evidence,
    valid: Bool[Tensor, "pos"] | None = None,
    ties: str = "expected",
) -> float:
    """Whether the top-scored token is evidence; ``"expected"``: share of tied maxima in E."""
    _check_ties(ties)
    prep = _prepare(scores, evidence, valid, "pointing_game")
    if prep is None:
        return float("nan")
    s, g = prep
    if ties == "expected":
        m, e, _, _ = _tie_groups(s, g)[0]
        return e / m
    return float(_hits(s, g, ties)[0])


def mrr(
    scores: Float[Tensor, "pos"],
    evidence: Evidence,
    valid: Bool[Tensor, "pos"] | None = None,
    ties: str = "expected",
) -> float:
    """Reciprocal rank of the best-ranked evidence token (expected under random tie-breaking)."""
    _check_ties(ties)
    prep = _prepare(scores, evidence, valid, "mrr")
    if prep is None:
        return float("nan")
    s, g = prep
    if ties == "expected":
        m, e, r, _ = next(grp for grp in _tie_groups(s, g) if grp[1] > 0)
        total = comb(m, e)
        return sum(comb(m - k, e - 1) / total / (r + k) for k in range(1, m - e + 2))
    return 1.0 / (1 + int(torch.nonzero(_hits(s, g, ties)).min()))


def token_accuracy(
    scores: Float[Tensor, "pos"],
    evidence: Evidence,
    valid: Bool[Tensor, "pos"] | None = None,
    ties: str = "expected",
) -> float:
    """Top-|E| rank accuracy ``|top_{|E|}(s) ∩ E| / |E|`` (expected under random tie-breaking by
    default); the decomposition paper's PTA is :func:`per_token_accuracy`."""
    _check_ties(ties)
    prep = _prepare(scores, evidence, valid, "token_accuracy")
    if prep is None:
        return float("nan")
    s, g = prep
    k = int(g.sum())
    if ties == "expected":
        inside = sum(e * min(max((k - r) / m, 0.0), 1.0) for m, e, r, _ in _tie_groups(s, g))
        return inside / k
    return float(_hits(s, g, ties)[:k].sum()) / k


def per_token_accuracy(
    scores: Float[Tensor, "pos"],
    evidence: Evidence,
    valid: Bool[Tensor, "pos"] | None = None,
) -> float:
    """The decomposition paper's per-token accuracy: ``(1/n) Σ_i 1[(s_i > 0) = (i ∈ E)]`` over
    the ``n`` valid tokens (a constant ``s`` scores ``|E|/n``; see the module docstring)."""
    prep = _prepare(scores, evidence, valid, "per_token_accuracy")
    if prep is None:
        return float("nan")
    s, g = prep
    if s.numel() > 1 and bool((s == s[0]).all()):
        return float(g.sum()) / s.numel()
    return float(((s > 0) == g).double().mean())


def average_precision(
    scores: Float[Tensor, "pos"],
    evidence: Evidence,
    valid: Bool[Tensor, "pos"] | None = None,
    ties: str = "expected",
) -> float:
    """``(1/|E|) Σ_{j: π_j ∈ E} precision@j`` (expected under random tie-breaking by default)."""
    _check_ties(ties)
    prep = _prepare(scores, evidence, valid, "average_precision")
    if prep is None:
        return float("nan")
    s, g = prep
    if ties == "expected":
        total = 0.0
        for m, e, r, big_r in _tie_groups(s, g):
            if e == 0:
                continue
            ahead = (e - 1) / (m - 1) if m > 1 else 0.0
            total += e / m * sum((big_r + 1 + (t - 1) * ahead) / (r + t) for t in range(1, m + 1))
        return total / float(g.sum())
    hits = _hits(s, g, ties)
    precision_at = hits.cumsum(0) / torch.arange(1, hits.numel() + 1, dtype=torch.float64)
    return float((precision_at * hits).sum() / hits.sum())


def relevance_mass_accuracy(
    scores: Float[Tensor, "pos"], evidence: Evidence, valid: Bool[Tensor, "pos"] | None = None
) -> float:
    """Share of the positive relevance that falls on evidence tokens (negatives clipped)."""
    prep = _prepare(scores, evidence, valid, "relevance_mass_accuracy")
    if prep is None:
        return float("nan")
    s, g = prep
    pos = s.clamp_min(0.0)
    total = float(pos.sum())
    return float(pos[g].sum()) / total if total > 0 else 0.0


def dot_product(
    scores: Float[Tensor, "pos"],
    evidence: Evidence,
    valid: Bool[Tensor, "pos"] | None = None,
    normalize: str = "l1",
) -> float:
    """``Σ_i ŝ_i g_i`` with ``ŝ`` = raw scores, ``s/Σ|s|`` (l1) or ``softmax(s)``."""
    prep = _prepare(scores, evidence, valid, "dot_product")
    if prep is None:
        return float("nan")
    s, g = prep
    if normalize == "raw":
        hat = s
    elif normalize == "l1":
        denom = float(s.abs().sum())
        hat = s / denom if denom > 0 else torch.zeros_like(s)
    elif normalize == "softmax":
        hat = torch.softmax(s, dim=0)
    else:
        raise ValueError(f"normalize must be 'raw', 'l1' or 'softmax', got {normalize!r}")
    return float(hat[g].sum())


MetricFn = Callable[[Tensor, Evidence, Tensor | None], float]

PLAUSIBILITY_METRICS: dict[str, MetricFn] = {
    "pointing_game": pointing_game,
    "pointing_game_first": partial(pointing_game, ties="first"),
    "pointing_game_optimistic": partial(pointing_game, ties="optimistic"),
    "mrr": mrr,
    "mrr_optimistic": partial(mrr, ties="optimistic"),
    "mrr_ferrando": partial(mrr, ties="ferrando"),
    "rma": relevance_mass_accuracy,
    "per_token_accuracy": per_token_accuracy,
    "token_accuracy": token_accuracy,
    "token_accuracy_first": partial(token_accuracy, ties="first"),
    "average_precision": average_precision,
    "average_precision_first": partial(average_precision, ties="first"),
    "dot_product": partial(dot_product, normalize="l1"),
    "dot_product_raw": partial(dot_product, normalize="raw"),
    "dot_product_softmax": partial(dot_product, normalize="softmax"),
}
"""Metric name → pure function ``(scores, evidence, valid) -> float``. ``per_token_accuracy`` is
the decomposition paper's PTA; ``token_accuracy`` the top-|E| rank accuracy. Unsuffixed rank
metrics use ``ties="expected"``; ``_first`` / ``_ferrando`` / ``_optimistic`` name the other
rules."""


def plausibility(
    attribution: Attribution,
    evidence: Sequence[Evidence],
    metrics: Sequence[str] = tuple(PLAUSIBILITY_METRICS),
    *,
    special_ids: Sequence[int] | None = None,
    correct: Bool[Tensor, "batch"] | Sequence[bool] | None = None,
    per_layer: bool = False,
) -> dict[str, Tensor]:
    """Plausibility metrics of every item of ``attribution``.

    ``evidence[b]``: item b's evidence positions among its *real* tokens (unpadded positions,
    e.g. from :func:`lens_attrib.data.evidence_token_positions`), or a boolean mask over them.
    ``special_ids``: token ids to exclude (e.g. ``tokenizer.all_special_ids``: BOS/CLS/SEP).
    ``correct``: items where it is False get NaN (evaluate correctly predicted items only).
    ``per_layer``: use ``layer_scores`` and return ``[batch, layer]`` per metric; otherwise
    ``[batch]``.
    """
    unknown = [m for m in metrics if m not in PLAUSIBILITY_METRICS]
    if unknown:
        known = list(PLAUSIBILITY_METRICS)
        raise KeyError(f"Unknown plausibility metrics {unknown}; known: {known}")
    check_attribution(attribution, "plausibility")
    if isinstance(evidence, str) or not isinstance(evidence, Sequence | np.ndarray | Tensor):
        raise TypeError(
            f"evidence must be one evidence list per item, got {type(evidence).__name__}."
        )
    if len(evidence) != len(attribution):
        raise ValueError(
            f"{len(evidence)} evidence lists for {len(attribution)} items: pass one list of "
            "evidence positions (or a boolean mask) per item, e.g. [[1], [2, 3]]."
        )
    single = [b for b, e in enumerate(evidence) if isinstance(e, int | np.integer | bool)]
    if single:
        raise TypeError(
            f"evidence[{single[0]}] is {evidence[single[0]]!r}, a single position: pass one list "
            "per item, e.g. [[1], [2, 3]] (a flat list would be read as one item's evidence)."
        )
    if per_layer and attribution.layer_scores is None:
        raise ValueError(f"{attribution.method!r} has no layer_scores; use per_layer=False.")
    special = torch.tensor(sorted({int(i) for i in special_ids or []}), dtype=torch.long)
    keep_item = (
        torch.ones(len(attribution), dtype=torch.bool)
        if correct is None
        else torch.as_tensor(correct, dtype=torch.bool).reshape(-1).cpu()
    )
    n_layers = 1 if not per_layer else int(attribution.layer_scores.shape[1])  # type: ignore[union-attr]
    out = {
        m: torch.full((len(attribution), n_layers), float("nan"), dtype=torch.float64)
        for m in metrics
    }
    for b in range(len(attribution)):
        if not bool(keep_item[b]):
            continue
        real = attribution.mask[b].cpu()
        ids = attribution.token_ids[b].cpu()[real]
        valid = ~torch.isin(ids, special) if special.numel() else None
        layer_scores = attribution.layer_scores
        if per_layer and layer_scores is not None:
            rows = layer_scores[b][:, real.to(layer_scores.device)]
        else:
            rows = attribution.scores[b][real.to(attribution.scores.device)][None]
        for layer in range(n_layers):
            row = rows[layer].detach().cpu()
            for m in metrics:
                out[m][b, layer] = PLAUSIBILITY_METRICS[m](row, evidence[b], valid)
    return {m: (v if per_layer else v[:, 0]) for m, v in out.items()}


def degenerate(
    attribution: Attribution,
    *,
    special_ids: Sequence[int] | None = None,
    per_layer: bool = False,
) -> Bool[Tensor, "batch *layer"]:
    """Which items' scores are constant over their valid tokens (:func:`is_degenerate`).

    Valid tokens are the real (unpadded) positions minus ``special_ids``, as in
    :func:`plausibility`. ``per_layer``: one flag per item and layer of ``layer_scores``.
    """
    special = torch.tensor(sorted({int(i) for i in special_ids or []}), dtype=torch.long)
    layer_scores = attribution.layer_scores
    if per_layer and layer_scores is None:
        raise ValueError(f"{attribution.method!r} has no layer_scores; use per_layer=False.")
    flags: list[bool | list[bool]] = []
    for b in range(len(attribution)):
        real = attribution.mask[b].cpu()
        ids = attribution.token_ids[b].cpu()[real]
        valid = ~torch.isin(ids, special) if special.numel() else None
        if per_layer and layer_scores is not None:
            rows = layer_scores[b][:, real.to(layer_scores.device)].detach().cpu()
            flags.append([is_degenerate(row, valid) for row in rows])
        else:
            row = attribution.scores[b][real.to(attribution.scores.device)].detach().cpu()
            flags.append(is_degenerate(row, valid))
    return torch.tensor(flags, dtype=torch.bool)


__all__ = [
    "PLAUSIBILITY_METRICS",
    "TIE_RULES",
    "average_precision",
    "degenerate",
    "dot_product",
    "is_degenerate",
    "mrr",
    "per_token_accuracy",
    "plausibility",
    "pointing_game",
    "relevance_mass_accuracy",
    "token_accuracy",
]
