"""A real browser opens the reports offline: every figure draws, the console stays clean.

Headless Chromium (Debian package ``chromium``) loads the demo report and the faithfulness
report from the test's temporary directory with the network off (see ``headless_chromium``),
waits for plotly to draw, counts the drawn figures in the live DOM and in the dumped DOM, and
saves a full-page PNG beside the report. A negative control (a page that loads plotly.js from
the CDN) shows that the harness does catch a page that needs the network.
"""

from __future__ import annotations

import time
from functools import partial

import plotly.graph_objects as go
import pytest
import torch
from headless_chromium import PageReport, find_chromium, open_page

from experiments import common
from lens_attrib.methods.registry import METHODS

DEMO_METHODS = ("grad_x_input", "normxlogit", "logat", "alti_logit", "embed_norm")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def one_thread():
    """One torch thread while a report is built (much faster on a loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def chromium() -> str:
    found = find_chromium()
    if found is None:
        pytest.fail(
            "No Chromium found for the browser test: install the Debian package `chromium` "
            "(sudo apt-get install -y chromium; .ci/run does this when CI=true) or set "
            "LENS_ATTRIB_CHROMIUM=/path/to/chrome."
        )
    return found


def _check_rendered(report: PageReport, expected: int) -> None:
    assert report.errors == [], f"console errors: {report.errors}"
    assert report.remote_requests == [], (
        f"the page reached for the network: {report.remote_requests}"
    )
    state = report.state
    assert state["plotly"], "plotly.js did not load"
    assert state["figures"] == expected and state["rendered"] == expected, state
    # the dumped DOM: plotly builds one .plot-container.plotly with its main-svg per figure
    assert report.dom.count('class="plot-container plotly"') == expected
    assert report.dom.count('class="main-svg"') >= expected
    for width, height in state["sizes"]:
        assert width > 300 and height > 200, state["sizes"]
    assert report.screenshot is not None
    shot = report.screenshot.read_bytes()
    assert shot.startswith(PNG_MAGIC) and len(shot) > 10_000


def _describe(name: str, report: PageReport, page_bytes: int, seconds: float) -> None:
    sizes = ", ".join(
        f"{t} {w}×{h}" for t, (w, h) in zip(report.state["traces"], report.state["sizes"])
    )
    print(
        f"\n{name}: {page_bytes} bytes, {report.state['rendered']} figures ({sizes}); page "
        f"{report.state['width']}×{report.state['height']} px; screenshot {report.screenshot}; "
        f"browser {seconds:.1f} s"
    )


def test_demo_report_renders_offline(smollm2, tmp_path, chromium, one_thread):
    from experiments import demo

    args = demo.parse_args(
        [
            "--n", "2", "--n-blimp", "2", "--n-explain", "2",
            "--methods", ",".join(DEMO_METHODS), "--out", str(tmp_path / "demo"),
        ]
    )  # fmt: skip
    out = demo.run(smollm2, args, started=time.perf_counter(), command="python -m experiments.demo")
    page = out["report"]
    text = page.read_text(encoding="utf-8")
    assert "cdn.plot.ly" not in text and "<script src=" not in text
    # methods × tokens map + one layer map per per-layer method + the ground-truth bars
    expected = 2 + sum(METHODS[m].per_layer for m in DEMO_METHODS)
    started = time.perf_counter()
    report = open_page(chromium, page, screenshot=tmp_path / "demo.png", expect_figures=expected)
    _describe("demo", report, len(text.encode()), time.perf_counter() - started)
    _check_rendered(report, expected)
    assert {t for t in report.state["traces"]} == {"heatmap", "bar+bar"}
    assert len(out["attributions"]) == len(DEMO_METHODS)
    assert report.dom.count('class="tok"') == sum(len(a.tokens[0]) for a in out["attributions"])


def test_experiment_report_renders_offline(smollm2, tmp_path, chromium, one_thread, monkeypatch):
    """The faithfulness page, on a classifier trained on a few items in a temporary cache (the
    built-in one takes hours to train and is not part of the suite)."""
    from experiments import faithfulness
    from lens_attrib import classifiers

    trained = partial(classifiers.load_classifier, cache_dir=tmp_path / "cache")
    monkeypatch.setattr(faithfulness, "load_classifier", trained)
    common._MODELS[("smollm2-135m", "cpu")] = smollm2
    try:
        out = faithfulness.main(
            [
                "--n", "1", "--datasets", "sst2", "--methods", "normxlogit,random",
                "--train-n", "24", "--dev-n", "8",
                "--max-tokens", "12", "--pis", "0.3,0.7", "--n-draws", "1",
                "--fractions", "0.5", "--device", "cpu", "--out", str(tmp_path / "faith"),
            ]
        )  # fmt: skip
    finally:
        common._MODELS.pop(("smollm2-135m", "cpu"), None)
    page = out["paths"]["html"]
    text = page.read_text(encoding="utf-8")
    assert "cdn.plot.ly" not in text
    started = time.perf_counter()
    # normxlogit's layer × token map, then the AOPC and π-Soft curves of the one dataset
    expected = 3
    report = open_page(
        chromium, page, screenshot=tmp_path / "faithfulness.png", expect_figures=expected
    )
    _describe("faithfulness", report, len(text.encode()), time.perf_counter() - started)
    _check_rendered(report, expected)
    assert report.state["traces"] == ["heatmap"] + ["scatter+scatter+scatter+scatter"] * 2
    assert "95% percentile-bootstrap interval" in report.dom
    assert "target-free" in report.dom  # the random baseline's row says so


def test_a_page_that_needs_the_cdn_fails_offline(tmp_path, chromium):
    """The negative control: plotly.js from the CDN cannot load, so nothing draws and the
    harness sees the request and the console error."""
    fig = go.Figure(go.Scatter(x=[0, 1], y=[1, 0]))
    page = tmp_path / "cdn.html"
    fig.write_html(page, include_plotlyjs="cdn")
    report = open_page(chromium, page, expect_figures=1, timeout=5.0)
    assert report.state["figures"] == 1 and report.state["rendered"] == 0
    assert report.state["plotly"] is None
    assert any("cdn.plot.ly" in url for url in report.remote_requests)
    assert report.errors
