"""``experiments.run_costs``: CPU seconds per item and method from a journal, and the expected
total of the run at full size (one-off units — the depth tuning, qa's screening — counted once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments import run_costs
from lens_attrib.evaluation.journal import Journal


def _journal(path: Path) -> Path:
    journal = Journal.open(path, {"experiment": "agreement", "n": 4})
    units = [
        # (key, items, cpu_s)
        ("qa:aaa|screening", range(50), 30.0),  # the reported split's screening
        ("qa:bbb|screening", range(50), 2.0),  # the tuning split's: read from the cache
        ("qa:ccc|grad_ellm_depth[pointing_game][n_layers=1]", range(3), 6.0),
        ("qa:ccc|grad_ellm_depth[pointing_game][n_layers=4]", range(3), 9.0),
        ("qa:ddd|gradient|plain", range(2), 4.0),
        ("qa:ddd|gradient|plain", range(2, 4), 2.0),
        ("ra:eee|gradient|contrastive", range(2), 1.0),
        ("ra:eee|gradient|plain", range(2), 3.0),
    ]
    for key, items, cpu in units:
        journal.append(
            key, list(items), [], batch_size=len(items), bucket=0,
            info={"cpu_s": cpu, "wall_s": cpu + 1},
        )  # fmt: skip
    return path


def test_cost_table_counts_items_once_per_mode_and_one_off_units_once(tmp_path):
    rows = {
        (r["where"], r["method"]): r for r in run_costs.cost_table(_journal(tmp_path / "j.jsonl"))
    }
    assert rows["qa", "gradient"]["items"] == 4 and rows["qa", "gradient"]["cpu_s_per_item"] == 1.5
    # an agreement item's two modes are one explained item
    assert rows["ra", "gradient"]["items"] == 2 and rows["ra", "gradient"]["cpu_s_per_item"] == 2.0
    assert rows["qa", "screening"]["cpu_s"] == 32.0 and rows["qa", "screening"]["items"] == 50
    assert (
        rows["qa", run_costs.TUNING]["cpu_s"] == 15.0 and rows["qa", run_costs.TUNING]["items"] == 3
    )
    # at n items: per-item costs scale with n, the tuning and the screening do not
    expected = run_costs.expected_cpu_s(list(rows.values()), 100)
    assert expected == pytest.approx(1.5 * 100 + 2.0 * 100 + 32.0 + 15.0)


def test_cli_prints_per_task_totals_and_the_expected_hours(tmp_path, capsys):
    text = run_costs.main([str(_journal(tmp_path / "j.jsonl")), "--n", "100"])
    assert "qa: 1.5 CPU-s per item (all methods), tuning 15 s, screening 32 s" in text
    assert "ra: 2.0 CPU-s per item (all methods), tuning 0 s" in text
    assert "expected at n=100: 397 CPU-s = 0.1 CPU-h" in text
    with pytest.raises(SystemExit):
        run_costs.main([str(tmp_path / "missing")])


def test_a_depth_tuning_unit_books_the_attribution_it_scores(tmp_path):
    """The criterion of a depth is cheap next to explaining the tuning items at that depth,
    which happens before the criterion is called: its unit's journaled CPU includes that."""
    import time
    from types import SimpleNamespace

    import torch

    from experiments.grad_ellm_depth import journaled
    from experiments.resume import Units, unit_costs

    path = tmp_path / "records.jsonl.gz"
    units = Units(None, "agreement", {}, journal=path)
    metric = journaled(units, "ra:abc|grad_ellm_depth", 2, lambda model, attr: torch.zeros(2))
    for depth in (1, 4):
        started = time.process_time()
        while time.process_time() - started < 0.2:  # the depth's attribution, 0.2 CPU-s
            pass
        metric(None, SimpleNamespace(meta={"options": {"n_layers": depth}}))
    costs = unit_costs(path)
    assert [c["key"] for c in costs] == [
        "ra:abc|grad_ellm_depth[n_layers=1]",
        "ra:abc|grad_ellm_depth[n_layers=4]",
    ]
    assert all(c["cpu_s"] >= 0.2 for c in costs), costs


def test_units_computed_on_an_accelerator_are_left_out_of_the_cpu_figures(tmp_path):
    """A GPU unit's CPU seconds are not its work: it is counted on a line of its own, and the
    device each unit ran on is journaled (older units, without it, ran on the CPU)."""
    from experiments.resume import Units, unit_costs

    path = _journal(tmp_path / "j.jsonl")
    gpu = Units(None, "agreement", {"n": 4}, journal=path, resume=True, device="cuda:0 (H200)")
    gpu.get("qa:fff|gradient|plain", [4, 5, 6], lambda: [])
    costs = unit_costs(path)
    assert {c["device"] for c in costs[:-1]} == {"cpu"}
    assert costs[-1]["device"] == "cuda:0 (H200)" and costs[-1]["n_items"] == 3
    rows = {(r["where"], r["method"]): r for r in run_costs.cost_table(path)}
    assert rows["qa", "gradient"]["items"] == 4  # the CPU units only
    assert run_costs.accelerator_units(path) == {
        "cuda:0 (H200)": {"units": 1, "unit_items": 3, "wall_s": costs[-1]["wall_s"]}
    }
    text = run_costs.main([str(path)])
    assert "on cuda:0 (H200) (not in the CPU figures): 1 units, 3 unit items" in text
