"""What a journaled run has cost so far and what it will cost at full size, from its journal.

    python -m experiments.run_costs docs/results/runs/agreement-smollm2/records.jsonl.gz --n 100

Every unit an experiment journals records the CPU and wall seconds it took
(:func:`experiments.resume.unit_costs`). This prints, per task / dataset × method, the units,
items, CPU seconds and CPU seconds per item (the modes of an agreement task summed: per explained
item), the one-off costs (the Grad-ELLM depth tuning, qa's screening of the questions the model
answers), and with ``--n`` the expected CPU hours of the whole run at ``n`` items per task /
dataset: ``Σ_where (CPU-s per item × n) + one-off costs``. One process uses one
core (``--threads 1``), so CPU hours are wall hours of a run that has a core to itself.

Units computed on an accelerator (``info.device`` other than ``cpu``) are left out of the CPU
figures, whose per-item costs they would understate, and counted on a line of their own per
device (units, items, wall seconds).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.common import format_table
from experiments.resume import journal_file, unit_costs

TUNING = "grad_ellm_depth"
SCREENING = "screening"
ONE_OFF = (TUNING, SCREENING)
"""Units whose cost does not grow with the number of explained items."""


def split_key(key: str) -> tuple[str, str]:
    """(task / dataset, method) of a unit key ``<where>:<ids>|<method>[|<mode>]``."""
    head, _, rest = key.partition("|")
    return head.split(":")[0], rest.split("|")[0]


def cost_table(path: str | Path) -> list[dict[str, Any]]:
    """Rows per (where, method): units, items (explained items: an agreement item's modes
    count once), CPU and wall seconds, and ``cpu_s_per_item`` (the depth tuning: per tuning
    item, all candidates)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for unit in unit_costs(path):
        if unit["device"] != "cpu":
            continue
        where, method = split_key(unit["key"])
        method = TUNING if method.startswith(TUNING) else method
        row = rows.setdefault(
            (where, method),
            {"where": where, "method": method, "units": 0, "unit_items": 0, "modes": set(),
             "cpu_s": 0.0, "wall_s": 0.0},
        )  # fmt: skip
        parts = unit["key"].split("|")
        row["modes"].add(parts[2] if len(parts) > 2 else "")
        row["units"] += 1
        row["unit_items"] += unit["n_items"]
        row["cpu_s"] += unit["cpu_s"]
        row["wall_s"] += unit["wall_s"]
    out = []
    for row in rows.values():
        if row["method"] in ONE_OFF:  # tuning: one unit per candidate over every tuning item
            row["items"] = row["unit_items"] / row["units"]
        else:
            row["items"] = row["unit_items"] / len(row.pop("modes"))
        row.pop("modes", None)
        row["cpu_s_per_item"] = row["cpu_s"] / row["items"] if row["items"] else float("nan")
        out.append(row)
    return out


def accelerator_units(path: str | Path) -> dict[str, dict[str, float]]:
    """Per accelerator a run's units were computed on: units, unit items and wall seconds."""
    found: dict[str, dict[str, float]] = {}
    for unit in unit_costs(path):
        if unit["device"] == "cpu":
            continue
        row = found.setdefault(unit["device"], {"units": 0, "unit_items": 0, "wall_s": 0.0})
        row["units"] += 1
        row["unit_items"] += unit["n_items"]
        row["wall_s"] += unit["wall_s"]
    return found


def expected_cpu_s(rows: Sequence[dict[str, Any]], n: int) -> float:
    """CPU seconds of a run at ``n`` items per task / dataset: every method's CPU-s per item
    times ``n``, plus the one-off costs as measured (their size does not grow with ``n``)."""
    return sum(r["cpu_s"] if r["method"] in ONE_OFF else r["cpu_s_per_item"] * n for r in rows)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m experiments.run_costs", description=__doc__)
    parser.add_argument(
        "journal", help="a run's journal (records.jsonl.gz or .jsonl), or the run's folder"
    )
    parser.add_argument("--n", type=int, default=None, help="items per task / dataset at full size")
    args = parser.parse_args(argv)
    try:
        journal = journal_file(args.journal)
    except FileNotFoundError as err:
        parser.error(str(err))
    rows = cost_table(journal)
    cells = [
        [r["where"], r["method"], r["units"], round(r["items"], 1), round(r["cpu_s"], 1),
         round(r["cpu_s_per_item"], 2)]
        for r in rows
    ]  # fmt: skip
    table = format_table(
        cells,
        ["where", "method", "units", "items", "CPU-s", "CPU-s/item"],
        fmt=str,
    )
    lines = [table]
    for where in sorted({r["where"] for r in rows}):
        mine = [r for r in rows if r["where"] == where]
        per_item = sum(r["cpu_s_per_item"] for r in mine if r["method"] not in ONE_OFF)
        tuning = sum(r["cpu_s"] for r in mine if r["method"] == TUNING)
        screening = sum(r["cpu_s"] for r in mine if r["method"] == SCREENING)
        lines.append(
            f"{where}: {per_item:.1f} CPU-s per item (all methods), tuning {tuning:.0f} s"
            + (f", screening {screening:.0f} s" if screening else "")
        )
    for device, row in accelerator_units(journal).items():
        lines.append(
            f"on {device} (not in the CPU figures): {row['units']:.0f} units, "
            f"{row['unit_items']:.0f} unit items, {row['wall_s']:.0f} wall-s"
        )
    if args.n is not None:
        total = expected_cpu_s(rows, args.n)
        lines.append(f"expected at n={args.n}: {total:.0f} CPU-s = {total / 3600:.1f} CPU-h")
    text = "\n".join(lines)
    print(text)  # CLI output
    return text


if __name__ == "__main__":
    main()
