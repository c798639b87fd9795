"""Grad-ELLM's depth in the tables: chosen per task / dataset × model on a tuning split.

The π-Soft paper (Huang & Chan, Appendix I) runs Grad-ELLM with the last ``n ∈ {1, 4, 8, 16,
32}`` layers aggregated and keeps, per dataset and model, the depth whose π-Soft-NC/NS AUCs are
best. The experiments do the same with
:func:`lens_attrib.evaluation.depth_selection.select_grad_ellm_depth` on a *tuning split*: items
of the same source drawn with ``--tuning-seed`` (default: the run's seed + 1), every item equal
to a reported one removed (disjoint by construction, checked), the first ``--tuning-n`` kept.
Grad-ELLM is then run on the reported items at the chosen depth, and the split (its size, seed
and fingerprint), the candidates, each candidate's score and the chosen depth are written to the
journal, the JSON/HTML outputs and a line under each table.

``--grad-ellm-depth``: ``auto`` (default; the selection above), ``default`` (the library's
default, ``ceil(L / 4)``, no tuning) or an integer (fixed by hand, no tuning).
``--depth-metric``: the criterion, higher is better per tuning item:

- ``pi_soft`` — ``(π-Soft-NC + π-Soft-NS) / 2`` with dynamic routing over the run's π grid
  (the paper's), ``--tuning-draws`` Monte-Carlo draws (default: the run's);
- ``pointing_game`` — agreement only: the tie-aware pointing game against the evidence, special
  tokens excluded (the table's main setting). A departure from the paper's criterion, used where
  π-Soft tuning is unaffordable (stated in the table);
- ``aopc`` — faithfulness only: AOPC comprehensiveness − sufficiency over the run's fractions;
  the criterion for a regression head (STS-B), which π-Soft does not apply to (a departure,
  stated).

Every candidate's per-item criterion is one journal unit (key
``<where>:<tuning fingerprint>|grad_ellm_depth[<metric>,n_layers=<d>]``; its records carry
``criterion``, not ``value``, so the tables from committed records leave them out), so a resumed
run recomputes nothing but the cheap Grad-ELLM attributions of the tuning items.
"""

from __future__ import annotations

import argparse
import math
import random
import time
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from experiments.resume import Units, fingerprint
from lens_attrib.evaluation.depth_selection import (
    PAPER_CANDIDATES,
    depth_candidates,
    select_grad_ellm_depth,
)
from lens_attrib.methods.grad_ellm import default_depth

T = TypeVar("T")
Criterion = Callable[[Any, Any], torch.Tensor]
METRICS = ("pi_soft", "pointing_game", "aopc")


def depth_setting(text: str) -> str | int:
    """``--grad-ellm-depth``: ``auto``, ``default`` or a positive integer (argparse type)."""
    value = text.strip().lower()
    if value in ("auto", "default"):
        return value
    try:
        depth = int(value)
    except ValueError:
        depth = 0
    if depth < 1:
        raise argparse.ArgumentTypeError(
            f"--grad-ellm-depth must be 'auto', 'default' or a positive integer, got {text!r}"
        )
    return depth


def add_depth_arguments(
    parser: argparse.ArgumentParser, *, metrics: Sequence[str], metric: str, tuning_n: int
) -> None:
    """``--grad-ellm-depth``, ``--depth-metric``, ``--depth-candidates``, ``--tuning-n``,
    ``--tuning-seed``, ``--tuning-draws`` (module docstring)."""
    parser.add_argument(
        "--grad-ellm-depth",
        type=depth_setting,
        default="auto",
        help="Grad-ELLM's n_layers: auto (default: chosen per task/dataset on a tuning split "
        "disjoint from the reported items, as the π-Soft paper's Appendix I), default (the "
        "library's ceil(L/4)) or an integer fixed by hand",
    )
    parser.add_argument(
        "--depth-metric",
        choices=tuple(metrics),
        default=metric,
        help=f"criterion of the depth selection (default {metric}; experiments.grad_ellm_depth)",
    )
    parser.add_argument(
        "--depth-candidates",
        default=",".join(str(d) for d in PAPER_CANDIDATES),
        help="depths tried (clipped to the model's layers; default the paper's 1,4,8,16,32)",
    )
    parser.add_argument(
        "--tuning-n", type=int, default=tuning_n, help="tuning items per task / dataset"
    )
    parser.add_argument(
        "--tuning-seed", type=int, default=None, help="seed of the tuning split (default seed+1)"
    )
    parser.add_argument(
        "--tuning-draws",
        type=int,
        default=None,
        help="π-Soft Monte-Carlo draws of the pi_soft criterion (default: the run's draws, "
        "or 15 where the run has none)",
    )


def tuning_seed(args: Any) -> int:
    """The tuning split's seed: ``--tuning-seed``, else the run's seed + 1."""
    return int(args.seed) + 1 if args.tuning_seed is None else int(args.tuning_seed)


def candidates_of(args: Any) -> list[int]:
    """``--depth-candidates`` as integers."""
    try:
        values = [int(p) for p in str(args.depth_candidates).split(",") if p.strip()]
    except ValueError as err:
        raise ValueError(
            f"--depth-candidates must be comma-separated integers, got {args.depth_candidates!r}"
        ) from err
    return values


def depth_manifest(args: Any) -> dict[str, Any]:
    """The depth settings a journal's manifest records (a resume with others is refused)."""
    return {
        "grad_ellm_depth": args.grad_ellm_depth,
        "depth_metric": args.depth_metric,
        "depth_candidates": args.depth_candidates,
        "tuning_n": args.tuning_n,
        "tuning_seed": tuning_seed(args),
        "tuning_draws": args.tuning_draws,
    }


def disjoint_sample(
    pool: Sequence[T], taken: set[Hashable], key: Callable[[T], Hashable], n: int, seed: int
) -> list[T]:
    """``n`` items of ``pool`` (seeded sample, in pool order) whose ``key`` is not in ``taken``
    (all of them when fewer remain)."""
    free = [it for it in pool if key(it) not in taken]
    if len(free) <= n:
        return free
    keep = sorted(random.Random(seed).sample(range(len(free)), n))
    return [free[i] for i in keep]


def check_disjoint(reported: Sequence[Hashable], tuning: Sequence[Hashable], where: str) -> None:
    """Raise if a tuning item is also a reported one."""
    shared = set(reported) & set(tuning)
    if shared:
        raise AssertionError(
            f"{where}: {len(shared)} tuning item(s) are also reported items, e.g. "
            f"{sorted(map(str, shared))[:2]}; the tuning split must be disjoint"
        )


@dataclass
class DepthChoice:
    """Grad-ELLM's depth for one task / dataset and how it was obtained.

    ``how``: ``"selected"`` (on the tuning split), ``"fixed"`` (by hand) or ``"default"``;
    ``scores``: candidate → mean criterion on the tuning items (selected only); ``tuning``: the
    split (``n``, ``seed``, ``fingerprint``, ``source``, ``inputs``: the tuning prompts)."""

    where: str
    depth: int
    how: str
    metric: str | None = None
    candidates: list[int] = field(default_factory=list)
    scores: dict[int, float] = field(default_factory=dict)
    tuning: dict[str, Any] = field(default_factory=dict)
    departure: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "where": self.where,
            "depth": self.depth,
            "how": self.how,
            "metric": self.metric,
            "candidates": self.candidates,
            "scores": {str(k): v for k, v in self.scores.items()},
            "tuning": self.tuning,
            "departure": self.departure,
        }

    def note(self) -> str:
        """The line under a table."""
        if self.how == "fixed":
            return f"Grad-ELLM n_layers={self.depth} (fixed by hand, --grad-ellm-depth)."
        if self.how == "default":
            text = f"Grad-ELLM n_layers={self.depth} (the library default ceil(L/4); no tuning)."
            return text + (f" {self.departure}" if self.departure else "")
        scores = ", ".join(
            f"{d}: {'–' if math.isnan(s) else f'{s:.3f}'}" for d, s in self.scores.items()
        )
        split = self.tuning
        text = (
            f"Grad-ELLM n_layers={self.depth}, selected by {self.metric} on {split['n']} tuning "
            f"items ({split['source']}, seed {split['seed']}, disjoint from the reported items; "
            f"fingerprint {split['fingerprint']}); candidates {scores}."
        )
        return text + (f" {self.departure}" if self.departure else "")


def fixed_choice(model: Any, args: Any, where: str) -> DepthChoice | None:
    """The choice without tuning (``--grad-ellm-depth default`` or N), else ``None``."""
    setting = args.grad_ellm_depth
    total = int(model.cfg.n_layers)
    if setting == "default":
        return DepthChoice(where, default_depth(total), "default")
    if isinstance(setting, int):
        if setting > total:
            raise ValueError(
                f"--grad-ellm-depth {setting} exceeds the model's {total} layers; pass at most "
                f"{total}, 'default' or 'auto'."
            )
        return DepthChoice(where, setting, "fixed")
    return None


def journaled(units: Units, key: str, n_items: int, criterion: Criterion) -> Criterion:
    """``criterion`` with each depth's per-item values kept in (and read from) the journal.
    A computed unit's cost includes its depth's attribution: the time since the previous
    depth's criterion returned (or since this wrapper was made), in which
    :func:`~lens_attrib.evaluation.depth_selection.select_grad_ellm_depth` explains the items."""
    clock = {"cpu_s": time.process_time(), "wall_s": time.perf_counter()}

    def metric(model: Any, attr: Any) -> torch.Tensor:
        depth = int(attr.meta["options"]["n_layers"])
        spent = {
            "cpu_s": time.process_time() - clock["cpu_s"],
            "wall_s": time.perf_counter() - clock["wall_s"],
        }

        def compute() -> list[dict[str, Any]]:
            values = torch.as_tensor(criterion(model, attr), dtype=torch.float64).reshape(-1)
            return [
                {"candidate": depth, "item": i, "criterion": None if math.isnan(v) else v}
                for i, v in enumerate(values.tolist())
            ]

        unit = f"{key}[n_layers={depth}]"
        rows = units.get(unit, list(range(n_items)), compute, spent)
        clock["cpu_s"], clock["wall_s"] = time.process_time(), time.perf_counter()
        return torch.tensor(
            [math.nan if r["criterion"] is None else r["criterion"] for r in rows],
            dtype=torch.float64,
        )

    metric.__name__ = "journaled"
    return metric


def select_depth(
    model: Any,
    units: Units,
    where: str,
    inputs: Sequence[Any],
    target: Any,
    criterion: Criterion,
    args: Any,
    *,
    source: str,
    departure: str = "",
    metric: str | None = None,
    key: str | None = None,
) -> DepthChoice:
    """Grad-ELLM's depth for ``where`` chosen on the tuning ``inputs`` (explained with
    ``target``) by ``criterion`` (per item, higher is better; named ``metric``, default
    ``--depth-metric``), journaled in ``units`` under ``key`` (default ``where``; e.g. with the
    classifier's fingerprint)."""
    if not inputs:  # e.g. a user's file whose every item is reported: stated, not silent
        why = (
            "no tuning item is left once the reported items are removed; the library default "
            "ceil(L/4) is used (pass --grad-ellm-depth N, a smaller --n or a larger pool)"
        )
        warnings.warn(f"{where}: {why}", stacklevel=2)
        total = int(model.cfg.n_layers)
        return DepthChoice(where, default_depth(total), "default", departure=f"Note: {why}.")
    seed = tuning_seed(args)
    split_id = fingerprint([list(inputs), repr(target)])
    metric = metric or args.depth_metric
    unit = f"{key or where}:{split_id}|grad_ellm_depth[{metric},draws={args.tuning_draws}]"
    selection = select_grad_ellm_depth(
        model,
        list(inputs),
        target,
        candidates=candidates_of(args),
        metric=journaled(units, unit, len(inputs), criterion),
    )
    return DepthChoice(
        where,
        selection.depth,
        "selected",
        metric,
        depth_candidates(model, candidates_of(args)),
        dict(selection.scores),
        {
            "n": len(inputs),
            "seed": seed,
            "fingerprint": split_id,
            "source": source,
            "inputs": list(inputs),
        },
        departure,
    )


__all__ = [
    "METRICS",
    "DepthChoice",
    "add_depth_arguments",
    "candidates_of",
    "check_disjoint",
    "depth_manifest",
    "depth_setting",
    "disjoint_sample",
    "fixed_choice",
    "select_depth",
    "tuning_seed",
]
