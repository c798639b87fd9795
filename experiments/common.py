"""Shared command-line and output helpers for the experiment scripts.

Every experiment is ``python -m experiments.NAME --model … --n … --out results/NAME`` and writes
``<out>/<name>.json`` (config + records + summary), ``<out>/<name>.csv`` (the summary rows) and
``<out>/<name>.html`` (a self-contained report: the table, the method × metric means with 95%
bootstrap intervals, the figures with plotly.js inlined, and a footer with command, model, date
and wall time), then prints a table in the paper's layout.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import sys
import time
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


def parse_list(text: str | Sequence[str]) -> list[str]:
    """``"a,b, c"`` -> ``["a", "b", "c"]`` (empty entries dropped); a list passes through."""
    if not isinstance(text, str):
        return list(text)
    return [part.strip() for part in text.split(",") if part.strip()]


def get_model(name: str, device: str = "cpu") -> Any:
    """Load ``name`` once per process (HF hub offline unless the user set otherwise)."""
    key = (name.lower(), str(device))
    if key not in _MODELS:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from lens_attrib import load_model

        _MODELS[key] = load_model(name, device=device)  # silences TransformerLens' notice
    return _MODELS[key]


def device_label(device: str | torch.device) -> str:
    """Where a run computes, as journaled with each unit: ``cpu``, or e.g.
    ``cuda:0 (NVIDIA H200)`` (the accelerator's name, since its CPU seconds are not the work's)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def setup(args: argparse.Namespace) -> Any:
    """Threads, gradients on (methods need them); the model."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(True)
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


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """The shell command that reruns ``module`` with ``argv`` (default: this process's)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", "-m", module, *args])


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
    argv: Sequence[str] | None = None,
    started: float | None = None,
    ci_rows: Sequence[str] | None = None,
    examples: Sequence[Any] = (),
) -> dict[str, Path]:
    """Write ``<name>.json`` (config, summary, records, extra, table), ``<name>.csv`` (summary)
    and ``<name>.html`` (:func:`report_html`). Returns the paths.

    ``argv``: the experiment's arguments (for the footer's command); ``started``: its
    ``time.perf_counter()`` at start (for the wall time); ``ci_rows``: the record keys of the
    CI table's rows (default: the summary's text keys but ``metric``); ``examples``: one-item
    Attributions (one per method) shown as token maps and per-layer maps.
    """
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
    seconds = None if started is None else time.perf_counter() - started
    paths["html"].write_text(
        report_html(
            name,
            table=table,
            records=records,
            summary=summary,
            figures=figures,
            command=command_line(f"experiments.{name}", argv),
            model=config.get("model"),
            seconds=seconds,
            ci_rows=ci_rows,
            examples=examples,
        ),
        encoding="utf-8",
    )
    return paths


def report_html(
    name: str,
    *,
    table: str,
    records: Sequence[dict[str, Any]],
    summary: Sequence[dict[str, Any]],
    figures: Sequence[Any],
    command: str,
    model: str | None,
    seconds: float | None,
    ci_rows: Sequence[str] | None = None,
    examples: Sequence[Any] = (),
) -> str:
    """An experiment's page: the printed table, the method × metric means with n and 95%
    intervals (when the records have ``metric`` and ``value``), one example's token maps and
    per-layer maps, every figure (plotly.js inlined once), and the footer."""
    import html

    from lens_attrib.report import ci_table_html, figure_html, footer_html, page_html, section

    body = [section("Table", f"<pre>{html.escape(table)}</pre>")] if table else []
    if examples:
        body.append(example_section(examples))
    if records and {"metric", "value"} <= set(records[0]):
        keys = list(ci_rows) if ci_rows is not None else ci_row_keys(summary, records)
        body.append(
            section(
                "Means with 95% intervals",
                ci_table_html(records, keys, "metric"),
                intro="Each cell: the mean over items, its percentile-bootstrap interval over "
                "items and n.",
            )
        )
    if figures:
        body.append(section("Figures", *(figure_html(fig) for fig in figures)))
    return page_html(
        f"{name}: {model}" if model else name,
        body,
        footer=footer_html(command=command, model=model, seconds=seconds),
    )


def example_section(examples: Sequence[Any]) -> str:
    """Token maps of the first item of each example Attribution (one row per method) and a
    layer × token map for each that has per-layer scores."""
    from lens_attrib.plot import layer_heatmap
    from lens_attrib.report import attribution_rows, figure_html, section, token_map_html

    rows = [row for attr in examples for row in attribution_rows(attr, [0])]
    maps = [
        figure_html(
            layer_heatmap(attr),
            f"{attr.method}: each token's relevance read at every layer (scale ± max |score| "
            "of the map, centred at 0).",
        )
        for attr in examples
        if attr.layer_scores is not None
    ]
    prompt = "".join(examples[0].tokens[0])
    return section(
        "One example",
        token_map_html(rows),
        *maps,
        intro=f"The first explained item: {prompt[:300]}",
    )


def ci_row_keys(summary: Sequence[dict[str, Any]], records: Sequence[dict[str, Any]]) -> list[str]:
    """The grouping keys of the summary that the records share (``method`` last), but
    ``metric`` and the statistics: e.g. ``dataset, method`` or ``task, mode, specials, method``."""
    stats = {"metric", "mean", "n", "std", "value", "ci_low", "ci_high"}
    first = records[0]
    keys = [k for k in (summary[0] if summary else {}) if k in first and k not in stats]
    if "method" in keys:
        keys = [k for k in keys if k != "method"] + ["method"]
    return keys or ["method"]


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
