"""Run directories: a paper-size run's journal kept in the repository, and its tables from it.

A run named ``<name>`` lives in ``docs/results/runs/<name>/``: ``records.jsonl.gz`` (the
compressed journal of :mod:`lens_attrib.evaluation.journal`, one gzip member per finished batch
or unit), ``manifest.json`` (a readable copy of its first line), ``command.txt`` (the command
that runs it, written by :mod:`experiments.checkpoint_run`) and, once regenerated,
``summary.csv`` and ``table.txt``. The runner (``python -m lens_attrib.evaluation … --journal
docs/results/runs/<name>/records.jsonl.gz --resume``) and the journaled experiments
(``python -m experiments.agreement … --journal … --resume``) write it; a sharded runner writes
``records.shard-i-of-n.jsonl.gz`` files, read here together.

``python -m lens_attrib.evaluation.runs <name or folder>`` regenerates the tables from the
committed records alone (no model): the runner's method × metric summary
(:func:`lens_attrib.evaluation.records.summarize`, bootstrap CIs) or, for an experiment's journal,
the same summary grouped by every key its records carry (task, dataset, mode, specials …). The
records of a resumed run are those of an uninterrupted one, so are its tables.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lens_attrib.evaluation.journal import read_lines
from lens_attrib.evaluation.records import EvalResult, sort_records, summarize

RUNS = Path("docs/results/runs")
"""Where run directories live, relative to the repository root."""

JOURNAL = "records.jsonl.gz"
"""The journal's file name in a run directory."""

EXPERIMENT_KEYS = ("task", "dataset", "mode", "specials", "method", "metric", "layer")
"""Record fields an experiment's summary is grouped by (those its records carry)."""


def run_dir(name: str | Path, root: str | Path = RUNS) -> Path:
    """The folder of run ``name``: ``name`` itself when it is an existing folder (or has a
    slash), else ``<root>/<name>``."""
    path = Path(name)
    return path if path.is_dir() or len(path.parts) > 1 else Path(root) / path


def journals(directory: str | Path) -> list[Path]:
    """The journal files of a run directory (one, or one per shard), sorted."""
    directory = Path(directory)
    found = sorted(directory.glob("records*.jsonl.gz")) + sorted(directory.glob("records*.jsonl"))
    if not found:
        raise FileNotFoundError(
            f"{directory} holds no journal (records.jsonl.gz): start the run with "
            f"--journal {directory / JOURNAL} (see docs/results/README.md)."
        )
    return found


def load_run(directory: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run's manifest (its first journal's; shards must agree but for the shard) and every
    record of its finished batches."""
    manifest: dict[str, Any] | None = None
    records: list[dict[str, Any]] = []
    for path in journals(directory):
        lines = read_lines(path)
        head = {k: v for k, v in lines[0].items() if k not in ("shard", "n_items")}
        if manifest is None:
            manifest = head
        elif {k: v for k, v in manifest.items() if k != "code_version"} != {
            k: v for k, v in head.items() if k != "code_version"
        }:
            raise ValueError(f"{path} belongs to another run than the other journals beside it")
        records += [r for ln in lines[1:] if ln.get("kind") == "batch" for r in ln["records"]]
    assert manifest is not None
    return manifest, records


def tables(directory: str | Path) -> tuple[EvalResult, str]:
    """The run's result regenerated from its records, and its table as text."""
    manifest, records = load_run(directory)
    if "experiment" in manifest:
        by = [k for k in EXPERIMENT_KEYS if any(k in r for r in records)]
        summary = summarize([r for r in records if "value" in r], by)
        return EvalResult(records, summary, manifest), _text_table(summary, by)
    result = EvalResult(sort_records(records), summarize(records), manifest)
    return result, result.table()


def _text_table(summary: Sequence[dict[str, Any]], by: Sequence[str]) -> str:
    cols = [*by, "mean", "ci_low", "ci_high", "n"]
    rows = [[_cell(row.get(c)) for c in cols] for row in summary]
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(cols)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in [cols, *rows]
    )


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4f}"
    return str(value)


def write_tables(directory: str | Path) -> dict[str, Path]:
    """Write ``summary.csv`` and ``table.txt`` into the run directory; returns their paths."""
    directory = Path(directory)
    result, text = tables(directory)
    paths = {"csv": directory / "summary.csv", "table": directory / "table.txt"}
    fields = list(dict.fromkeys(k for row in result.summary for k in row))
    with paths["csv"].open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(result.summary)
    paths["table"].write_text(text + "\n", encoding="utf-8")
    return paths


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        prog="python -m lens_attrib.evaluation.runs",
        description="Regenerate a run directory's tables (summary.csv, table.txt) from its "
        "committed records.",
    )
    parser.add_argument("run", help=f"run name (a folder of {RUNS}) or the run's folder")
    parser.add_argument("--root", default=str(RUNS), help="where named runs live")
    args = parser.parse_args(argv)
    directory = run_dir(args.run, args.root)
    paths = write_tables(directory)
    text = paths["table"].read_text(encoding="utf-8")
    print(text, end="")  # CLI output
    print(f"written: {paths['csv']}, {paths['table']}")  # CLI output
    return text


if __name__ == "__main__":
    main()


__all__ = ["JOURNAL", "RUNS", "journals", "load_run", "main", "run_dir", "tables", "write_tables"]
