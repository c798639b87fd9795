"""Adaptive quadrature of a path integral, checked panel by panel against exact differences.

Integrated Gradients (Sundararajan et al. 2017) needs ``R_i = ∫₀¹ g_i(α) dα`` where ``g_i`` is
token ``i``'s share of ``df/dα`` along the straight path, and ``Σ_i R_i = f(1) − f(0)``
(completeness). On a panel ``[a, c] ⊂ [0, 1]`` the same holds locally:

    Σ_i ∫_a^c g_i(α) dα = f(c) − f(a),

and ``f(c) − f(a)`` costs one forward pass, without gradients. So every panel's quadrature (a
``points``-node Gauss–Legendre rule mapped to ``[a, c]``) has an exact reference, and its *local
gap* ``e_{[a,c]} = f(c) − f(a) − Σ_i Σ_s w_s g_i(α_s)`` says where the rule fails. Starting from
``first_panels`` equal panels, the panels holding the largest local gaps (together at least half
of ``Σ|e|``) are bisected until the total gap ``Σ e = f(1) − f(0) − Σ_i R_i`` is within
``tolerance · |f(1) − f(0)|`` or ``max_points`` integrand evaluations were spent.

Why adaptive: language models' ``f`` along the path is smooth but can change by several logits
within ``Δα ≈ 0.01`` (on SmolLM2 with only special tokens kept: −3.40 → −1.92 within
``α ∈ [0.3200, 0.3225]``), and a global rule with 512 nodes still misses such a step by tens
of percent of ``f(1) − f(0)``; bisecting where the local gap is large resolves it with a few
extra panels.

The module is pure numerics: the caller supplies ``node_scores(alphas) -> [n, pos]`` (the
per-token integrand at each node) and ``values(alphas) -> [n]`` (``f`` at each α).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch
from jaxtyping import Float
from torch import Tensor

NodeScores = Callable[[Float[Tensor, "n"]], Float[Tensor, "n pos"]]
Values = Callable[[Float[Tensor, "n"]], Float[Tensor, "n"]]


@dataclass
class Panel:
    """``[lo, hi]`` with ``f`` at both ends and the rule's per-token integral over it."""

    lo: float
    hi: float
    f_lo: float
    f_hi: float
    scores: Tensor | None = None

    @property
    def gap(self) -> float:
        assert self.scores is not None
        return self.f_hi - self.f_lo - float(self.scores.sum())


@dataclass
class QuadratureResult:
    """Per-token integrals ``scores`` ``[pos]``, the total gap, the integrand evaluations spent
    (``n_points``), and the panels of the final rule (``edges``: their ``n_panels + 1`` ends)."""

    scores: Tensor
    gap: float
    n_points: int
    edges: list[float]
    vectors: Tensor | None = None
    """A caller's integral of more than the scores over the final panels (e.g. the
    per-dimension vectors whose sum over ``d`` the scores are); ``None`` unless it added one."""


def mapped_rule(
    panels: list[Panel], alphas: Tensor, weights: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Nodes, weights and panel index of the rule ``(alphas, weights)`` on [0, 1] mapped to
    every panel: ``α = lo + (hi − lo) α₀``, ``w = (hi − lo) w₀``."""
    lo = torch.tensor([p.lo for p in panels], dtype=alphas.dtype)
    width = torch.tensor([p.hi - p.lo for p in panels], dtype=alphas.dtype)
    nodes = lo[:, None] + width[:, None] * alphas[None, :]
    scaled = width[:, None] * weights[None, :]
    owner = torch.arange(len(panels))[:, None].expand_as(nodes)
    return nodes.reshape(-1), scaled.reshape(-1), owner.reshape(-1)


def panel_sums(
    per_node: Float[Tensor, "n pos"], scaled: Float[Tensor, "n"], owner: Tensor, n_panels: int
) -> Float[Tensor, "panels pos"]:
    """``Σ_s w_s g(α_s)`` over every panel's nodes (``owner``: the panel of each node)."""
    weighted = per_node * scaled.to(per_node)[:, None]
    sums = torch.zeros(n_panels, per_node.shape[1], dtype=per_node.dtype)
    sums.index_add_(0, owner, weighted.cpu())
    return sums


def to_bisect(panels: list[Panel]) -> list[int]:
    """Indices of the panels with the largest ``|local gap|``, holding ≥ half of ``Σ|gap|``."""
    order = sorted(range(len(panels)), key=lambda i: -abs(panels[i].gap))
    total = sum(abs(p.gap) for p in panels)
    chosen, held = [], 0.0
    for i in order:
        chosen.append(i)
        held += abs(panels[i].gap)
        if held >= total / 2:
            break
    return chosen


@dataclass
class Request:
    """What one round of :func:`adaptive_rounds` needs: the integrand at ``nodes`` and ``f`` at
    ``values`` (the midpoints of the panels it bisects; may be empty). ``panels``: the new
    panels ``(lo, hi)`` whose rules the nodes are (the same number of nodes each, in order),
    ``weights``: each node's weight in its panel's rule; a round's halves come in pairs that
    replace the panel ``(left.lo, right.hi)``. A caller may use them to integrate more than the
    scores (e.g. per-dimension vectors) over the same panels."""

    nodes: Float[Tensor, "n"]
    values: Float[Tensor, "m"]
    panels: list[tuple[float, float]] = field(default_factory=list)
    weights: Float[Tensor, "n"] | None = None


Rounds = Generator[Request, tuple[Tensor, Tensor], QuadratureResult]


def adaptive_rounds(
    f0: float,
    f1: float,
    *,
    alphas: Tensor,
    weights: Tensor,
    tolerance: float,
    max_points: int,
    first_panels: int = 2,
) -> Rounds:
    """:func:`adaptive_quadrature` as rounds: yields a :class:`Request` per round, is sent
    ``(node_scores(request.nodes) [n, pos], values(request.values) [m])`` and returns the
    :class:`QuadratureResult`. A round's nodes (of the panels just bisected, or the first
    panels) and its values (their new ends) do not depend on each other, so a caller may
    evaluate both in one forward and advance many items' rounds together."""
    per_panel = int(alphas.numel())
    first_panels = max(1, min(first_panels, max_points // max(per_panel, 1)))
    edges = torch.linspace(0.0, 1.0, first_panels + 1, dtype=torch.float64).tolist()
    inner = torch.tensor(edges[1:-1], dtype=alphas.dtype)
    panels = [Panel(edges[i], edges[i + 1], f0, f1) for i in range(first_panels)]
    nodes, scaled, owner = mapped_rule(panels, alphas, weights)
    per_node, f_inner = yield Request(nodes, inner, [(p.lo, p.hi) for p in panels], scaled)
    ends = [f0, *[float(v) for v in f_inner.tolist()], f1]
    for i, (panel, row) in enumerate(zip(panels, panel_sums(per_node, scaled, owner, len(panels)))):
        panel.f_lo, panel.f_hi, panel.scores = ends[i], ends[i + 1], row
    spent = per_panel * first_panels
    delta = f1 - f0
    while True:
        gap = sum(p.gap for p in panels)
        if abs(gap) <= tolerance * abs(delta):
            break
        split = to_bisect(panels)
        if spent + 2 * per_panel * len(split) > max_points:
            split = split[: max(0, (max_points - spent) // (2 * per_panel))]
        if not split:
            break
        mids = torch.tensor([(panels[i].lo + panels[i].hi) / 2 for i in split], dtype=alphas.dtype)
        halves = [
            Panel(lo, hi, 0.0, 0.0)
            for i, m in zip(split, mids.tolist())
            for lo, hi in ((panels[i].lo, m), (m, panels[i].hi))
        ]
        nodes, scaled, owner = mapped_rule(halves, alphas, weights)
        per_node, f_mid = yield Request(nodes, mids, [(h.lo, h.hi) for h in halves], scaled)
        sums = panel_sums(per_node, scaled, owner, len(halves))
        replaced: dict[int, tuple[Panel, Panel]] = {}
        for k, (i, fm) in enumerate(zip(split, f_mid.tolist())):
            p = panels[i]
            left, right = halves[2 * k], halves[2 * k + 1]
            left.f_lo, left.f_hi, left.scores = p.f_lo, float(fm), sums[2 * k]
            right.f_lo, right.f_hi, right.scores = float(fm), p.f_hi, sums[2 * k + 1]
            replaced[i] = (left, right)
        spent += per_panel * len(halves)
        panels = [q for i, p in enumerate(panels) for q in (replaced.get(i) or (p,))]
    assert all(p.scores is not None for p in panels)
    scores = torch.stack([p.scores for p in panels if p.scores is not None]).sum(0)
    return QuadratureResult(
        scores, f1 - f0 - float(scores.sum()), spent, [panels[0].lo] + [p.hi for p in panels]
    )


def adaptive_quadrature(
    node_scores: NodeScores,
    values: Values,
    f0: float,
    f1: float,
    *,
    alphas: Tensor,
    weights: Tensor,
    tolerance: float,
    max_points: int,
    first_panels: int = 2,
) -> QuadratureResult:
    """``∫₀¹ g(α) dα`` per token by bisecting the panels with the largest local gaps.

    ``alphas``/``weights``: one panel's rule on [0, 1] (e.g. Gauss–Legendre); ``f0``/``f1``:
    ``f(0)`` and ``f(1)``. Stops when ``|f1 − f0 − Σ scores| ≤ tolerance · |f1 − f0|`` or when
    the next bisection would exceed ``max_points`` integrand evaluations. One item alone: the
    rounds of :func:`adaptive_rounds`, ``values`` then ``node_scores`` per round.
    """
    rounds = adaptive_rounds(
        f0,
        f1,
        alphas=alphas,
        weights=weights,
        tolerance=tolerance,
        max_points=max_points,
        first_panels=first_panels,
    )
    request = next(rounds)
    while True:
        f = values(request.values) if request.values.numel() else request.values
        try:
            request = rounds.send((node_scores(request.nodes), f))
        except StopIteration as done:
            return done.value
