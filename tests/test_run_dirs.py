"""Runs kept in the repository: compressed journals, run directories, checkpoint commits.

Oracles: a compressed journal reads back exactly what a plain one holds (and ``gzip`` reads it
as one stream); a run interrupted mid-way and resumed from its compressed journal — under
another code version — gives the records and the table of an uninterrupted run; the checkpoint
tool's commits hold the journal as it was, touch nothing else, and the last one holds all of it.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

from experiments import checkpoint_run
from experiments.resume import UnitNotJournaled, Units
from lens_attrib.evaluation import cli, provenance, runner, runs
from lens_attrib.evaluation.items import load_task
from lens_attrib.evaluation.journal import (
    Journal,
    JournalCorrupt,
    ManifestMismatch,
    compact_journal,
    manifest_path,
    merge_journals,
    read_lines,
)
from lens_attrib.evaluation.runner import evaluate
from lens_attrib.tiny_models import tiny_llama
from tests.processes import terminate_when

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["grad_x_input", "gradient"]
METRICS = ["pointing_game", "mrr", "comprehensiveness"]


@pytest.fixture(scope="module")
def model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_llama()


def _batches(journal: Journal) -> None:
    for k in range(3):
        recs = [{"item": 2 * k + j, "value": 0.1 * k + j / 3, "nan": math.nan} for j in range(2)]
        journal.append("m", [2 * k, 2 * k + 1], recs, batch_size=2, bucket=0)


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """Equal records, NaN equal to NaN."""
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)


def test_compressed_journal_reads_back_like_a_plain_one(tmp_path):
    plain = Journal.open(tmp_path / "p" / "records.jsonl", {"run": 1})
    packed = Journal.open(tmp_path / "z" / "records.jsonl.gz", {"run": 1})
    _batches(plain)
    _batches(packed)
    assert read_lines(packed.path) == read_lines(plain.path)
    with gzip.open(packed.path, "rb") as fh:  # members concatenated: one gzip stream
        assert fh.read() == plain.path.read_bytes()
    assert json.loads(manifest_path(packed.path).read_text()) == read_lines(packed.path)[0]
    assert manifest_path(packed.path).name == "manifest.json"
    assert not manifest_path(plain.path).exists()  # plain journals are readable already
    again = Journal.open(packed.path, {"run": 1})
    assert again.batches == packed.batches and again.finished("m") == set(range(6))


def test_torn_last_member_is_dropped_and_cut(tmp_path):
    journal = Journal.open(tmp_path / "records.jsonl.gz", {"run": 1})
    _batches(journal)
    whole = journal.path.read_bytes()
    good = read_lines(journal.path)
    journal.path.write_bytes(whole + gzip.compress(b'{"kind": "batch", "x": 1}\n')[:-9])
    with pytest.warns(RuntimeWarning, match="torn last member"):
        again = Journal.open(journal.path, {"run": 1})
    assert journal.path.read_bytes() == whole  # the torn member is cut from the file
    assert len(again.batches) == len(good) - 1
    again.append("m", [9], [{"item": 9}], batch_size=1, bucket=0)
    assert read_lines(journal.path)[-1]["items"] == [9]
    # a complete member whose line is torn JSON, at the end: dropped as well
    journal.path.write_bytes(whole + gzip.compress(b'{"kind": "batch", "ite'))
    with pytest.warns(RuntimeWarning, match="torn last member"):
        assert read_lines(journal.path, repair=True) == good
    assert journal.path.read_bytes() == whole
    # damage inside an earlier member is corruption, not a torn end
    mid = len(gzip.compress(json.dumps(good[0]).encode() + b"\n", mtime=0)) + 12
    journal.path.write_bytes(whole[:mid] + bytes([whole[mid] ^ 0xFF]) + whole[mid + 1 :])
    with pytest.raises(JournalCorrupt, match="member 2"):
        read_lines(journal.path)


def test_read_only_journal_leaves_the_writers_torn_tail_alone(tmp_path):
    """Journal.read (``--so-far``) while a run appends: the member in flight is left out and
    left in the file, nothing can be appended, and another run's journal is refused."""
    journal = Journal.open(tmp_path / "records.jsonl.gz", {"run": 1})
    _batches(journal)
    in_flight = journal.path.read_bytes() + gzip.compress(b'{"kind": "batch", "x": 1}\n')[:-9]
    journal.path.write_bytes(in_flight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the unit in flight is no warning here
        read = Journal.read(journal.path, {"run": 1})
    _same(read.records(), journal.records())
    assert journal.path.read_bytes() == in_flight
    with pytest.raises(PermissionError, match="read-only"):
        read.append("m", [9], [{"item": 9}], batch_size=1, bucket=0)
    with pytest.raises(ManifestMismatch, match=r"run: 1 -> 2.*--so-far in place of --resume"):
        Journal.read(journal.path, {"run": 2})
    with pytest.raises(FileNotFoundError, match="no such journal"):
        Journal.read(tmp_path / "other.jsonl.gz", {"run": 1})
    assert not (tmp_path / "other.jsonl.gz").exists()


def test_so_far_units_compute_nothing(tmp_path):
    path = tmp_path / "records.jsonl"
    Units(None, "agreement", {"n": 2}, journal=path).get("u", [0, 1], lambda: [{"item": 0}])
    units = Units(None, "agreement", {"n": 2}, journal=path, so_far=True)
    assert units.finished(["u"], [0, 1]) and not units.finished(["u", "v"], [0, 1])
    assert units.get("u", [0, 1], lambda: []) == [{"item": 0}]
    with pytest.raises(UnitNotJournaled, match="does not hold unit v"):
        units.get("v", [0, 1], lambda: [{"item": 0}])
    assert units.computed == 0 and len(path.read_text().splitlines()) == 2
    with pytest.raises(ValueError, match="--out or --journal"):
        Units(None, "agreement", {"n": 2}, so_far=True)


def test_shard_journal_names():
    shard = (1, 4)
    assert provenance.shard_journal("a/records.jsonl.gz", None) == Path("a/records.jsonl.gz")
    assert provenance.shard_journal("a/records.jsonl.gz", shard).name == (
        "records.shard-1-of-4.jsonl.gz"
    )
    assert provenance.shard_journal("a/r.jsonl", shard).name == "r.shard-1-of-4.jsonl"


def test_interrupted_run_resumes_to_the_uninterrupted_table(model, tmp_path, monkeypatch):
    """Half a run, killed (an exception in the method call), then the same call again under a
    new code version: records and regenerated table equal those of one uninterrupted run."""
    dataset = load_task("sva", 8, 0)
    kwargs: dict[str, Any] = {"batch_size": 2, "progress": False}
    whole = tmp_path / "runs" / "whole" / runs.JOURNAL
    full = evaluate(model, dataset, METHODS, METRICS, journal=whole, **kwargs)

    real, calls = runner.attribute, []

    def dies_midway(*args: Any, **kw: Any) -> Any:
        calls.append(kw["method"])
        if len(calls) == 6:  # 4 batches of the first method, 1 of the second, then killed
            raise KeyboardInterrupt
        return real(*args, **kw)

    split = tmp_path / "runs" / "split" / runs.JOURNAL
    monkeypatch.setattr(runner, "attribute", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        evaluate(model, dataset, METHODS, METRICS, journal=split, **kwargs)
    monkeypatch.setattr(runner, "attribute", real)
    assert len(read_lines(split)) == 1 + 4 + 4 + 1  # manifest, correctness, 5 method batches

    code = provenance.code_version()
    newer = {**code, "git": "0" * 40 if code["git"] != "0" * 40 else "1" * 40}
    monkeypatch.setattr(provenance, "code_version", lambda: newer)
    resumed = evaluate(model, dataset, METHODS, METRICS, journal=split, **kwargs)
    _same(resumed.records, full.records)
    lines = read_lines(split)
    assert lines[0]["code_version"] == code  # the manifest keeps the run's first code
    assert [ln.get("info", {}).get("code") for ln in lines[-3:]] == [newer] * 3
    assert len(lines) == len(read_lines(whole))  # nothing computed twice

    table, text = runs.tables(split.parent)
    assert text == runs.tables(whole.parent)[1] == full.table()
    _same(table.records, full.records)
    paths = runs.write_tables(split.parent)
    assert paths["table"].read_text() == text + "\n"
    assert runs.main([str(split.parent)]) == text + "\n"


def test_cli_journal_needs_resume_to_continue(model, tmp_path, capsys):
    journal = tmp_path / "runs" / "cli" / runs.JOURNAL
    args = ["--model", "tiny-llama", "--task", "sva", "--n-items", "4", "--batch-size", "2",
            "--methods", "gradient", "--metrics", "mrr", "--quiet"]  # fmt: skip
    args += ["--journal", str(journal)]
    first = cli.main(args)
    assert journal.exists() and (journal.parent / "manifest.json").exists()
    with pytest.raises(SystemExit):
        cli.main(args)
    assert "--resume" in capsys.readouterr().err
    again = cli.main([*args, "--resume"])
    _same(again.records, first.records)


def test_experiment_units_in_a_compressed_journal(tmp_path):
    path = tmp_path / "runs" / "e" / runs.JOURNAL
    units = Units(None, "agreement", {"n": 2}, journal=path)
    got = units.get("sva/0/C/random", [0, 1], lambda: [{"item": 0, "value": 0.5}])
    assert units.computed == 1 and units.path == path
    with pytest.raises(FileExistsError, match="--resume"):
        Units(None, "agreement", {"n": 2}, journal=path)
    again = Units(None, "agreement", {"n": 2}, journal=path, resume=True)
    assert again.get("sva/0/C/random", [0, 1], lambda: []) == got and again.reused == 1
    manifest, records = runs.load_run(path.parent)
    assert manifest["experiment"] == "agreement" and records == got


def test_experiments_take_the_journal_option(tmp_path):
    from experiments import agreement, faithfulness

    path = str(tmp_path / runs.JOURNAL)
    assert agreement.parse_args(["--journal", path, "--resume"]).journal == path
    assert faithfulness.parse_args(["--journal", path]).journal == path


FAKE_RUN = """
import gzip, json, os, sys, time
path, n = sys.argv[1], int(sys.argv[2])
os.makedirs(os.path.dirname(path), exist_ok=True)
def put(line):  # the journal's own format: one flushed gzip member per line
    with open(path, "ab") as fh:
        fh.write(gzip.compress((json.dumps(line) + "\\n").encode(), mtime=0))
put({"kind": "manifest", "fake": True})
for k in range(n):
    put({"kind": "batch", "method": "m", "items": [k], "records": [{"item": k}]})
    time.sleep(0.15)
"""


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_checkpoint_run_commits_the_run_directory_only(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    (repo / "other.txt").write_text("not part of the run\n")
    _git(repo, "add", "other.txt")
    _git(repo, "commit", "-q", "-m", "start")
    (repo / "other.txt").write_text("edited meanwhile\n")  # must stay uncommitted
    script = tmp_path / "fake.py"
    script.write_text(textwrap.dedent(FAKE_RUN))
    journal = repo / "docs/results/runs/fake" / runs.JOURNAL
    command = [sys.executable, str(script), str(journal), "12"]
    code = checkpoint_run.main(["fake", "--every", "0.5", "--repo", str(repo), "--", *command])
    assert code == 0
    log = _git(repo, "log", "--format=%s").splitlines()
    assert log[-1] == "start" and len(log) >= 3  # periodic commits and the final one
    assert log[0] == "run fake: 12 records"
    counts = [int(msg.split(": ")[1].split()[0]) for msg in log[:-1]]
    assert counts == sorted(counts, reverse=True)
    for rev in range(len(log) - 1):
        changed = _git(repo, "show", "--name-only", "--format=", f"HEAD~{rev}").split()
        assert changed and all(p.startswith("docs/results/runs/fake/") for p in changed)
    assert _git(repo, "status", "--porcelain").strip() == "M other.txt"
    committed = _git(repo, "show", "HEAD:docs/results/runs/fake/command.txt")
    assert str(script) in committed
    # nothing changed since: a second final commit is not made
    assert not checkpoint_run.commit(repo, journal.parent, "fake")
    # a failing command's status is passed on (and its journal still committed)
    failing = [sys.executable, "-c", "import sys; sys.exit(3)"]
    assert checkpoint_run.main(["fake2", "--repo", str(repo), "--", *failing]) == 3
    assert _git(repo, "log", "-1", "--format=%s").strip() == "run fake2: 0 records"


def test_checkpoint_message_counts_the_split_journals_new_records(tmp_path):
    """While a split run goes on, its new units are in the split journals (copies of the run's
    journal that grow): the commit message counts them apart, each once."""
    repo = tmp_path / "repo"
    directory = repo / "docs/results/runs/split"
    directory.mkdir(parents=True)
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    main = Journal.open(directory / runs.JOURNAL, {"run": 1})
    _batches(main)  # 3 units of 2 records
    parts = [directory / f"split-{k}-of-2.{runs.JOURNAL}" for k in (1, 2)]
    for k, part in enumerate(parts):
        copy = Journal.open(part, {"run": 1})
        for batch in main.batches:
            copy.append("m", batch["items"], batch["records"], batch_size=2, bucket=0)
        copy.append(
            f"split{k}", [0, 1, 2][: k + 1], [{"item": 0}] * (k + 1), batch_size=2, bucket=0
        )
    assert checkpoint_run.record_counts(directory) == (6, 1 + 2)
    assert checkpoint_run.commit(repo, directory, "split")
    assert _git(repo, "log", "-1", "--format=%s").strip() == (
        "run split: 6 records (+ 3 in split journals)"
    )


def test_agreement_table_from_its_committed_records(tmp_path):
    """The experiment journaled into a run directory: the regenerated summary equals the one
    the experiment computed (same groups, means, intervals, counts)."""
    from experiments import agreement

    journal = tmp_path / "runs" / "agr" / runs.JOURNAL
    args = ["--n", "3", "--tasks", "sva", "--batch-size", "2", "--device", "cpu",
            "--methods", "grad_x_input,random", "--out", str(tmp_path / "out")]  # fmt: skip
    first = agreement.main([*args, "--journal", str(journal), "--resume"])
    assert not (tmp_path / "out" / "agreement.records.jsonl").exists()
    result, text = runs.tables(journal.parent)
    keys = ("task", "mode", "specials", "method", "metric")
    ours = {tuple(r[k] for k in keys): r for r in result.summary}
    theirs = {tuple(r[k] for k in keys): r for r in first["summary"]}
    assert ours.keys() == theirs.keys() and ours
    for key, row in theirs.items():
        for field in ("mean", "ci_low", "ci_high", "n"):
            a, b = ours[key][field], row[field]
            assert a == b or (math.isnan(a) and math.isnan(b)), (key, field)
    assert "grad_x_input" in text and "specials" in text


def test_checkpoint_run_passes_sigterm_on_and_commits(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    script = tmp_path / "fake.py"
    script.write_text(textwrap.dedent(FAKE_RUN))
    journal = repo / "docs/results/runs/long" / runs.JOURNAL
    cmd = [sys.executable, "-m", "experiments.checkpoint_run", "long", "--every", "600"]
    cmd += ["--repo", str(repo), "--", sys.executable, str(script), str(journal), "1000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)

    def started() -> bool:
        return journal.exists() and len(read_lines(journal)) > 3

    assert terminate_when(proc, started) == 128 + signal.SIGTERM
    n = len(read_lines(journal)) - 1
    assert 2 < n < 1000
    assert _git(repo, "log", "--format=%s").splitlines() == [f"run long: {n} records"]


def test_merge_journals_appends_missing_units_and_refuses_disagreements(tmp_path):
    """Units the target lacks are appended with their info; identical ones (NaN included) are
    skipped; a unit with other records, or a journal of another run, is refused and nothing is
    written; a torn last member of a source is dropped."""
    into = Journal.open(tmp_path / "records.jsonl.gz", {"run": 1})
    _batches(into)
    other = Journal.open(tmp_path / "records.b.jsonl.gz", {"run": 1})
    _batches(other)  # the same three units (NaN in every record)
    other.append("n", [0, 1], [{"item": 0, "v": 1.5}], batch_size=2, bucket=0, info={"cpu_s": 2})
    other.append("n", [2, 3], [{"item": 2, "v": math.nan}], batch_size=2, bucket=0)
    with (tmp_path / "records.b.jsonl.gz").open("ab") as fh:
        fh.write(gzip.compress(b'{"kind": "batch", "method": "n"')[:-6])  # torn in flight
    before = (tmp_path / "records.jsonl.gz").read_bytes()
    with pytest.warns(RuntimeWarning, match="torn"):
        report = merge_journals(tmp_path / "records.jsonl.gz", [tmp_path / "records.b.jsonl.gz"])
    assert (report.added, report.duplicates) == (2, 3)
    lines = read_lines(tmp_path / "records.jsonl.gz")
    assert (tmp_path / "records.jsonl.gz").read_bytes().startswith(before)
    assert [(ln["method"], ln["items"]) for ln in lines[4:]] == [("n", [0, 1]), ("n", [2, 3])]
    assert lines[4]["info"] == {"cpu_s": 2} and math.isnan(lines[5]["records"][0]["v"])
    resumed = Journal.open(tmp_path / "records.jsonl.gz", {"run": 1})
    assert resumed.finished("n") == {0, 1, 2, 3} and resumed.finished("m") == set(range(6))

    merged = (tmp_path / "records.jsonl.gz").read_bytes()
    clash = Journal.open(tmp_path / "clash.jsonl", {"run": 1})
    clash.append("q", [9], [{"item": 9}], batch_size=1, bucket=0)  # new, listed first
    clash.append("n", [0, 1], [{"item": 0, "v": 1.25}], batch_size=2, bucket=0)
    with pytest.raises(ValueError, match="other records"):
        merge_journals(tmp_path / "records.jsonl.gz", [tmp_path / "clash.jsonl"])
    assert (tmp_path / "records.jsonl.gz").read_bytes() == merged
    Journal.open(tmp_path / "run2.jsonl", {"run": 2})
    with pytest.raises(ManifestMismatch, match="run: 1 -> 2"):
        merge_journals(tmp_path / "records.jsonl.gz", [tmp_path / "run2.jsonl"])
    assert (tmp_path / "records.jsonl.gz").read_bytes() == merged


def test_compact_journal_reads_back_the_same_and_resumes(tmp_path):
    """One member for all lines: the same lines (NaN included), smaller, and a resumed run
    appends to it as before."""
    path = tmp_path / "records.jsonl.gz"
    journal = Journal.open(path, {"run": 1})
    _batches(journal)
    before, size = read_lines(path), path.stat().st_size
    assert compact_journal(path) < size
    _same(read_lines(path), before)
    again = Journal.open(path, {"run": 1})
    again.append("n", [7], [{"item": 7}], batch_size=1, bucket=0)
    assert Journal.open(path, {"run": 1}).finished("n") == {7}
    with pytest.raises(ValueError, match="not a compressed journal"):
        compact_journal(tmp_path / "plain.jsonl")


def test_a_copied_tree_names_its_commit(monkeypatch):
    """A tree copied to another machine (whose ``.git``, if any, is not the copied code's)
    journals the commit named in ``LENS_ATTRIB_GIT_COMMIT``; without it, git's HEAD."""
    monkeypatch.delenv("LENS_ATTRIB_GIT_COMMIT", raising=False)
    head = provenance.code_version()["git"]
    monkeypatch.setenv("LENS_ATTRIB_GIT_COMMIT", "f" * 40)
    assert provenance.code_version()["git"] == "f" * 40 != head
