"""Resumable experiment runs: every finished unit of work is journaled and skipped on a rerun.

An experiment's work splits into *units* (e.g. one task × batch of items × mode × method), each
giving a list of records. :class:`Units` keeps them in the journal ``<out>/<name>.records.jsonl``
(:mod:`lens_attrib.evaluation.journal`: one flushed and fsynced line per unit, a torn last line
dropped), so a run that is killed loses at most the unit in flight and rerunning the same command
computes only the missing units (``--resume``; an existing journal is never
overwritten without ``--overwrite``).

The manifest holds what fixes the items and their scores (model, seed, sizes, options); a rerun
with other settings is refused with the differing fields named (``--overwrite`` starts afresh).
The method list is not part of it, so one journal gathers the units of several method lists:
processes one after the other can take disjoint ``--methods`` on the same ``--out``, and a last
run with every method makes the table from the journal alone. A journal has one writer: processes
side by side each keep their own ``--journal`` and are merged afterwards
(:mod:`experiments.merge_journals`). A unit's key
carries a fingerprint of its items, so units of other items are never taken for it, and its line
records the code version (package version and git commit) that computed it and the CPU and wall
seconds it took (``info.cpu_s``, ``info.wall_s``: this process's CPU time, all its threads) and the
device that computed it (``info.device``), from which a run's cost per item and its time to
finish are read (:func:`unit_costs`).

``--so-far`` makes a run's tables while it still goes on (or after it stopped), from its
journal alone: the same command plus ``--so-far`` reads the journal without writing to it,
computes no unit, and leaves out every batch that some method has not finished (the experiment
checks each batch with :meth:`Units.finished` and skips it), so that all methods are compared on
the same items; the tables say how many items they cover.

``--journal PATH`` keeps the journal elsewhere, e.g. compressed in a run directory of the
repository (``docs/results/runs/<name>/records.jsonl.gz`` with ``manifest.json``,
:mod:`lens_attrib.evaluation.runs`), so that the run resumes from a fresh checkout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lens_attrib.evaluation.journal import Journal
from lens_attrib.evaluation.provenance import code_version

Records = list[dict[str, Any]]


class UnitNotJournaled(LookupError):
    """A ``--so-far`` run needed a unit that its journal does not hold yet."""


def fingerprint(values: Sequence[Any]) -> str:
    """First 12 hex digits of the SHA-256 of ``values`` as JSON (a task's prompts, targets…)."""
    text = json.dumps(list(values), ensure_ascii=False, default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


class Units:
    """Journaled units of one run (or, without ``out``, plain computation kept in memory)."""

    def __init__(
        self,
        out: str | Path | None,
        name: str,
        manifest: Mapping[str, Any],
        *,
        resume: bool = False,
        overwrite: bool = False,
        journal: str | Path | None = None,
        device: str = "cpu",
        so_far: bool = False,
    ) -> None:
        """``journal``: the journal's path (``.jsonl`` or compressed ``.jsonl.gz``) instead of
        ``<out>/<name>.records.jsonl``; either one makes the run journaled. ``device``: where
        the units are computed (:func:`experiments.common.device_label`), journaled with each
        unit's cost, since CPU seconds measure the work only of units computed on the CPU.
        ``so_far``: read the journal without writing to it and compute nothing (:meth:`get`
        raises :class:`UnitNotJournaled` for a unit it lacks; see the module docstring)."""
        self.journal: Journal | None = None
        self.device = device
        self.so_far = so_far
        self.computed = 0
        self.reused = 0
        if journal is None and out is None:
            if so_far:
                raise ValueError("--so-far reads a run's journal: pass its --out or --journal")
            return
        path = Path(str(out)) / f"{name}.records.jsonl" if journal is None else Path(journal)
        if so_far:
            self.journal = Journal.read(path, {"experiment": name, **manifest})
        else:
            if path.exists() and not (resume or overwrite):
                raise FileExistsError(
                    f"{path} holds the records of an earlier run. Pass --resume (resume=True) "
                    "to continue it, reusing its finished units, or --overwrite "
                    "(overwrite=True) to discard them and start again."
                )
            self.journal = Journal.open(path, {"experiment": name, **manifest}, overwrite=overwrite)
            self.version = code_version()

    @property
    def path(self) -> Path | None:
        return None if self.journal is None else self.journal.path

    def stored(self, key: str, items: Sequence[int]) -> Records | None:
        """The records of unit ``key`` over ``items`` if the journal holds them."""
        if self.journal is None:
            return None
        wanted = [int(i) for i in items]
        for line in self.journal.batches:
            if line["method"] == key and line["items"] == wanted:
                return list(line["records"])
        return None

    def finished(self, keys: Iterable[str], items: Sequence[int]) -> bool:
        """Whether the journal holds every unit of ``keys`` over ``items``."""
        return all(self.stored(key, items) is not None for key in keys)

    def get(
        self,
        key: str,
        items: Sequence[int],
        compute: Callable[[], Records],
        spent_before: Mapping[str, float] | None = None,
    ) -> Records:
        """The unit's records: from the journal, or ``compute()`` them and journal them.
        ``spent_before``: ``cpu_s``/``wall_s`` the unit already cost outside ``compute`` (e.g.
        the attributions a criterion scores), added to its journaled cost."""
        found = self.stored(key, items)
        if found is not None:
            self.reused += 1
            return found
        if self.so_far:
            raise UnitNotJournaled(
                f"--so-far: {self.path} does not hold unit {key} over its {len(items)} "
                "items yet, and the tables need it before any "
                "batch (e.g. a depth tuning): resume the run until it has passed that unit."
            )
        cpu, wall = time.process_time(), time.perf_counter()
        records = compute()
        before = spent_before or {}
        cost = {
            "cpu_s": time.process_time() - cpu + before.get("cpu_s", 0.0),
            "wall_s": time.perf_counter() - wall + before.get("wall_s", 0.0),
        }
        self.computed += 1
        if self.journal is not None:
            info = {
                "code": self.version,
                **{k: round(v, 3) for k, v in cost.items()},
                "device": self.device,
            }
            self.journal.append(key, items, records, batch_size=len(items), bucket=0, info=info)
        return records


def journal_file(path: str | Path) -> Path:
    """A journal file, or the ``records.jsonl.gz`` / ``records.jsonl`` in a run's folder."""
    path = Path(path)
    if path.is_dir():
        for name in ("records.jsonl.gz", "records.jsonl"):
            if (path / name).exists():
                return path / name
        raise FileNotFoundError(f"{path} holds no records.jsonl.gz or records.jsonl")
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such journal; pass a run's folder (docs/results/runs/<name>) or its "
            "records.jsonl.gz"
        )
    return path


def unit_costs(path: str | Path) -> list[dict[str, Any]]:
    """Per journaled unit of ``path``: its key, number of items, CPU / wall seconds and the
    device it was computed on (units journaled before costs were recorded are left out; units
    journaled before devices were recorded were computed on the CPU)."""
    from lens_attrib.evaluation.journal import read_lines

    rows = []
    for line in read_lines(Path(path))[1:]:
        info = line.get("info") or {}
        if line.get("kind") == "batch" and "cpu_s" in info:
            rows.append(
                {
                    "key": line["method"],
                    "n_items": len(line["items"]),
                    "cpu_s": float(info["cpu_s"]),
                    "wall_s": float(info["wall_s"]),
                    "device": str(info.get("device", "cpu")),
                }
            )
    return rows


def add_resume_arguments(parser: argparse.ArgumentParser, name: str, unit: str) -> None:
    """``--resume`` and ``--overwrite`` for an experiment journaled in
    ``<out>/<name>.records.jsonl`` whose units are ``unit`` (e.g. "task × batch × method")."""
    parser.add_argument(
        "--resume",
        action="store_true",
        help=f"continue the run journaled in --out ({name}.records.jsonl): finished units "
        f"({unit}) are reused, the rest computed",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="discard a journal already in --out"
    )
    parser.add_argument(
        "--so-far",
        action="store_true",
        help="make the tables from the run's journal as it stands (the run may still be going): "
        "nothing is computed or written to the journal, and batches that some method has not "
        "finished are left out, so every method is scored on the same items",
    )
    parser.add_argument(
        "--journal",
        default=None,
        help=f"journal here instead of <out>/{name}.records.jsonl (.jsonl.gz: compressed, "
        "e.g. docs/results/runs/<run>/records.jsonl.gz, resumable from a fresh checkout)",
    )


__all__ = [
    "Records",
    "UnitNotJournaled",
    "Units",
    "add_resume_arguments",
    "fingerprint",
    "journal_file",
    "unit_costs",
]
