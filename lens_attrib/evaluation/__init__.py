"""Evaluation of Attributions: faithfulness (hard and soft perturbation) and plausibility.

Everything here consumes :class:`~lens_attrib.attribution.Attribution` objects and never depends on
how they were made. :func:`score` is the one door to every metric (:mod:`.metrics`),
:func:`load_task` to every task's items (:mod:`.items`), :func:`evaluate` the loop (:mod:`.runner`).
"""

from lens_attrib.evaluation.faithfulness import (
    AOPCResult,
    CurveResult,
    aopc,
    insertion_deletion,
    pearson_drop,
)
from lens_attrib.evaluation.items import load_task
from lens_attrib.evaluation.metrics import METRICS, MetricRecord, ScoreOptions, score
from lens_attrib.evaluation.plausibility import (
    PLAUSIBILITY_METRICS,
    average_precision,
    dot_product,
    mrr,
    per_token_accuracy,
    plausibility,
    pointing_game,
    relevance_mass_accuracy,
    token_accuracy,
)
from lens_attrib.evaluation.records import EvalResult, merge_records, summarize
from lens_attrib.evaluation.runner import evaluate
from lens_attrib.evaluation.shared_forwards import ForwardMemo
from lens_attrib.evaluation.soft import SoftResult, soft_metrics, solve_alpha

__all__ = [
    "METRICS",
    "PLAUSIBILITY_METRICS",
    "AOPCResult",
    "CurveResult",
    "EvalResult",
    "ForwardMemo",
    "MetricRecord",
    "ScoreOptions",
    "SoftResult",
    "aopc",
    "average_precision",
    "dot_product",
    "evaluate",
    "insertion_deletion",
    "load_task",
    "merge_records",
    "mrr",
    "pearson_drop",
    "per_token_accuracy",
    "plausibility",
    "pointing_game",
    "relevance_mass_accuracy",
    "score",
    "soft_metrics",
    "solve_alpha",
    "summarize",
    "token_accuracy",
]
