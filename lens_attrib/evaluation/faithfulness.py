"""Hard-perturbation faithfulness: AOPC comprehensiveness/sufficiency, accuracy under
perturbation, and insertion/deletion curves with flip points.

Every metric consumes an :class:`~lens_attrib.attribution.Attribution` and re-runs the model on
perturbed copies of its inputs; nothing here knows how the scores were made.

Perturbation. For item ``b`` with real tokens ``x_1..x_n`` the *always kept* tokens are the special
tokens (BOS/CLS/SEP…, ids from ``special_ids``, default the tokenizer's ``all_special_ids``
without UNK) and the target position (for decoders the last real token: the prediction is read
there, so deleting it would change the question, not the evidence — we keep it and rank only the
other tokens). The remaining *candidates* are ranked by score (descending, stable: ties keep
sequence order) and the top ``k(f) = ⌈f·n_cand⌉`` are perturbed:

- decoders: the tokens are **deleted** and the sequence re-padded (left) — the target position
  moves with the deletions;
- encoders: the tokens are **replaced by [MASK]** (``tokenizer.mask_token_id``), as in the
  NormXLogit evaluation; positions are unchanged.

AOPC (DeYoung et al. 2020, ERASER; NormXLogit, Mohammadi et al.) over fractions ``K`` (default
10 %, …, 90 %), with ``p`` the probability of the reference label ``y`` (default: the prediction on
the full input) at the target position:

    comprehensiveness = mean_K [ p_y(x) − p_y(x ∖ top_K) ]
    sufficiency       = mean_K [ p_y(x) − p_y(top_K ∪ kept) ]
    accuracy          = mean_K 1[ argmax p(x ∖ top_K) = y_ref ]

(``y_ref`` = gold label ids when given, else the prediction on the full input). For a regression
target (``ResolvedTarget.regression``) ``p_y`` is the head's scalar output, and
:func:`pearson_drop` gives the dataset-level drop of Pearson r.

Insertion / deletion (π-Soft paper, appendix E): fractions ``0, 0.05, …, 1`` (20 steps).
Deletion removes the top ``k(f)`` candidates; insertion starts from the kept tokens only (the
BOS-only / empty input plus the target token) and adds the top ``k(f)`` back in their original
order. Curves of ``p_y``; AUC by the trapezoid rule over ``f ∈ [0, 1]``; flip: deletion — the
prediction differs from the full-input prediction; insertion — the prediction equals it again.
``flip_fraction`` is the first fraction at which that happens (NaN if never).

Flip-probability AUCs (the π-Soft paper's Tables 4–5, after DeYoung et al.): the trapezoid AUC
over ``f`` of the indicator that the prediction differs from the full-input prediction,

    deletion_flip_auc  = ∫ 1[argmax p(x ∖ top_f) ≠ ŷ] df      (higher is better)
    insertion_flip_auc = ∫ 1[argmax p(top_f ∪ kept) ≠ ŷ] df    (lower is better)

whose mean over items is the AUC of the paper's flip-probability curve (the share of items
flipped at each step). A prediction can flip and flip back along a curve, so these are not
``1 − deletion_flip_fraction`` and ``insertion_flip_fraction``: on 200 SST-2 items of the MiniLM
classifier 37–57 % of the deletion curves flipped back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lens_attrib.attribution import Attribution
from lens_attrib.backend import Head, arch_of
from lens_attrib.evaluation.shared_forwards import SharedForwards
from lens_attrib.evaluation.validate import check_attribution, check_count, check_fractions
from lens_attrib.inputs import start_token_of

DEFAULT_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def pad_sequences(
    seqs: Sequence[Sequence[int]], pad_id: int, side: str
) -> tuple[Int[Tensor, "n pos"], Bool[Tensor, "n pos"]]:
    """Pad id lists on ``side`` ("left" for decoders, "right" for encoders)."""
    length = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.bool)
    for i, s in enumerate(seqs):
        sl = slice(length - len(s), length) if side == "left" else slice(0, len(s))
        tokens[i, sl] = torch.tensor(list(s), dtype=torch.long)
        mask[i, sl] = True
    return tokens, mask


# --------------------------------------------------------------------------- items
@dataclass
class ItemView:
    """One item of an Attribution in unpadded coordinates."""

    ids: list[int]
    scores: Tensor
    target: int
    kept: list[int]
    ranked: list[int]
    types: list[int] | None = None
    """Encoders: the item's segment ids (sentence pairs); perturbation keeps them."""


def special_ids_of(model: Any, special_ids: Sequence[int] | None) -> set[int]:
    """``special_ids``, or the tokenizer's ``all_special_ids`` without the UNK id (an unknown
    word is content, not a BOS/CLS/SEP-like marker) unless the UNK token is the model's start
    token (:func:`lens_attrib.inputs.start_token_of`; SmolLM2's UNK is ``<|endoftext|>``): the
    start token is never perturbed."""
    if special_ids is not None:
        return {int(i) for i in special_ids}
    tok = getattr(model, "tokenizer", None)
    ids = {int(i) for i in (getattr(tok, "all_special_ids", None) or [])}
    unk = getattr(tok, "unk_token_id", None)
    if unk is None or int(unk) == start_token_of(model).id:
        return ids
    return ids - {int(unk)}


def item_views(
    attribution: Attribution, special: set[int], keep_target: bool = True
) -> list[ItemView]:
    """Real ids, scores, target index, always-kept positions and ranked candidates per item."""
    views = []
    for b in range(len(attribution)):
        real = attribution.mask[b].cpu()
        ids = attribution.token_ids[b].cpu()[real].tolist()
        scores = attribution.scores[b].detach().cpu()[real].to(torch.float64)
        first = int(torch.nonzero(real).min())
        target = int(attribution.target.positions[b]) - first
        kept = [i for i, t in enumerate(ids) if t in special or (keep_target and i == target)]
        cand = [i for i in range(len(ids)) if i not in set(kept)]
        order = torch.argsort(scores[cand], descending=True, stable=True).tolist()
        types = None
        if attribution.token_types is not None:
            types = attribution.token_types[b].cpu()[real].tolist()
        views.append(ItemView(ids, scores, target, kept, [cand[o] for o in order], types))
    return views


def n_perturbed(fraction: float, n_candidates: int) -> int:
    """``k(f) = ⌈f · n⌉`` (a tolerance keeps exact products like 0.3·10 at 3)."""
    return min(n_candidates, max(0, math.ceil(fraction * n_candidates - 1e-9)))


def _perturb(
    view: ItemView, removed: set[int], encoder: bool, mask_id: int | None
) -> tuple[list[int], int, list[int] | None]:
    """(perturbed ids, target index, segment ids): encoders keep every position and segment."""
    if encoder:
        if mask_id is None:
            raise ValueError("Encoder perturbation needs tokenizer.mask_token_id ([MASK]).")
        ids = [mask_id if i in removed else t for i, t in enumerate(view.ids)]
        return ids, view.target, view.types
    seq = [t for i, t in enumerate(view.ids) if i not in removed]
    return seq, view.target - sum(1 for r in removed if r < view.target), None


@dataclass
class _Plan:
    seqs: list[list[int]] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    types: list[list[int] | None] = field(default_factory=list)

    def add(self, seq: list[int], target: int, types: list[int] | None = None) -> None:
        self.seqs.append(seq)
        self.targets.append(target)
        self.types.append(types)

    def token_types(self, side: str) -> Tensor | None:
        """Segment ids padded like the sequences (0 at padding); ``None`` when no row has any."""
        if all(t is None for t in self.types):
            return None
        rows = [t if t is not None else [0] * len(s) for t, s in zip(self.types, self.seqs)]
        return pad_sequences(rows, 0, side)[0]


def _run_plan(
    shared: SharedForwards, plan: _Plan, items: list[int], regression: bool, use_pred: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(value of the row's label, argmax, max value) for every sequence of item ``items[r]``:
    the label is the clean prediction (``use_pred``) or the explained token; each distinct row
    is forwarded once, at its own length (:meth:`SharedForwards.hard_values`)."""
    rows = list(zip(items, plan.seqs, plan.targets, plan.types))
    res = shared.hard_values(rows)
    value = res[:, 1] if use_pred and not regression else res[:, 0]
    return value, res[:, 2].long(), res[:, 3]


def _references(
    shared: SharedForwards, regression: bool, label: str
) -> tuple[Tensor, Tensor, Tensor]:
    """(label ids, value of the label on the full input, prediction on the full input), from
    the clean forward every metric of the call shares."""
    n = len(shared.items)
    res = shared.hard_values(
        [(b, it.ids, it.target, it.types) for b, it in enumerate(shared.items)]
    )
    labels = shared.attribution.target.token_ids.cpu().long()
    value, pred, top = res[:, 0], res[:, 2].long(), res[:, 3]
    if label == "prediction" and not regression:
        value, labels = top, pred
    elif label != "target" and not regression:
        raise ValueError(f"label must be 'prediction' or 'target', got {label!r}")
    assert value.shape[0] == n
    return labels, value, pred


def _shared_for(
    model: Any, attribution: Attribution, head: Head | None, max_batch: int, shared: Any
) -> SharedForwards:
    if shared is not None and shared.serves(model, attribution, head):
        return cast(SharedForwards, shared)
    return SharedForwards(model, attribution, head, max_batch)


# --------------------------------------------------------------------------- AOPC
@dataclass
class AOPCResult:
    """Per-item AOPC scores and the per-fraction values they average."""

    comprehensiveness: Float[Tensor, "batch"]
    sufficiency: Float[Tensor, "batch"]
    accuracy: Float[Tensor, "batch"]
    fractions: list[float]
    comprehensiveness_k: Float[Tensor, "batch k"]
    sufficiency_k: Float[Tensor, "batch k"]
    correct_k: Float[Tensor, "batch k"]
    p_full: Float[Tensor, "batch"]
    labels: Int[Tensor, "batch"]
    prediction: Int[Tensor, "batch"]
    perturbed_values: dict[str, Tensor] = field(default_factory=dict)


def aopc(
    model: Any,
    attribution: Attribution,
    *,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    head: Head | None = None,
    label: str = "prediction",
    gold: Int[Tensor, "batch"] | None = None,
    special_ids: Sequence[int] | None = None,
    max_batch: int = 64,
    shared: SharedForwards | None = None,
) -> AOPCResult:
    """AOPC comprehensiveness and sufficiency, and accuracy under perturbation (module doc).

    ``label``: ``"prediction"`` (the full-input argmax, default) or ``"target"`` (the
    attribution's explained token). ``gold``: label ids for the accuracy (default: prediction).
    ``head``: the head to read (default: the attribution's Target's head, kept in
    ``ResolvedTarget.head``; the model's own when the Target named none).

    ``shared``: the forwards of one :func:`~lens_attrib.evaluation.score` call
    (:class:`~lens_attrib.evaluation.shared_forwards.SharedForwards`: the clean forward and
    every distinct perturbation made once); ``None`` makes them for this call alone.
    """
    check_faithfulness_args(attribution, "aopc", label, max_batch)
    head = head if head is not None else attribution.target.head
    check_fractions(fractions, "fractions", "aopc")
    regression = bool(attribution.target.regression)
    encoder = arch_of(model).encoder
    mask_id = getattr(getattr(model, "tokenizer", None), "mask_token_id", None)
    views = item_views(attribution, special_ids_of(model, special_ids))
    shared = _shared_for(model, attribution, head, max_batch, shared)
    labels, p_full, pred = _references(shared, regression, label)
    ref = pred if gold is None else torch.as_tensor(gold).long().cpu()
    plan = _Plan()
    items: list[int] = []
    for b, v in enumerate(views):
        items += [b] * (2 * len(fractions))
        for f in fractions:
            top = set(v.ranked[: n_perturbed(f, len(v.ranked))])
            plan.add(*_perturb(v, top, encoder, mask_id))
            rest = set(v.ranked) - top
            plan.add(*_perturb(v, rest, encoder, mask_id))
    n_k = len(fractions)
    value, argmax, _ = _run_plan(shared, plan, items, regression, label == "prediction")
    value = value.reshape(len(views), n_k, 2)
    argmax = argmax.reshape(len(views), n_k, 2)
    comp_k = p_full[:, None] - value[..., 0]
    suff_k = p_full[:, None] - value[..., 1]
    correct_k = (argmax[..., 0] == ref[:, None]).to(torch.float64)
    return AOPCResult(
        comprehensiveness=comp_k.mean(-1),
        sufficiency=suff_k.mean(-1),
        accuracy=correct_k.mean(-1),
        fractions=[float(f) for f in fractions],
        comprehensiveness_k=comp_k,
        sufficiency_k=suff_k,
        correct_k=correct_k,
        p_full=p_full,
        labels=labels,
        prediction=pred,
        perturbed_values={"without_top": value[..., 0], "only_top": value[..., 1]},
    )


def check_faithfulness_args(attribution: Any, who: str, label: str, max_batch: int) -> None:
    """The arguments every perturbation metric shares, with errors naming the fix."""
    check_attribution(attribution, who)
    if label not in ("prediction", "target"):
        raise ValueError(f"{who}: label must be 'prediction' or 'target', got {label!r}.")
    check_count(max_batch, "max_batch", who)


def pearson_drop(full: Tensor, perturbed: Tensor, gold: Tensor) -> float:
    """Regression: ``r(full, gold) − r(perturbed, gold)`` (Pearson r over the dataset)."""

    def r(a: Tensor, b: Tensor) -> float:
        return float(np.corrcoef(a.double().numpy(), b.double().numpy())[0, 1])

    return r(full, gold) - r(perturbed, gold)


# --------------------------------------------------------------------------- insertion/deletion
@dataclass
class CurveResult:
    """Insertion and deletion curves (``[batch, steps+1]``), AUCs of ``p_y``, the first flip
    fractions and the flip-probability AUCs (module docstring)."""

    fractions: list[float]
    deletion: Float[Tensor, "batch f"]
    insertion: Float[Tensor, "batch f"]
    deletion_flipped: Bool[Tensor, "batch f"]
    insertion_flipped: Bool[Tensor, "batch f"]
    deletion_auc: Float[Tensor, "batch"]
    insertion_auc: Float[Tensor, "batch"]
    deletion_flip_fraction: Float[Tensor, "batch"]
    insertion_flip_fraction: Float[Tensor, "batch"]
    deletion_flip_auc: Float[Tensor, "batch"]
    insertion_flip_auc: Float[Tensor, "batch"]


def _first_fraction(flags: Tensor, fractions: Tensor) -> Tensor:
    hit = flags.any(-1)
    first = flags.to(torch.int64).argmax(-1)
    return torch.where(hit, fractions[first], torch.full_like(fractions[first], float("nan")))


def insertion_deletion(
    model: Any,
    attribution: Attribution,
    *,
    steps: int = 20,
    head: Head | None = None,
    label: str = "prediction",
    special_ids: Sequence[int] | None = None,
    max_batch: int = 64,
    shared: SharedForwards | None = None,
) -> CurveResult:
    """Deletion and insertion curves in ``1/steps`` steps (default 5 % × 20; module doc).

    ``shared``: the forwards of one :func:`~lens_attrib.evaluation.score` call
    (:class:`~lens_attrib.evaluation.shared_forwards.SharedForwards`: the clean forward and
    every distinct perturbation made once); ``None`` makes them for this call alone.
    """
    check_faithfulness_args(attribution, "insertion_deletion", label, max_batch)
    head = head if head is not None else attribution.target.head
    check_count(steps, "steps", "insertion_deletion")
    regression = bool(attribution.target.regression)
    if regression:
        raise ValueError("insertion/deletion flips need a classification target.")
    encoder = arch_of(model).encoder
    mask_id = getattr(getattr(model, "tokenizer", None), "mask_token_id", None)
    views = item_views(attribution, special_ids_of(model, special_ids))
    shared = _shared_for(model, attribution, head, max_batch, shared)
    _, _, pred = _references(shared, False, label)
    fr = torch.linspace(0.0, 1.0, steps + 1, dtype=torch.float64)
    plan = _Plan()
    items: list[int] = []
    for b, v in enumerate(views):
        items += [b] * (2 * (steps + 1))
        for f in fr.tolist():
            top = v.ranked[: n_perturbed(f, len(v.ranked))]
            plan.add(*_perturb(v, set(top), encoder, mask_id))
            plan.add(*_perturb(v, set(v.ranked) - set(top), encoder, mask_id))
    value, argmax, _ = _run_plan(shared, plan, items, False, label == "prediction")
    value = value.reshape(len(views), steps + 1, 2)
    argmax = argmax.reshape(len(views), steps + 1, 2)
    del_flip = argmax[..., 0] != pred[:, None]
    ins_flip = argmax[..., 1] == pred[:, None]
    return CurveResult(
        fractions=fr.tolist(),
        deletion=value[..., 0],
        insertion=value[..., 1],
        deletion_flipped=del_flip,
        insertion_flipped=ins_flip,
        deletion_auc=torch.trapezoid(value[..., 0], fr, dim=-1),
        insertion_auc=torch.trapezoid(value[..., 1], fr, dim=-1),
        deletion_flip_fraction=_first_fraction(del_flip, fr),
        insertion_flip_fraction=_first_fraction(ins_flip, fr),
        deletion_flip_auc=torch.trapezoid(del_flip.to(torch.float64), fr, dim=-1),
        insertion_flip_auc=torch.trapezoid((~ins_flip).to(torch.float64), fr, dim=-1),
    )


__all__ = [
    "DEFAULT_FRACTIONS",
    "AOPCResult",
    "CurveResult",
    "aopc",
    "insertion_deletion",
    "item_views",
    "n_perturbed",
    "pad_sequences",
    "pearson_drop",
    "special_ids_of",
]
