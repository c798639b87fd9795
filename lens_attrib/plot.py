"""Plotly figures for attributions and evaluations."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import plotly.graph_objects as go

from lens_attrib.display import escape_token
from lens_attrib.display import explained_title as _explained_title
from lens_attrib.display import grid_title as _grid_title
from lens_attrib.display import row_explains as _row_explains
from lens_attrib.display import token_axis_labels as _token_labels

if TYPE_CHECKING:  # plot reads Attributions; it imports neither them nor methods at run time
    from lens_attrib.attribution import Attribution


# Heatmap sizes: every row gets ROW_PX; the colour bar is vertical beside the map when the map is
# at least COLORBAR_PX tall, else horizontal below it (its length then follows the width).
ROW_PX = 30
COLORBAR_PX = 180
TITLE_PX = 70
HORIZONTAL_BAR_PX = 80
"""Room below the map for a horizontal colour bar with its title and tick labels."""


def _fit_heatmap(fig: go.Figure, n_rows: int, *, row_px: int, axis_px: int, title: str) -> None:
    """Height from the content: ``n_rows · row_px`` of map, ``axis_px`` of x tick labels below it,
    the title above, and a colour bar at least :data:`COLORBAR_PX` long (vertical, as tall as the
    map) or, for short maps, horizontal below the map across most of its width."""
    map_px = max(1, n_rows) * row_px
    if map_px < COLORBAR_PX:  # plotly places a colour bar at most 2 map heights below the map
        map_px = max(map_px, math.ceil((axis_px + 12) / 1.9))
    if map_px >= COLORBAR_PX:
        # just above the switch keep the horizontal layout's height, so that heights grow
        # with the number of rows
        bottom = axis_px + 20 + max(0, HORIZONTAL_BAR_PX - 20 - (map_px - COLORBAR_PX))
        colorbar: dict[str, Any] = {"len": 1.0, "lenmode": "fraction", "thickness": 18}
    else:
        bottom = axis_px + HORIZONTAL_BAR_PX
        colorbar = {
            "orientation": "h",
            "len": 0.8,
            "lenmode": "fraction",
            "thickness": 14,
            "x": 0.5,
            "xanchor": "center",
            "y": -(axis_px + 12) / map_px,  # in map heights below its bottom edge
            "yanchor": "top",
            "title": {"side": "top"},
        }
    fig.update_traces(colorbar=colorbar, selector={"type": "heatmap"})
    fig.update_layout(
        title=title,
        height=TITLE_PX + map_px + bottom,
        margin={"t": TITLE_PX, "b": bottom, "l": 90, "r": 40},
    )


def _symmetric_range(values: Any) -> float:
    import numpy as np

    m = float(np.nanmax(np.abs(values))) if np.size(values) else 1.0
    return m or 1.0


def segment_boundaries(attribution: Attribution, item: int) -> list[int]:
    """Real-token indices where a new segment (sentence pair: ``token_types``) begins."""
    if attribution.token_types is None:
        return []
    types = attribution.token_types[item][attribution.mask[item]].tolist()
    return [i for i in range(1, len(types)) if types[i] != types[i - 1]]


def _mark_segments(fig: go.Figure, attribution: Attribution, item: int) -> go.Figure:
    """A black vertical line between the segments of a sentence pair."""
    for start in segment_boundaries(attribution, item):
        fig.add_vline(x=start - 0.5, line={"color": "black", "width": 3})
    return fig


def token_heatmap(attribution: Attribution, item: int = 0, title: str | None = None) -> go.Figure:
    """Signed relevance of every real token of one item (diverging colours, zero = white)."""
    scores = attribution.numpy(item)
    tokens = attribution.tokens[item]
    labels = _token_labels(tokens)
    vmax = _symmetric_range(scores)
    fig = go.Figure(
        go.Heatmap(
            z=[scores],
            x=labels,
            y=[attribution.method],
            zmin=-vmax,
            zmax=vmax,
            zmid=0.0,
            colorscale="RdBu_r",
            colorbar={"title": {"text": "relevance"}},
            text=[[escape_token(t) for t in tokens]],
            texttemplate="%{text}",
            hovertemplate="%{x}<br>relevance %{z:.4g}<extra></extra>",
        )
    )
    fig.update_layout(xaxis={"showticklabels": False})
    prefix = f"{attribution.method}: token relevance for "
    _fit_heatmap(
        fig,
        1,
        row_px=2 * ROW_PX,
        axis_px=0,
        title=title or _explained_title(prefix, attribution, item),
    )
    return _mark_segments(fig, attribution, item)


def layer_heatmap(attribution: Attribution, item: int = 0, title: str | None = None) -> go.Figure:
    """Layer × token relevance (logit-lens style) of one item."""
    if attribution.layer_scores is None:
        raise ValueError(f"{attribution.method!r} has no per-layer scores: use token_heatmap.")
    mask = attribution.mask[item]
    z = attribution.layer_scores[item][:, mask].detach().cpu().double().numpy()
    tokens = attribution.tokens[item]
    layers = list(attribution.meta.get("layers") or range(z.shape[0]))
    if len(layers) != z.shape[0]:
        layers = list(range(z.shape[0]))
    vmax = _symmetric_range(z)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=_token_labels(tokens),
            y=[f"layer {layer}" for layer in layers],
            zmin=-vmax,
            zmax=vmax,
            zmid=0.0,
            colorscale="RdBu_r",
            colorbar={"title": {"text": "relevance"}},
            hovertemplate="%{y} %{x}<br>relevance %{z:.4g}<extra></extra>",
        )
    )
    fig.update_layout(xaxis={"tickangle": -45})
    prefix = f"{attribution.method}, layer × token relevance for "
    _fit_heatmap(
        fig,
        z.shape[0],
        row_px=18,
        axis_px=min(160, 20 + 5 * max((len(x) for x in _token_labels(tokens)), default=0)),
        title=title or _explained_title(prefix, attribution, item),
    )
    return _mark_segments(fig, attribution, item)


# --------------------------------------------------------------------------- comparisons
def _row_normalized(values: Any) -> Any:
    """Each row divided by its max |value| (rows of zeros stay zero)."""
    import numpy as np

    arr = np.asarray(values, dtype=np.float64)
    denom = np.nanmax(np.abs(arr), axis=-1, keepdims=True) if arr.size else np.ones((0, 1))
    return arr / np.where(denom > 0, denom, 1.0)


def method_grid(
    attributions: Sequence[Attribution] | Mapping[str, Attribution],
    item: int = 0,
    normalize: bool = True,
    title: str | None = None,
) -> go.Figure:
    """Methods × tokens heatmap for one sentence (each row scaled to max |score| = 1).

    ``attributions``: Attributions of the same inputs (a list, or label -> Attribution). The
    ``z`` matrix is ``[n_methods, n_real_tokens]`` of ``item``; ``normalize=False`` keeps raw
    scores (then the colour range is the global max |score|).
    """
    import numpy as np

    named = (
        list(attributions.items())
        if isinstance(attributions, Mapping)
        else [(a.method, a) for a in attributions]
    )
    if not named:
        raise ValueError("method_grid needs at least one Attribution.")
    tokens = named[0][1].tokens[item]
    rows = []
    for label, attr in named:
        if attr.tokens[item] != tokens:
            raise ValueError(f"{label!r} explains other tokens than {named[0][0]!r}.")
        rows.append(attr.numpy(item))
    z = _row_normalized(rows) if normalize else np.asarray(rows, dtype=np.float64)
    vmax = 1.0 if normalize else _symmetric_range(z)
    bar = "score ÷ row max |score|" if normalize else "relevance"
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=_token_labels(tokens),
            y=[label for label, _ in named],
            zmin=-vmax,
            zmax=vmax,
            zmid=0.0,
            colorscale="RdBu_r",
            colorbar={"title": {"text": bar}},
            text=[[escape_token(t) for t in tokens]] * len(named),
            texttemplate="%{text}",
            customdata=[[_row_explains(a, item)] * len(tokens) for _, a in named],
            hovertemplate="%{y} %{x}<br>%{customdata}<br>relevance %{z:.3g}<extra></extra>",
        )
    )
    fig.update_layout(xaxis={"showticklabels": False}, yaxis={"autorange": "reversed"})
    _fit_heatmap(fig, len(named), row_px=ROW_PX, axis_px=0, title=title or _grid_title(named, item))
    return _mark_segments(fig, named[0][1], item)


def _to_numpy(values: Any) -> Any:
    """A float64 numpy array of a tensor, array or sequence of numbers."""
    import numpy as np

    if hasattr(values, "detach"):
        return values.detach().cpu().double().numpy()
    return np.asarray([float(v) for v in values], dtype=np.float64)


def _curve_mean(values: Any) -> Any:
    import numpy as np

    arr = np.asarray(
        values.detach().cpu().double() if hasattr(values, "detach") else values, dtype=np.float64
    )
    return np.nanmean(arr.reshape(-1, arr.shape[-1]), axis=0)


def pi_curves(results: Mapping[str, Any], title: str | None = None) -> go.Figure:
    """π-Soft-NC and π-Soft-NS curves (mean over items) with their AUC, one line per method.

    ``results``: label -> :class:`lens_attrib.evaluation.SoftResult` (or any object with
    ``pis``, ``pi_nc_curve`` ``[batch, pi]`` and ``pi_ns_curve``). Two subplots (NC left, NS
    right); the legend gives the trapezoid AUC of the mean curve over the π grid.
    """
    import numpy as np
    from plotly.subplots import make_subplots

    if not results:
        raise ValueError("pi_curves needs at least one result.")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("π-Soft-NC (↑)", "π-Soft-NS (↑)"))
    for k, (label, res) in enumerate(results.items()):
        pis = _curve_mean(res.pis)
        for col, curve in ((1, res.pi_nc_curve), (2, res.pi_ns_curve)):
            mean = _curve_mean(curve)
            auc = float(np.trapezoid(mean, pis)) if len(pis) > 1 else float("nan")
            fig.add_trace(
                go.Scatter(
                    x=pis,
                    y=mean,
                    mode="lines+markers",
                    name=f"{label} (AUC {auc:.3f})",
                    legendgroup=f"{label}-{col}",
                    line={"color": _colour(k)},
                ),
                row=1,
                col=col,
            )
    fig.update_xaxes(title_text="π (expected share perturbed / kept)")
    fig.update_layout(title=title or "π-Soft curves", height=420)
    return fig


def aopc_curves(results: Mapping[str, Any], title: str | None = None) -> go.Figure:
    """Comprehensiveness and sufficiency vs fraction perturbed (mean over items), per method.

    ``results``: label -> :class:`lens_attrib.evaluation.AOPCResult` (``fractions``,
    ``comprehensiveness_k`` ``[batch, k]``, ``sufficiency_k``); the legend gives the AOPC (the
    mean over the fractions).
    """
    from plotly.subplots import make_subplots

    if not results:
        raise ValueError("aopc_curves needs at least one result.")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("comprehensiveness (↑)", "sufficiency (↓)"))
    for k, (label, res) in enumerate(results.items()):
        fractions = _to_numpy(res.fractions)  # tensors of 0-d tensors make plotly warn
        for col, curve in ((1, res.comprehensiveness_k), (2, res.sufficiency_k)):
            mean = _curve_mean(curve)
            fig.add_trace(
                go.Scatter(
                    x=fractions,
                    y=mean,
                    mode="lines+markers",
                    name=f"{label} (AOPC {float(mean.mean()):.3f})",
                    legendgroup=f"{label}-{col}",
                    line={"color": _colour(k)},
                ),
                row=1,
                col=col,
            )
    fig.update_xaxes(title_text="fraction of tokens removed / kept")
    fig.update_yaxes(title_text="p(x) − p(perturbed)")
    fig.update_layout(title=title or "AOPC curves", height=420)
    return fig


def metric_bars(
    summary: Any,
    metrics: Sequence[str] | None = None,
    title: str | None = None,
    error: bool = True,
) -> go.Figure:
    """Grouped bars: one group per method, one bar per metric (mean with error bars).

    ``summary``: rows with ``method``, ``metric``, ``mean`` (optional ``ci_low``/``ci_high``
    or ``std``, and ``layer``) — e.g. ``EvalResult.summary``, an ``EvalResult`` or
    :func:`lens_attrib.report.ci_rows`. Error bars: the interval ``[ci_low, ci_high]`` when the
    rows have one, else ± std. Per-layer rows (``layer`` not None) and the ``model``
    pseudo-method are left out.
    """
    rows = [
        r
        for r in getattr(summary, "summary", summary)
        if r.get("layer") is None and r.get("method") != "model"
    ]
    names = list(dict.fromkeys(r["metric"] for r in rows)) if metrics is None else list(metrics)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    if not rows or not names:
        raise ValueError("metric_bars needs summary rows with method, metric and mean.")
    table = {(r["method"], r["metric"]): r for r in rows}
    with_ci = any("ci_low" in r for r in rows)
    fig = go.Figure()
    for metric in names:
        cells = [table.get((m, metric), {}) for m in methods]
        means = [c.get("mean") for c in cells]
        bars: dict[str, Any] | None
        if with_ci:
            up = [_gap(c.get("ci_high"), c.get("mean")) for c in cells]
            down = [_gap(c.get("mean"), c.get("ci_low")) for c in cells]
            bars = {"type": "data", "array": up, "arrayminus": down, "visible": True}
        else:
            stds = [c.get("std") for c in cells]
            has_std = any(s is not None for s in stds)
            bars = {"type": "data", "array": stds, "visible": True} if has_std else None
        fig.add_trace(go.Bar(x=methods, y=means, name=metric, error_y=bars if error else None))
    fig.update_layout(
        title=title or ("Metrics by method (95% CI)" if with_ci else "Metrics by method"),
        barmode="group",
        height=420,
        yaxis_title="mean",
    )
    return fig


def _gap(high: float | None, low: float | None) -> float | None:
    if high is None or low is None:
        return None
    return float(high) - float(low)


def layer_curves(
    series: Mapping[str, Sequence[float]],
    title: str | None = None,
    yaxis: str = "value",
    first_layer: int = 0,
) -> go.Figure:
    """One line per label over layers (e.g. per-layer dot product of each method)."""
    fig = go.Figure()
    for k, (label, values) in enumerate(series.items()):
        values = list(values)
        x = list(range(first_layer, first_layer + len(values)))
        fig.add_trace(
            go.Scatter(
                x=x,
                y=values,
                mode="lines+markers" if len(values) > 1 else "markers",
                name=label,
                line={"color": _colour(k)},
            )
        )
    fig.update_layout(title=title or yaxis, xaxis_title="layer", yaxis_title=yaxis, height=420)
    return fig


def _colour(k: int) -> str:
    import plotly.colors

    palette = plotly.colors.qualitative.Plotly
    return palette[k % len(palette)]


def pruning_curve(
    curves: Any,
    metric: str = "accuracy",
    title: str | None = None,
    pooling_labels: Mapping[str, str] | None = None,
) -> go.Figure:
    """Head-pruning curves: ``metric`` vs number of pruned heads, one line per label.

    ``curves``: a :class:`lens_attrib.pruning.PruningResult`, or a list of ``PruningCurve``.
    Curves sharing a label (the random baseline's seeds) are drawn as their mean with a ± std
    band; every other label (``method/pooling``) as one line, named ``method (pooling label)``
    when ``pooling_labels`` (e.g. ``lens_attrib.pruning.POOLINGS``) names the pooling.
    """
    import numpy as np

    names_of_poolings = dict(pooling_labels or {})

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
        name = f"{method} ({names_of_poolings.get(pooling, pooling)})" if pooling else label
        if len(group) > 1:
            std = values.std(0)
            name = f"{name} (mean ± std, n={len(group)})"
            fig.add_trace(
                go.Scatter(
                    x=np.concatenate([x, x[::-1]]),
                    y=np.concatenate([mean + std, (mean - std)[::-1]]),
                    mode="lines",
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


# --------------------------------------------------------------------------- per-head relevances
def head_heatmap(attribution: Attribution, item: int = 0, title: str | None = None) -> go.Figure:
    """Layer × head heatmap of ``head_scores[item]`` (signed, diverging colours, zero = white).

    Rows are layers (the real layer numbers), columns heads; methods fill ``head_scores`` with
    ``heads=True`` (LRP/AttnLRP, gradients) or always (ALTI-Logit).
    """
    if attribution.head_scores is None:
        raise ValueError(
            f"This {attribution.method!r} Attribution has no head_scores: run a method with "
            "per-head relevances (e.g. attnlrp or grad_x_input with heads=True, or alti_logit)."
        )
    if not -len(attribution) <= item < len(attribution):
        raise IndexError(f"item {item} is outside this Attribution of {len(attribution)} items.")
    z = attribution.head_scores[item].detach().cpu().double().numpy()
    n_layers, n_heads = z.shape
    vmax = _symmetric_range(z)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[f"head {h}" for h in range(n_heads)],
            y=[f"layer {layer}" for layer in range(n_layers)],
            zmin=-vmax,
            zmax=vmax,
            zmid=0.0,
            colorscale="RdBu_r",
            colorbar={"title": {"text": "relevance"}},
            hovertemplate="%{y} %{x}<br>relevance %{z:.4g}<extra></extra>",
        )
    )
    fig.update_layout(yaxis={"autorange": "reversed"})
    _fit_heatmap(
        fig,
        n_layers,
        row_px=18,
        axis_px=40,
        title=title or _explained_title(f"{attribution.method} per head → ", attribution, item),
    )
    return fig


# --------------------------------------------------------------------------- generations
BLANK_GREY = "#b4b4b4"
"""Background of a step × token map, seen where a cell is blank (outside the diverging scale,
whose zero is white)."""


def _blank_after_explained(attribution: Attribution, row: int, n_units: int) -> list[bool]:
    """Per real token (or aggregated unit) of ``row``: after the explained position (cannot
    influence a causal model's step, shown blank rather than as a zero)."""
    if not attribution.meta.get("causal", False):
        return [False] * n_units
    units = attribution.meta.get("unit_tokens")
    explained = attribution.meta.get("explained_token")
    if isinstance(units, list) and isinstance(explained, list):  # aggregated: words, roles
        at = int(explained[row])
        return [min(members) > at for members in units[row]]
    first = int(attribution.mask[row].nonzero().min())
    at = int(attribution.target.positions[row]) - first
    return [j > at for j in range(n_units)]


def step_heatmap(attribution: Attribution, prompt: int = 0, title: str | None = None) -> go.Figure:
    """Step × token heatmap of one prompt's generation (``Target(generate=N)`` /
    ``Target(continuation=...)``): one row per step (labelled with the token it explains, and
    its foil), one column per token of the sequence the steps share (prompt + continuation), or
    per word / span / role of an aggregated Attribution (``to_words``, ``to_roles``).

    Signed relevance in diverging colours (zero = white, one colour range for the whole map);
    cells after each step's explained position are left blank (NaN, shown in the grey
    background, not zero-coloured): the causal triangle. A black line marks where the prompt
    ends (token columns).
    """
    import numpy as np

    if "generated_ids" not in attribution.meta:
        raise ValueError(
            f"step_heatmap shows the steps of a generation; this {attribution.method!r} "
            "Attribution explains no Target(generate=N) or Target(continuation=...): use "
            "token_heatmap or layer_heatmap."
        )
    steps = attribution.prompt_steps(prompt)
    widths = [int(steps.mask[r].sum()) for r in range(len(steps))]
    columns = steps.tokens[int(np.argmax(widths))]
    z = np.full((len(steps), len(columns)), np.nan)
    for r in range(len(steps)):
        if list(steps.tokens[r]) != list(columns[: widths[r]]):
            raise ValueError(f"Step rows of prompt {prompt} do not share their tokens.")
        values = steps.item_scores(r).detach().cpu().double().numpy()
        blank = _blank_after_explained(steps, r, widths[r])
        z[r, : widths[r]] = np.where(blank, np.nan, values)
    targets = steps.meta.get("target_tokens") or [
        str(int(t)) for t in steps.target.token_ids.tolist()
    ]
    foils = steps.meta.get("foil_tokens")
    rows = []
    for r, s in enumerate(steps.meta["step_index"]):
        label = f"{s}: {escape_token(targets[r])}"
        if foils:
            label += f" − {escape_token(foils[r])}"
        rows.append(label)
    vmax = _symmetric_range(z[~np.isnan(z)]) if np.any(~np.isnan(z)) else 1.0
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=_token_labels(columns),
            y=rows,
            zmin=-vmax,
            zmax=vmax,
            zmid=0.0,
            colorscale="RdBu_r",
            hoverongaps=False,
            colorbar={"title": {"text": "relevance"}},
            hovertemplate="step %{y}<br>%{x}<br>relevance %{z:.4g}<extra></extra>",
        )
    )
    fig.update_layout(  # blank cells show the grey background: not a colour of the scale
        xaxis={"tickangle": -45, "showgrid": False, "zeroline": False},
        yaxis={"autorange": "reversed", "showgrid": False, "zeroline": False},
        plot_bgcolor=BLANK_GREY,
    )
    prompt_length = steps.meta.get("prompt_length")
    if "unit_tokens" not in steps.meta and isinstance(prompt_length, int):
        fig.add_vline(x=prompt_length - 0.5, line={"color": "black", "width": 2})
    unit = (steps.meta.get("aggregation") or {}).get("unit", "token")
    heading = f"{attribution.method}: step × {unit} relevance"
    if isinstance(attribution.meta.get("prompt_length"), list):
        heading += f" (prompt {prompt})"
    heading += "; grey: after the step's explained token"
    _fit_heatmap(
        fig,
        len(rows),
        row_px=ROW_PX,
        axis_px=min(160, 20 + 5 * max((len(x) for x in _token_labels(columns)), default=0)),
        title=title or heading,
    )
    return fig
