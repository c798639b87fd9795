"""One journaled run split over processes by method (``experiments.split_run``).

Oracles: the merged journal holds, unit for unit, the records one process writes; units already
journaled are never recomputed; a failed or interrupted process keeps what it finished and the
rerun of the same line completes the run; the split journals leave nothing behind. The
experiment is a small script with the journal and command line of the real ones (``--methods``,
``--journal``, ``--out``, ``--resume``) that loads only the journal module, so that each of its
processes starts in a fraction of a second.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from experiments import split_run
from lens_attrib.evaluation.journal import Journal, read_lines
from tests.processes import terminate_when

ROOT = Path(__file__).resolve().parents[1]
JOURNAL_MODULE = ROOT / "lens_attrib" / "evaluation" / "journal.py"
FAKE = textwrap.dedent(
    """
    import argparse, importlib.util, json, sys, time
    from pathlib import Path

    # the journal module alone (standard library only): the package would import torch
    spec = importlib.util.spec_from_file_location("journal", sys.argv.pop(1))
    journal_module = sys.modules["journal"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(journal_module)
    Journal, read_lines = journal_module.Journal, journal_module.read_lines

    p = argparse.ArgumentParser()
    for flag in ("--methods", "--journal", "--out", "--fail", "--model"):
        p.add_argument(flag)
    p.add_argument("--n", type=int, default=6)
    p.add_argument("--units", type=int, default=None)  # stop after this many computed units
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    journal = Journal.open(a.journal, {"experiment": "fake", "n": a.n})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    computed = 0
    for m in a.methods.split(","):
        key = "d:ids|" + m
        for k in range(0, a.n, 2):
            if k in journal.finished(key):
                continue
            if m == a.fail:
                sys.exit(3)
            if a.units is not None and computed == a.units:
                sys.exit(0)
            time.sleep(a.sleep)
            with open(out / "computed.txt", "a") as fh:
                fh.write(f"{m} {k}\\n")
            recs = [{"item": i, "method": m, "value": len(m) / 10 + i / 7} for i in (k, k + 1)]
            info = {"cpu_s": 10.0 if m == "slow" else 1.0, "wall_s": 1.0, "device": "cpu"}
            journal.append(key, [k, k + 1], recs, batch_size=2, bucket=0, info=info)
            computed += 1
    units = sorted((ln["method"], ln["items"]) for ln in read_lines(a.journal)[1:])
    (out / "table.json").write_text(json.dumps(units))
    """
)
METHODS = "slow,a,b[x=1],c"


def _command(tmp_path: Path, journal: Path, out: Path, *extra: str) -> list[str]:
    script = tmp_path / "fake_experiment.py"
    script.write_text(FAKE)
    return [sys.executable, str(script), str(JOURNAL_MODULE), "--journal", str(journal),
            "--out", str(out), "--methods", METHODS, "--resume", *extra]  # fmt: skip


def _units(journal: Path) -> dict[tuple[str, tuple[int, ...]], list]:
    lines = read_lines(journal)[1:]
    found = {(ln["method"], tuple(ln["items"])): ln["records"] for ln in lines}
    assert len(found) == len(lines), "a unit journaled twice"
    return found


def _computed(out: Path) -> list[str]:
    return sorted(
        line for path in out.rglob("computed.txt") for line in path.read_text().splitlines()
    )


def _leftovers(journal: Path) -> list[str]:
    return sorted(p.name for p in journal.parent.iterdir() if p.name.startswith("split-"))


def test_split_run_gives_the_one_process_journal_and_skips_done_units(tmp_path):
    alone = tmp_path / "alone" / "records.jsonl.gz"
    assert subprocess.call(_command(tmp_path, alone, tmp_path / "alone-out")) == 0

    journal, out = tmp_path / "run" / "records.jsonl.gz", tmp_path / "run-out"
    # a first process journals 3 units, then the run is split over 2 processes
    assert subprocess.call(_command(tmp_path, journal, out, "--units", "3")) == 0
    before = _units(journal)
    assert len(before) == 3
    report = split_run.split_run(_command(tmp_path, journal, out), 2)
    assert report.codes == [0, 0] and report.merged == 9
    assert sorted(m for g in report.groups for m in g) == sorted(METHODS.split(",")[1:])
    assert subprocess.call(_command(tmp_path, journal, out)) == 0  # what main() runs last
    assert _units(journal) == _units(alone)
    # every unit computed once over all processes, the 3 journaled ones not again
    done = _computed(out)
    assert len(done) == len(set(done)) == 12
    assert _leftovers(journal) == []
    # the last, unsplit, command found everything journaled and wrote the run's output
    assert (out / "table.json").read_text() == (tmp_path / "alone-out" / "table.json").read_text()
    split_outs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert split_outs == ["split-1-of-2", "split-2-of-2"]


def test_groups_balance_the_measured_cost(tmp_path, capsys):
    """``slow`` costs 10 CPU-s per unit in the journal, the others 1: it gets a process alone."""
    journal, out = tmp_path / "records.jsonl.gz", tmp_path / "out"
    assert subprocess.call(_command(tmp_path, journal, out, "--units", "5")) == 0  # slow 3, a 2
    costs, measured = split_run.remaining_costs(split_run.split_method_list(METHODS), journal)
    # slow: done (5 CPU-s per item); a: 2 items left at 0.5; b, c: 6 items at the median, 2.75
    assert measured and costs == {"slow": 0.0, "a": 1.0, "b[x=1]": 16.5, "c": 16.5}
    assert split_run.main(["--processes", "3", "--", *_command(tmp_path, journal, out)]) == 0
    printed = capsys.readouterr().out
    assert "done by the journal's count: slow" in printed
    assert "process 1/3 (≈ 0.00 CPU-h): b[x=1]" in printed
    assert "process 3/3 (≈ 0.00 CPU-h): a" in printed
    assert split_run.plan_groups({"ig": 10.0, "a": 1.0, "b": 2.0, "c": 3.0}, 2) == [
        ["ig"],
        ["a", "b", "c"],
    ]
    assert split_run.plan_groups({"a": 1.0, "b": 1.0}, 5) == [["a"], ["b"]]


def test_journal_labels_name_the_options_a_run_resolved(tmp_path):
    """A method spec matches the journal's label with the options the run filled in; a variant
    that is itself requested is not mistaken for its plain method."""
    journal = Journal.open(tmp_path / "records.jsonl.gz", {"experiment": "fake", "n": 4})
    for label, cpu in (("value_zeroing[aggregation=mean]", 8.0), ("ig", 4.0),
                       ("ig[pooling=l1]", 2.0)):  # fmt: skip
        journal.append(f"d:ids|{label}", [0, 1], [{"item": 0}], batch_size=2, bucket=0,
                       info={"cpu_s": cpu, "wall_s": cpu, "device": "cpu"})  # fmt: skip
    costs, _ = split_run.remaining_costs(
        ["value_zeroing", "ig", "ig[pooling=l1]", "new"], journal.path
    )
    assert costs == {"value_zeroing": 8.0, "ig": 4.0, "ig[pooling=l1]": 2.0, "new": 8.0}


def test_a_failed_process_keeps_its_units_and_the_rerun_completes(tmp_path):
    journal, out = tmp_path / "records.jsonl.gz", tmp_path / "out"
    failing = _command(tmp_path, journal, out, "--fail", "c")
    assert split_run.main(["--processes", "2", "--", *failing]) == 3
    assert {m for m, _ in _units(journal)} == {"d:ids|slow", "d:ids|a", "d:ids|b[x=1]"}
    assert _leftovers(journal) == [] and not (out / "table.json").exists()
    assert split_run.main(["--processes", "2", "--", *_command(tmp_path, journal, out)]) == 0
    assert len(_units(journal)) == 12 and (out / "table.json").exists()
    assert len(_computed(out)) == 12


def test_split_journals_of_a_killed_split_are_merged_first(tmp_path, capsys):
    journal, out = tmp_path / "records.jsonl.gz", tmp_path / "out"
    left = tmp_path / "split-2-of-3.records.jsonl.gz"
    assert subprocess.call(_command(tmp_path, left, out, "--units", "4")) == 0
    assert split_run.main(["--processes", "2", "--", *_command(tmp_path, journal, out)]) == 0
    printed = capsys.readouterr().out
    assert "4 units of an earlier split merged" in printed and "8 units merged" in printed
    assert len(_units(journal)) == 12 and len(_computed(out)) == 12
    assert _leftovers(journal) == []


def test_sigterm_reaches_every_process_and_their_units_are_merged(tmp_path):
    journal, out = tmp_path / "records.jsonl.gz", tmp_path / "out"
    command = _command(tmp_path, journal, out, "--sleep", "0.3")
    cmd = [sys.executable, "-m", "experiments.split_run", "--processes", "2", "--", *command]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    parts = [tmp_path / f"split-{k}-of-2.records.jsonl.gz" for k in (1, 2)]

    def started() -> bool:  # every process has journaled a unit
        return all(p.exists() and len(read_lines(p)) > 1 for p in parts)

    assert terminate_when(proc, started) == 128 + signal.SIGTERM
    held = {f"{m.split('|')[1]} {items[0]}" for m, items in _units(journal)}
    computed = set(_computed(out))  # a process may be stopped between its record and its unit
    assert 2 <= len(held) < 12 and held <= computed and len(computed - held) <= 2
    assert _leftovers(journal) == []


def test_a_command_without_a_journal_is_refused(tmp_path, capsys):
    command = _command(tmp_path, tmp_path / "records.jsonl.gz", tmp_path / "out")
    with pytest.raises(SystemExit) as exit_info:
        split_run.main(["--", *[w for w in command if w != "--resume"]])
    assert exit_info.value.code == 2
    assert "--resume" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_signed_ig_and_its_pooled_variant_go_to_one_process():
    """The two share one pass in a process (``experiments.pooling_share``). Dealt one by one,
    these costs would put them apart (IG 10 and the rest 9 + 2 + 1)."""
    ig, l1 = "integrated_gradients", "integrated_gradients[pooling=l1]"
    assert split_run.shared_pass_bundles([ig, "a", l1, "b"]) == [[ig, l1], ["a"], ["b"]]
    assert split_run.plan_groups({ig: 10.0, "a": 9.0, l1: 2.0, "b": 1.0}, 2) == [
        [ig, l1],
        ["a", "b"],
    ]
    # another integration (fewer steps) is a pass of its own
    other = "integrated_gradients[max_steps=64]"
    assert split_run.shared_pass_bundles([ig, other, l1]) == [[ig, l1], [other]]
    assert split_run.plan_groups({ig: 5.0, other: 5.0, l1: 5.0}, 2) == [[ig, l1], [other]]


def test_a_pooled_variant_left_alone_is_priced_at_the_whole_pass(tmp_path):
    """The journal books the shared pass under the unit computed first (here the signed IG at
    8 CPU-s per 2 items, its pooled variant at 0.02): while both lack the same items their sum
    is the pass; once the signed one is done, the variant integrates alone, at the sum."""
    ig, l1 = "integrated_gradients", "integrated_gradients[pooling=l1]"
    journal = Journal.open(tmp_path / "records.jsonl.gz", {"experiment": "fake", "n": 4})

    def book(label: str, items: list[int], cpu: float) -> None:
        journal.append(f"d:ids|{label}", items, [{"item": i} for i in items],
                       batch_size=2, bucket=0,
                       info={"cpu_s": cpu, "wall_s": cpu, "device": "cpu"})  # fmt: skip

    book(ig, [0, 1], 8.0)
    book(l1, [0, 1], 0.02)
    costs, _ = split_run.remaining_costs([ig, l1], journal.path)
    assert costs[ig] == pytest.approx(8.0) and costs[l1] == pytest.approx(0.02)
    book(ig, [2, 3], 8.0)
    costs, _ = split_run.remaining_costs([ig, l1], journal.path)
    assert costs[ig] == 0.0 and costs[l1] == pytest.approx(2 * (4.0 + 0.01))


def test_a_so_far_command_runs_as_one_process(tmp_path, capsys):
    """A run's recorded split line with ``--so-far`` in place of ``--resume`` (a table while the
    run goes on) computes nothing: it runs once, as given, and leaves no split journal."""
    journal, marker = tmp_path / "records.jsonl.gz", tmp_path / "ran.txt"
    script = "import sys; open(sys.argv[1], 'a').write('ran\\n'); sys.exit(7)"
    command = [sys.executable, "-c", script, str(marker), "--methods", METHODS,
               "--journal", str(journal), "--so-far"]  # fmt: skip
    assert split_run.main(["--processes", "2", "--", *command]) == 7
    assert marker.read_text() == "ran\n"
    assert "--so-far: the command runs as one process" in capsys.readouterr().out
    assert _leftovers(journal) == []


def test_methods_that_do_not_apply_to_the_model_are_left_out_of_the_plan(tmp_path):
    """The experiment skips DecompX and GlobEnc on a decoder and ALTI-Logit on an encoder; the
    plan leaves them out instead of pricing them at the median. A model whose architecture is
    not known without loading it (a hub name) skips nothing."""
    from transformers import BertConfig, LlamaConfig

    methods = ["alti_logit", "decompx", "globenc", "integrated_gradients[pooling=l1]", "random"]
    skips = split_run.architecture_skips
    assert skips(["run", "--model", "smollm2-135m"], methods) == ["decompx", "globenc"]
    assert skips(["run", "--model=minilm-l6"], methods) == ["alti_logit"]
    assert skips(["run", "--model", "someone/some-hub-model"], methods) == []
    assert skips(["run"], methods) == []
    BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=16).save_pretrained(tmp_path / "bert")  # fmt: skip
    LlamaConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=16).save_pretrained(tmp_path / "llama")  # fmt: skip
    assert skips(["run", "--model", str(tmp_path / "bert")], methods) == ["alti_logit"]
    assert skips(["run", "--model", str(tmp_path / "llama")], methods) == ["decompx", "globenc"]
    assert skips(["run", "--model", str(tmp_path / "missing")], methods) == []


def test_the_split_plan_prints_and_leaves_out_the_skipped_methods(tmp_path, capsys):
    journal, out = tmp_path / "records.jsonl.gz", tmp_path / "out"
    command = _command(tmp_path, journal, out)
    command = split_run.with_option(command, "--methods", "slow,a,decompx,globenc")
    report = split_run.split_run([*command, "--model", "smollm2-135m"], 2)
    assert sorted(m for g in report.groups for m in g) == ["a", "slow"]
    assert "(the run skips them): decompx, globenc" in capsys.readouterr().out


def test_an_abandoned_variant_is_neither_counted_nor_priced(tmp_path):
    """A spec that matches two journal labels (a Grad-ELLM depth used before the tuning chose
    another) is priced by the label journaled last in each dataset: its items, and its units there
    for the rate."""
    journal = Journal.open(tmp_path / "records.jsonl.gz", {"experiment": "fake", "n": 6})
    units = (  # (where, label, items, CPU seconds), in journal order
        ("d", "grad_ellm[n_layers=1]", [0, 1], 1.0),  # abandoned at depth 1: 0.5 CPU-s per item
        ("d", "grad_ellm[n_layers=4]", [0, 1], 4.0),  # the tuned depth: 2 CPU-s per item
        ("d", "grad_ellm[n_layers=4]", [2, 3], 4.0),
        ("e", "grad_ellm[n_layers=1]", [0, 1, 2], 1.5),  # where depth 1 is the current one
    )
    for where, label, items, cpu in units:
        journal.append(f"{where}:ids|{label}", items, [{"item": i} for i in items],
                       batch_size=len(items), bucket=0,
                       info={"cpu_s": cpu, "wall_s": cpu, "device": "cpu"})  # fmt: skip
    costs, measured = split_run.remaining_costs(["grad_ellm"], journal.path)
    # d lacks items 4, 5 of depth 4; e lacks 3, 4, 5 of depth 1; the current units price them,
    # not d's depth-1 unit: (4.0 + 4.0 + 1.5) CPU-s / (2 + 2 + 3) items
    assert measured and costs["grad_ellm"] == pytest.approx((2 + 3) * 9.5 / 7)
    costs, _ = split_run.remaining_costs(["grad_ellm[n_layers=4]"], journal.path)
    assert costs == {"grad_ellm[n_layers=4]": pytest.approx((2 + 6) * 8.0 / 4)}
