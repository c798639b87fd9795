"""Every figure function returns a plotly Figure whose data has the right shape and values."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

from lens_attrib import Target, attribute
from lens_attrib.plot import (
    aopc_curves,
    layer_curves,
    layer_heatmap,
    method_grid,
    metric_bars,
    pi_curves,
    token_heatmap,
)
from lens_attrib.tiny_models import tiny_gpt2

PROMPTS = ["the cat sat on the", "a dog ran"]


@pytest.fixture(scope="module")
def model():
    return tiny_gpt2()


@pytest.fixture(scope="module")
def attrs(model):
    return {
        m: attribute(model, PROMPTS, Target(), method=m)
        for m in ("grad_x_input", "gradient", "normxlogit")
    }


def test_token_heatmap_is_signed_and_symmetric(attrs):
    attr = attrs["grad_x_input"]
    fig = token_heatmap(attr, item=1)
    assert isinstance(fig, go.Figure)
    heat = fig.data[0]
    z = np.asarray(heat.z)
    assert z.shape == (1, int(attr.mask[1].sum()))
    np.testing.assert_allclose(z[0], attr.numpy(1))
    assert heat.zmin == -heat.zmax and heat.zmax == pytest.approx(np.abs(z).max())


def test_layer_heatmap_shape(attrs, model):
    attr = attrs["normxlogit"]
    fig = layer_heatmap(attr, item=0)
    z = np.asarray(fig.data[0].z)
    assert z.shape == (model.cfg.n_layers, int(attr.mask[0].sum()))
    assert attr.plot().data[0].type == "heatmap"  # Attribution.plot uses the layer view
    with pytest.raises(ValueError, match="no per-layer"):
        layer_heatmap(attrs["gradient"])


def test_method_grid_rows_are_methods_scaled_to_one(attrs):
    fig = method_grid(list(attrs.values()), item=0)
    z = np.asarray(fig.data[0].z, dtype=float)
    n_tok = int(attrs["gradient"].mask[0].sum())
    assert z.shape == (3, n_tok)
    assert list(fig.data[0].y) == list(attrs)
    np.testing.assert_allclose(np.abs(z).max(axis=1), 1.0)
    # sign and order preserved: each row is a positive multiple of the method's scores
    for row, attr in zip(z, attrs.values()):
        raw = attr.numpy(0)
        np.testing.assert_allclose(row * np.abs(raw).max(), raw, rtol=1e-6)
    raw = method_grid(attrs, item=1, normalize=False)
    np.testing.assert_allclose(np.asarray(raw.data[0].z)[1], attrs["gradient"].numpy(1))


def test_method_grid_rejects_other_inputs(model, attrs):
    other = attribute(model, ["a dog ran", "the cat"], Target(), method="gradient")
    with pytest.raises(ValueError, match="other tokens"):
        method_grid([attrs["gradient"], other], item=0)


def test_pi_curves_two_panels_with_auc():
    pis = torch.tensor([0.1, 0.5, 0.9])
    res = {
        "a": SimpleNamespace(
            pis=pis,
            pi_nc_curve=torch.tensor([[0.2, 0.4, 0.6], [0.4, 0.6, 0.8]]),
            pi_ns_curve=torch.ones(2, 3),
        ),
        "b": SimpleNamespace(pis=pis, pi_nc_curve=torch.zeros(1, 3), pi_ns_curve=torch.ones(1, 3)),
    }
    fig = pi_curves(res)
    assert isinstance(fig, go.Figure) and len(fig.data) == 4
    first = fig.data[0]
    np.testing.assert_allclose(first.y, [0.3, 0.5, 0.7])
    assert first.xaxis == "x" and fig.data[1].xaxis == "x2"
    auc = np.trapezoid([0.3, 0.5, 0.7], [0.1, 0.5, 0.9])
    assert f"AUC {auc:.3f}" in first.name


def test_aopc_curves_with_real_result(model, attrs):
    from lens_attrib.evaluation import aopc

    res = aopc(model, attrs["grad_x_input"], fractions=(0.25, 0.5))
    fig = aopc_curves({"gxi": res})
    assert len(fig.data) == 2
    np.testing.assert_allclose(fig.data[0].y, res.comprehensiveness_k.double().mean(0).numpy())
    np.testing.assert_allclose(fig.data[1].y, res.sufficiency_k.double().mean(0).numpy())
    assert list(fig.data[0].x) == [0.25, 0.5]


def test_metric_bars_groups_methods_and_skips_layers():
    summary = [
        {"method": "a", "metric": "pg", "layer": None, "mean": 0.5, "std": 0.1},
        {"method": "b", "metric": "pg", "layer": None, "mean": 0.25, "std": 0.2},
        {"method": "a", "metric": "mrr", "layer": None, "mean": 0.75, "std": 0.0},
        {"method": "a", "metric": "mrr", "layer": 3, "mean": 9.0, "std": 0.0},
        {"method": "model", "metric": "model_correct", "layer": None, "mean": 1.0},
    ]
    fig = metric_bars(summary)
    assert [t.name for t in fig.data] == ["pg", "mrr"]
    assert list(fig.data[0].x) == ["a", "b"] and list(fig.data[0].y) == [0.5, 0.25]
    assert list(fig.data[1].y) == [0.75, None]
    with pytest.raises(ValueError):
        metric_bars([])


def test_layer_curves_one_line_per_label():
    fig = layer_curves({"x": [0.1, 0.2, 0.3], "y": [0.5]}, first_layer=1)
    assert [list(t.x) for t in fig.data] == [[1, 2, 3], [1]]
    assert list(fig.data[0].y) == [0.1, 0.2, 0.3]


def test_pruning_curve_names_poolings_only_when_given():
    from lens_attrib.plot import pruning_curve

    def curve(label, acc):
        return SimpleNamespace(label=label, n_pruned=[0, 2, 4], accuracy=acc, n_heads=4)

    curves = [curve("gxi/relu_dim", [1.0, 0.5, 0.0]), curve("random", [1.0, 0.5, 0.5])]
    named = pruning_curve(curves, pooling_labels={"relu_dim": "ReLU dim"})
    assert [t.name for t in named.data] == ["gxi (ReLU dim)", "random"]
    raw = pruning_curve(curves)
    assert [t.name for t in raw.data] == ["gxi (relu_dim)", "random"]
    np.testing.assert_allclose(raw.data[0].y, [1.0, 0.5, 0.0])


def test_token_labels_are_escaped_and_whitespace_visible(model):
    attr = attribute(model, ["the cat"], Target(), method="gradient")
    attr.tokens[0] = ["<b>", "\n cat"]
    fig = token_heatmap(attr)
    assert list(fig.data[0].x) == ["0:&lt;b&gt;", "1:⏎␣cat"]
    assert fig.data[0].zmid == 0.0
    assert "<b>" not in fig.layout.title.text


def test_target_free_methods_are_not_labelled_with_a_target(model):
    attr = attribute(model, ["the cat sat"], Target(), method="embed_norm")
    assert "target-free" in token_heatmap(attr).layout.title.text
    assert "target-free" in attr.to_html()
