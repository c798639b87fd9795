"""The π-Soft pages' tables read from journals (``experiments.pisoft_tables``).

Oracles: on a journal written here with known values, every cell equals the statistic computed
directly with numpy; on the committed MiniLM run, the tables equal the committed results page
(``docs/results/pisoft_minilm_sst2.md``) to its printed digits, i.e. the page is regenerated from
the committed journals alone.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from experiments import pisoft_tables
from lens_attrib.evaluation.journal import Journal

ROOT = Path(__file__).resolve().parents[1]
N_ITEMS = 30


def _rows(method: str, values: dict[str, np.ndarray]) -> list[dict]:
    return [
        {"dataset": "sst2", "item": i, "method": method, "metric": metric, "value": float(v[i])}
        for metric, v in values.items()
        for i in range(N_ITEMS)
    ]


def _method_values(
    rng: np.random.Generator, shift: float, retained: float
) -> dict[str, np.ndarray]:
    """One method's per-item records; ``shift`` is its π-Soft lead over random at π ≤ 0.5 and
    its lag above (so the per-π table has both directions)."""
    base = {
        "pi_soft_ns": 0.4 + shift + 0.01 * rng.standard_normal(N_ITEMS),
        "pi_soft_nc": 0.7 + shift + 0.01 * rng.standard_normal(N_ITEMS),
        "pi_soft_ns_fixed": 0.3 + 2 * shift + 0.01 * rng.standard_normal(N_ITEMS),
        "pi_soft_nc_fixed": 0.8 + shift + 0.3 * rng.standard_exponential(N_ITEMS),
        "soft_ns": 0.2 + retained / 100 + 0.01 * rng.standard_normal(N_ITEMS),
        "soft_nc": 0.5 + 0.01 * rng.standard_normal(N_ITEMS),
        "expected_retained_ns": retained + rng.random(N_ITEMS),
        "expected_retained_nc": retained + 1 + rng.random(N_ITEMS),
    }
    for k, p in enumerate(pisoft_tables.GRID):
        lead = shift if p <= 0.5 else -shift
        for family in ("pi_soft_ns", "pi_soft_nc"):  # curves vary over π: every π reachable
            base[f"{family}@{p:g}"] = 0.1 * k + lead + 0.001 * rng.standard_normal(N_ITEMS)
    return base


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> tuple[Path, dict[str, dict[str, np.ndarray]]]:
    rng = np.random.default_rng(3)
    values = {
        "random": _method_values(rng, 0.0, 12.0),
        "grad_ellm[n_layers=4]": _method_values(rng, 0.2, 8.0),
        "deeplift[pooling=l2]": _method_values(rng, 0.1, 4.0),
    }
    values["deeplift[pooling=l2]"]["pi_soft_nc"][5] = math.nan  # an item without a ΔP₀
    path = tmp_path_factory.mktemp("pisoft") / "records.jsonl.gz"
    journal = Journal.open(path, {"experiment": "faithfulness"})
    for method, vals in values.items():
        journal.append(
            f"sst2:ab12|{method}", list(range(N_ITEMS)), _rows(method, vals), batch_size=4, bucket=0
        )
    # an earlier Grad-ELLM depth on fewer items: not the one standing for the paper's column
    early = {k: v[:10] for k, v in _method_values(rng, 0.0, 5.0).items()}
    rows = [r for r in _rows("grad_ellm[n_layers=1]", values["random"]) if r["item"] < 10]
    for r in rows:
        r["value"] = float(early[r["metric"]][r["item"]])
    journal.append("sst2:ab12|grad_ellm[n_layers=1]", list(range(10)), rows, batch_size=4, bucket=0)
    return path, values


def _table(text: str) -> dict[str, list[str]]:
    """``{first cell: cells}`` of a Markdown table."""
    rows = [line.strip("|").split(" | ") for line in text.splitlines()[2:]]
    return {r[0].strip(): [c.strip() for c in r] for r in rows}


def _point(cell: str) -> float:
    return float(cell.split(" [")[0].replace("−", "-"))


def test_cells_equal_the_statistics_computed_directly(synthetic) -> None:
    path, values = synthetic
    methods = ["grad_ellm[n_layers=4]", "deeplift[pooling=l2]", "random"]
    tables = pisoft_tables.pisoft_tables(path, methods=methods, n_resamples=200)
    dynamic = _table(tables["dynamic"])
    assert list(dynamic) == ["Grad-ELLM (depth 4)", "DeepLIFT (ℓ²)", "random"]  # by NS mean
    for method in methods:
        v, row = values[method], dynamic[pisoft_tables.display_name(method)]
        nc = v["pi_soft_nc"][np.isfinite(v["pi_soft_nc"])]
        assert _point(row[1]) == pytest.approx(np.mean(v["pi_soft_ns"]), abs=5.1e-4)
        assert _point(row[2]) == pytest.approx(np.median(nc), abs=5.1e-4)
        assert float(row[3]) == pytest.approx(np.mean(nc), abs=5.1e-3)
        assert row[4:] == ["100 %", "100 %"]
        fixed = _table(tables["fixed"])[pisoft_tables.display_name(method)]
        assert _point(fixed[2]) == pytest.approx(np.median(v["pi_soft_nc_fixed"]), abs=5.1e-4)
    paired = _table(tables["paired"])["Grad-ELLM (depth 4)"]
    lead = values["grad_ellm[n_layers=4]"]["pi_soft_ns"] - values["random"]["pi_soft_ns"]
    assert _point(paired[1]) == pytest.approx(lead.mean(), abs=5.1e-4)
    per_pi = _table(tables["per_pi"])
    assert per_pi["Grad-ELLM (depth 4)"][1:] == ["0.05–0.5", "0.55–0.95"] * 2
    assert "random" not in per_pi
    # Soft-NS rises with E[R] here (by construction): Spearman +1 over the three methods
    assert tables["spearman_soft_ns_retained"] == "1.000"
    raw = _table(tables["raw"])["DeepLIFT (ℓ²)"]
    assert float(raw[3]) == pytest.approx(
        values["deeplift[pooling=l2]"]["expected_retained_ns"].mean(), abs=5.1e-3
    )


def test_the_paper_column_takes_the_label_with_most_items(synthetic) -> None:
    path, _ = synthetic
    records = pisoft_tables.by_method(pisoft_tables.labelled_records(path))
    labels = pisoft_tables.paper_methods(sorted(records), records)
    mapped = dict(zip(pisoft_tables.PAPER_COLUMNS, labels, strict=True))
    assert mapped["Ours"] == "grad_ellm[n_layers=4]"
    assert mapped["DL"] == "deeplift[pooling=l2]" and mapped["Rnd"] == "random"
    assert mapped["Attn"] is None and mapped["VZ"] is None
    paper = _table(pisoft_tables.pisoft_tables(path, n_resamples=10, sections=["paper"])["paper"])
    assert paper["pi_soft_ns"][1].endswith("(3)")  # three of the nine columns are in the run


def test_rows_are_over_the_items_every_shown_method_holds(synthetic) -> None:
    path, values = synthetic
    both = ["grad_ellm[n_layers=1]", "deeplift[pooling=l2]"]
    tables = pisoft_tables.pisoft_tables(path, methods=both, n_resamples=10)
    assert tables["items"] == "10 items held by every method (of 30)"
    assert {row[1] for row in _table(tables["reach"]).values()} == {"10"}
    dynamic = _table(tables["dynamic"])["DeepLIFT (ℓ²)"]
    first_ten = values["deeplift[pooling=l2]"]["pi_soft_ns"][:10]
    assert _point(dynamic[1]) == pytest.approx(first_ten.mean(), abs=5.1e-4)
    own = pisoft_tables.pisoft_tables(path, methods=both, n_resamples=10, common_items=False)
    assert "items" not in own
    assert {row[1] for row in _table(own["reach"]).values()} == {"10", "30"}


def test_bad_requests_name_the_problem(synthetic, tmp_path) -> None:
    path, _ = synthetic
    with pytest.raises(ValueError, match="no π-Soft records of \\['ig'\\]"):
        pisoft_tables.pisoft_tables(path, methods=["ig"])
    with pytest.raises(ValueError, match="unknown sections"):
        pisoft_tables.pisoft_tables(path, sections=["dynamc"])
    with pytest.raises(ValueError, match="no deletion_flip_auc records"):
        pisoft_tables.pisoft_tables(path, curves_journal=path, sections=["curves"])
    without_random = tmp_path / "no-random" / "records.jsonl.gz"
    journal = Journal.open(without_random, {"experiment": "faithfulness"})
    rng = np.random.default_rng(0)
    journal.append(
        "sst2:ab12|gradient",
        list(range(N_ITEMS)),
        _rows("gradient", _method_values(rng, 0.1, 3.0)),
        batch_size=4,
        bucket=0,
    )
    with pytest.raises(ValueError, match="holds no π-Soft records of random"):
        pisoft_tables.pisoft_tables(without_random, sections=["dynamic", "per_pi"])
    assert (
        "Gradient" in pisoft_tables.pisoft_tables(without_random, sections=["dynamic"])["dynamic"]
    )
    other = tmp_path / "records.jsonl.gz"
    journal = Journal.open(other, {"experiment": "faithfulness"})
    journal.append(
        "sst2:ab12|random",
        [0],
        [
            {
                "dataset": "sst2",
                "item": 0,
                "method": "random",
                "metric": "comprehensiveness",
                "value": 0.1,
            }
        ],
        batch_size=1,
        bucket=0,
    )
    with pytest.raises(ValueError, match="no pi_soft_ns records"):
        pisoft_tables.pisoft_tables(other)


def _page_tables(text: str) -> dict[str, dict[str, list[str]]]:
    """The page's tables keyed by their header line."""
    out, lines = {}, text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out[line] = _table("\n".join(lines[i:j]))
    return out


NUMBER = re.compile(r"[−+-]?\d+\.\d+|[−+-]?\d+")


def _numbers(cell: str) -> list[tuple[float, int]]:
    """The numbers of a cell outside its CI brackets, with their printed decimals."""
    text = re.sub(r"\[[^\]]*\]", "", cell)
    return [
        (float(m.replace("−", "-")), len(m.split(".")[1]) if "." in m else 0)
        for m in NUMBER.findall(text)
    ]


def test_the_committed_minilm_page_is_regenerated_from_its_journals() -> None:
    runs = ROOT / "docs" / "results" / "runs"
    page = _page_tables((ROOT / "docs" / "results" / "pisoft_minilm_sst2.md").read_text())
    command = re.search(
        r"--methods '([^']+)'", (ROOT / "docs/results/pisoft_minilm_sst2.md").read_text()
    )
    assert command, "the page names its --methods"
    methods = command.group(1)
    sections = ["reach", "dynamic", "fixed", "raw", "curves", "paper"]
    tables = pisoft_tables.pisoft_tables(
        runs / "pisoft-minilm-sst2",
        curves_journal=runs / "flips-minilm-sst2",
        methods=pisoft_tables.split_method_list(methods),
        n_resamples=10,
        sections=sections,
    )
    for section in sections:
        header, *_ = tables[section].splitlines()
        assert header in page, f"{section}: the page has no table headed {header}"
        got, want = _table(tables[section]), page[header]
        assert sorted(got) == sorted(want), section
        for name, cells in want.items():
            for cell, new in zip(cells[1:], got[name][1:], strict=True):
                a, b = _numbers(cell), _numbers(new)
                assert len(a) == len(b), (section, name, cell, new)
                for (x, digits), (y, _) in zip(a, b, strict=True):
                    # one unit of the last printed digit: the two roundings of one value
                    assert abs(x - y) <= 1.01 * 10.0**-digits, (section, name, cell, new)
