"""Figure sizes follow their content and colour bars stay legible; titles say what is shown."""

from __future__ import annotations

from typing import Any

import pytest

from lens_attrib import Target, attribute
from lens_attrib.plot import COLORBAR_PX, layer_heatmap, method_grid, token_heatmap
from lens_attrib.tiny_models import tiny_gpt2

PROMPTS = ["the cat sat on the", "a dog ran"]
METHODS = ("grad_x_input", "gradient", "normxlogit", "alti", "attention", "logat", "lrp")


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_gpt2(n_layers=12)


@pytest.fixture(scope="module")
def attrs(model: Any) -> dict[str, Any]:
    target = Target(token=[" the", " the"], foil=[" a", " a"])
    return {m: attribute(model, PROMPTS, target, method=m) for m in METHODS}


def map_px(fig: Any) -> float:
    """Height of the plotting area: the figure less its top and bottom margins."""
    layout = fig.layout
    return float(layout.height - layout.margin.t - layout.margin.b)


def check_colorbar(fig: Any) -> None:
    """Vertical: as tall as the map, which is ≥ COLORBAR_PX. Horizontal: below the map (inside
    the figure and within plotly's range for y), across 80 % of the width."""
    bar = fig.data[0].colorbar
    assert fig.layout.height >= map_px(fig) + fig.layout.margin.t
    if bar.orientation == "h":
        assert bar.lenmode == "fraction" and bar.len >= 0.5
        assert bar.yanchor == "top" and -2 <= bar.y < 0
        below = -bar.y * map_px(fig)  # px from the map's bottom edge to the bar's top
        assert fig.layout.margin.b - below >= 60, "no room for the bar, its title and ticks"
    else:
        assert bar.lenmode == "fraction" and bar.len == 1.0
        assert map_px(fig) * bar.len >= COLORBAR_PX


def test_one_row_figures_get_a_horizontal_legible_colour_bar(attrs: dict[str, Any]) -> None:
    fig = token_heatmap(attrs["grad_x_input"])
    check_colorbar(fig)
    assert fig.data[0].colorbar.orientation == "h"
    assert fig.layout.height >= 200  # was a fixed 220 px with a ≈ 5 px vertical bar


@pytest.mark.parametrize("n_rows", [1, 2, 5, 7])
def test_method_grid_height_grows_with_rows_and_bar_stays_legible(
    attrs: dict[str, Any], n_rows: int
) -> None:
    fig = method_grid(list(attrs.values())[:n_rows])
    check_colorbar(fig)
    one_more = method_grid(list(attrs.values())[: n_rows + 1]) if n_rows < 7 else None
    if one_more is not None:
        assert one_more.layout.height >= fig.layout.height
    many = method_grid([a for a in attrs.values()] * 3)  # 21 rows: a vertical bar
    check_colorbar(many)
    assert many.data[0].colorbar.orientation != "h"
    assert map_px(many) >= 21 * 25


def test_layer_heatmap_bar_is_legible_for_few_and_many_layers(attrs: dict[str, Any]) -> None:
    many = layer_heatmap(attrs["normxlogit"])  # 12 layers
    check_colorbar(many)
    few = layer_heatmap(attribute(tiny_gpt2(n_layers=2), PROMPTS, Target(), method="normxlogit"))
    check_colorbar(few)
    assert few.data[0].colorbar.orientation == "h"


def test_grid_title_names_the_shared_target_and_the_target_free_rows(
    attrs: dict[str, Any],
) -> None:
    title = method_grid(list(attrs.values())).layout.title.text
    assert "&#x27;the&#x27; − &#x27;a&#x27;" in title  # the contrastive target, escaped
    assert "target-free rows" in title and "alti, attention" in title
    assert not title.startswith("Methods × tokens → target-free")
    only_free = method_grid([attrs["alti"], attrs["attention"]]).layout.title.text
    assert "all target-free" in only_free
    contrastive = method_grid([attrs["grad_x_input"], attrs["lrp"]]).layout.title.text
    assert "target-free" not in contrastive


def test_grid_title_says_when_rows_explain_different_targets(
    model: Any, attrs: dict[str, Any]
) -> None:
    plain = attribute(model, PROMPTS, Target(token=[" the", " the"]), method="grad_x_input")
    title = method_grid([attrs["grad_x_input"], plain]).layout.title.text
    assert "2 different targets" in title


def test_token_heatmap_title_says_what_it_explains(attrs: dict[str, Any]) -> None:
    assert token_heatmap(attrs["alti"]).layout.title.text.startswith(
        "alti: token relevance for target-free"
    )
    title = token_heatmap(attrs["lrp"]).layout.title.text
    assert title == "lrp: token relevance for &#x27;the&#x27; − &#x27;a&#x27;"
