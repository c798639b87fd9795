"""Benchmark Integrated Gradients convergence on SmolLM2-135M: completeness gap and time per item.

    python -m benchmarks.bench_ig [--n 50] [--n-anaphora 10] [--configs before after]

Items: ``--n`` subject–verb agreement items (:func:`lens_attrib.data.generate_sva`, 0–3
attractors, prepositional phrases and object relative clauses) and ``--n-anaphora`` reflexive
anaphora items (:func:`lens_attrib.data.generate_anaphora`); target the correct verb/reflexive,
foil the other form. Every item is explained alone (one call per item, float32, one thread).

Configurations:

- ``before``: ``rule="trapezoid", n_steps=50, keep_sink=True`` (the defaults before issue 14:
  the first real token is frozen on the path and gets no relevance),
- ``after``: the defaults (Gauss–Legendre, ``n_steps="auto"`` with adaptive panels,
  ``keep_sink="special"``: only special tokens kept, a sink token prepended where the prompt
  has none, so every real token is attributed),
- ``first_fixed``: the defaults with ``keep_sink=True`` (the first real token also kept fixed
  and unattributed: a smoother path).

Reports per configuration and task the median relative completeness gap
``|f(x) − f(b) − Σ_i R_i| / |f(x) − f(b)|``, the share of items with a gap ≤ 1 %, the median
time per item, the median number of steps, and the share of items whose first real token has
exactly zero relevance. Prints a markdown table and writes ``results/bench_ig.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

CONFIGS: dict[str, dict[str, Any]] = {
    "before": {"rule": "trapezoid", "n_steps": 50, "keep_sink": True},
    "after": {},
    "first_fixed": {"keep_sink": True},
}


def load() -> Any:
    from lens_attrib import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("smollm2-135m")


def items_of(model: Any, n_sva: int, n_anaphora: int) -> list[Any]:
    from lens_attrib.data import generate_anaphora, generate_sva
    from lens_attrib.scoring import single_token_items

    sva, _ = single_token_items(model, generate_sva(n_sva * 2, seed=0))
    ana, _ = single_token_items(model, generate_anaphora(n_anaphora * 2, seed=0))
    return sva[:n_sva] + ana[:n_anaphora]


def measure(model: Any, item: Any, options: dict[str, Any]) -> dict[str, Any]:
    from lens_attrib import Target, attribute

    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = attribute(
            model,
            item.prompt,
            Target(token=item.target, foil=item.foil),
            method="integrated_gradients",
            start_token=False,  # as measured: IG prepends <|endoftext|> itself ("special")
            **options,
        )
    seconds = time.perf_counter() - start
    delta = float(a.meta["explained_value"][0] - a.meta["baseline_value"][0])
    gap = float(a.meta["completeness_gap"][0])
    first = int(a.mask[0].nonzero()[0])
    steps: Any = a.meta.get("n_steps", options.get("n_steps", 0))
    return {
        "task": item.task,
        "prompt": item.prompt,
        "delta": delta,
        "gap": gap,
        "relative_gap": abs(gap) / abs(delta) if delta != 0 else float("inf"),
        "seconds": seconds,
        "n_steps": int(steps[0]) if isinstance(steps, list | tuple) else int(steps),
        "first_token_zero": float(a.scores[0, first]) == 0.0,
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    rel = [r["relative_gap"] for r in rows]
    return {
        "n": len(rows),
        "median_relative_gap": statistics.median(rel),
        "share_within_1pct": sum(g <= 0.01 for g in rel) / len(rel),
        "median_seconds": statistics.median(r["seconds"] for r in rows),
        "median_steps": statistics.median(r["n_steps"] for r in rows),
        "first_token_zero": sum(r["first_token_zero"] for r in rows) / len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=50, help="agreement (SVA) items")
    parser.add_argument("--n-anaphora", type=int, default=10)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", default="results/bench_ig.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load()
    items = items_of(model, args.n, args.n_anaphora)
    results: dict[str, Any] = {"platform": platform.platform(), "torch": torch.__version__}
    for name in args.configs:
        rows = []
        for i, item in enumerate(items):
            rows.append(measure(model, item, CONFIGS[name]))
            print(name, i, json.dumps(rows[-1]), flush=True)
        tasks = sorted({r["task"] for r in rows})
        results[name] = {
            "options": CONFIGS[name],
            "rows": rows,
            "summary": {t: summary([r for r in rows if r["task"] == t]) for t in tasks},
        }
    print("| config | task | n | median gap | ≤ 1 % | s/item | steps | first token 0 |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.configs:
        for task, s in results[name]["summary"].items():
            print(
                f"| {name} | {task} | {s['n']} | {s['median_relative_gap']:.2%} | "
                f"{s['share_within_1pct']:.0%} | {s['median_seconds']:.2f} | "
                f"{s['median_steps']:.0f} | {s['first_token_zero']:.0%} |"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
