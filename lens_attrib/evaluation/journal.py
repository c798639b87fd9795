"""Resumable, lossless evaluation records: an append-only JSONL journal with a run manifest.

Line 1 is the *manifest* (``{"kind": "manifest", ...}``: model, methods, metrics, options, data
hash, shard, code version); every further line is one finished batch (``{"kind": "batch",
"method", "items", "batch_size", "bucket", "records"}``), written with one ``write`` and made
durable (``flush`` + ``fsync``) before the next batch starts. A run killed at any moment therefore
loses at most the batch in flight: its line is either absent or *torn* (no final newline, or not
valid JSON), and a torn last line is dropped (and cut from the file) when the journal is opened
again. A bad line anywhere else is corruption that this writer cannot produce, and is an error.

Opening an existing journal with a different manifest is an error that names the differing
fields: records of two different runs are never mixed (use a new output path or ``overwrite``).
Floats are written losslessly (``repr`` round trip; NaN as ``NaN``).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = 1
"""Version of the journal layout (part of the manifest)."""


class ManifestMismatch(ValueError):
    """An existing journal belongs to a different run."""


class JournalCorrupt(ValueError):
    """A journal line other than the last one is not a valid record line."""


def normalized(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest`` as it reads back from JSON (tuples become lists, odd values their repr)."""
    result: dict[str, Any] = json.loads(json.dumps(dict(manifest), default=repr, sort_keys=True))
    return result


def differences(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``"field: old -> new"`` for every (nested) field that differs between two manifests."""
    out: list[str] = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


@dataclass
class Journal:
    """An open journal: the finished batches read back, and an append handle for new ones."""

    path: Path
    manifest: dict[str, Any]
    batches: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def open(
        cls, path: str | Path, manifest: Mapping[str, Any], *, overwrite: bool = False
    ) -> Journal:
        """Open ``path`` for ``manifest``: resume it if it holds the same run, else start it.

        Raises :class:`ManifestMismatch` if ``path`` holds another run (unless ``overwrite``).
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        wanted = {"kind": "manifest", "format": FORMAT, **normalized(manifest)}
        lines = [] if overwrite or not path.exists() else read_lines(path, repair=True)
        if lines and lines[0].get("kind") == "manifest":
            changed = differences(lines[0], wanted)
            if changed:
                raise ManifestMismatch(
                    f"{path} holds the records of a different run ({'; '.join(changed)}). "
                    "Resuming would mix the two: write to a new output path, or pass "
                    "--overwrite (overwrite=True) to discard the old records and start again."
                )
            return cls(path, wanted, [ln for ln in lines[1:] if ln.get("kind") == "batch"])
        if lines:
            raise JournalCorrupt(f"{path} does not start with a manifest line: not a journal.")
        journal = cls(path, wanted)
        _write(path, [wanted], mode="w")
        return journal

    def finished(self, method: str) -> set[int]:
        """Items whose records for ``method`` are on disk."""
        return {i for b in self.batches if b["method"] == method for i in b["items"]}

    def records(self) -> list[dict[str, Any]]:
        return [r for b in self.batches for r in b["records"]]

    def append(
        self,
        method: str,
        items: Sequence[int],
        records: Sequence[dict[str, Any]],
        *,
        batch_size: int,
        bucket: int,
        info: Mapping[str, Any] | None = None,
    ) -> None:
        """Write one finished batch durably (one line, flushed and fsynced); ``info``: extra
        facts about it (e.g. the code version that computed it), kept under ``"info"``."""
        line = {
            "kind": "batch",
            "method": method,
            "items": [int(i) for i in items],
            "batch_size": int(batch_size),
            "bucket": int(bucket),
            "records": list(records),
        }
        if info:
            line["info"] = normalized(info)
        _write(self.path, [line], mode="a")
        self.batches.append(json.loads(json.dumps(line)))


def _write(path: Path, lines: Sequence[Mapping[str, Any]], mode: str) -> None:
    text = "".join(json.dumps(line) + "\n" for line in lines)
    with path.open(mode, encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def read_lines(path: str | Path, *, repair: bool = False) -> list[dict[str, Any]]:
    """The journal's valid lines; a torn last line is dropped (``repair``: and cut from the file).

    Raises :class:`JournalCorrupt` for an invalid line that is not the last one.
    """
    path = Path(path)
    data = path.read_bytes()
    chunks = data.split(b"\n")
    # a complete file ends with b"\n", so its last chunk is empty
    torn_tail = chunks.pop()
    lines: list[dict[str, Any]] = []
    good_bytes = 0
    for number, chunk in enumerate(chunks, start=1):
        try:
            parsed = json.loads(chunk)
            if not isinstance(parsed, dict):
                raise ValueError("not an object")
        except ValueError as err:
            if number == len(chunks) and not torn_tail:
                torn_tail = chunk  # an unparsable last line: torn as well
                break
            raise JournalCorrupt(
                f"{path}, line {number}, is not a valid record line ({err}); only the last "
                "line can be torn by a killed run. Move the file aside and rerun."
            ) from None
        lines.append(parsed)
        good_bytes += len(chunk) + 1
    if torn_tail:
        warnings.warn(
            f"{path}: dropped a torn last line ({len(torn_tail)} bytes, the batch in flight "
            "when the run stopped); it will be recomputed.",
            RuntimeWarning,
            stacklevel=3,
        )
        if repair:
            with path.open("r+b") as fh:
                fh.truncate(good_bytes)
                fh.flush()
                os.fsync(fh.fileno())
    return lines


def load_journal_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a journal's finished batches (for :func:`records.merge_records`)."""
    return [r for ln in read_lines(path) if ln.get("kind") == "batch" for r in ln["records"]]


__all__ = [
    "FORMAT",
    "Journal",
    "JournalCorrupt",
    "ManifestMismatch",
    "differences",
    "load_journal_records",
    "normalized",
    "read_lines",
]
