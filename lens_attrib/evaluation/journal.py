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
The code version (``code_version``) is not compared: a run resumes under newer code (e.g. on a
fresh checkout after the run's own commits), and each batch written by code other than the
manifest's records that code under ``info.code``. Floats are written losslessly (``repr`` round
trip; NaN as ``NaN``).

*Compressed journals*: a path ending in ``.gz`` (e.g. ``records.jsonl.gz``) holds the same lines,
each written as its own gzip member appended to the file; concatenated members are one valid
multi-member gzip stream (``gzip.open``/``zcat`` read it whole). A killed run leaves at most an
incomplete last member, which is dropped (and cut) like a torn line. Beside a compressed journal
a readable copy of its manifest is kept (:func:`manifest_path`: ``manifest.json`` for
``records.jsonl.gz``), for people and diffs; the journal's first line stays the reference.

*Segments*: a journal is kept in files of at most :data:`SEGMENT_BYTES` each, so that a long
run's journal stays a set of small files that any git host or code index takes whole. An append
that would take the last file past the limit starts the next one: ``records.jsonl.gz`` is
continued by ``segment-2.records.jsonl.gz``, ``segment-3.records.jsonl.gz``, … beside it
(:func:`segment_paths`); the journal's lines are those of its files in that order. Only the last
file's last line can be torn. A single line larger than the limit gets a file of its own.
:func:`copy_journal` and :func:`remove_journal` act on every file of a journal;
:func:`compact_journal` rewrites a finished one as few, fully compressed, files.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import warnings
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = 1
"""Version of the journal layout (part of the manifest)."""

SEGMENT_BYTES = 3 * 2**20
"""Size limit of one journal file (module docstring, *Segments*): 3 MiB, under the 4 MiB above
which public code indexes leave a file out."""

UNCOMPARED = ("code_version",)
"""Manifest fields a resumed run may change (the code version; each batch records its own)."""


class ManifestMismatch(ValueError):
    """An existing journal belongs to a different run."""


class JournalCorrupt(ValueError):
    """A journal line other than the last one is not a valid record line."""


def normalized(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest`` as it reads back from JSON (tuples become lists, odd values their repr)."""
    result: dict[str, Any] = json.loads(json.dumps(dict(manifest), default=repr, sort_keys=True))
    return result


def is_compressed(path: str | Path) -> bool:
    """Whether the journal at ``path`` is gzip-compressed (its name ends in ``.gz``)."""
    return Path(path).suffix == ".gz"


def manifest_path(path: str | Path) -> Path:
    """The readable manifest copy beside the journal ``path``: ``manifest.json`` for a journal
    named ``records.jsonl[.gz]``, else ``<name without .jsonl[.gz]>.manifest.json``."""
    path = Path(path)
    stem = path.name.removesuffix(".gz").removesuffix(".jsonl")
    return path.with_name("manifest.json" if stem == "records" else f"{stem}.manifest.json")


SEGMENT_PREFIX = "segment-"


def segment_path(path: str | Path, k: int) -> Path:
    """File ``k`` (1-based) of the journal ``path``: ``path`` itself for ``k = 1``, else
    ``segment-<k>.<name>`` beside it."""
    path = Path(path)
    return path if k == 1 else path.with_name(f"{SEGMENT_PREFIX}{k}.{path.name}")


def segment_paths(path: str | Path) -> list[Path]:
    """The journal's files in order: ``path``, then its segments 2, 3, … that exist.

    Raises :class:`JournalCorrupt` for a segment after a missing one (a file lost or renamed).
    """
    path = Path(path)
    found = [path]
    while (nxt := segment_path(path, len(found) + 1)).exists():
        found.append(nxt)
    stray = sorted(p.name for p in _existing_segments(path) if p not in found)
    if stray:
        raise JournalCorrupt(
            f"{path}: segment file(s) {', '.join(stray)} follow a missing one (the journal's "
            f"files are {path.name}, {segment_path(path, 2).name}, … without gaps). Put the "
            "missing file back, or move the journal's files aside and rerun."
        )
    return found


def _existing_segments(path: Path) -> list[Path]:
    """Every ``segment-<k>.<name>`` file beside ``path`` (k ≥ 2), gaps or not."""
    pattern = re.compile(rf"{re.escape(SEGMENT_PREFIX)}\d+\.{re.escape(path.name)}")
    beside = path.parent.glob(f"{SEGMENT_PREFIX}*.{path.name}")
    return [p for p in beside if pattern.fullmatch(p.name)]


def remove_journal(path: str | Path) -> None:
    """Delete the journal ``path`` and its segments (its manifest copy is left)."""
    path = Path(path)
    for file in [path, *_existing_segments(path)]:
        file.unlink(missing_ok=True)


def copy_journal(source: str | Path, target: str | Path) -> None:
    """Copy every file of the journal ``source`` to the journal ``target`` (whose earlier
    files, if any, are removed first)."""
    files = segment_paths(source)
    remove_journal(target)
    for k, file in enumerate(files, start=1):
        shutil.copyfile(file, segment_path(target, k))


def differences(
    old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "", *, skip: Sequence[str] = ()
) -> list[str]:
    """``"field: old -> new"`` for every (nested) field that differs between two manifests
    (top-level fields in ``skip`` ignored)."""
    out: list[str] = []
    for key in sorted((set(old) | set(new)) - set(skip)):
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
    code: dict[str, Any] | None = None
    """The code version of this process when it differs from the manifest's (resumed run)."""
    read_only: bool = False
    """Opened by :meth:`read`: batches cannot be appended."""

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
        orphans = [] if overwrite or path.exists() else _existing_segments(path)
        if orphans:
            names = ", ".join(sorted(p.name for p in orphans))
            raise JournalCorrupt(
                f"{path} is missing but its segment file(s) {names} "
                "are there: put the first file back, or pass --overwrite (overwrite=True) to "
                "start the run again and delete them."
            )
        lines = [] if overwrite or not path.exists() else read_lines(path, repair=True)
        if lines:
            journal = cls._of(path, lines, wanted)
        else:
            journal = cls(path, wanted)
            _write(path, [wanted], mode="w")
        if is_compressed(path):
            copy = manifest_path(path)
            text = json.dumps(journal.manifest, indent=1, sort_keys=True) + "\n"
            if not copy.exists() or copy.read_text(encoding="utf-8") != text:
                copy.write_text(text, encoding="utf-8")
        return journal

    @classmethod
    def read(cls, path: str | Path, manifest: Mapping[str, Any]) -> Journal:
        """Read the journal at ``path`` without writing to it, e.g. while its run still appends
        to it: its manifest must be ``manifest`` (else :class:`ManifestMismatch`), and a torn
        last line (the batch being written) is left out and left in the file. The journal is
        read-only (:meth:`append` refuses)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such journal (the run has not started here?)")
        wanted = {"kind": "manifest", "format": FORMAT, **normalized(manifest)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a torn tail is the unit in flight
            lines = read_lines(path)
        if not lines:
            raise JournalCorrupt(f"{path} is empty: not a journal.")
        fix = "run the run's own command (its settings) with --so-far in place of --resume."
        journal = cls._of(path, lines, wanted, fix)
        journal.read_only = True
        return journal

    @classmethod
    def _of(
        cls,
        path: Path,
        lines: list[dict[str, Any]],
        wanted: dict[str, Any],
        fix: str = "Resuming would mix the two: write to a new output path, or pass --overwrite "
        "(overwrite=True) to discard the old records and start again.",
    ) -> Journal:
        """The journal of ``lines`` read from ``path``, checked against the manifest
        ``wanted``; ``fix``: what a mismatch's error tells the user to do."""
        if lines[0].get("kind") != "manifest":
            raise JournalCorrupt(f"{path} does not start with a manifest line: not a journal.")
        changed = differences(lines[0], wanted, skip=UNCOMPARED)
        if changed:
            raise ManifestMismatch(
                f"{path} holds the records of a different run ({'; '.join(changed)}). {fix}"
            )
        old, new = lines[0].get("code_version"), wanted.get("code_version")
        batches = [ln for ln in lines[1:] if ln.get("kind") == "batch"]
        return cls(path, lines[0], batches, code=new if new != old else None)

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
        if self.read_only:
            raise PermissionError(f"{self.path} was opened read-only (Journal.read)")
        line = {
            "kind": "batch",
            "method": method,
            "items": [int(i) for i in items],
            "batch_size": int(batch_size),
            "bucket": int(bucket),
            "records": list(records),
        }
        if self.code is not None and not (info and "code" in info):
            info = {**(info or {}), "code": self.code}
        if info:
            line["info"] = normalized(info)
        _write(self.path, [line], mode="a")
        self.batches.append(json.loads(json.dumps(line)))


def _write(path: Path, lines: Sequence[Mapping[str, Any]], mode: str) -> None:
    """Write ``lines`` with one ``write``, flushed and fsynced (a compressed journal: as one
    gzip member, appended to the stream). ``mode="w"`` starts the journal afresh (its segments
    removed); ``"a"`` appends to its last file, or starts the next segment when that file would
    pass :data:`SEGMENT_BYTES`."""
    data = "".join(json.dumps(line) + "\n" for line in lines).encode("utf-8")
    if is_compressed(path):
        data = gzip.compress(data, mtime=0)
    if mode == "w":
        remove_journal(path)
    else:
        files = segment_paths(path)
        path = files[-1]
        size = path.stat().st_size if path.exists() else 0
        if size and size + len(data) > SEGMENT_BYTES:
            path = segment_path(files[0], len(files) + 1)
    with path.open(mode + "b") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _plain_units(data: bytes) -> tuple[list[tuple[bytes, int]], bytes]:
    """A plain journal's lines with the byte offset after each; the unterminated tail."""
    chunks = data.split(b"\n")
    tail = chunks.pop()  # a complete file ends with b"\n", so its last chunk is empty
    units, end = [], 0
    for chunk in chunks:
        end += len(chunk) + 1
        units.append((chunk, end))
    return units, tail


_MEMBER_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00"
"""How every member this writer makes begins (gzip magic, deflate, no flags, mtime 0)."""


def _gzip_units(path: Path, data: bytes) -> tuple[list[tuple[bytes, int]], bytes]:
    """A compressed journal's members (their text, the byte offset after each); the bytes of
    an incomplete last member. A member that fails to decompress is corruption."""
    units: list[tuple[bytes, int]] = []
    offset = 0
    while offset < len(data):
        member = zlib.decompressobj(wbits=31)
        try:
            text = member.decompress(data[offset:])
        except zlib.error as err:
            raise JournalCorrupt(
                f"{path}, gzip member {len(units) + 1} (byte {offset}), does not decompress "
                f"({err}); a killed run can only cut the last member short. Move the file "
                "aside and rerun."
            ) from None
        if not member.eof:
            if data.find(_MEMBER_HEADER, offset + 1) >= 0:  # later members follow: not torn
                raise JournalCorrupt(
                    f"{path}, gzip member {len(units) + 1} (byte {offset}), is cut short but "
                    "more members follow it; only the last member can be torn by a killed "
                    "run. Move the file aside and rerun."
                )
            return units, data[offset:]
        offset = len(data) - len(member.unused_data)
        units.append((text, offset))
    return units, b""


def read_lines(path: str | Path, *, repair: bool = False) -> list[dict[str, Any]]:
    """The journal's valid lines, from all its files (module docstring, *Segments*); a torn
    last line (compressed: an incomplete or unreadable last member) is dropped (``repair``: and
    cut from the file).

    Raises :class:`JournalCorrupt` for an invalid line that is not the journal's last one.
    """
    files = segment_paths(path)
    lines: list[dict[str, Any]] = []
    for k, file in enumerate(files, start=1):
        lines += _read_file(file, last=k == len(files), repair=repair)
    return lines


def _read_file(path: Path, *, last: bool, repair: bool) -> list[dict[str, Any]]:
    """The valid lines of one file of a journal; only the ``last`` file may end torn."""
    data = path.read_bytes()
    compressed = is_compressed(path)
    units, torn_tail = _gzip_units(path, data) if compressed else _plain_units(data)
    what = "member" if compressed else "line"
    later = "" if last else " (a later segment of the journal follows this file)"
    if torn_tail and not last:
        raise JournalCorrupt(
            f"{path} ends in an incomplete {what}{later}; only the journal's last {what} can "
            "be torn by a killed run. Move the journal's files aside and rerun."
        )
    lines: list[dict[str, Any]] = []
    good_bytes = 0
    for number, (unit, end) in enumerate(units, start=1):
        try:
            parsed = [json.loads(text) for text in unit.splitlines()]
            if not parsed or not all(isinstance(p, dict) for p in parsed):
                raise ValueError("not an object")
            if compressed and not unit.endswith(b"\n"):
                raise ValueError("no final newline")
        except ValueError as err:
            if last and number == len(units) and not torn_tail:
                torn_tail = unit  # an unparsable last line: torn as well
                break
            raise JournalCorrupt(
                f"{path}, {what} {number}, is not a valid record line ({err}){later}; only "
                f"the last {what} can be torn by a killed run. Move the file aside and rerun."
            ) from None
        lines += parsed
        good_bytes = end
    if torn_tail:
        warnings.warn(
            f"{path}: dropped a torn last {what} ({len(torn_tail)} bytes, the batch in flight "
            "when the run stopped); it will be recomputed.",
            RuntimeWarning,
            stacklevel=4,
        )
        if repair:
            with path.open("r+b") as fh:
                fh.truncate(good_bytes)
                fh.flush()
                os.fsync(fh.fileno())
    return lines


@dataclass(frozen=True)
class MergeReport:
    """What :func:`merge_journals` did: batch lines appended, and lines already present."""

    added: int
    duplicates: int


def _canonical(records: Any) -> str:
    """Records as comparable text (NaN equals NaN, key order ignored)."""
    return json.dumps(records, sort_keys=True)


def merge_journals(into: str | Path, sources: Sequence[str | Path]) -> MergeReport:
    """Append to journal ``into`` the batch lines of ``sources`` that it does not hold yet.

    For a run split over processes that each kept their own journal of the same run (e.g. one
    process per task, ``--journal records.qa.jsonl.gz``): afterwards ``into`` resumes as if one
    process had computed everything. Every journal must have ``into``'s manifest (the code
    version aside), else :class:`ManifestMismatch`. A line of a source is identified by its unit
    (``method``) and ``items``; one that ``into`` holds with the same records is skipped, one it
    holds with *other* records raises ``ValueError`` (the two processes disagree: nothing is
    written). Lines are appended in the sources' order, each as its own line or gzip member,
    with their ``info`` (code version, cost) as computed. Run it when no process writes to
    these journals; a torn last line of a source is dropped with a warning, as on resume.
    """
    into = Path(into)
    target = read_lines(into, repair=True)
    if not target or target[0].get("kind") != "manifest":
        raise JournalCorrupt(f"{into} does not start with a manifest line: not a journal.")
    held = {
        (line["method"], tuple(line["items"])): _canonical(line["records"])
        for line in target[1:]
        if line.get("kind") == "batch"
    }
    new: list[dict[str, Any]] = []
    duplicates = 0
    for source in sources:
        lines = read_lines(source)
        if not lines or lines[0].get("kind") != "manifest":
            raise JournalCorrupt(f"{source} does not start with a manifest line: not a journal.")
        changed = differences(target[0], lines[0], skip=UNCOMPARED)
        if changed:
            raise ManifestMismatch(
                f"{source} holds the records of a different run than {into} "
                f"({'; '.join(changed)}): merging would mix the two."
            )
        for line in lines[1:]:
            if line.get("kind") != "batch":
                continue
            key = (line["method"], tuple(line["items"]))
            if key not in held:
                held[key] = _canonical(line["records"])
                new.append(line)
            elif held[key] == _canonical(line["records"]):
                duplicates += 1
            else:
                raise ValueError(
                    f"{source}: unit {line['method']!r} over items {line['items']} has other "
                    f"records than in {into}; the two runs disagree, so nothing was merged. "
                    "Compare the two lines (their info.code says which code computed each)."
                )
    for line in new:
        _write(into, [line], mode="a")
    return MergeReport(added=len(new), duplicates=duplicates)


def compact_journal(path: str | Path) -> int:
    """Rewrite a finished compressed journal with one gzip member per file (a member per line
    compresses ≈ 1.4× worse), in as few files of at most :data:`SEGMENT_BYTES` as it takes; it
    reads back line for line the same, and later appends add members as before. Returns the new
    size in bytes, all files together. Run it when no process writes to it."""
    path = Path(path)
    if not is_compressed(path):
        raise ValueError(f"{path} is not a compressed journal (.gz): nothing to compact.")
    texts = [(json.dumps(line) + "\n").encode("utf-8") for line in read_lines(path, repair=True)]
    blobs = _compressed_groups(texts)
    files = [segment_path(path, k) for k in range(1, len(blobs) + 1)]
    temporary = [file.with_name(file.name + ".tmp") for file in files]
    for tmp, blob in zip(temporary, blobs):
        tmp.write_bytes(blob)
    for tmp, file in zip(temporary, files):  # every new file in place before any old one goes
        os.replace(tmp, file)
    for file in _existing_segments(path):
        if file not in files:
            file.unlink()
    return sum(len(blob) for blob in blobs)


def _compressed_groups(texts: Sequence[bytes]) -> list[bytes]:
    """``texts`` (lines) in order, as the fewest gzip members of at most :data:`SEGMENT_BYTES`
    found by filling each file up to a raw-size budget (shrunk until every file fits; a line
    that alone compresses past the limit is a file of its own)."""
    whole = gzip.compress(b"".join(texts), compresslevel=9, mtime=0)
    if len(whole) <= SEGMENT_BYTES:
        return [whole]
    budget = 0.95 * sum(map(len, texts)) * SEGMENT_BYTES / len(whole)
    while True:
        groups: list[list[bytes]] = [[]]
        size = 0
        for text in texts:
            if groups[-1] and size + len(text) > budget:
                groups.append([])
                size = 0
            groups[-1].append(text)
            size += len(text)
        blobs = [gzip.compress(b"".join(g), compresslevel=9, mtime=0) for g in groups]
        if all(len(b) <= SEGMENT_BYTES or len(g) == 1 for b, g in zip(blobs, groups)):
            return blobs
        budget *= 0.9


def load_journal_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a journal's finished batches (for :func:`records.merge_records`)."""
    return [r for ln in read_lines(path) if ln.get("kind") == "batch" for r in ln["records"]]


__all__ = [
    "FORMAT",
    "SEGMENT_BYTES",
    "Journal",
    "JournalCorrupt",
    "ManifestMismatch",
    "MergeReport",
    "compact_journal",
    "copy_journal",
    "differences",
    "is_compressed",
    "load_journal_records",
    "manifest_path",
    "merge_journals",
    "normalized",
    "read_lines",
    "remove_journal",
    "segment_path",
    "segment_paths",
]
