"""Plotly figures for attributions and evaluations."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from lens_attrib.attribution import Attribution


def _symmetric_range(values: Any) -> float:
    import numpy as np

    m = float(np.nanmax(np.abs(values))) if np.size(values) else 1.0
    return m or 1.0


def token_heatmap(attribution: Attribution, item: int = 0, title: str | None = None) -> go.Figure:
    """Signed relevance of every real token of one item (diverging colours, zero = white)."""
    scores = attribution.numpy(item)
    tokens = attribution.tokens[item]
    labels = [f"{i}:{t}" for i, t in enumerate(tokens)]
    vmax = _symmetric_range(scores)
    fig = go.Figure(
        go.Heatmap(
            z=[scores],
            x=labels,
            y=[attribution.method],
            zmin=-vmax,
            zmax=vmax,
            colorscale="RdBu_r",
            text=[[t for t in tokens]],
            texttemplate="%{text}",
            hovertemplate="%{x}<br>relevance %{z:.4g}<extra></extra>",
        )
    )
    fig.update_layout(
        title=title or f"{attribution.method} → {attribution._target_label(item)}",
        height=220,
        xaxis={"showticklabels": False},
    )
    return fig


def layer_heatmap(attribution: Attribution, item: int = 0, title: str | None = None) -> go.Figure:
    """Layer × token relevance (logit-lens style) of one item."""
    if attribution.layer_scores is None:
        raise ValueError(f"{attribution.method!r} has no per-layer scores: use token_heatmap.")
    mask = attribution.mask[item]
    z = attribution.layer_scores[item][:, mask].detach().cpu().double().numpy()
    tokens = attribution.tokens[item]
    vmax = _symmetric_range(z)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[f"{i}:{t}" for i, t in enumerate(tokens)],
            y=[f"layer {layer}" for layer in range(z.shape[0])],
            zmin=-vmax,
            zmax=vmax,
            colorscale="RdBu_r",
            hovertemplate="%{y} %{x}<br>relevance %{z:.4g}<extra></extra>",
        )
    )
    fig.update_layout(
        title=title or f"{attribution.method} per layer → {attribution._target_label(item)}",
        height=max(300, 18 * z.shape[0]),
    )
    return fig


def pruning_curve(curves: Any, metric: str = "accuracy", title: str | None = None) -> go.Figure:
    """Head-pruning curves: ``metric`` vs number of pruned heads, one line per label.

    ``curves``: a :class:`lens_attrib.pruning.PruningResult`, or a list of ``PruningCurve``.
    Curves sharing a label (the random baseline's seeds) are drawn as their mean with a ± std
    band; every other label (``method/pooling``) as one line.
    """
    import numpy as np

    from lens_attrib.pruning import POOLINGS

    curve_list = list(getattr(curves, "curves", curves))
    if not curve_list:
        raise ValueError("No pruning curves to plot.")
    groups: dict[str, list[Any]] = {}
    for curve in curve_list:
        groups.setdefault(curve.label, []).append(curve)
    fig = go.Figure()
    for label, group in groups.items():
        x = np.asarray(group[0].n_pruned)
        if any(list(c.n_pruned) != list(x) for c in group):
            raise ValueError(f"Curves labelled {label!r} are recorded at different points.")
        values = np.array([getattr(c, metric) for c in group], dtype=np.float64)
        mean = values.mean(0)
        method, _, pooling = label.partition("/")
        name = f"{method} ({POOLINGS.get(pooling, pooling)})" if pooling else label
        if len(group) > 1:
            std = values.std(0)
            name = f"{name} (mean ± std, n={len(group)})"
            fig.add_trace(
                go.Scatter(
                    x=np.concatenate([x, x[::-1]]),
                    y=np.concatenate([mean + std, (mean - std)[::-1]]),
                    fill="toself",
                    fillcolor="rgba(128,128,128,0.25)",
                    line={"width": 0},
                    hoverinfo="skip",
                    showlegend=False,
                    legendgroup=label,
                )
            )
        fig.add_trace(
            go.Scatter(
                x=x,
                y=mean,
                mode="lines",
                name=name,
                legendgroup=label,
                line={"color": "gray", "dash": "dash"} if len(group) > 1 else None,
                hovertemplate=f"{name}<br>%{{x}} pruned<br>{metric} %{{y:.3f}}<extra></extra>",
            )
        )
    n_heads = curve_list[0].n_heads
    fig.update_layout(
        title=title or f"Head pruning: {metric.replace('_', ' ')} vs heads pruned (of {n_heads})",
        xaxis_title="number of pruned heads",
        yaxis_title=metric.replace("_", " "),
        height=500,
    )
    return fig
