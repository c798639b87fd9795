"""Reachable π read from a π-Soft journal (``experiments.pi_reach``).

Oracle: the α solver's own ``SoftResult.pi_reached`` (π is reachable when ``mean(s^α)`` meets it
within the solver's tolerance), on items whose keep scores reach known shares of the grid; the
journal-read shares must equal the solver's item by item.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

from experiments import pi_reach
from lens_attrib import attribute
from lens_attrib.evaluation.journal import Journal
from lens_attrib.evaluation.soft import ALPHA_TOL, DEFAULT_PIS, soft_metrics
from lens_attrib.tiny_models import tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore:π unreachable:RuntimeWarning")

LONG = "the dog near the cats is the man and the man sees the keys to the cabinet on it"
SHORT = "the dog near the cats is here"  # BOS + 7 perturbable tokens


def test_constant_ends_are_cut_and_a_varying_curve_keeps_its_grid() -> None:
    assert pi_reach.reachable_span([1.0, 1.0, 2.0, 3.0, 4.0, 4.0, 4.0]) == (2, 3)
    assert pi_reach.reachable_span([0.5, 2.0, 3.0, 4.0]) == (0, 3)  # single end values stay
    assert pi_reach.reachable_span([7.0] * 5) is None
    assert pi_reach.reachable_span([1.0, 1.0, 2.0, 2.0]) is None
    # NS clipped at 0 everywhere, NC varying: reachable by NC
    spans = [pi_reach.reachable_span([0.0] * 4), pi_reach.reachable_span([1.0, 2.0, 3.0, 3.0])]
    assert pi_reach.combined_span(spans) == (0, 1)


@pytest.fixture(scope="module")
def llama():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_llama(dtype=torch.float64)


def _soft_journal(model, path, prompt: str, signs: list[list[int]], n_draws: int):
    """π-Soft curves of items whose keep scores have the given signs (magnitudes decreasing,
    the first two tied at the top), journaled as ``experiments.faithfulness`` writes them;
    returns the journal and the solver's reachable grid ``[item, π]``."""
    attr = attribute(model, [prompt] * len(signs), method="grad_x_input")
    n = attr.mask.shape[1] - 1
    assert attr.mask.all() and n == len(signs[0])
    magnitudes = torch.linspace(1.0, 0.3, n, dtype=torch.float64)
    magnitudes[1] = 1.0
    scores = torch.zeros(len(signs), n + 1, dtype=torch.float64)
    scores[:, 1:] = torch.tensor(signs, dtype=torch.float64) * magnitudes
    res = soft_metrics(model, replace(attr, scores=scores), n_draws=n_draws, raw=False, seed=4)
    reachable = ((res.pi_reached - res.pis).abs() <= ALPHA_TOL).numpy()
    journal = Journal.open(path, {"experiment": "test"})
    rows = [
        {"dataset": "d", "item": b, "method": "grad_x_input", "metric": f"{name}@{p:g}",
         "value": float(curve[b, j])}
        for b in range(len(signs))
        for name, curve in (("pi_soft_ns", res.pi_ns_curve), ("pi_soft_nc", res.pi_nc_curve))
        for j, p in enumerate(DEFAULT_PIS)
    ]  # fmt: skip
    journal.append("d:ab12|grad_x_input", list(range(len(signs))), rows, batch_size=3, bucket=0)
    return path, reachable


def _read(path) -> dict:
    (row,) = pi_reach.main([str(path.parent), "--pis", ",".join(f"{p:g}" for p in DEFAULT_PIS)])
    return row


def test_reach_read_from_the_journal_equals_the_solver(llama, tmp_path) -> None:
    # 19 perturbable tokens, two tied at the top: π ≤ 0.1 out of reach below (2/19 = 0.105);
    # 8, 19 and 14 positive: above 8/19 = 0.42, nothing, 14/19 = 0.74 out of reach
    signs = [[1] * 8 + [-1] * 11, [1] * 19, [1, 1, -1, 1, -1, 1, 1, -1] + [1] * 9 + [-1, -1]]
    path, reachable = _soft_journal(llama, tmp_path / "r" / "records.jsonl.gz", LONG, signs, 15)
    grid = list(DEFAULT_PIS)
    largest = [max(p for p, ok in zip(grid, r) if ok) for r in reachable]
    assert largest == [0.4, 0.95, 0.7] and not reachable[:, :2].any() and reachable[:, 2].all()
    row = _read(path)
    assert row["n"] == 3
    for j, p in enumerate(grid):
        assert row[f"reach@{p:g}"] == pytest.approx(reachable[:, j].mean(), abs=1e-12), p
    assert row["median_max_pi"] == pytest.approx(float(np.median(largest)), abs=1e-12)


def test_few_draws_on_a_short_item_can_only_understate_the_reach(llama, tmp_path) -> None:
    # 3 draws over 7 tokens: a reachable π next to the boundary can draw the boundary mask
    # every time (its π-Soft value is then the boundary's); a π out of reach never reads as held
    signs = [[1, 1, 1, -1, -1, -1, -1], [1] * 7, [1, 1, -1, 1, -1, 1, 1]]
    path, reachable = _soft_journal(llama, tmp_path / "r" / "records.jsonl.gz", SHORT, signs, 3)
    row = _read(path)
    for j, p in enumerate(DEFAULT_PIS):
        assert row[f"reach@{p:g}"] <= reachable[:, j].mean() + 1e-12, p


def test_a_pi_off_the_grid_or_a_journal_without_curves_is_refused(llama, tmp_path) -> None:
    path, _ = _soft_journal(llama, tmp_path / "r" / "records.jsonl.gz", SHORT, [[1] * 7], 2)
    with pytest.raises(SystemExit):
        pi_reach.main([str(path), "--pis", "0.33"])
    other = tmp_path / "aopc" / "records.jsonl.gz"
    journal = Journal.open(other, {"experiment": "test"})
    journal.append("d:ab12|x", [0], [{"dataset": "d", "item": 0, "method": "x",
                                      "metric": "comprehensiveness", "value": 0.2}],
                   batch_size=1, bucket=0)  # fmt: skip
    with pytest.raises(ValueError, match="no pi_soft_ns@π"):
        pi_reach.reach_table(pi_reach.labelled_records(other))


def test_the_faithfulness_table_states_the_reach_only_when_some_pi_is_missed() -> None:
    from experiments.faithfulness import reach_lines

    grid = (0.2, 0.4, 0.6, 0.8)
    curves = {"signed": [0.1, 0.3, 0.5, 0.5], "unsigned": [0.1, 0.3, 0.45, 0.7]}

    def records(which: dict[str, list[float]]) -> list[dict]:
        return [
            {"dataset": "d", "item": i, "method": m, "metric": f"{fam}@{p:g}", "value": v + i}
            for m, curve in which.items()
            for i in range(2)
            for fam in ("pi_soft_ns", "pi_soft_nc")
            for p, v in zip(grid, curve)
        ]  # fmt: skip

    lines = reach_lines(records(curves), "d", ["signed", "unsigned"])
    assert "π=0.6" in lines[1] and "π=0.4" not in lines[1]  # the upper half of the grid
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[1].splitlines()[2:]}
    assert rows == {"signed": ["0", "%", "0", "%"], "unsigned": ["100", "%", "100", "%"]}
    assert reach_lines(records({"unsigned": curves["unsigned"]}), "d", ["unsigned"]) == []
    assert reach_lines(records(curves), "other", ["signed"]) == []
