"""Sweeps at scale: torchrun ranks, a journal that survives SIGKILL, batches found by halving.

Oracles: a 2-rank gloo run under torchrun and a run killed with SIGKILL and resumed both give
exactly the records of one uninterrupted process (every item is computed in the same batch);
an auto-sized run equals the fixed run at the batch size the halving must reach.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lens_attrib.evaluation import cli, records, runner
from lens_attrib.evaluation.items import load_task
from lens_attrib.evaluation.journal import JournalCorrupt, ManifestMismatch, read_lines
from lens_attrib.evaluation.runner import evaluate
from lens_attrib.tiny_models import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["grad_x_input", "gradient"]
METRICS = ["pointing_game", "mrr", "comprehensiveness"]
SOFT = {"soft": {"n_draws": 15}}  # what the CLI passes


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Like the subprocesses (OMP_NUM_THREADS=1): same kernels, and no thread contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_llama()


def _cli_args(n: int, batch_size: int, out: Path) -> list[str]:
    return [
        "--model",
        "tiny-llama",
        "--task",
        "sva",
        "--n-items",
        str(n),
        "--batch-size",
        str(batch_size),
        "--methods",
        ",".join(METHODS),
        "--metrics",
        ",".join(METRICS),
        "--out",
        str(out),
        "--quiet",
    ]


def _reference(model: Any, n: int, batch_size: int) -> list[dict[str, Any]]:
    """One uninterrupted in-process run of what ``_cli_args`` asks."""
    return evaluate(
        model,
        load_task("sva", n, 0),
        METHODS,
        METRICS,
        batch_size=batch_size,
        metric_options=SOFT,
        progress=False,
    ).records


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """Equal records: same keys and fields, values bit for bit (NaN equal to NaN)."""
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert set(x) == set(y)
        for k in x:
            vx, vy = x[k], y[k]
            if isinstance(vx, float) and math.isnan(vx):
                assert isinstance(vy, float) and math.isnan(vy), (k, x)
            else:
                assert vx == vy, (k, x, y)


def test_torchrun_two_gloo_ranks_equal_one_process(model, tmp_path):
    out = tmp_path / "x.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "lens_attrib.evaluation", *_cli_args(6, 2, out)]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("metric") == 1  # rank 0 alone prints the merged table
    payload = json.loads(out.read_text())
    assert payload["config"]["world_size"] == 2
    journals = [tmp_path / f"x.shard-{r}-of-2.records.jsonl" for r in range(2)]
    per_rank = [{i for b in read_lines(p)[1:] for i in b["items"]} for p in journals]
    assert per_rank[0] and per_rank[1] and not per_rank[0] & per_rank[1]
    _same(records.load(out), _reference(model, 6, 2))


def test_sigkill_loses_at_most_the_batch_in_flight(model, tmp_path):
    out = tmp_path / "k.json"
    journal = tmp_path / "k.records.jsonl"
    args = _cli_args(16, 2, out)
    cmd = [sys.executable, "-m", "lens_attrib.evaluation", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # kill once a method's first batch is on disk
            if journal.exists() and b'"method": "gradient' in journal.read_bytes():
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    before = journal.read_bytes()
    lines = read_lines(journal)
    assert lines[0]["kind"] == "manifest"
    n_batches = 8 * (1 + len(METHODS))
    assert 1 < len(lines) - 1 < n_batches  # interrupted in the middle
    result = cli.main(args)  # the same command again: resumes
    after = journal.read_bytes()
    assert after.startswith(before[: before.rfind(b"\n") + 1])  # finished batches kept as they are
    batches = read_lines(journal)[1:]
    assert len(batches) == n_batches  # nothing recomputed twice, nothing missing
    _same(result.records, _reference(model, 16, 2))
    _same(records.load(out), result.records)


def test_torn_last_line_is_dropped_and_recomputed(model, tmp_path):
    out = tmp_path / "t.json"
    dataset = load_task("sva", 4, 0)
    first = evaluate(model, dataset, METHODS, METRICS, batch_size=2, progress=False, out=out)
    journal = tmp_path / "t.records.jsonl"
    whole = journal.read_bytes()
    last = whole[: whole.rstrip(b"\n").rfind(b"\n") + 1]
    journal.write_bytes(last + b'{"kind": "batch", "method": "gradient", "items": [0')
    with pytest.warns(RuntimeWarning, match="torn last line"):
        again = evaluate(model, dataset, METHODS, METRICS, batch_size=2, progress=False, out=out)
    assert journal.read_bytes() == whole
    _same(again.records, first.records)
    lines = whole.split(b"\n")
    journal.write_bytes(b"\n".join([*lines[:2], b"garbage", *lines[2:]]))
    with pytest.raises(JournalCorrupt, match="line 3"):
        evaluate(model, dataset, METHODS, METRICS, batch_size=2, progress=False, out=out)


def test_manifest_mismatch_names_the_fields(model, tmp_path):
    out = tmp_path / "m.csv"
    dataset = load_task("sva", 3, 0)
    evaluate(model, dataset, ["gradient"], ["mrr"], progress=False, out=out)
    with pytest.raises(ManifestMismatch, match=r"methods: \['gradient'\] -> .*seed: 0 -> 1"):
        evaluate(model, dataset, ["grad_x_input"], ["mrr"], seed=1, progress=False, out=out)
    with pytest.raises(ManifestMismatch, match=r"data_hash.*--overwrite"):
        evaluate(model, dataset[:2], ["gradient"], ["mrr"], progress=False, out=out)
    res = evaluate(
        model, dataset, ["grad_x_input"], ["mrr"], seed=1, progress=False, out=out, overwrite=True
    )
    assert {r["method"] for r in res.records} == {"model", "grad_x_input"}


@pytest.mark.parametrize("error", [MemoryError, torch.OutOfMemoryError])
def test_auto_batch_halves_until_it_fits(model, monkeypatch, caplog, error):
    real = runner.attribute
    tried: list[int] = []

    def small_memory(model, inputs, *args, **kwargs):
        tried.append(len(inputs))
        if len(inputs) > 3:
            raise error("out of memory (simulated)")
        return real(model, inputs, *args, **kwargs)

    monkeypatch.setattr(runner, "attribute", small_memory)
    dataset = load_task("sva", 10, 0)
    with caplog.at_level(logging.INFO, logger="lens_attrib.evaluation"):
        auto = evaluate(
            model, dataset, METHODS, METRICS, batch_size=8, max_batch="auto", progress=False
        )
    assert sorted(set(tried), reverse=True)[:3] == [8, 4, 2]
    used = auto.config["batches"]
    assert all(size == 2 for m in METHODS for size in used[m].values())
    assert "out of memory at batch 8" in caplog.text and "batch 2" in caplog.text
    # halving ends at batch 2, and the plan keeps the length order: the fixed batch-2 run
    fixed = evaluate(model, dataset, METHODS, METRICS, batch_size=2, progress=False)
    _same(auto.records, fixed.records)
    with pytest.raises(error):  # a fixed batch size is kept: the error is the user's to see
        evaluate(model, dataset, METHODS, METRICS, batch_size=8, progress=False)


def test_auto_batch_gives_up_at_one_item(model, monkeypatch):
    def no_memory(*args, **kwargs):
        raise MemoryError("out of memory (simulated)")

    monkeypatch.setattr(runner, "attribute", no_memory)
    dataset = load_task("sva", 3, 0)
    with pytest.raises(MemoryError):
        evaluate(model, dataset, ["gradient"], ["mrr"], max_batch="auto", progress=False)


def test_plan_shards_partition_the_length_sorted_batches():
    from lens_attrib.evaluation.batching import bucket_of, plan_chunks

    lengths = [5, 3, 9, 3, 17, 1, 8]
    whole = plan_chunks(lengths, 2)
    assert [c.items for c in whole] == [(5, 1), (3, 0), (6, 2), (4,)]
    assert [c.bucket for c in whole] == [4, 8, 16, 32]
    shards = [plan_chunks(lengths, 2, (i, 3)) for i in range(3)]
    assert sorted((c for s in shards for c in s), key=lambda c: c.index) == whole
    assert [bucket_of(n) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]
