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
