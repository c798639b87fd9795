"""Each experiment's small-run output equals the pinned one (tests/fixtures/experiments_small).

The runs (:mod:`experiments_small`) use SmolLM2-135M and MiniLM-L6 in float64, so every number
is compared at 1e-12 relative to the largest magnitude of its array (one metric × method × …
over the items): float64 rounding differences between CPUs (BLAS summation order) stay near
1e-15 relative per operation, far inside that; a change of the orchestration that computed a
different number (another seed, batch, head, option or perturbation) moves it by far more.
Labels, counts, item sets and the printed tables must be identical.
"""

from __future__ import annotations

import json

import pytest
from experiments_small import FIXTURES, RUNS, compare, experiment_models, load_models, run


@pytest.fixture(scope="module")
def models64():
    return load_models()


@pytest.mark.parametrize("name", sorted(RUNS))
def test_small_run_matches_fixture(name, models64, tmp_path):
    want = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    with experiment_models(models64):
        got = json.loads(json.dumps(run(name, tmp_path / name)))
    problems = compare(got, want)
    assert not problems, "\n".join(problems[:20])


def test_comparison_sees_a_changed_number():
    want = json.loads((FIXTURES / "blimp_alignment.json").read_text(encoding="utf-8"))
    got = json.loads(json.dumps(want))
    assert compare(got, want) == []
    row = next(r for r in got["records"] if isinstance(r["value"], float) and r["value"] != 0)
    row["value"] *= 1 + 1e-9
    assert any("records" in p for p in compare(got, want))


def test_comparison_sees_a_changed_ci_bound():
    """A CI bound is compared relative to its cell (mean and bounds), still at 1e-12."""
    want = json.loads((FIXTURES / "faithfulness_classifier.json").read_text(encoding="utf-8"))
    got = json.loads(json.dumps(want))
    row = next(r for r in got["summary"] if isinstance(r.get("ci_high"), float) and r["ci_high"])
    scale = max(abs(row[f]) for f in ("mean", "ci_low", "ci_high"))
    row["ci_high"] += 1e-10 * scale
    assert any("ci_high" in p for p in compare(got, want))
    row["ci_high"] -= 1e-10 * scale
    row["ci_high"] += 1e-14 * scale
    assert compare(got, want) == []
