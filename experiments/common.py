"""Shared command-line and output helpers for the experiment scripts.

Every experiment is ``python -m experiments.NAME --model … --n … --out results/NAME`` and writes
``<out>/<name>.json`` (config + records + summary), ``<out>/<name>.csv`` (the summary rows) and
``<out>/<name>.html`` (its plotly figures), then prints a table in the paper's layout.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

_MODELS: dict[tuple[str, str], Any] = {}
"""(model name, device) -> loaded model, so that several ``main()`` calls in one process (tests,
notebooks) load each model once. Tests may put an already loaded model here."""


def base_parser(description: str, *, n: int, out: str) -> argparse.ArgumentParser:
    """The options every experiment shares: --model --n --out --device --seed --threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="smollm2-135m (offline), or any TransformerLens model name",
    )
    parser.add_argument("--n", type=int, default=n, help="items per task / dataset")
    parser.add_argument("--out", default=out, help="output folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared 2-core machine one thread ran ~3× "
        "faster than two; 0 leaves torch's default)",
    )
    return parser


def parse_list(text: str) -> list[str]:
    """``"a,b, c"`` -> ``["a", "b", "c"]`` (empty entries dropped)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def get_model(name: str, device: str = "cpu") -> Any:
    """Load ``name`` once per process (HF hub offline unless the user set otherwise)."""
    key = (name.lower(), str(device))
    if key not in _MODELS:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from lens_attrib import load_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _MODELS[key] = load_model(name, device=device)
    return _MODELS[key]


def setup(args: argparse.Namespace) -> Any:
    """Threads, gradients on (methods need them), quiet deprecation warnings; the model."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(True)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    return get_model(args.model, args.device)


def finite_mean(values: Iterable[float | None]) -> float:
    """Mean of the finite values (NaN when there are none)."""
    kept = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(kept) / len(kept) if kept else float("nan")


def json_safe(value: Any) -> Any:
    """NaN/inf -> None, tensors and numpy scalars -> Python numbers, recursively."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, torch.Tensor):
        return json_safe(value.detach().cpu().tolist())
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_outputs(
    out: str | Path,
    name: str,
    *,
    config: dict[str, Any],
    summary: Sequence[dict[str, Any]],
    records: Sequence[dict[str, Any]] = (),
    figures: Sequence[Any] = (),
    table: str = "",
    extra: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write ``<name>.json`` (config, summary, records, extra, table), ``<name>.csv`` (summary)
    and ``<name>.html`` (figures, plotly.js from the CDN once). Returns the paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": folder / f"{name}.json",
        "csv": folder / f"{name}.csv",
        "html": folder / f"{name}.html",
    }
    payload = {
        "config": config,
        "summary": list(summary),
        "records": list(records),
        "table": table,
        **(extra or {}),
    }
    paths["json"].write_text(json.dumps(json_safe(payload), indent=1), encoding="utf-8")
    write_csv(paths["csv"], summary)
    parts = [
        "<html><head><meta charset='utf-8'>",
        f"<title>{name}</title></head><body>",
        f"<h1>{name}</h1><pre>{_escape(table)}</pre>",
    ]
    for i, fig in enumerate(figures):
        parts.append(fig.to_html(full_html=False, include_plotlyjs="cdn" if i == 0 else False))
    parts.append("</body></html>")
    paths["html"].write_text("\n".join(parts), encoding="utf-8")
    return paths


def _escape(text: str) -> str:
    import html

    return html.escape(text)


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Rows (dicts) as CSV; the header is the union of keys in first-seen order."""
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows([{k: json_safe(v) for k, v in row.items()} for row in rows])


def format_table(
    rows: Sequence[Sequence[Any]], header: Sequence[str], *, fmt: Callable[[Any], str] | None = None
) -> str:
    """A plain-text table: first column left-aligned, others right-aligned."""
    fmt = fmt or _cell
    cells = [[str(h) for h in header]] + [
        [fmt(c) if j else str(c) for j, c in enumerate(r)] for r in rows
    ]
    widths = [max(len(row[j]) for row in cells) for j in range(len(header))]
    lines = []
    for i, row in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(widths[j]) if j == 0 else c.rjust(widths[j]) for j, c in enumerate(row)
            )
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:.3f}"
    return str(value)


def pct(value: float | None) -> str:
    """A fraction in [0, 1] as a percentage with no decimals (the papers' tables)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{100 * value:.0f}"


class Stopwatch:
    """``with Stopwatch() as sw: …; sw.seconds``."""

    def __enter__(self) -> Stopwatch:
        self.started = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.started
