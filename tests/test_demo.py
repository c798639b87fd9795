"""The demo announces its stages, runs IG at the fixed steps it states, and reports the gap."""

from __future__ import annotations

import contextlib
import html
import io
import time
from typing import Any

import pytest
import torch

from experiments import demo

METHODS = "grad_x_input,integrated_gradients,alti"


@pytest.fixture(scope="module")
def ran(smollm2: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """One small demo run: its result and what it printed."""
    out = tmp_path_factory.mktemp("demo")
    args = demo.parse_args(
        ["--n", "2", "--n-blimp", "2", "--n-explain", "2", "--methods", METHODS,
         "--ig-steps", "4", "--out", str(out)]
    )  # fmt: skip
    printed = io.StringIO()
    with torch.enable_grad(), contextlib.redirect_stdout(printed):
        result = demo.run(smollm2, args, started=time.perf_counter(), command="demo")
    return result, printed.getvalue()


def test_stages_methods_and_gap_are_printed(ran: tuple[dict[str, Any], str]) -> None:
    printed = ran[1]
    stages = [line for line in printed.splitlines() if line.startswith("[") and " s] " in line]
    assert [s.split(" s] ")[1].split(" ")[0] for s in stages] == ["Accuracy:", "3", "Report:"]
    assert "3 methods on 2 subject–verb agreement items" in stages[1]
    times = [float(s[1:].split(" s, CPU")[0]) for s in stages]
    assert times == sorted(times)
    assert "[2/3] integrated_gradients" in printed
    assert "n_steps=4 fixed Gauss–Legendre points; completeness gap" in printed


def test_the_gap_shown_is_the_gap_of_the_scores(ran: tuple[dict[str, Any], str]) -> None:
    (ig,) = [a for a in ran[0]["attributions"] if a.method == "integrated_gradients"]
    assert ig.meta["options"]["n_steps"] == 4
    delta = ig.meta["explained_value"] - ig.meta["baseline_value"]
    independent = (delta - ig.scores.sum(-1).double()).abs() / delta.abs()
    torch.testing.assert_close(
        demo.completeness_gaps(ig).double(), independent.double(), rtol=1e-4, atol=1e-5
    )
    page = ran[0]["report"].read_text(encoding="utf-8")
    assert page.count("n_steps=4 fixed Gauss–Legendre points") == 1
    assert "--ig-tolerance 0.01 --ig-max-steps 1024" in page


def test_the_methods_grid_title_says_what_its_rows_explain(ran: tuple[dict[str, Any], str]) -> None:
    grid, _ = demo.figures(ran[0]["attributions"])[0]
    title = grid.layout.title.text
    meta = ran[0]["attributions"][0].meta  # grad_x_input: contrastive
    explained = html.escape(f"{meta['target_tokens'][0]!r} − {meta['foil_tokens'][0]!r}")
    assert title.startswith(f"Methods × tokens → {explained};")
    assert title.endswith("target-free rows (the same for any target): alti")
    assert "target-free rows (the same for any target): alti" in ran[0]["report"].read_text()


@pytest.mark.parametrize("bad", ["1", "x", "-3"])
def test_ig_steps_must_be_auto_or_an_integer(bad: str, capsys: Any) -> None:
    with pytest.raises(SystemExit):
        demo.parse_args(["--ig-steps", bad])
    assert "--ig-steps must be" in capsys.readouterr().err
