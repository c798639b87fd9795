"""Soft-perturbation faithfulness: Soft-NC/NS (Zhao & Aletras 2023; Zhao & Shan 2024, ReAGent)
and π-Soft-NC/NS (Huang & Chan 2026), with dynamic or fixed attention routing.

Scores → keep probabilities. Relevances are mapped to ``s_i ∈ [0, 1]`` by clipping negatives to
0 and dividing by the item's maximum (``s = max(r, 0) / max_j max(r_j, 0)``; all zeros when no
score is positive): for a retention probability a negative score means "not evidence", the same
as zero.

Perturbation (the papers' eq. 1). Each token embedding ``e_i`` (``hook_embed``; the token embedding
only — learned positional embeddings are left alone) is multiplied by ``m_i ~ Bernoulli(q_i)``
(``per_element=True``: one Bernoulli per embedding element, as the ReAGent code does), with
retention ``q_i = s_i`` for sufficiency and ``q_i = 1 − s_i`` for comprehensiveness. Special tokens
(BOS/CLS/SEP) are never perturbed (``keep_special``); every other real token is, the target token
included (its embedding is an input like any other; the prediction is still read at its position).

Distances between the full next-token (or class) distributions at the target position, ``p = p(x)``:

- ``distance="hellinger"`` (default): ``H(p, q) = ‖√p − √q‖₂ / √2 ∈ [0, 1]``, and with the
  all-zero baseline ``p⁰ = p(x ⊙ 0)`` (every perturbable embedding zeroed)

      Soft-NC(x, s) = H(p, p(x ⊙ m^{1−s})) / H(p, p⁰)
      Soft-NS(x, s) = max(0, 1 − H(p, p(x ⊙ m^{s})) / H(p, p⁰))

  i.e. Zhao & Aletras' normalization ``Soft-NS = (S(x,s) − S(x,0)) / (1 − S(x,0))``,
  ``Soft-NC = C(x,s) / (1 − S(x,0))`` with ``S = 1 − D`` and ``C = D``.
- ``distance="reagent"``: the ReAGent code's quantities — comprehensiveness distance
  ``Σ(√p − √q)² / √2``, sufficiency distance ``H(p, q)``, and the baseline term
  ``D⁰ = max(0, KL(p ‖ p⁰))``: ``Soft-NC = D_C / D⁰``, ``Soft-NS = clip(D⁰ − D_S, 0, 10) / D⁰``.
  Because it mixes distances, only Soft-NS(s ≡ 1) = 1 and Soft-NC(s ≡ 0) = 0 hold there; the
  other two limits below hold for ``"hellinger"`` only.

Both are averaged over ``n_draws`` Monte-Carlo draws (default 15). Soft-NC = 1 when everything is
removed (``s ≡ 1``) and 0 when nothing is (``s ≡ 0``); Soft-NS = 1 when everything is kept
(``s ≡ 1``) and 0 when nothing is (``s ≡ 0``). Items whose baseline distance is 0 give NaN.

π-variants. For each ``π`` (default 0.05, …, 0.95) ``α`` solves ``mean_i s_i^α = π`` over the
perturbable tokens (bisection on ``log α``, ``|error| ≤ 1e-4``; a warning where ``π`` is outside
the reachable range ``(mean 1[s=1], mean 1[s>0])``, the closest α is then used and the reached
value reported). π-Soft-NS keeps token i with ``s_i^α`` (expected retained share π), π-Soft-NC
removes it with ``s_i^α`` (expected removed share π). The reported π-Soft-NC/NS are the areas
under these curves by the trapezoid rule over the π grid (not divided by its width).

The raw variants' expected number of retained tokens ``E[R] = Σ_i s_i`` (sufficiency; ``Σ_i
(1 − s_i)`` for comprehensiveness) is reported: it differs between methods, which is the bias the
π variants remove.

Routing: ``"dynamic"`` (the perturbed input computes its own attention) or ``"fixed"`` (every layer
replays the clean run's attention pattern, :mod:`lens_attrib.hooks.routing`).

Batching and seeds: every perturbed row (all draws × all π × NC/NS, plus the clean and baseline
rows, for every item) runs at its item's own length, without padding (items of one length share
chunks of ``max_batch`` rows), and each distinct keep mask of an item runs once: tokens whose
keep probability is 0 or 1 always drop or stay, so on short items many draws coincide; a mask
keeping everything is the clean forward, shared with the other metrics of a ``score`` call
(:mod:`lens_attrib.evaluation.shared_forwards`). Row ``r`` of an item draws its uniforms from its
own ``torch.Generator`` seeded by ``(seed, item tokens, r)``, so results depend on the seed and
the item only — not on batch composition, chunk size or which rows coincide.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lens_attrib.attribution import Attribution
from lens_attrib.backend import arch_of, token_embedding_hook
from lens_attrib.evaluation.faithfulness import special_ids_of
from lens_attrib.evaluation.shared_forwards import (
    SharedForwards,
    forward_by_length,
    index_of_rows,
)
from lens_attrib.evaluation.validate import check_attribution, check_count, check_fractions
from lens_attrib.hooks.masking import embedding_mask_hook
from lens_attrib.hooks.routing import fixed_routing_hooks
from lens_attrib.target import Head

DEFAULT_PIS = tuple(round(0.05 * k, 2) for k in range(1, 20))
ALPHA_TOL = 1e-4


# --------------------------------------------------------------------------- scores and α
def keep_scores(scores: Float[Tensor, "pos"]) -> Float[Tensor, "pos"]:
    """``max(r, 0) / max_j max(r_j, 0)`` (zeros when nothing is positive)."""
    pos = scores.to(torch.float64).clamp_min(0.0)
    top = float(pos.max()) if pos.numel() else 0.0
    return pos / top if top > 0 else torch.zeros_like(pos)


def solve_alpha(
    s: Float[Tensor, "pos"],
    pis: Sequence[float],
    *,
    iterations: int = 200,
    log_bounds: tuple[float, float] = (-40.0, 40.0),
    warn: bool = True,
) -> tuple[Float[Tensor, "pi"], Float[Tensor, "pi"]]:
    """``α`` with ``mean(s^α) = π`` for every ``π`` by bisection on ``log α``.

    Returns ``(alpha, reached)`` where ``reached = mean(s^α)``. ``mean(s^α)`` decreases in α
    from ``mean 1[s>0]`` (α → 0⁺) to ``mean 1[s=1]`` (α → ∞); targets outside that range are
    unreachable: a warning is issued and the boundary α is returned.
    """
    s = s.to(torch.float64).reshape(1, -1)
    target = torch.as_tensor(list(pis), dtype=torch.float64).reshape(-1, 1)
    lo = torch.full_like(target, log_bounds[0])
    hi = torch.full_like(target, log_bounds[1])

    def mean_pow(log_alpha: Tensor) -> Tensor:
        return torch.pow(s, torch.exp(log_alpha)).mean(-1, keepdim=True)

    for _ in range(iterations):
        mid = (lo + hi) / 2
        too_big = mean_pow(mid) > target  # mean still above π: α must grow
        lo = torch.where(too_big, mid, lo)
        hi = torch.where(too_big, hi, mid)
    log_alpha = (lo + hi) / 2
    reached = mean_pow(log_alpha)
    err = (reached - target).abs().reshape(-1)
    if warn and bool((err > ALPHA_TOL).any()):
        bad = [float(p) for p, e in zip(target.reshape(-1), err) if e > ALPHA_TOL]
        lo_r = float((s > 0).to(torch.float64).mean()) if s.numel() else 0.0
        hi_r = float((s >= 1).to(torch.float64).mean()) if s.numel() else 0.0
        warnings.warn(
            f"π = {bad} unreachable with mean(s^α): reachable range is ({hi_r:.4g}, {lo_r:.4g}) "
            "for these scores; using the closest α.",
            RuntimeWarning,
            stacklevel=2,
        )
    return torch.exp(log_alpha).reshape(-1), reached.reshape(-1)


# --------------------------------------------------------------------------- distances
def hellinger(p: Tensor, q: Tensor) -> Tensor:
    """``‖√p − √q‖₂ / √2`` over the last dimension."""
    return (p.sqrt() - q.sqrt()).norm(dim=-1) / math.sqrt(2.0)


def reagent_comprehensiveness_distance(p: Tensor, q: Tensor) -> Tensor:
    """ReAGent's comprehensiveness distance ``Σ (√p − √q)² / √2``."""
    return (p.sqrt() - q.sqrt()).pow(2).sum(-1) / math.sqrt(2.0)


def kl(p: Tensor, q: Tensor) -> Tensor:
    """``KL(p ‖ q) = Σ p log(p/q)`` (terms with p = 0 count 0)."""
    ratio = torch.where(p > 0, p / q, torch.ones_like(p))
    return (p * ratio.log()).sum(-1)


# --------------------------------------------------------------------------- result
@dataclass
class SoftResult:
    """Per-item Soft and π-Soft scores (``[batch]``) and the curves behind them."""

    soft_nc: Float[Tensor, "batch"]
    soft_ns: Float[Tensor, "batch"]
    pi_soft_nc: Float[Tensor, "batch"]
    pi_soft_ns: Float[Tensor, "batch"]
    pis: Float[Tensor, "pi"]
    pi_nc_curve: Float[Tensor, "batch pi"]
    pi_ns_curve: Float[Tensor, "batch pi"]
    alpha: Float[Tensor, "batch pi"]
    pi_reached: Float[Tensor, "batch pi"]
    expected_retained_ns: Float[Tensor, "batch"]
    expected_retained_nc: Float[Tensor, "batch"]
    baseline_distance: Float[Tensor, "batch"]
    options: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Tensor]:
        return {
            "soft_nc": self.soft_nc,
            "soft_ns": self.soft_ns,
            "pi_soft_nc": self.pi_soft_nc,
            "pi_soft_ns": self.pi_soft_ns,
            "expected_retained_ns": self.expected_retained_ns,
            "expected_retained_nc": self.expected_retained_nc,
        }


# --------------------------------------------------------------------------- the plan
@dataclass
class _ItemPlan:
    s: Tensor  # [n_real] keep scores (0 where not perturbable)
    perturbable: Bool[Tensor, "n_real"]
    seed: int
    alpha: Tensor
    reached: Tensor
    retention: Tensor  # [rows, n_real] retention probability of every row (after clean, zero)


def _item_seed(seed: int, ids: list[int]) -> int:
    data = torch.tensor(ids, dtype=torch.int64).numpy().tobytes()
    return (int(seed) * 1_000_003 + zlib.crc32(data)) % (2**63 - 1)


def _row_uniforms(item_seed: int, row: int, shape: tuple[int, ...]) -> Tensor:
    gen = torch.Generator().manual_seed((item_seed * 7919 + row * 104_729) % (2**63 - 1))
    return torch.rand(shape, generator=gen, dtype=torch.float64)


def soft_metrics(
    model: Any,
    attribution: Attribution,
    *,
    pis: Sequence[float] = DEFAULT_PIS,
    n_draws: int = 15,
    raw: bool = True,
    pi_variants: bool = True,
    per_element: bool = False,
    distance: str = "hellinger",
    routing: str = "dynamic",
    seed: int = 0,
    max_batch: int = 64,
    keep_special: bool = True,
    special_ids: Sequence[int] | None = None,
    head: Head | None = None,
    shared: SharedForwards | None = None,
) -> SoftResult:
    """Soft-NC/NS and π-Soft-NC/NS of every item of ``attribution`` (see the module doc).

    ``shared``: the forwards of one :func:`~lens_attrib.evaluation.score` call
    (:class:`~lens_attrib.evaluation.shared_forwards.SharedForwards`: the clean forward and
    every distinct perturbation made once); ``None`` makes them for this call alone.
    """
    if distance not in ("hellinger", "reagent"):
        raise ValueError(f"distance must be 'hellinger' or 'reagent', got {distance!r}")
    if routing not in ("dynamic", "fixed"):
        raise ValueError(f"routing must be 'dynamic' or 'fixed', got {routing!r}")
    check_attribution(attribution, "soft_metrics")
    head = head if head is not None else attribution.target.head  # the Target's own head
    check_count(n_draws, "n_draws", "soft_metrics")
    check_count(max_batch, "max_batch", "soft_metrics")
    if pi_variants:
        check_fractions(pis, "pis", "soft_metrics", open_=True)
    pis_t = torch.as_tensor(list(pis), dtype=torch.float64)
    n_pi = len(pis) if pi_variants else 0
    special = special_ids_of(model, special_ids) if keep_special else set()
    unreachable: list[tuple[int, list[float]]] = []
    # rows per item: 0 clean, 1 zero baseline, raw NC draws, raw NS draws, π NC, π NS
    plans: list[_ItemPlan] = []
    for b in range(len(attribution)):
        real = attribution.mask[b].cpu()
        ids = attribution.token_ids[b].cpu()[real].tolist()
        perturbable = torch.tensor([t not in special for t in ids], dtype=torch.bool)
        s = torch.zeros(len(ids), dtype=torch.float64)
        s[perturbable] = keep_scores(attribution.scores[b].detach().cpu()[real][perturbable])
        if n_pi:
            alpha, reached = solve_alpha(s[perturbable], pis, warn=False)
            bad = (reached - pis_t).abs() > ALPHA_TOL
            if bool(bad.any()):
                unreachable.append((b, [float(p) for p in pis_t[bad]]))
        else:
            alpha = reached = torch.zeros(0, dtype=torch.float64)
        ret: list[Tensor] = [
            torch.ones(len(ids), dtype=torch.float64),
            torch.zeros(len(ids), dtype=torch.float64),
        ]
        if raw:
            ret += [1 - s] * n_draws + [s] * n_draws
        for a in alpha.tolist():
            ret += [1 - s.pow(a)] * n_draws
        for a in alpha.tolist():
            ret += [s.pow(a)] * n_draws
        retention = torch.stack(ret)
        retention[:, ~perturbable] = 1.0
        plans.append(_ItemPlan(s, perturbable, _item_seed(seed, ids), alpha, reached, retention))

    if unreachable:
        warnings.warn(
            f"π unreachable with mean(s^α) for {len(unreachable)} of {len(plans)} items (the "
            f"closest α is used and SoftResult.pi_reached says what was reached); first: item "
            f"{unreachable[0][0]}, π = {unreachable[0][1]}.",
            RuntimeWarning,
            stacklevel=3,
        )
    shared = _shared_for(model, attribution, head, max_batch, routing, shared)
    dists = _distances(model, shared, plans, routing, per_element, distance, max_batch, head)
    return _assemble(
        plans,
        dists,
        pis_t,
        n_draws,
        raw,
        n_pi,
        distance,
        {
            "n_draws": n_draws,
            "per_element": per_element,
            "distance": distance,
            "routing": routing,
            "seed": seed,
            "keep_special": keep_special,
        },
    )


def _shared_for(
    model: Any,
    attribution: Attribution,
    head: Head | None,
    max_batch: int,
    routing: str,
    shared: SharedForwards | None,
) -> SharedForwards:
    """``shared`` when it holds the forwards of this call, else new ones."""
    if shared is not None and shared.serves(model, attribution, head):
        return shared
    return SharedForwards(model, attribution, head, max_batch, patterns=routing == "fixed")


def _row_masks(plan: _ItemPlan, d_model: int, per_element: bool) -> tuple[list[bytes], Any]:
    """Each row's dedup key and a function giving the keep masks of some of its rows.

    Per token, the keep mask of every row is drawn (``[rows, n]``, cheap) and is its own key,
    so rows that happen to draw the same tokens (short items; tokens of keep probability 0 or
    1 always drop or stay) share one forward. Per element, a row whose retention is all 0/1 is
    keyed by that retention, every random row by its own index (elementwise draws of ``n·d``
    uniforms practically never coincide), and masks are drawn only for the forwarded rows."""
    n = int(plan.retention.shape[1])

    def draw(k: int) -> Tensor:
        q = plan.retention[k]
        if bool(((q > 0) & (q < 1)).any()):
            u = _row_uniforms(plan.seed, k, (n, d_model) if per_element else (n,))
            return (u < (q[:, None] if per_element else q)).to(torch.float64)
        return (q[:, None] if per_element else q).expand((n, d_model) if per_element else (n,))

    if not per_element:
        masks = [draw(k) for k in range(plan.retention.shape[0])]
        keys = [m.to(torch.bool).numpy().tobytes() for m in masks]
        return keys, lambda rows: torch.stack([masks[k] for k in rows])
    keys = []
    for k in range(plan.retention.shape[0]):
        q = plan.retention[k]
        random_row = bool(((q > 0) & (q < 1)).any())
        keys.append(b"r%d" % k if random_row else b"d" + q.to(torch.bool).numpy().tobytes())
    return keys, lambda rows: torch.stack([draw(k) for k in rows])


def _distances(
    model: Any,
    shared: SharedForwards,
    plans: list[_ItemPlan],
    routing: str,
    per_element: bool,
    distance: str,
    max_batch: int,
    head: Head | None,
) -> Tensor:
    """``[items, rows, 3]``: (Hellinger, ReAGent comprehensiveness distance, KL) of every row's
    output distribution to the item's clean one. Each distinct keep mask of an item is
    forwarded once, at the item's own length (items of one length share batches); a mask that
    keeps everything is the clean forward (under fixed routing too: replaying the clean
    pattern on the clean input computes the clean forward), which is not run again."""
    d_model = int(model.cfg.d_model)
    clean = torch.softmax(shared.clean_outputs(), -1)  # [items, n_out]
    patterns = shared.clean_patterns() if routing == "fixed" else None
    hook_name = token_embedding_hook(arch_of(model))
    rows: list[tuple[list[int], int, list[int] | None]] = []
    row_item: list[int] = []
    row_k: list[int] = []
    mask_of: list[Any] = []
    index: list[Tensor] = []
    firsts_of: list[list[int]] = []
    memo, memo_keys = shared.memo, {}
    found: dict[tuple[int, int], Tensor] = {}
    for b, plan in enumerate(plans):
        keys, masks = _row_masks(plan, d_model, per_element)
        mask_of.append(masks)
        firsts, where = index_of_rows(keys)
        index.append(where)
        firsts_of.append(firsts)
        item = shared.items[b]
        everything = plan.retention.new_ones(plan.retention.shape[1])
        for k in firsts:
            if bool((plan.retention[k] == everything).all()):
                continue  # the clean forward, already made
            if not per_element and bool(masks([k]).all()):
                continue
            if memo is not None and not keys[k].startswith(b"r"):  # keyed by its mask
                memo_keys[(b, k)] = (routing, distance, shared.item_key(b), keys[k])
                kept = memo.soft.get(memo_keys[(b, k)])
                if kept is not None:
                    found[(b, k)] = kept
                    memo.served += 1
                    continue
            rows.append((item.ids, item.target, item.types))
            row_item.append(b)
            row_k.append(k)

    def hooks(members: Sequence[int], chunk: slice) -> list[Any]:
        keep = torch.cat([mask_of[row_item[r]]([row_k[r]]) for r in members])
        hs: list[Any] = [embedding_mask_hook(keep, name=hook_name)]
        if patterns is not None:
            group = sorted({row_item[r] for r in members})
            local = torch.tensor([group.index(row_item[r]) for r in members], dtype=torch.long)
            stacked = {
                name: torch.stack([patterns[b][name] for b in group]) for name in patterns[0]
            }
            hs += fixed_routing_hooks(stacked, local)
        return hs

    def reduce(out: Tensor, members: Sequence[int]) -> Tensor:
        probs = torch.softmax(out.to(torch.float64), -1).cpu()
        ref = clean[[row_item[r] for r in members]]
        return _three_distances(ref, probs, distance)

    outs = forward_by_length(
        model, rows, head=head, max_batch=max_batch, hooks=hooks, reduce=reduce
    )
    for b, k, d in zip(row_item, row_k, outs):
        found[(b, k)] = d
        if (b, k) in memo_keys:
            assert memo is not None
            memo.soft[memo_keys[(b, k)]] = d
    result = []
    for b in range(len(plans)):
        clean_d = _three_distances(clean[b : b + 1], clean[b : b + 1], distance)[0]
        per_unique = [found.get((b, k), clean_d) for k in firsts_of[b]]
        result.append(torch.stack([per_unique[int(w)] for w in index[b].tolist()]))
    return torch.stack(result) if result else torch.zeros(0, 0, 3, dtype=torch.float64)


def _three_distances(ref: Tensor, probs: Tensor, distance: str) -> Tensor:
    """``[rows, 3]``: Hellinger, ReAGent comprehensiveness distance, KL (``"reagent"`` only)."""
    res = torch.zeros(probs.shape[0], 3, dtype=torch.float64)
    res[:, 0] = hellinger(ref, probs)
    res[:, 1] = reagent_comprehensiveness_distance(ref, probs)
    if distance == "reagent":
        res[:, 2] = kl(ref, probs)
    return res


def _assemble(
    plans: list[_ItemPlan],
    dists: Tensor,
    pis: Tensor,
    n_draws: int,
    raw: bool,
    n_pi: int,
    distance: str,
    options: dict[str, Any],
) -> SoftResult:
    n_items = len(plans)
    h = dists[..., 0]
    if distance == "hellinger":
        d0 = h[:, 1]
        d_nc, d_ns = h, h
    else:
        d0 = dists[:, 1, 2].clamp_min(0.0)
        d_nc, d_ns = dists[..., 1], h
    safe = torch.where(d0 > 0, d0, torch.full_like(d0, float("nan")))[:, None]

    def nc(block: Tensor) -> Tensor:
        return block / safe

    def ns(block: Tensor) -> Tensor:
        if distance == "hellinger":
            return (1 - block / safe).clamp_min(0.0)
        return (safe - block).clamp(0.0, 10.0) / safe

    nan = torch.full((n_items,), float("nan"), dtype=torch.float64)
    start = 2
    soft_nc = soft_ns = nan
    if raw:
        soft_nc = nc(d_nc[:, start : start + n_draws]).mean(-1)
        soft_ns = ns(d_ns[:, start + n_draws : start + 2 * n_draws]).mean(-1)
        start += 2 * n_draws
    nc_curve = torch.full((n_items, n_pi), float("nan"), dtype=torch.float64)
    ns_curve = nc_curve.clone()
    if n_pi:
        blk = n_pi * n_draws
        nc_curve = nc(d_nc[:, start : start + blk]).reshape(n_items, n_pi, n_draws).mean(-1)
        ns_curve = ns(d_ns[:, start + blk : start + 2 * blk]).reshape(n_items, n_pi, n_draws)
        ns_curve = ns_curve.mean(-1)
    auc_nc = torch.trapezoid(nc_curve, pis, dim=-1) if n_pi else nan
    auc_ns = torch.trapezoid(ns_curve, pis, dim=-1) if n_pi else nan
    s_sum = torch.stack([p.s[p.perturbable].sum() for p in plans])
    n_pert = torch.stack([p.perturbable.sum().to(torch.float64) for p in plans])
    return SoftResult(
        soft_nc=soft_nc,
        soft_ns=soft_ns,
        pi_soft_nc=auc_nc,
        pi_soft_ns=auc_ns,
        pis=pis[:n_pi] if n_pi else pis[:0],
        pi_nc_curve=nc_curve,
        pi_ns_curve=ns_curve,
        alpha=torch.stack([p.alpha for p in plans]),
        pi_reached=torch.stack([p.reached for p in plans]),
        expected_retained_ns=s_sum,
        expected_retained_nc=n_pert - s_sum,
        baseline_distance=d0,
        options=options,
    )


__all__ = [
    "DEFAULT_PIS",
    "SoftResult",
    "hellinger",
    "keep_scores",
    "kl",
    "reagent_comprehensiveness_distance",
    "soft_metrics",
    "solve_alpha",
]
