"""The report building blocks: bootstrap intervals, token maps, tables, pages (no browser)."""

from __future__ import annotations

import html
import math
import re

import numpy as np
import plotly.graph_objects as go
import pytest

from lens_attrib import Target, attribute
from lens_attrib.evaluation.stats import bootstrap_ci
from lens_attrib.report import (
    NEGATIVE_RGB,
    POSITIVE_RGB,
    TokenRow,
    attribution_rows,
    ci_rows,
    ci_table_html,
    diverging_rgb,
    figure_html,
    footer_html,
    page_html,
    plotly_js,
    token_map_html,
)
from lens_attrib.tiny_models import tiny_gpt2


# --------------------------------------------------------------------------- bootstrap
def test_bootstrap_constant_values_collapse():
    stat = bootstrap_ci([0.25] * 7)
    assert stat.n == 7 and stat.mean == pytest.approx(0.25)
    assert stat.low == pytest.approx(0.25) and stat.high == pytest.approx(0.25)


def test_bootstrap_drops_missing_and_is_seeded():
    values = [1.0, None, float("nan"), 0.0, float("inf"), 1.0, 0.0, 1.0]
    stat = bootstrap_ci(values, seed=3)
    assert stat.n == 5 and stat.mean == pytest.approx(0.6)
    assert stat == bootstrap_ci(values, seed=3)
    assert 0.0 <= stat.low <= stat.mean <= stat.high <= 1.0
    empty = bootstrap_ci([None, float("nan")])
    assert empty.n == 0 and all(math.isnan(v) for v in empty[:3])
    with pytest.raises(ValueError, match="level"):
        bootstrap_ci([1.0], level=95)


def test_bootstrap_width_matches_the_normal_theory():
    """For a mean of n iid values the 95% interval is ≈ mean ± 1.96 σ/√n (CLT)."""
    rng = np.random.default_rng(0)
    values = rng.normal(2.0, 3.0, size=400)
    stat = bootstrap_ci(values.tolist(), n_resamples=4000, seed=1)
    half = 1.96 * values.std(ddof=1) / math.sqrt(len(values))
    assert stat.mean == pytest.approx(values.mean())
    assert stat.high - stat.low == pytest.approx(2 * half, rel=0.1)
    assert stat.low == pytest.approx(values.mean() - half, abs=0.1 * half)
    # a narrower level gives a narrower interval from the same resamples
    narrow = bootstrap_ci(values.tolist(), n_resamples=4000, seed=1, level=0.5)
    assert stat.low < narrow.low < narrow.high < stat.high


def test_bootstrap_large_n_is_chunked_but_equal_in_distribution():
    values = [float(i % 2) for i in range(5001)]
    stat = bootstrap_ci(values, n_resamples=500)
    half = 1.96 * np.std(values, ddof=1) / math.sqrt(len(values))
    assert stat.high - stat.low == pytest.approx(2 * half, rel=0.15)


# --------------------------------------------------------------------------- colours
def test_diverging_colours_are_centred_and_monotone():
    assert diverging_rgb(0.0) == (255, 255, 255)
    assert diverging_rgb(1.0) == POSITIVE_RGB and diverging_rgb(-1.0) == NEGATIVE_RGB
    assert diverging_rgb(5.0) == POSITIVE_RGB and diverging_rgb(float("nan")) == (255, 255, 255)
    greens = [diverging_rgb(v)[1] for v in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert greens == sorted(greens, reverse=True)  # whiter to redder


def _backgrounds(fragment: str) -> list[tuple[int, int, int]]:
    found = re.findall(r'class="tok"[^>]*background:rgb\((\d+),(\d+),(\d+)\)', fragment)
    return [tuple(int(c) for c in rgb) for rgb in found]


def test_token_map_row_and_shared_scales():
    rows = [
        TokenRow("a", "x", [" the", "\n", "<cat>"], np.array([2.0, -1.0, 0.0])),
        TokenRow("b", "x", [" the", "\n", "<cat>"], np.array([0.5, 0.25, -0.5])),
    ]
    per_row = token_map_html(rows)
    assert "␣the" in per_row and "⏎" in per_row and "&lt;cat&gt;" in per_row
    assert "<cat>" not in per_row
    colours = _backgrounds(per_row)
    assert colours[0] == POSITIVE_RGB  # 2 / 2
    assert colours[1] == diverging_rgb(-0.5)  # −1 / 2
    assert colours[3] == POSITIVE_RGB and colours[5] == NEGATIVE_RGB  # ±0.5 / 0.5
    assert "row&#x27;s max |score|" in per_row or "row's max |score|" in per_row
    shared = token_map_html(rows, shared_scale=True)
    colours = _backgrounds(shared)
    assert colours[3] == diverging_rgb(0.25) and colours[5] == diverging_rgb(-0.25)
    assert "÷ 2 (the largest max |score| of all rows)" in html.unescape(shared)
    with pytest.raises(ValueError):
        token_map_html([])


@pytest.fixture(scope="module")
def tiny():
    return tiny_gpt2()


def test_attribution_html_labels_and_target_free(tiny):
    target = Target()
    gxi = attribute(tiny, ["the keys to the cabinet", "the dog"], target, method="grad_x_input")
    norm = attribute(tiny, ["the keys to the cabinet"], target, method="embed_norm")
    assert attribution_rows(gxi, [0])[0].explains == gxi.explained_label(0)
    assert attribution_rows(norm)[0].explains == norm.explained_label(0)
    assert norm.explained_label(0).startswith("target-free")
    page = gxi._repr_html_()
    assert page.count("<tr>") == 3  # header + one row per item
    assert len(_backgrounds(gxi.to_html(item=1))) == int(gxi.mask[1].sum())
    rows = attribution_rows(gxi, [1])
    np.testing.assert_allclose(rows[0].scores, gxi.numpy(1))
    assert f"{np.abs(gxi.numpy(1)).max():.3g}" in gxi.to_html(item=1)


# --------------------------------------------------------------------------- tables, page
RECORDS = [
    {"method": m, "metric": k, "item": i, "value": v}
    for m, k, values in (
        ("a", "pg", [1.0, 0.0, 1.0, 1.0]),
        ("a", "mrr", [0.5, 1.0, float("nan"), 1.0]),
        ("b", "pg", [0.0, 0.0, 0.0, 1.0]),
    )
    for i, v in enumerate(values)
]


def test_ci_rows_and_table():
    rows = {(r["method"], r["metric"]): r for r in ci_rows(RECORDS, ["method", "metric"])}
    assert rows[("a", "pg")]["n"] == 4 and rows[("a", "pg")]["mean"] == pytest.approx(0.75)
    assert rows[("a", "mrr")]["n"] == 3 and rows[("a", "mrr")]["mean"] == pytest.approx(2.5 / 3)
    for r in rows.values():
        assert r["ci_low"] <= r["mean"] <= r["ci_high"]
    table = ci_table_html(RECORDS)
    assert table.count("<tr>") == 3  # header, a, b
    assert "<th>method</th><th>pg</th><th>mrr</th>" in table
    assert "0.750" in table and "n=4" in table and "n=3" in table
    assert table.count('<td class="num">–</td>') == 1  # b has no mrr
    long = [dict(r, method=f"m{i}") for i in range(45) for r in RECORDS[:1]]
    assert ci_table_html(long).startswith("<details>")


def test_page_inlines_plotly_once_and_names_no_cdn():
    fig = go.Figure(go.Scatter(x=[0, 1], y=[1, 0]))
    footer = footer_html(command="python -m experiments.demo --n 1", model="m", seconds=1.25)
    page = page_html("t <1>", [figure_html(fig, "cap"), figure_html(fig)], footer=footer)
    assert page.count(plotly_js()) == 1 and len(plotly_js()) > 1_000_000
    assert "cdn.plot.ly" not in page and "<script src=" not in page
    assert page.count('class="plotly-graph-div"') == 2
    assert "t &lt;1&gt;" in page and "1.2 s" in page and "python -m experiments.demo" in page
    assert "<script" not in page_html("no figures", ["<p>x</p>"], footer=footer)
    cdn = fig.to_html(full_html=False, include_plotlyjs="cdn")
    with pytest.raises(ValueError, match="figure_html"):
        page_html("bad", [cdn], footer=footer)


def test_write_outputs_writes_an_offline_report(tmp_path):
    from experiments.common import write_outputs

    fig = go.Figure(go.Bar(x=["a"], y=[1.0]))
    paths = write_outputs(
        tmp_path,
        "toy",
        config={"model": "tiny"},
        summary=[{"method": "a", "metric": "pg", "mean": 0.75, "n": 4}],
        records=RECORDS,
        figures=[fig],
        table="a table <x>",
        argv=["--n", "4"],
        started=0.0,
    )
    page = paths["html"].read_text()
    assert "cdn.plot.ly" not in page and page.count("<script") == 1 + 1  # plotly.js + the figure
    assert "python -m experiments.toy --n 4" in page and "a table &lt;x&gt;" in page
    assert "<th>method</th><th>pg</th><th>mrr</th>" in page
