"""Run a long command and commit its run directory to git every so often, so it survives.

    python -m experiments.checkpoint_run NAME [--every 1200] -- python -m experiments.agreement \\
        --n 100 --journal docs/results/runs/NAME/records.jsonl.gz --resume

starts the command in the background (its output goes to this process's), writes the command to
``docs/results/runs/NAME/command.txt``, and every ``--every`` seconds commits that folder — only
that folder: ``git add -- <dir>`` then ``git commit -m "run NAME: K records" -- <dir>``, and
only when something in it changed. When the command ends (or this process gets SIGINT /
SIGTERM, which it passes on to the command first) it commits once more and exits with the
command's exit status. A command that exits with status 2 (argparse's usage error, e.g. an
argument that kept its shell quotes because the line was not run through ``eval``) leaves
``command.txt`` as it was, so the recorded command is always one that ran. It never pushes.
Several runs may checkpoint into one repository: a commit that finds git's index locked by
another is retried (:func:`commit_retrying`), and a commit that fails is reported and skipped,
never stopping the run. A commit may catch the journal mid-write: the torn last line or gzip
member is dropped when the run resumes (:mod:`lens_attrib.evaluation.journal`).

Continue a run on a fresh checkout by running the same line again: with ``--resume`` in the
wrapped command, finished batches are read from the committed journal and only the rest is
computed (see ``docs/results/README.md``).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from lens_attrib.evaluation.journal import JournalCorrupt, read_lines
from lens_attrib.evaluation.runs import RUNS, run_dir


def record_counts(directory: Path) -> tuple[int, int]:
    """Records in the run directory's journals (0 when there is none yet), and the records that
    the split journals of a running :mod:`experiments.split_run` hold beyond them (each split
    journal starts as a copy of the run's journal), each unit counted once."""
    run = _units(directory, "records*.jsonl*")
    held = {key for key, _ in run}
    split = dict(_units(directory, "split-*-of-*.records*.jsonl*"))
    new = sum(len(records) for key, records in split.items() if key not in held)
    return sum(len(records) for _, records in run), new


def _units(directory: Path, pattern: str) -> list[tuple[tuple[str, tuple[int, ...]], list[Any]]]:
    """The finished batches of the journals matching ``pattern`` in ``directory``: each unit's
    key (method and items) and records; a journal that cannot be read is skipped."""
    units: list[tuple[tuple[str, tuple[int, ...]], list[Any]]] = []
    for path in sorted(directory.glob(pattern)):
        try:
            lines = read_lines(path)
        except (JournalCorrupt, OSError):
            continue
        for line in lines[1:]:
            if line.get("kind") == "batch":
                units.append(((line["method"], tuple(line["items"])), line["records"]))
    return units


def git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


LOCK_RETRIES = 20
"""Tries of a commit that finds the repository locked (another git process, e.g. a second run's
checkpoint in the same repository), ``LOCK_WAIT`` seconds apart."""
LOCK_WAIT = 3.0


def commit_retrying(repo: Path, directory: Path, name: str) -> bool:
    """:func:`commit`, retried while git's index is locked by another process; a commit that
    still fails is reported and skipped (the run goes on: its journal is on disk, and the next
    checkpoint commits it). Whether a commit was made."""
    for attempt in range(LOCK_RETRIES):
        try:
            return commit(repo, directory, name)
        except RuntimeError as err:
            if "index.lock" not in str(err) or attempt == LOCK_RETRIES - 1:
                print(f"[checkpoint_run] commit skipped: {err}", file=sys.stderr, flush=True)
                return False
            time.sleep(LOCK_WAIT)
    return False


def commit(repo: Path, directory: Path, name: str) -> bool:
    """Commit ``directory`` (and nothing else) if it changed; whether a commit was made."""
    rel = str(directory.resolve().relative_to(repo.resolve()))
    added = git(repo, "add", "--", rel)
    if added.returncode != 0:
        raise RuntimeError(f"git add -- {rel} failed: {added.stderr.strip()}")
    if git(repo, "diff", "--cached", "--quiet", "--", rel).returncode == 0:
        return False
    records, split = record_counts(directory)
    message = f"run {name}: {records} records" + (
        f" (+ {split} in split journals)" if split else ""
    )
    done = git(repo, "commit", "--no-verify", "-q", "-m", message, "--", rel)
    if done.returncode != 0:
        raise RuntimeError(f"git commit of {rel} failed: {done.stderr.strip()}")
    print(f"[checkpoint_run] committed: {message}", flush=True)
    return True


USAGE_ERROR = 2  # argparse's exit status for a bad command line


def restore(recorded: Path, before: str | None) -> None:
    """Put back the ``command.txt`` of the last command that ran (none: remove it)."""
    if before is None:
        recorded.unlink(missing_ok=True)
    else:
        recorded.write_text(before, encoding="utf-8")
    print(
        f"[checkpoint_run] the command exited with a usage error (status {USAGE_ERROR}); "
        f"{recorded} is left as it was. A command.txt line is run as "
        '`eval "python -m experiments.checkpoint_run NAME -- $(cat .../command.txt)"`.',
        file=sys.stderr,
        flush=True,
    )


def checkpoint_run(
    name: str,
    command: Sequence[str],
    *,
    every: float = 1200.0,
    repo: str | Path = ".",
    root: str | Path = RUNS,
) -> int:
    """Run ``command``, committing ``<repo>/<root>/<name>`` every ``every`` seconds and at its
    end; returns the command's exit status."""
    if not command:
        raise ValueError("no command to run: put it after --, e.g. -- python -m experiments.…")
    if every <= 0:
        raise ValueError(f"--every must be positive seconds, got {every}")
    repo = Path(repo)
    top = git(repo, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        raise ValueError(f"{repo} is not inside a git repository: {top.stderr.strip()}")
    repo = Path(top.stdout.strip())
    directory = repo / run_dir(name, root)
    directory.mkdir(parents=True, exist_ok=True)
    recorded = directory / "command.txt"
    before = recorded.read_text(encoding="utf-8") if recorded.exists() else None
    recorded.write_text(shlex.join(command) + "\n", encoding="utf-8")
    proc = subprocess.Popen(list(command))

    def forward(signum: int, frame: FrameType | None) -> None:
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        next_commit = time.monotonic() + every
        while True:
            try:
                code = proc.wait(timeout=max(0.0, next_commit - time.monotonic()))
                break
            except subprocess.TimeoutExpired:
                commit_retrying(repo, directory, name)
                next_commit = time.monotonic() + every
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code == USAGE_ERROR:
        restore(recorded, before)
    commit_retrying(repo, directory, name)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        raise SystemExit(
            "usage: python -m experiments.checkpoint_run NAME [--every SECONDS] -- COMMAND ..."
        )
    split = args.index("--")
    parser = argparse.ArgumentParser(
        prog="python -m experiments.checkpoint_run",
        description="Run COMMAND, committing docs/results/runs/NAME every --every seconds.",
    )
    parser.add_argument("name", help="the run's name (its folder under --root)")
    parser.add_argument("--every", type=float, default=1200.0, help="seconds between commits")
    parser.add_argument("--repo", default=".", help="the git repository (default: here)")
    parser.add_argument("--root", default=str(RUNS), help="folder of run directories")
    opts = parser.parse_args(args[:split])
    code = checkpoint_run(
        opts.name, args[split + 1 :], every=opts.every, repo=opts.repo, root=opts.root
    )
    return code if code >= 0 else 128 - code  # killed by signal N: the shell's 128 + N


if __name__ == "__main__":
    sys.exit(main())
