"""Head pruning: per-head relevances → pooling → pruning order → accuracy curve.

Reuses the per-head relevances the attribution methods already produce (no attribution code of
its own), following the head-pruning evaluation of Arras et al. (2025), "A Close Look at
Decomposition-based XAI-Methods for Transformer Language Models":

1. **Relevance of every head.** A method run with ``heads=True`` returns the relevance of every
   element of every head's output ``z`` (``attn.hook_z``), ``R[b, l, h, p, d]`` in
   ``Attribution.parts["head_dim_relevance"]``. It is pooled to one number per head and item:

   - ``"relu_dim"``   ("ReLU dim"):       ``Σ_p Σ_d max(0, R[p, d])``
   - ``"relu_token"`` ("ReLU per token"): ``Σ_p max(0, Σ_d R[p, d])``
   - ``"none"``       ("no ReLU"):        ``Σ_p Σ_d R[p, d]``

   and averaged over the items. Methods without a ``d_head`` axis (``alti_logit``, whose
   ``head_token_scores[b, l, h, p]`` is the contribution of token ``p`` through head ``h`` to the
   logit) are pooled with each token's contribution taken as one dimension (``d = 1``), so for
   them "ReLU dim" and "ReLU per token" coincide. ``gradient`` gives ``|∂f/∂z|``, which is never
   negative, so its three poolings coincide. Padding positions never count.

2. **Pruning curve.** Heads are pruned least relevant first, ``step`` at a time, by zeroing the
   head's output ``z`` with a hook (:func:`lens_attrib.hooks.masking.head_mask_hooks`; a *query*
   head in grouped-query models); the model's weights are never modified. After every step the
   evaluation set is run and the task accuracy (``logit(target) > logit(foil)`` at the last real
   position) and the mean logit difference ``logit(target) − logit(foil)`` are recorded. A random
   order (averaged over seeds) is the baseline; the area under each curve is the trapezoid over
   the fraction of heads pruned.

Evaluations are batched twice over: items in batches (sorted by length, little padding), and many
masks in one forward (each batch repeated once per mask, every copy with its own head mask, up to
``max_tokens`` tokens per forward). They are memoised by the set of pruned heads, so points shared
by several curves (no head pruned, every head pruned, identical orders) run once. The tokenized
batches are shared between the relevance pass and the evaluation pass.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lens_attrib.attribution import Attribution
from lens_attrib.errors import TargetError
from lens_attrib.forward import resid_of, target_rows
from lens_attrib.hooks.guard import model_guard
from lens_attrib.hooks.masking import item_head_mask_hooks
from lens_attrib.inputs import Batch, to_batch
from lens_attrib.methods import METHODS, attribute
from lens_attrib.progress import progress_bar
from lens_attrib.target import ResolvedTarget, Target, default_head

POOLINGS: dict[str, str] = {
    "relu_dim": "ReLU dim",
    "relu_token": "ReLU per token",
    "none": "no ReLU",
}
"""Pooling name -> the decomposition paper's label."""


def head_relevance_methods() -> list[str]:
    """Every registered method that gives per-head relevances (``MethodSpec.head_relevances``)."""
    return sorted(name for name, spec in METHODS.items() if spec.head_relevances)


RANDOM = "random"


# --------------------------------------------------------------------------------- pooling
def pool_head_relevance(
    relevance: Float[Tensor, "batch layer head pos d"] | Float[Tensor, "batch layer head pos"],
    mask: Bool[Tensor, "batch pos"],
    pooling: str,
) -> Float[Tensor, "batch layer head"]:
    """Pool the relevance of a head's output ``[pos, d_head]`` to one score per head and item.

    ``"relu_dim"``: ``Σ_p Σ_d max(0, R_pd)``; ``"relu_token"``: ``Σ_p max(0, Σ_d R_pd)``;
    ``"none"``: ``Σ_p Σ_d R_pd`` (Arras et al. 2025). A 4-d input ``[batch, layer, head, pos]``
    is taken as ``d = 1`` (each token's contribution one dimension). Positions where ``mask`` is
    False (padding) never count, whatever they hold.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {sorted(POOLINGS)}, got {pooling!r}")
    rel = relevance[..., None] if relevance.ndim == 4 else relevance
    if rel.ndim != 5:
        raise ValueError(
            f"Head relevance must be [batch, layer, head, pos(, d)], got {tuple(relevance.shape)}"
        )
    if mask.shape != (rel.shape[0], rel.shape[3]):
        raise ValueError(f"mask {tuple(mask.shape)} does not match relevance {tuple(rel.shape)}")
    real = mask.to(device=rel.device, dtype=torch.bool)[:, None, None, :, None]
    rel = torch.where(real, rel, torch.zeros((), dtype=rel.dtype, device=rel.device))
    if pooling == "relu_dim":
        return rel.clamp(min=0).sum(dim=(-1, -2))
    if pooling == "relu_token":
        return rel.sum(-1).clamp(min=0).sum(-1)
    return rel.sum(dim=(-1, -2))


def head_relevance_tensor(
    attribution: Attribution,
) -> Float[Tensor, "batch layer head pos d"]:
    """The un-pooled head-output relevance of an Attribution, ``[batch, layer, head, pos, d]``.

    ``parts["head_dim_relevance"]`` when the method has a ``d_head`` axis (LRP, AttnLRP,
    Gradient×Input, Gradient with ``heads=True``); otherwise ``head_token_scores`` with ``d = 1``
    (ALTI-Logit's per-head, per-token logit contributions).
    """
    dims = attribution.parts.get("head_dim_relevance")
    if dims is not None:
        return dims
    if attribution.head_token_scores is not None:
        return attribution.head_token_scores[..., None]
    raise ValueError(
        f"Method {attribution.method!r} returned no per-head relevance (neither "
        "parts['head_dim_relevance'] nor head_token_scores): run it with heads=True, or use "
        f"one of {head_relevance_methods()}."
    )


# ------------------------------------------------------------------------------ task data
def _triple(item: Any) -> tuple[str, str, str]:
    if isinstance(item, tuple | list):
        prompt, target, foil = item
    else:
        prompt, target, foil = item.prompt, item.target, item.foil
    if target is None or foil is None:
        raise TargetError(f"Pruning needs a target and a foil for every item; got {item!r}")
    return str(prompt), str(target), str(foil)


@dataclass
class TaskSet:
    """Tokenized items with their target and foil ids, in batches (shared by both passes).

    Build with :meth:`build` from ``TaskItem``-like objects (``.prompt``, ``.target``, ``.foil``)
    or ``(prompt, target, foil)`` tuples; targets and foils must be single tokens.
    """

    batches: list[Batch]
    resolved: list[ResolvedTarget]
    items: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[Int[Tensor, "batch"]]:
        return [r.token_ids for r in self.resolved]

    @property
    def foil_ids(self) -> list[Int[Tensor, "batch"]]:
        return [r.foil_ids for r in self.resolved if r.foil_ids is not None]

    @classmethod
    def build(cls, model: Any, items: Sequence[Any], batch_size: int = 32) -> TaskSet:
        """Tokenize ``items`` into batches of at most ``batch_size``.

        Items are sorted by token length before batching, so that a batch holds items of similar
        length and little padding is computed; ``items[i]`` is the original index of the i-th
        batched row (results are returned in the original order).
        """
        if not items:
            raise ValueError("No items: pass at least one (prompt, target, foil) item.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        triples = [_triple(item) for item in items]
        lengths = [int(to_batch(model, prompt).length) for prompt, _, _ in triples]
        order = sorted(range(len(triples)), key=lambda i: lengths[i])
        batches, resolved = [], []
        n_out = int(model.cfg.d_vocab_out)
        for start in range(0, len(order), batch_size):
            chunk = [triples[i] for i in order[start : start + batch_size]]
            batch = to_batch(model, [p for p, _, _ in chunk])
            target = Target(token=[t for _, t, _ in chunk], foil=[f for _, _, f in chunk])
            no_logits = torch.zeros(batch.size, n_out, device=batch.tokens.device)
            resolved.append(target.resolve(model, batch, no_logits).to(batch.tokens.device))
            batches.append(batch)
        return cls(batches, resolved, order)

    def __len__(self) -> int:
        return sum(b.size for b in self.batches)

    def targets(self) -> list[Target]:
        """The contrastive Target (target − foil logit) of every batch."""
        return [Target(token=r.token_ids, foil=r.foil_ids) for r in self.resolved]


# ------------------------------------------------------------------------------- relevance
def head_relevance(
    model: Any,
    data: TaskSet | Sequence[Any],
    method: str,
    poolings: Sequence[str] = tuple(POOLINGS),
    *,
    contrastive: bool = True,
    batch_size: int = 32,
    progress: bool = False,
    **options: Any,
) -> dict[str, Float[Tensor, "layer head"]]:
    """Mean pooled relevance of every head over a dataset, for each pooling (one method pass).

    ``R̄[l, h] = (1/N) Σ_b pool(R_b[l, h, :, :])`` with ``pool`` from :func:`pool_head_relevance`.
    The explained scalar is ``logit(target) − logit(foil)`` at the last real position
    (``contrastive=False``: the target logit alone). ``options`` go to the method (``heads=True``
    is added when the method takes it).
    """
    if method not in METHODS:
        raise KeyError(f"Unknown method {method!r}. Registered: {sorted(METHODS)}")
    for pooling in poolings:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {sorted(POOLINGS)}, got {pooling!r}")
    task = data if isinstance(data, TaskSet) else TaskSet.build(model, data, batch_size)
    opts = dict(options)
    if METHODS[method].head_relevances and "heads" in METHODS[method].options:
        opts.setdefault("heads", True)
    sums = {p: torch.zeros((), dtype=torch.float64) for p in poolings}
    count = 0
    pairs = list(zip(task.batches, task.targets()))
    for batch, target in progress_bar(pairs, desc=f"relevance {method}", enabled=progress):
        if not contrastive:
            target = target.with_(foil=None)
        attr = attribute(model, batch, target, method=method, **opts)
        rel = head_relevance_tensor(attr)
        for pooling in poolings:
            pooled = pool_head_relevance(rel, attr.mask, pooling).detach().cpu().double()
            if not torch.isfinite(pooled).all():
                raise FloatingPointError(f"{method} gave non-finite head relevances ({pooling}).")
            sums[pooling] = sums[pooling] + pooled.sum(0)
        count += batch.size
    return {p: s / count for p, s in sums.items()}


def pruning_order(relevance: Float[Tensor, "layer head"]) -> Int[Tensor, "n_heads"]:
    """Flat head indices (``layer * n_heads + head``), least relevant first (stable on ties)."""
    flat = relevance.detach().reshape(-1).double().cpu()
    return torch.sort(flat, stable=True).indices


def random_order(n_layers: int, n_heads: int, seed: int) -> Int[Tensor, "n_heads"]:
    """A uniformly random pruning order, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randperm(n_layers * n_heads, generator=gen)


def checkpoints(n_total: int, step: int = 1, max_pruned: int | None = None) -> list[int]:
    """Numbers of pruned heads at which the curve is recorded: 0, step, 2·step, …, max_pruned."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    last = n_total if max_pruned is None else max(0, min(int(max_pruned), n_total))
    points = list(range(0, last + 1, step))
    if points[-1] != last:
        points.append(last)
    return points


# ------------------------------------------------------------------------------ evaluation
@dataclass(frozen=True)
class EvalPoint:
    """Task accuracy and mean logit difference of the (pruned) model on an evaluation set."""

    accuracy: float
    logit_diff: float


def _keep_from_pruned(n_layers: int, n_heads: int, pruned: Tensor) -> Tensor:
    keep = torch.ones(n_layers * n_heads, dtype=torch.bool)
    keep[pruned.cpu()] = False
    return keep.reshape(n_layers, n_heads)


def masks_per_pass(task: TaskSet, max_tokens: int) -> int:
    """How many masks one forward evaluates: the largest batch, repeated, fits ``max_tokens``."""
    largest = max(b.size * b.length for b in task.batches)
    return max(1, int(max_tokens) // largest)


def logit_differences_many(
    model: Any,
    task: TaskSet,
    keeps: Bool[Tensor, "mask layer head"],
    *,
    max_tokens: int = 4096,
    bar: Any = None,
) -> Float[Tensor, "mask n_items"]:
    """``logit(target) − logit(foil)`` at every item's last real token under every head mask.

    Many masks share one forward: each batch of items is repeated once per mask and every copy
    gets its own mask (:func:`lens_attrib.hooks.masking.item_head_mask_hooks`), with at most
    ``max_tokens`` (padded) tokens per forward. The forward stops before ``ln_final``; the head
    is applied to the last real rows only. Rows come back in the original item order.
    """
    keeps = keeps.to(torch.bool).cpu()
    n_masks = int(keeps.shape[0])
    per_pass = masks_per_pass(task, max_tokens)
    head = default_head(model)
    out = torch.empty(n_masks, len(task), dtype=torch.float64)
    columns = torch.tensor(task.items) if task.items else torch.arange(len(task))
    with model_guard(model), torch.inference_mode():
        for start in range(0, n_masks, per_pass):
            chunk = keeps[start : start + per_pass]
            m = int(chunk.shape[0])
            offset = 0
            for batch, resolved in zip(task.batches, task.resolved):
                b = batch.size
                tiled_index = torch.arange(b, device=batch.tokens.device).repeat(m)
                tiled = batch.select(tiled_index)
                hooks = item_head_mask_hooks(chunk.repeat_interleave(b, dim=0))
                with model.hooks(fwd_hooks=hooks):
                    resid = resid_of(model, tiled)
                tiled_target = resolved.index(tiled_index.to(resolved.positions.device))
                diff = tiled_target.select(head(target_rows(resid, tiled_target.positions)))
                out[start : start + m, columns[offset : offset + b]] = (
                    diff.double().cpu().reshape(m, b)
                )
                offset += b
            if bar is not None:
                bar.update(m)
    return out


def logit_differences(
    model: Any, task: TaskSet, keep: Bool[Tensor, "layer head"] | None = None
) -> Float[Tensor, "n_items"]:
    """``logit(target) − logit(foil)`` at every item's last real token, heads masked by ``keep``."""
    if keep is None:
        keep = torch.ones(int(model.cfg.n_layers), int(model.cfg.n_heads), dtype=torch.bool)
    return logit_differences_many(model, task, keep[None])[0]


def _point(diffs: Tensor) -> EvalPoint:
    return EvalPoint(float((diffs > 0).double().mean()), float(diffs.mean()))


def prune_and_score(
    model: Any, task: TaskSet, keep: Bool[Tensor, "layer head"] | None = None
) -> EvalPoint:
    """Prune the heads that ``keep`` leaves out (``None``: none) and score the task: accuracy
    (``logit(target) > logit(foil)``) and mean logit difference, one batched pass."""
    return _point(logit_differences(model, task, keep))


class Evaluator:
    """Evaluates sets of pruned heads on one task set, memoised by the set (order-free).

    ``max_tokens`` bounds the padded tokens of one forward, which evaluates several masks at once.
    """

    def __init__(self, model: Any, task: TaskSet, max_tokens: int = 4096) -> None:
        self.model = model
        self.task = task
        self.max_tokens = max_tokens
        self.n_layers = int(model.cfg.n_layers)
        self.n_heads = int(model.cfg.n_heads)
        self.cache: dict[bytes, EvalPoint] = {}
        self.masks_evaluated = 0

    def _key(self, keep: Tensor) -> bytes:
        return bytes(keep.numpy().tobytes())

    def evaluate_many(self, pruned_sets: Sequence[Tensor], bar: Any = None) -> list[EvalPoint]:
        """Evaluate every set of pruned heads (flat indices); new sets share forwards."""
        keeps = [_keep_from_pruned(self.n_layers, self.n_heads, p) for p in pruned_sets]
        keys = [self._key(k) for k in keeps]
        todo: dict[bytes, Tensor] = {}
        for key, keep in zip(keys, keeps):
            if key not in self.cache:
                todo.setdefault(key, keep)
        if todo:
            diffs = logit_differences_many(
                self.model,
                self.task,
                torch.stack(list(todo.values())),
                max_tokens=self.max_tokens,
                bar=bar,
            )
            for key, row in zip(todo, diffs):
                self.cache[key] = _point(row)
            self.masks_evaluated += len(todo)
        return [self.cache[key] for key in keys]

    def __call__(self, pruned: Tensor) -> EvalPoint:
        return self.evaluate_many([pruned])[0]


# ---------------------------------------------------------------------------------- curves
@dataclass
class PruningCurve:
    """Accuracy and mean logit difference after pruning ``n_pruned`` heads in ``order``."""

    label: str
    n_pruned: list[int]
    accuracy: list[float]
    logit_diff: list[float]
    n_heads: int
    order: list[int]
    method: str | None = None
    pooling: str | None = None
    seed: int | None = None

    @property
    def fraction(self) -> np.ndarray:
        """Fraction of all heads pruned at every point."""
        return np.asarray(self.n_pruned, dtype=np.float64) / self.n_heads

    def auc(self, metric: str = "accuracy") -> float:
        """Trapezoid area under ``metric`` over the fraction of heads pruned.

        With ``max_pruned`` below the number of heads the area covers ``[0, max_pruned/n]``.
        """
        values = np.asarray(getattr(self, metric), dtype=np.float64)
        return float(np.trapezoid(values, self.fraction)) if len(values) > 1 else 0.0


def curve_for_order(
    evaluator: Evaluator,
    order: Int[Tensor, "n_heads"],
    *,
    label: str,
    step: int = 1,
    max_pruned: int | None = None,
    bar: Any = None,
    **info: Any,
) -> PruningCurve:
    """Prune heads in ``order`` (flat indices), ``step`` at a time; evaluate at every point."""
    n_total = evaluator.n_layers * evaluator.n_heads
    order = torch.as_tensor(order, dtype=torch.long).cpu()
    if sorted(order.tolist()) != list(range(n_total)):
        raise ValueError(f"order must be a permutation of the {n_total} heads")
    points = checkpoints(n_total, step, max_pruned)
    results = evaluator.evaluate_many([order[:k] for k in points], bar=bar)
    accuracy = [r.accuracy for r in results]
    logit_diff = [r.logit_diff for r in results]
    return PruningCurve(label, points, accuracy, logit_diff, n_total, order.tolist(), **info)


@dataclass
class PruningResult:
    """All curves of a pruning experiment, the head relevances they came from, and settings."""

    curves: list[PruningCurve]
    relevance: dict[str, Float[Tensor, "layer head"]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def labels(self) -> list[str]:
        return list(dict.fromkeys(c.label for c in self.curves))

    def by_label(self, label: str) -> list[PruningCurve]:
        return [c for c in self.curves if c.label == label]

    def aucs(self, metric: str = "accuracy") -> dict[str, tuple[float, float, int]]:
        """Label -> (mean AUC, std AUC over curves with that label, number of curves)."""
        out = {}
        for label in self.labels():
            values = np.array([c.auc(metric) for c in self.by_label(label)])
            out[label] = (float(values.mean()), float(values.std()), int(values.size))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "curves": [asdict(c) for c in self.curves],
            "relevance": {k: v.tolist() for k, v in self.relevance.items()},
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> Path:
        """Write the result as JSON."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PruningResult:
        return cls(
            [PruningCurve(**c) for c in data["curves"]],
            {k: torch.tensor(v, dtype=torch.float64) for k, v in data["relevance"].items()},
            dict(data.get("meta", {})),
        )

    @classmethod
    def load(cls, path: str | Path) -> PruningResult:
        return cls.from_dict(json.loads(Path(path).read_text()))


def run_pruning(
    model: Any,
    items: Sequence[Any],
    methods: Sequence[str] | None = None,
    poolings: Sequence[str] = tuple(POOLINGS),
    *,
    relevance_items: Sequence[Any] | None = None,
    step: int = 1,
    max_pruned: int | None = None,
    n_random: int = 10,
    seed: int = 0,
    batch_size: int = 32,
    contrastive: bool = True,
    method_options: Mapping[str, Mapping[str, Any]] | None = None,
    max_tokens: int = 4096,
    progress: bool = True,
) -> PruningResult:
    """Head-pruning curves for every method × pooling, plus ``n_random`` random orders.

    ``methods``: default every registered method with per-head relevances.

    Relevances come from ``relevance_items`` (default: the evaluation ``items`` themselves,
    sharing their tokenized batches); curves are evaluated on ``items``. Random orders use seeds
    ``seed, seed+1, …``. The model is left unchanged (masks are hooks, removed afterwards).
    Every distinct set of pruned heads is evaluated once, several per forward (at most
    ``max_tokens`` padded tokens per forward: the items repeated once per mask).
    """
    task = TaskSet.build(model, items, batch_size)
    rel_task = task
    if relevance_items is not None:
        rel_task = TaskSet.build(model, relevance_items, batch_size)
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    n_total = n_layers * n_heads
    relevance: dict[str, Tensor] = {}
    for method in head_relevance_methods() if methods is None else methods:
        opts = dict((method_options or {}).get(method, {}))
        pooled = head_relevance(
            model, rel_task, method, poolings, contrastive=contrastive, progress=progress, **opts
        )
        for pooling, rel in pooled.items():
            relevance[f"{method}/{pooling}"] = rel
    plans: list[tuple[str, Tensor, dict[str, Any]]] = []
    for label, rel in relevance.items():
        method, pooling = label.split("/")
        plans.append((label, pruning_order(rel), {"method": method, "pooling": pooling}))
    for i in range(n_random):
        plans.append((RANDOM, random_order(n_layers, n_heads, seed + i), {"seed": seed + i}))
    # every distinct set of pruned heads of every curve, evaluated together (shared forwards)
    evaluator = Evaluator(model, task, max_tokens)
    points = checkpoints(n_total, step, max_pruned)
    sets = {
        bytes(_keep_from_pruned(n_layers, n_heads, o[:k]).numpy().tobytes()): o[:k]
        for _, o, _ in plans
        for k in points
    }
    with progress_bar(desc="pruning masks", total=len(sets), enabled=progress) as bar:
        evaluator.evaluate_many(list(sets.values()), bar=bar)
    curves = [
        curve_for_order(evaluator, order, label=label, step=step, max_pruned=max_pruned, **info)
        for label, order, info in plans
    ]
    meta = {
        "model": getattr(model.cfg, "model_name", None),
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_items": len(task),
        "n_relevance_items": len(rel_task),
        "step": step,
        "max_pruned": max_pruned,
        "n_random": n_random,
        "seed": seed,
        "contrastive": contrastive,
        "masks_evaluated": evaluator.masks_evaluated,
        "max_tokens": max_tokens,
    }
    return PruningResult(curves, relevance, meta)


__all__ = [
    "POOLINGS",
    "RANDOM",
    "EvalPoint",
    "Evaluator",
    "PruningCurve",
    "PruningResult",
    "TaskSet",
    "checkpoints",
    "curve_for_order",
    "head_relevance",
    "head_relevance_methods",
    "head_relevance_tensor",
    "logit_differences",
    "logit_differences_many",
    "masks_per_pass",
    "pool_head_relevance",
    "prune_and_score",
    "pruning_order",
    "random_order",
    "run_pruning",
]
