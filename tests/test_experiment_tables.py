"""The paper-size table settings of the experiments: Grad-ELLM's depth chosen on a tuning split
disjoint from the reported items (recorded and used), value zeroing's decoder aggregation, and
IG's completeness-gap lines (:mod:`experiments.grad_ellm_depth`,
:mod:`experiments.method_settings`)."""

from __future__ import annotations

import json
import math
import sys
from types import SimpleNamespace

import pytest
import torch

from experiments import common
from experiments.method_settings import (
    GAP_METRIC,
    experiment_options,
    gap_summary,
    relative_gaps,
    unit_suffix,
)
from lens_attrib import Target, attribute
from lens_attrib.data import generate_sva, item_evidence_positions
from lens_attrib.evaluation.metrics import ScoreOptions, score

SVA = ["--tasks", "sva", "--n", "3", "--batch-size", "3", "--device", "cpu", "--n-boot", "20"]


@pytest.fixture(scope="module", autouse=True)
def shared_model(smollm2):
    common._MODELS[("smollm2-135m", "cpu")] = smollm2
    yield
    common._MODELS.pop(("smollm2-135m", "cpu"), None)


def _journal(folder) -> list[dict]:
    lines = (folder / "agreement.records.jsonl").read_text().splitlines()
    return [json.loads(ln) for ln in lines]


def _pg_and_rma(model, prompts, targets, foils, evidence, depth):
    """Pointing game and RMA per item (special tokens excluded) of Grad-ELLM at ``depth``,
    computed directly (the oracle of the wiring)."""
    attr = attribute(model, prompts, Target(token=targets, foil=foils), method="grad_ellm",
                     n_layers=depth)  # fmt: skip
    special = sorted(int(i) for i in model.tokenizer.all_special_ids)
    rows = score(model, attr, ["pointing_game", "rma"], evidence=evidence,
                 options=ScoreOptions(special_ids=special))  # fmt: skip
    pg = [r.value for r in rows if r.metric == "pointing_game"]
    rma = [r.value for r in rows if r.metric == "rma"]
    return pg, rma


def test_agreement_selects_grad_ellm_depth_on_a_disjoint_split_and_uses_it(smollm2, tmp_path):
    from experiments import agreement

    argv = [*SVA, "--methods", "grad_ellm,random", "--tuning-n", "4",
            "--depth-candidates", "1,4,40", "--out", str(tmp_path)]  # fmt: skip
    out = agreement.main(argv)
    choice = out["grad_ellm_depth"]["sva"]
    assert choice.how == "selected" and choice.metric == "pointing_game"
    assert choice.candidates == [1, 4, 30]  # 40 clipped to SmolLM2's 30 layers

    # the tuning split: sva items of the tuning seed (run seed 0 + 1), none of them reported
    reported = agreement.prepare_items(smollm2, generate_sva(3, seed=0), 3)
    tuning = choice.tuning["inputs"]
    assert choice.tuning["seed"] == 1 and len(tuning) == 4
    assert not set(tuning) & set(reported.prompts)
    by_prompt = {it.prompt: it for it in generate_sva(8, seed=1)}
    items = [by_prompt[p] for p in tuning]
    evidence = [item_evidence_positions(smollm2, it) for it in items]
    targets, foils = [it.target for it in items], [it.foil for it in items]

    # each candidate's recorded score is the mean pointing game at that depth (oracle)
    for depth in (1, 4, 30):
        pg, _ = _pg_and_rma(smollm2, tuning, targets, foils, evidence, depth)
        assert choice.scores[depth] == pytest.approx(sum(pg) / len(pg), abs=1e-12)
    best = max(choice.scores.values())
    assert choice.depth == min(d for d, s in choice.scores.items() if s == best)

    # recorded: JSON output, table line, journal units of the split and of the chosen depth
    payload = json.loads((tmp_path / "agreement.json").read_text())
    assert payload["grad_ellm_depth"]["sva"]["depth"] == choice.depth
    assert payload["grad_ellm_depth"]["sva"]["tuning"]["inputs"] == tuning
    assert f"Grad-ELLM n_layers={choice.depth}, selected by pointing_game on 4" in out["table"]
    keys = [ln["method"] for ln in _journal(tmp_path)[1:]]
    assert sum("grad_ellm_depth[pointing_game" in k for k in keys) == 3
    assert any(f"|grad_ellm[n_layers={choice.depth}]|contrastive" in k for k in keys)

    # used: the reported items' RMA is Grad-ELLM's at the chosen depth
    want_row = {"method": "grad_ellm", "mode": "contrastive", "specials": "out", "metric": "rma"}
    rows = [r for r in payload["records"] if all(r[k] == v for k, v in want_row.items())]
    got = [r["value"] for r in sorted(rows, key=lambda r: r["item"])]
    rep_ev = reported.evidence
    _, want = _pg_and_rma(smollm2, reported.prompts, reported.targets, reported.foils, rep_ev,
                          choice.depth)  # fmt: skip
    assert got == pytest.approx(want, abs=1e-9)
    others = [_pg_and_rma(smollm2, reported.prompts, reported.targets, reported.foils, rep_ev,
                          d)[1] for d in (1, 4, 30) if d != choice.depth]  # fmt: skip
    assert any(o != pytest.approx(want, abs=1e-9) for o in others)  # the depth matters here

    # a resumed run takes the selection and the units from the journal
    before = _journal(tmp_path)
    again = agreement.main([*argv, "--resume"])
    assert again["grad_ellm_depth"]["sva"].depth == choice.depth
    assert _journal(tmp_path) == before


def test_agreement_fixed_depth_runs_no_tuning(tmp_path):
    from experiments import agreement

    out = agreement.main([*SVA, "--methods", "grad_ellm", "--grad-ellm-depth", "2",
                          "--out", str(tmp_path)])  # fmt: skip
    assert out["grad_ellm_depth"]["sva"].how == "fixed"
    keys = [ln["method"] for ln in _journal(tmp_path)[1:]]
    assert keys and all("grad_ellm[n_layers=2]" in k for k in keys)
    assert "Grad-ELLM n_layers=2 (fixed by hand" in out["table"]
    with pytest.raises(SystemExit):
        agreement.parse_args(["--grad-ellm-depth", "0"])


def test_ig_gap_records_and_table_lines(smollm2, tmp_path):
    from experiments import agreement

    out = agreement.main([*SVA, "--n", "2", "--methods", "integrated_gradients",
                          "--ig-max-steps", "16", "--out", str(tmp_path)])  # fmt: skip
    payload = json.loads((tmp_path / "agreement.json").read_text())
    gaps = [r for r in payload["records"] if r["metric"] == GAP_METRIC]
    n = payload["counts"]["sva"]["n_explained"]
    assert len(gaps) == 2 * n  # contrastive and plain, one per item
    reported = agreement.prepare_items(smollm2, generate_sva(2, seed=0), 2)
    attr = attribute(smollm2, reported.prompts,
                     Target(token=reported.targets, foil=reported.foils),
                     method="integrated_gradients", max_steps=16)  # fmt: skip
    want = [abs(float(g)) / abs(float(s + g)) for g, s in
            zip(attr.meta["completeness_gap"], attr.meta["relevance_sum"])]  # fmt: skip
    got = [r["value"] for r in sorted(gaps, key=lambda r: r["item"]) if r["mode"] == "contrastive"]
    assert got == pytest.approx(want, rel=1e-9)
    above = sum(v > 0.01 for v in got)
    line = next(ln for ln in out["table"].splitlines() if "(mode contrastive)" in ln)
    assert f"{above}/{n} items" in line and "max_steps=16" in line
    keys = [ln["method"] for ln in _journal(tmp_path)[1:]]
    assert all("integrated_gradients[max_steps=16]" in k for k in keys)


def test_gap_summary_and_relative_gaps():
    meta = {"completeness_gap": torch.tensor([0.0, 0.5, -0.02, 1.0]),
            "relevance_sum": torch.tensor([2.0, 0.5, 1.02, -1.0])}  # fmt: skip
    gaps = relative_gaps(SimpleNamespace(meta=meta))
    assert gaps == pytest.approx([0.0, 0.5, 0.02, math.inf])
    s = gap_summary(gaps)
    assert s["n"] == 4 and s["above_1pct"] == 3 and s["share_above_1pct"] == 0.75
    assert s["median"] == pytest.approx(0.02) and s["max"] == math.inf


def test_value_zeroing_aggregation_per_architecture(smollm2, minilm):
    args = SimpleNamespace(vz_aggregation="auto", ig_max_steps=None)
    dec = experiment_options("value_zeroing", 0, smollm2, args)
    enc = experiment_options("value_zeroing", 0, minilm, args)
    assert dec == {"aggregation": "mean"} and enc == {"aggregation": "rollout"}
    assert unit_suffix("value_zeroing", dec) == "[aggregation=mean]"
    assert unit_suffix("grad_x_input", experiment_options("grad_x_input", 0, smollm2, args)) == ""
    forced = SimpleNamespace(vz_aggregation="rollout", ig_max_steps=None)
    assert experiment_options("value_zeroing", 0, smollm2, forced) == {"aggregation": "rollout"}


def test_faithfulness_zero_shot_depth_split_is_disjoint(tmp_path):
    from experiments import faithfulness

    argv = ["--mode", "zero-shot", "--datasets", "sst2", "--n", "2", "--batch-size", "2",
            "--methods", "grad_ellm", "--max-tokens", "6", "--pis", "0.3,0.7", "--n-draws", "1",
            "--fractions", "0.5", "--no-chat", "--tuning-n", "2", "--depth-candidates", "1,30",
            "--no-fixed", "--out", str(tmp_path)]  # fmt: skip
    out = faithfulness.main(argv)
    choice = out["grad_ellm_depth"]["sst2"]
    assert choice.how == "selected" and choice.metric == "pi_soft" and len(choice.scores) == 2
    args = faithfulness.parse_args(argv)
    tok = common._MODELS[("smollm2-135m", "cpu")].tokenizer
    reported = [faithfulness.make_prompt(tok, "sst2", it, 6, False)
                for it in faithfulness.load("sst2", 2, args.seed)]  # fmt: skip
    assert not set(choice.tuning["inputs"]) & set(reported)
    assert f"Grad-ELLM n_layers={choice.depth}, selected by pi_soft" in out["table"]
    payload = json.loads((tmp_path / "faithfulness.json").read_text())
    assert payload["grad_ellm_depth"]["sst2"]["depth"] == choice.depth


def test_checkpoint_commit_waits_for_a_locked_index_and_never_raises(tmp_path, monkeypatch):
    """Two runs checkpointing into one repository: a commit that meets the other's index.lock
    is retried; one that keeps failing is skipped with a message, never stopping the run."""
    from experiments import checkpoint_run

    repo = _git_repo(tmp_path / "repo")
    run = repo / "runs" / "a"
    run.mkdir(parents=True)
    (run / "records.jsonl").write_text("{}\n")
    lock = repo / ".git" / "index.lock"
    lock.write_text("")
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # the other process finishes during the first wait
        waits.append(seconds)
        lock.unlink(missing_ok=True)

    monkeypatch.setattr(checkpoint_run.time, "sleep", sleep)
    assert checkpoint_run.commit_retrying(repo, run, "a") is True and len(waits) == 1
    (run / "records.jsonl").write_text("{}\n{}\n")
    lock.write_text("")
    monkeypatch.setattr(checkpoint_run.time, "sleep", lambda s: None)
    monkeypatch.setattr(checkpoint_run, "LOCK_RETRIES", 3)
    assert checkpoint_run.commit_retrying(repo, run, "a") is False  # reported, not raised
    lock.unlink()
    assert checkpoint_run.commit_retrying(repo, run, "a") is True


def _git_repo(path):
    import subprocess

    path.mkdir()
    for cmd in (
        ["init", "-q"],
        ["config", "user.email", "t@example.com"],
        ["config", "user.name", "t"],
        ["commit", "-q", "--allow-empty", "-m", "start"],
    ):
        subprocess.run(["git", "-C", str(path), *cmd], check=True)
    return path


def test_checkpoint_run_keeps_the_recorded_command_after_a_usage_error(tmp_path):
    """A command line that argparse rejects (exit 2) never replaces the recorded command; one
    that runs is recorded, shell-quoted, and committed."""
    import shlex
    import subprocess

    from experiments import checkpoint_run

    repo = _git_repo(tmp_path / "repo")
    good = [sys.executable, "-c", "import sys; sys.exit(0)", "--methods", "a[k=1],b"]
    assert checkpoint_run.checkpoint_run("a", good, repo=repo, root="runs") == 0
    recorded = repo / "runs" / "a" / "command.txt"
    assert shlex.split(recorded.read_text()) == good
    quoted = [sys.executable, "-c", "import sys; sys.exit(2)", "--methods", "'a[k=1],b'"]
    assert checkpoint_run.checkpoint_run("a", quoted, repo=repo, root="runs") == 2
    assert shlex.split(recorded.read_text()) == good
    assert checkpoint_run.checkpoint_run("b", quoted, repo=repo, root="runs") == 2
    assert not (repo / "runs" / "b" / "command.txt").exists()
    log = subprocess.run(["git", "-C", str(repo), "log", "--format=%s"], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert log.splitlines()[0] == "run a: 0 records"
    shown = subprocess.run(["git", "-C", str(repo), "show", "HEAD:runs/a/command.txt"],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert shlex.split(shown) == good


def test_empty_tuning_split_falls_back_to_the_default_with_a_note():
    from experiments.grad_ellm_depth import disjoint_sample, select_depth

    args = SimpleNamespace(depth_metric="pointing_game", tuning_seed=None, seed=0,
                           tuning_draws=None, depth_candidates="1,4")  # fmt: skip
    model = SimpleNamespace(cfg=SimpleNamespace(n_layers=30))
    with pytest.warns(UserWarning, match="no tuning item is left"):
        choice = select_depth(model, None, "mine", [], None, None, args, source="file")
    assert choice.how == "default" and choice.depth == 8
    assert "no tuning item is left" in choice.note()
    pool = list(range(10))
    picked = disjoint_sample(pool, {0, 1, 2}, lambda x: x, 4, seed=1)
    assert len(picked) == 4 and not {0, 1, 2} & set(picked) and picked == sorted(picked)
    assert disjoint_sample(pool, set(range(8)), lambda x: x, 4, seed=1) == [8, 9]


def test_a_smaller_run_can_tune_on_the_larger_runs_split(minilm):
    """π-Soft SmolLM2 reports 200 SST-2 items, AOPC SmolLM2 500 (the 200 among them): with
    ``--tuning-disjoint-from 500`` the smaller run draws the larger run's tuning split (so both
    choose one Grad-ELLM depth), still disjoint from every reported item."""
    from experiments.faithfulness import classifier_items, classifier_tuning_inputs

    def args(n: int, wider: int | None = None) -> SimpleNamespace:
        return SimpleNamespace(n=n, seed=0, tuning_seed=None, tuning_n=20, max_tokens=128,
                               tuning_disjoint_from=wider)  # fmt: skip

    def split(a: SimpleNamespace) -> list:
        reported = classifier_items(minilm, None, "sst2", a)[0]
        return classifier_tuning_inputs(minilm, "sst2", a, reported)[0]

    large = split(args(500))
    assert len(large) == 20
    assert split(args(200, 500)) == large
    assert not set(large) & set(classifier_items(minilm, None, "sst2", args(500))[0])
    assert split(args(200)) != large  # its own split: the pool outside 200 items is larger
    assert split(args(200, 100)) == split(args(200))  # N ≤ --n changes nothing
