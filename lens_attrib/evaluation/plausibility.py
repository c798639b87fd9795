"""Ground-truth (plausibility) metrics: agreement of token scores with evidence positions.

Pure functions take one item's scores ``s`` (``[pos]``, real tokens only) and its evidence
positions ``E`` (indices into ``s``), optionally a ``valid`` mask of the positions that take part
(e.g. special tokens excluded); the Attribution-level wrapper :func:`plausibility` applies them to
every item (and every layer of ``layer_scores``).

Definitions (``n`` valid positions, ``g_i = 1[i ∈ E]``):

- **pointing game** (Zhang et al. 2018): ``1[argmax_i s_i ∈ E]``; among tied maxima the first
  position counts.
- **MRR** (reciprocal rank of the best-ranked evidence token, Ferrando et al. 2023):
  ``1 / min_{e∈E} rank(e)`` with two tie rules:
  ``"optimistic"``: ``rank(e) = 1 + |{j : s_j > s_e}|`` (ties resolved in favour of evidence);
  ``"ferrando"``: ``rank(e)`` = 1 + position of ``e`` in a *stable* descending sort, so tied tokens
  keep sequence order and a zero-relevance evidence token tied with earlier zero-relevance tokens
  is ranked after them (the failure with zero-relevance ties discussed in the decomposition
  literature: the score then reflects token order, not relevance).
- **relevance mass accuracy** (Arras et al. 2022): ``Σ_{i∈E} max(s_i,0) / Σ_i max(s_i,0)``;
  negative relevance is clipped to zero (as in Arras et al., who count positive relevance only);
  0 when no relevance is positive.
- **per-token (rank) accuracy**: ``|top_{|E|}(s) ∩ E| / |E|`` with ``top_k`` taken from the
  stable descending sort.
- **average precision**: ``AP = (1/|E|) Σ_{k : π_k ∈ E} precision@k`` over the stable descending
  ranking ``π``; e.g. ``s = [0.3, 0.1, 0.5, 0.1]``, ``E = {0}`` gives ``AP = 0.5`` (NormXLogit
  appendix example).
- **dot product**: ``DP = Σ_i ŝ_i g_i`` with ``ŝ = s`` (``"raw"``), ``ŝ = s / Σ_j |s_j|``
  (``"l1"``: sums to one for non-negative scores) or ``ŝ = softmax(s)`` (``"softmax"``).

Items with no (valid) evidence get NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lens_attrib.attribution import Attribution

Evidence = Sequence[int] | Tensor


def _prepare(
    scores: Tensor, evidence: Evidence, valid: Tensor | None
) -> tuple[Tensor, Tensor] | None:
    """Scores and boolean evidence vector restricted to valid positions (None if E is empty)."""
    s = torch.as_tensor(scores).detach().to(torch.float64).reshape(-1)
    g = torch.zeros_like(s, dtype=torch.bool)
    ev = torch.as_tensor(evidence, dtype=torch.long).reshape(-1) if len(evidence) else None
    if ev is not None:
        if bool(((ev < 0) | (ev >= s.numel())).any()):
            raise IndexError(f"Evidence positions {ev.tolist()} outside {s.numel()} tokens.")
        g[ev] = True
    if valid is not None:
        keep = torch.as_tensor(valid, dtype=torch.bool).reshape(-1).to(s.device)
        s, g = s[keep], g[keep]
    if not bool(g.any()):
        return None
    return s, g


def _stable_order(s: Tensor) -> Tensor:
    return torch.argsort(s, descending=True, stable=True)


def pointing_game(
    scores: Float[Tensor, "pos"], evidence: Evidence, valid: Bool[Tensor, "pos"] | None = None
) -> float:
    """``1`` if the top-scored token (first among ties) is evidence, else ``0``."""
    prep = _prepare(scores, evidence, valid)
    if prep is None:
        return float("nan")
    s, g = prep
    return float(g[int(torch.argmax(s))])


def mrr(
    scores: Float[Tensor, "pos"],
    evidence: Evidence,
    valid: Bool[Tensor, "pos"] | None = None,
    ties: str = "optimistic",
) -> float:
    """Reciprocal rank of the best-ranked evidence token (``ties``: optimistic | ferrando)."""
    prep = _prepare(scores, evidence, valid)
    if prep is None:
        return float("nan")
    s, g = prep
    if ties == "optimistic":
        ranks = 1 + (s[None, :] > s[g][:, None]).sum(-1)
        best = int(ranks.min())
    elif ties == "ferrando":
        order = _stable_order(s)
        best = 1 + int(torch.nonzero(g[order]).min())
    else:
        raise ValueError(f"ties must be 'optimistic' or 'ferrando', got {ties!r}")
    return 1.0 / best


def relevance_mass_accuracy(
    scores: Float[Tensor, "pos"], evidence: Evidence, valid: Bool[Tensor, "pos"] | None = None
) -> float:
    """Share of the positive relevance that falls on evidence tokens (negatives clipped)."""
    prep = _prepare(scores, evidence, valid)
    if prep is None:
        return float("nan")
    s, g = prep
    pos = s.clamp_min(0.0)
    total = float(pos.sum())
    return float(pos[g].sum()) / total if total > 0 else 0.0


def token_accuracy(
    scores: Float[Tensor, "pos"], evidence: Evidence, valid: Bool[Tensor, "pos"] | None = None
) -> float:
    """``|top_{|E|}(s) ∩ E| / |E|`` (stable descending sort for ties)."""
    prep = _prepare(scores, evidence, valid)
    if prep is None:
        return float("nan")
    s, g = prep
    k = int(g.sum())
    return float(g[_stable_order(s)[:k]].sum()) / k


def average_precision(
    scores: Float[Tensor, "pos"], evidence: Evidence, valid: Bool[Tensor, "pos"] | None = None
) -> float:
    """``(1/|E|) Σ_{k: π_k ∈ E} precision@k`` over the stable descending ranking ``π``."""
    prep = _prepare(scores, evidence, valid)
    if prep is None:
        return float("nan")
    s, g = prep
    hits = g[_stable_order(s)].to(torch.float64)
    precision_at = hits.cumsum(0) / torch.arange(1, hits.numel() + 1, dtype=torch.float64)
    return float((precision_at * hits).sum() / hits.sum())


def dot_product(
    scores: Float[Tensor, "pos"],
    evidence: Evidence,
    valid: Bool[Tensor, "pos"] | None = None,
    normalize: str = "l1",
) -> float:
    """``Σ_i ŝ_i g_i`` with ``ŝ`` = raw scores, ``s/Σ|s|`` (l1) or ``softmax(s)``."""
    prep = _prepare(scores, evidence, valid)
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
    "mrr": lambda s, e, v: mrr(s, e, v, ties="optimistic"),
    "mrr_ferrando": lambda s, e, v: mrr(s, e, v, ties="ferrando"),
    "rma": relevance_mass_accuracy,
    "token_accuracy": token_accuracy,
    "average_precision": average_precision,
    "dot_product": lambda s, e, v: dot_product(s, e, v, normalize="l1"),
    "dot_product_raw": lambda s, e, v: dot_product(s, e, v, normalize="raw"),
    "dot_product_softmax": lambda s, e, v: dot_product(s, e, v, normalize="softmax"),
}
"""Metric name → pure function ``(scores, evidence, valid) -> float``."""


def plausibility(
    attribution: Attribution,
    evidence: Sequence[Sequence[int]],
    metrics: Sequence[str] = tuple(PLAUSIBILITY_METRICS),
    *,
    special_ids: Sequence[int] | None = None,
    correct: Bool[Tensor, "batch"] | Sequence[bool] | None = None,
    per_layer: bool = False,
) -> dict[str, Tensor]:
    """Plausibility metrics of every item of ``attribution``.

    ``evidence[b]``: item b's evidence positions among its *real* tokens (unpadded positions,
    e.g. from :func:`lens_attrib.data.evidence_token_positions`). ``special_ids``: token ids to
    exclude (e.g. ``tokenizer.all_special_ids``: BOS/CLS/SEP). ``correct``: items where it is
    False get NaN (evaluate correctly predicted items only). ``per_layer``: use ``layer_scores``
    and return ``[batch, layer]`` per metric; otherwise ``[batch]``.
    """
    unknown = [m for m in metrics if m not in PLAUSIBILITY_METRICS]
    if unknown:
        known = list(PLAUSIBILITY_METRICS)
        raise KeyError(f"Unknown plausibility metrics {unknown}; known: {known}")
    if len(evidence) != len(attribution):
        raise ValueError(f"{len(evidence)} evidence lists for {len(attribution)} items.")
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
                out[m][b, layer] = PLAUSIBILITY_METRICS[m](row, list(evidence[b]), valid)
    return {m: (v if per_layer else v[:, 0]) for m, v in out.items()}


__all__ = [
    "PLAUSIBILITY_METRICS",
    "average_precision",
    "dot_product",
    "mrr",
    "plausibility",
    "pointing_game",
    "relevance_mass_accuracy",
    "token_accuracy",
]
