"""A journal kept in files of bounded size (``journal.SEGMENT_BYTES``).

Oracles: a journal written with a small segment limit reads back line for line what the same
appends give in one file; every file keeps to the limit; only the last file may end torn; a
missing middle file is an error; merging, copying, compacting and a killed-and-resumed run give
what they give on a one-file journal.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import warnings
from typing import Any

import pytest

from experiments.split_run import merge_into, split_journal
from lens_attrib.evaluation import journal as journal_module
from lens_attrib.evaluation import runner
from lens_attrib.evaluation.items import load_task
from lens_attrib.evaluation.journal import (
    Journal,
    JournalCorrupt,
    compact_journal,
    copy_journal,
    merge_journals,
    read_lines,
    remove_journal,
    segment_path,
    segment_paths,
)
from lens_attrib.evaluation.runner import evaluate
from lens_attrib.tiny_models import tiny_llama

LIMIT = 600
"""Bytes per file in these tests: a few batches each."""


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(journal_module, "SEGMENT_BYTES", LIMIT)
    return LIMIT


def _append_batches(journal: Journal, start: int, count: int) -> None:
    for k in range(start, start + count):
        noise = hashlib.sha256(str(k).encode()).hexdigest()  # compresses poorly, as real floats do
        records = [{"item": k, "value": k / 7, "nan": float("nan"), "noise": noise}]
        journal.append("m", [k], records, batch_size=1, bucket=0)


def _dumped(lines: list[dict[str, Any]]) -> list[str]:
    return [json.dumps(line, sort_keys=True) for line in lines]


@pytest.mark.parametrize("name", ["records.jsonl.gz", "records.jsonl"])
def test_segments_read_back_as_one_file(tmp_path, monkeypatch, name):
    whole = Journal.open(tmp_path / "one" / name, {"run": 1})
    _append_batches(whole, 0, 30)
    monkeypatch.setattr(journal_module, "SEGMENT_BYTES", LIMIT)
    split = Journal.open(tmp_path / "split" / name, {"run": 1})
    _append_batches(split, 0, 12)
    _append_batches(Journal.open(split.path, {"run": 1}), 12, 18)  # resumed mid-way

    files = segment_paths(split.path)
    assert len(files) > 3 and files[1].name == f"segment-2.{name}"
    assert all(f.stat().st_size <= LIMIT for f in files)
    assert sum(f.stat().st_size for f in files) == whole.path.stat().st_size
    assert _dumped(read_lines(split.path)) == _dumped(read_lines(whole.path))
    assert Journal.open(split.path, {"run": 1}).finished("m") == set(range(30))
    if name.endswith(".gz"):  # the files in order are the one-file journal's gzip stream
        with gzip.open(whole.path, "rb") as fh:
            stream = fh.read()
        assert b"".join(gzip.decompress(f.read_bytes()) for f in files) == stream


def test_only_the_last_file_may_end_torn(tmp_path, small_segments):
    journal = Journal.open(tmp_path / "records.jsonl.gz", {"run": 1})
    _append_batches(journal, 0, 20)
    files = segment_paths(journal.path)
    good = read_lines(journal.path)
    last = files[-1].read_bytes()
    files[-1].write_bytes(last + gzip.compress(b'{"kind": "batch", "x": 1}\n')[:-9])
    with pytest.warns(RuntimeWarning, match="torn last member"):
        again = Journal.open(journal.path, {"run": 1})
    assert files[-1].read_bytes() == last and len(again.batches) == len(good) - 1

    middle = files[1].read_bytes()
    files[1].write_bytes(middle + gzip.compress(b'{"kind": "batch", "x": 1}\n')[:-9])
    with pytest.raises(JournalCorrupt, match="later segment"):
        read_lines(journal.path)
    bad = middle + gzip.compress(b'{"kind": "batch", "ite')
    files[1].write_bytes(bad)
    with pytest.raises(JournalCorrupt, match="later segment"):
        read_lines(journal.path, repair=True)
    assert files[1].read_bytes() == bad  # an error cuts nothing
    files[1].write_bytes(middle)
    assert _dumped(read_lines(journal.path)) == _dumped(good)


def test_a_torn_first_write_of_a_new_file_is_cut_and_written_again(tmp_path, small_segments):
    journal = Journal.open(tmp_path / "records.jsonl.gz", {"run": 1})
    _append_batches(journal, 0, 6)
    files = segment_paths(journal.path)
    nxt = segment_path(journal.path, len(files) + 1)
    nxt.write_bytes(gzip.compress(b'{"kind": "batch", "x": 1}\n')[:-9])
    with pytest.warns(RuntimeWarning, match="torn last member"):
        again = Journal.open(journal.path, {"run": 1})
    assert nxt.read_bytes() == b""
    _append_batches(again, 6, 1)
    assert segment_paths(journal.path) == [*files, nxt] and nxt.stat().st_size > 0
    assert Journal.open(journal.path, {"run": 1}).finished("m") == set(range(7))


def test_a_missing_middle_file_is_an_error_and_overwrite_clears_every_file(
    tmp_path, small_segments
):
    journal = Journal.open(tmp_path / "records.jsonl.gz", {"run": 1})
    _append_batches(journal, 0, 20)
    files = segment_paths(journal.path)
    assert len(files) >= 4
    saved = files[2].read_bytes()
    files[2].unlink()
    with pytest.raises(JournalCorrupt, match=f"{files[3].name}.*follow a missing one"):
        read_lines(journal.path)
    with pytest.raises(JournalCorrupt, match="follow a missing one"):
        journal.append("m", [99], [{"item": 99}], batch_size=1, bucket=0)
    files[2].write_bytes(saved)
    assert Journal.open(journal.path, {"run": 1}).finished("m") == set(range(20))

    journal.path.rename(journal.path.with_name("aside.jsonl.gz"))  # the first file lost
    with pytest.raises(JournalCorrupt, match="is missing but its segment file"):
        Journal.open(journal.path, {"run": 1})
    assert segment_paths(journal.path)[1:] == files[1:]  # nothing deleted
    journal.path.with_name("aside.jsonl.gz").rename(journal.path)

    fresh = Journal.open(journal.path, {"run": 2}, overwrite=True)
    assert segment_paths(fresh.path) == [fresh.path]
    assert [ln["run"] for ln in read_lines(fresh.path)] == [2]


def test_merge_copy_and_remove_act_on_every_file(tmp_path, small_segments):
    into = Journal.open(tmp_path / "a" / "records.jsonl.gz", {"run": 1})
    _append_batches(into, 0, 8)
    other = Journal.open(tmp_path / "b" / "records.jsonl.gz", {"run": 1})
    _append_batches(other, 4, 16)
    report = merge_journals(into.path, [other.path])
    assert (report.added, report.duplicates) == (12, 4)
    assert Journal.open(into.path, {"run": 1}).finished("m") == set(range(20))
    assert all(f.stat().st_size <= LIMIT for f in segment_paths(into.path))

    copy = tmp_path / "c" / "records.jsonl.gz"
    copy.parent.mkdir()
    (copy.parent / "segment-9.records.jsonl.gz").write_bytes(b"stale")
    copy_journal(into.path, copy)
    assert _dumped(read_lines(copy)) == _dumped(read_lines(into.path))
    assert len(segment_paths(copy)) == len(segment_paths(into.path))
    assert not (copy.parent / "segment-9.records.jsonl.gz").exists()
    remove_journal(copy)
    assert list(copy.parent.iterdir()) == []


def test_compacting_writes_full_files_under_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "SEGMENT_BYTES", 1500)
    journal = Journal.open(tmp_path / "records.jsonl.gz", {"run": 1})
    _append_batches(journal, 0, 60)
    before, size = (
        read_lines(journal.path),
        sum(f.stat().st_size for f in segment_paths(journal.path)),
    )
    compacted = compact_journal(journal.path)
    files = segment_paths(journal.path)
    assert compacted < size and compacted == sum(f.stat().st_size for f in files)
    assert 1 < len(files) and all(f.stat().st_size <= 1500 for f in files)
    assert _dumped(read_lines(journal.path)) == _dumped(before)
    assert not list(tmp_path.glob("*.tmp"))
    _append_batches(Journal.open(journal.path, {"run": 1}), 60, 3)
    assert Journal.open(journal.path, {"run": 1}).finished("m") == set(range(63))
    monkeypatch.setattr(journal_module, "SEGMENT_BYTES", 10**6)  # all fits one file again
    compact_journal(journal.path)
    assert segment_paths(journal.path) == [journal.path]
    assert len(read_lines(journal.path)) == 64


def test_split_run_merges_segmented_parts_into_a_new_journal(tmp_path, small_segments):
    journal = tmp_path / "records.jsonl.gz"
    parts = [split_journal(journal, k, 2) for k in (1, 2)]
    for k, part in enumerate(parts):
        _append_batches(Journal.open(part, {"run": 1}), 10 * k, 10)
    assert all(len(segment_paths(p)) > 1 for p in parts)
    assert merge_into(journal, parts) == 20
    assert Journal.open(journal, {"run": 1}).finished("m") == set(range(20))
    assert not [p.name for p in tmp_path.iterdir() if "split-" in p.name]


def test_a_killed_run_resumes_across_files_to_the_uninterrupted_records(
    tmp_path, small_segments, monkeypatch
):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_llama()
    dataset = load_task("sva", 8, 0)
    methods, metrics = ["grad_x_input", "gradient"], ["pointing_game", "mrr"]
    kwargs: dict[str, Any] = {"batch_size": 2, "progress": False}
    monkeypatch.setattr(journal_module, "SEGMENT_BYTES", 10**9)
    full = evaluate(model, dataset, methods, metrics, journal=tmp_path / "w.jsonl.gz", **kwargs)
    monkeypatch.setattr(journal_module, "SEGMENT_BYTES", 2000)

    real, calls = runner.attribute, []

    def dies_midway(*args: Any, **kw: Any) -> Any:
        calls.append(kw["method"])
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(*args, **kw)

    path = tmp_path / "records.jsonl.gz"
    monkeypatch.setattr(runner, "attribute", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        evaluate(model, dataset, methods, metrics, journal=path, **kwargs)
    monkeypatch.setattr(runner, "attribute", real)
    resumed = evaluate(model, dataset, methods, metrics, journal=path, **kwargs)
    assert len(segment_paths(path)) > 1
    assert _dumped(resumed.records) == _dumped(full.records)
    assert len(read_lines(path)) == len(read_lines(tmp_path / "w.jsonl.gz"))
