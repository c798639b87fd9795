"""One door to every metric: ``score(model, attribution, metrics)`` → tidy :class:`MetricRecord`s.

The metric registry maps a name to a :class:`Metric`: the *family* that computes it and the
field it reads from the family's result (in the manner of Inseq's step-function map, name →
function). Metrics of one family share one computation per call: asking for
``comprehensiveness`` and ``sufficiency`` runs one AOPC plan, every Soft metric of one routing
one Soft plan. The runner (:func:`lens_attrib.evaluation.evaluate`) and every experiment call
:func:`score` and turn its records into their rows; none loops over metrics itself.

Forwards are shared: one :class:`~lens_attrib.evaluation.shared_forwards.SharedForwards` per
call makes the clean forward once for every family (with the attention patterns when a
fixed-routing family is asked for) and every distinct hard perturbation once (AOPC and
insertion/deletion), each at its item's own length.

Families (see each metric module for the formulas):

- ``plausibility`` (:mod:`~lens_attrib.evaluation.plausibility`, needs ``evidence``):
  ``pointing_game, mrr, mrr_ferrando, rma, per_token_accuracy`` (the decomposition paper's PTA),
  ``token_accuracy`` (top-|E|), ``average_precision, dot_product,
  dot_product_raw, dot_product_softmax`` and ``degenerate`` (1.0 when the scores are constant
  over the valid tokens); ``ScoreOptions.per_layer`` adds one record per layer of
  ``layer_scores`` (its real layer numbers from ``meta["layers"]``);
- ``aopc`` (:func:`~lens_attrib.evaluation.faithfulness.aopc`): ``comprehensiveness,
  sufficiency, accuracy_perturbation`` (against ``gold`` when given, else the prediction), the
  curve points ``comprehensiveness_curve, sufficiency_curve`` (one record per fraction,
  ``point`` = the fraction) and, for regression heads, ``output_full`` and
  ``output_without_top_curve`` (the head's output before / after deleting the top tokens);
- ``curves`` (:func:`~lens_attrib.evaluation.faithfulness.insertion_deletion`):
  ``deletion_auc, insertion_auc, deletion_flip, insertion_flip, deletion_flip_auc,
  insertion_flip_auc``;
- ``soft`` / ``soft_fixed`` (:func:`~lens_attrib.evaluation.soft.soft_metrics`, dynamic / fixed
  routing): ``soft_nc, soft_ns, pi_soft_nc, pi_soft_ns, expected_retained_ns,
  expected_retained_nc`` and the curve points ``pi_soft_nc_curve, pi_soft_ns_curve`` (one
  record per π); the fixed-routing names end in ``_fixed`` (``pi_soft_nc_fixed``,
  ``pi_soft_nc_fixed_curve``).

The head every perturbation metric reads is the attribution's own
(``attribution.target.head``): the one the explained Target used.

Adding a metric: a function ``(context, wanted) -> list[MetricRecord]`` registered with
:func:`register_family`, and one :func:`register_metric` per name it answers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lens_attrib.attribution import Attribution
from lens_attrib.evaluation.faithfulness import aopc, insertion_deletion
from lens_attrib.evaluation.plausibility import PLAUSIBILITY_METRICS, degenerate, plausibility
from lens_attrib.evaluation.shared_forwards import ForwardMemo, SharedForwards
from lens_attrib.evaluation.soft import soft_metrics


@dataclass(frozen=True)
class MetricRecord:
    """One number: ``metric`` of item ``item`` (its index in the Attribution), at ``layer``
    (per-layer plausibility; ``None``: the final scores) and curve ``point`` (the fraction or
    π of a curve metric; ``None`` for a scalar metric)."""

    item: int
    metric: str
    value: float
    layer: int | None = None
    point: float | None = None

    @property
    def name(self) -> str:
        """``metric``, or for a curve point ``<metric without _curve>@<point>`` (e.g.
        ``comprehensiveness@0.3``, ``pi_soft_nc@0.5``): the label the result tables use."""
        if self.point is None:
            return self.metric
        return f"{self.metric.removesuffix('_curve')}@{self.point:g}"


@dataclass(frozen=True)
class ScoreOptions:
    """How the metrics run: rows per perturbed forward, the Soft seed, excluded special token
    ids (``None``: the tokenizer's special tokens but ``[UNK]`` for the perturbation metrics,
    none for plausibility), per-layer plausibility, and each family's own keyword options
    (``aopc``: ``fractions``, ``label``; ``curves``: ``steps``, ``label``; ``soft``: ``pis``,
    ``n_draws``, ``distance``, …)."""

    max_batch: int = 64
    seed: int = 0
    special_ids: Sequence[int] | None = None
    scope: Sequence[Sequence[int] | None] | None = None
    """Plausibility metrics only: per item, the real-token positions that take part (e.g. a qa
    prompt's context, as the decomposition paper evaluates qa); ``None``: every real token."""
    per_layer: bool = False
    aopc: Mapping[str, Any] = field(default_factory=dict)
    curves: Mapping[str, Any] = field(default_factory=dict)
    soft: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> ScoreOptions:
        """From the runner's ``metric_options`` dict (keys are this class's fields)."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(cls.__dataclass_fields__))
        if unknown:
            raise KeyError(
                f"Unknown metric options {unknown}; known: {sorted(cls.__dataclass_fields__)}."
            )
        return cls(**options)


@dataclass(frozen=True)
class Context:
    """What a family gets: the model, the Attribution and the call's evidence, gold, options,
    and the call's forwards (:class:`~lens_attrib.evaluation.shared_forwards.SharedForwards`:
    the clean forward and every distinct hard perturbation made once for all families;
    ``None``: each family makes its own)."""

    model: Any
    attribution: Attribution
    evidence: Sequence[Any] | None
    gold: Tensor | None
    options: ScoreOptions
    shared: SharedForwards | None = None


@dataclass(frozen=True)
class Metric:
    """A registered metric: its family and the key of the family's result it reads."""

    name: str
    family: str
    key: str
    curve: bool = False


Family = Callable[[Context, Sequence[Metric]], list[MetricRecord]]
FAMILIES: dict[str, Family] = {}
METRICS: dict[str, Metric] = {}


def register_family(name: str) -> Callable[[Family], Family]:
    """Decorator: ``name`` → the function computing a family's metrics."""

    def add(fn: Family) -> Family:
        FAMILIES[name] = fn
        return fn

    return add


def register_metric(name: str, family: str, key: str | None = None, curve: bool = False) -> None:
    """Make ``name`` answerable by :func:`score` through ``family`` (reading ``key``)."""
    METRICS[name] = Metric(name, family, key or name, curve)


def _per_item(metric: str, values: Tensor, layer: int | None = None) -> list[MetricRecord]:
    return [MetricRecord(i, metric, float(v), layer) for i, v in enumerate(values.tolist())]


def _per_point(metric: str, points: Sequence[float], values: Tensor) -> list[MetricRecord]:
    """Records of a curve ``[items, points]``, point by point (items inside)."""
    return [
        MetricRecord(i, metric, float(v), None, float(x))
        for k, x in enumerate(points)
        for i, v in enumerate(values[:, k].tolist())
    ]


# --------------------------------------------------------------------------- families
@register_family("plausibility")
def _plausibility(ctx: Context, wanted: Sequence[Metric]) -> list[MetricRecord]:
    if ctx.evidence is None:
        raise ValueError(
            f"score: the plausibility metrics {[m.name for m in wanted]} need evidence= (one "
            "list of evidence positions per item)."
        )
    attr, special, evidence = ctx.attribution, ctx.options.special_ids, list(ctx.evidence)
    scope = ctx.options.scope
    ranked = [m.key for m in wanted if m.key in PLAUSIBILITY_METRICS]
    values = (
        plausibility(attr, evidence, ranked, special_ids=special, scope=scope) if ranked else {}
    )
    layered = ctx.options.per_layer and attr.layer_scores is not None
    out: list[MetricRecord] = []
    for m in wanted:
        if m.key == "degenerate":
            flags = degenerate(attr, special_ids=special, scope=scope)
            out += _per_item(m.name, flags.double())
        else:
            out += _per_item(m.name, values[m.key])
    if layered:
        per = plausibility(attr, evidence, ranked, special_ids=special, per_layer=True, scope=scope)
        for m in wanted:
            v = (
                degenerate(attr, special_ids=special, per_layer=True, scope=scope).double()
                if m.key == "degenerate"
                else per[m.key]
            )
            numbers = attr.meta.get("layers") or list(range(v.shape[1]))
            for j in range(v.shape[1]):
                out += _per_item(m.name, v[:, j], int(numbers[j]))
    return out


@register_family("aopc")
def _aopc(ctx: Context, wanted: Sequence[Metric]) -> list[MetricRecord]:
    opts = ctx.options
    res = aopc(
        ctx.model,
        ctx.attribution,
        gold=ctx.gold,
        max_batch=opts.max_batch,
        special_ids=opts.special_ids,
        shared=ctx.shared,
        **opts.aopc,
    )
    fields: dict[str, Tensor] = {
        "comprehensiveness": res.comprehensiveness,
        "sufficiency": res.sufficiency,
        "accuracy": res.accuracy,
        "comprehensiveness_k": res.comprehensiveness_k,
        "sufficiency_k": res.sufficiency_k,
        "output_full": res.p_full,
        "output_without_top_k": res.perturbed_values["without_top"],
    }
    out: list[MetricRecord] = []
    for m in wanted:
        if m.curve:
            out += _per_point(m.name, res.fractions, fields[m.key])
        else:
            out += _per_item(m.name, fields[m.key])
    return out


@register_family("curves")
def _curves(ctx: Context, wanted: Sequence[Metric]) -> list[MetricRecord]:
    opts = ctx.options
    res = insertion_deletion(
        ctx.model,
        ctx.attribution,
        max_batch=opts.max_batch,
        special_ids=opts.special_ids,
        shared=ctx.shared,
        **opts.curves,
    )
    return [r for m in wanted for r in _per_item(m.name, getattr(res, m.key))]


def _soft(ctx: Context, wanted: Sequence[Metric], routing: str) -> list[MetricRecord]:
    opts = ctx.options
    res = soft_metrics(
        ctx.model,
        ctx.attribution,
        routing=routing,
        max_batch=opts.max_batch,
        special_ids=opts.special_ids,
        shared=ctx.shared,
        **{"seed": opts.seed, **opts.soft},
    )
    values = res.as_dict()
    curves = {"pi_nc_curve": res.pi_nc_curve, "pi_ns_curve": res.pi_ns_curve}
    out: list[MetricRecord] = []
    for m in wanted:
        if m.curve:
            out += _per_point(m.name, res.pis.tolist(), curves[m.key])
        else:
            out += _per_item(m.name, values[m.key])
    return out


register_family("soft")(lambda ctx, wanted: _soft(ctx, wanted, "dynamic"))
register_family("soft_fixed")(lambda ctx, wanted: _soft(ctx, wanted, "fixed"))

for _name in PLAUSIBILITY_METRICS:
    register_metric(_name, "plausibility")
register_metric("degenerate", "plausibility")
for _name, _key in (
    ("comprehensiveness", None),
    ("sufficiency", None),
    ("accuracy_perturbation", "accuracy"),
    ("output_full", None),
):
    register_metric(_name, "aopc", _key)
for _name, _key in (
    ("comprehensiveness_curve", "comprehensiveness_k"),
    ("sufficiency_curve", "sufficiency_k"),
    ("output_without_top_curve", "output_without_top_k"),
):
    register_metric(_name, "aopc", _key, curve=True)
for _name, _key in (
    ("deletion_auc", None),
    ("insertion_auc", None),
    ("deletion_flip", "deletion_flip_fraction"),
    ("insertion_flip", "insertion_flip_fraction"),
    ("deletion_flip_auc", None),
    ("insertion_flip_auc", None),
):
    register_metric(_name, "curves", _key)
SOFT_BASE = (
    "soft_nc",
    "soft_ns",
    "pi_soft_nc",
    "pi_soft_ns",
    "expected_retained_ns",
    "expected_retained_nc",
)
for _suffix, _family in (("", "soft"), ("_fixed", "soft_fixed")):
    for _name in SOFT_BASE:
        register_metric(_name + _suffix, _family, _name)
    register_metric(f"pi_soft_nc{_suffix}_curve", _family, "pi_nc_curve", curve=True)
    register_metric(f"pi_soft_ns{_suffix}_curve", _family, "pi_ns_curve", curve=True)


# --------------------------------------------------------------------------- the door
def check_metrics(metrics: Sequence[str], who: str = "score") -> None:
    """A clear error for a metric list given as a string or an unknown name."""
    if isinstance(metrics, str):
        raise TypeError(f"{who}: metrics must be a list of names, got the string {metrics!r}.")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise KeyError(f"{who}: unknown metrics {unknown}; known: {list(METRICS)}")


def score(
    model: Any,
    attribution: Attribution,
    metrics: Sequence[str],
    *,
    evidence: Sequence[Any] | None = None,
    gold: Tensor | Sequence[int] | None = None,
    options: ScoreOptions | None = None,
    memo: ForwardMemo | None = None,
) -> list[MetricRecord]:
    """Every metric in ``metrics`` for every item of ``attribution``, as tidy records.

    ``evidence``: per item, its evidence positions among its real tokens (plausibility);
    ``gold``: per item, the gold class (accuracy under perturbation; default: the model's own
    prediction); ``options``: :class:`ScoreOptions`; ``memo``: a
    :class:`~lens_attrib.evaluation.shared_forwards.ForwardMemo` of ``model`` and the
    attribution's head, to share perturbed forwards with earlier calls on the same items (e.g.
    the other methods of a table). Records come family by family in the order
    the families are first asked for, and within a family metric by metric in the order asked,
    items (and curve points, point by point) inside; each family's computation runs once.
    """
    check_metrics(metrics)
    options = options or ScoreOptions()
    gold_t = None if gold is None else torch.as_tensor(gold)
    by_family: dict[str, list[Metric]] = {}
    for name in dict.fromkeys(metrics):
        spec = METRICS[name]
        by_family.setdefault(spec.family, []).append(spec)
    shared = SharedForwards(
        model,
        attribution,
        attribution.target.head,
        options.max_batch,
        patterns="soft_fixed" in by_family,
        memo=memo,
    )
    ctx = Context(model, attribution, evidence, gold_t, options, shared)
    return [r for family, wanted in by_family.items() for r in FAMILIES[family](ctx, wanted)]


def by_metric(records: Sequence[MetricRecord]) -> dict[str, list[MetricRecord]]:
    """Records grouped by :attr:`MetricRecord.name` in first-seen order."""
    out: dict[str, list[MetricRecord]] = {}
    for r in records:
        out.setdefault(r.name, []).append(r)
    return out


__all__ = [
    "FAMILIES",
    "METRICS",
    "SOFT_BASE",
    "Context",
    "Metric",
    "MetricRecord",
    "ScoreOptions",
    "by_metric",
    "check_metrics",
    "register_family",
    "register_metric",
    "score",
]
