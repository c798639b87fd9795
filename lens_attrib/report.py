"""Self-contained HTML reports: a stylesheet, plotly.js inlined once, token maps, tables with
confidence intervals and a footer. A page needs no network: it opens on a cluster node, offline.

Building blocks (each returns an HTML string; every token and label is HTML-escaped with the
helpers of :mod:`lens_attrib.display`):

- :func:`token_map_html` — tokens coloured on a diverging scale centred at 0 with a legend;
  whitespace made visible (``␣``, ``⏎``, ``⇥``). Inline styles only, so that it renders the same
  in a report, in Jupyter (``Attribution._repr_html_``) and in an exported notebook.
- :func:`figure_html` — a plotly figure without its library (the page carries it once).
- :func:`ci_table_html` — a method × metric table of means with ``n`` and 95% bootstrap
  intervals over items (:func:`lens_attrib.evaluation.stats.bootstrap_ci`).
- :func:`footer_html`, :func:`page_html`, :func:`write_page`.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lens_attrib.display import escape_token, visible_token

if TYPE_CHECKING:
    from lens_attrib.attribution import Attribution

STYLESHEET = """
:root { --fg: #1f2328; --muted: #59636e; --line: #d1d9e0; --bg-alt: #f6f8fa; }
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
       max-width: 1200px; margin: 0 auto; padding: 24px 32px 0; }
h1 { font-size: 1.6em; margin: 0 0 4px; }
h2 { font-size: 1.25em; margin: 32px 0 8px; padding-bottom: 4px;
     border-bottom: 1px solid var(--line); }
h3 { font-size: 1.05em; margin: 20px 0 6px; }
p.lead, p.note, figcaption, .muted { color: var(--muted); }
p.note, figcaption { font-size: 0.9em; }
code, pre, .tok { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
pre { background: var(--bg-alt); padding: 10px 12px; border-radius: 6px; overflow-x: auto;
      font-size: 0.85em; }
table.data { border-collapse: collapse; margin: 8px 0 4px; font-size: 0.92em; }
table.data th, table.data td { border: 1px solid var(--line); padding: 4px 10px; }
table.data th { background: var(--bg-alt); text-align: left; }
table.data td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap;
                    line-height: 1.25; }
table.data td .ci { color: var(--muted); font-size: 0.85em; }
table.data tr:nth-child(even) td { background: #fbfcfd; }
figure.fig { margin: 12px 0 20px; }
div.wide { overflow-x: auto; max-width: 100%; }
details > summary { cursor: pointer; color: var(--muted); }
footer { margin-top: 40px; padding: 12px 0 24px; border-top: 1px solid var(--line);
         color: var(--muted); font-size: 0.85em; }
footer dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 12px; margin: 0; }
footer dt { font-weight: 600; }
footer dd { margin: 0; }
"""

NEGATIVE_RGB = (33, 102, 172)
"""Colour of score ÷ scale = −1 (RdBu's blue end); +1 is :data:`POSITIVE_RGB`, 0 is white."""
POSITIVE_RGB = (178, 24, 43)


# --------------------------------------------------------------------------- colours
def diverging_rgb(value: float) -> tuple[int, int, int]:
    """Colour of ``value`` ∈ [−1, 1] (clipped): linear from blue (−1) through white (0) to red."""
    v = 0.0 if math.isnan(value) else max(-1.0, min(1.0, value))
    end = POSITIVE_RGB if v >= 0 else NEGATIVE_RGB
    a = abs(v)
    r, g, b = (round(255 + a * (c - 255)) for c in end)
    return r, g, b


def _css_rgb(rgb: tuple[int, int, int]) -> str:
    return f"rgb({rgb[0]},{rgb[1]},{rgb[2]})"


@dataclass
class TokenRow:
    """One line of a token map: a label, what it explains, its tokens and their scores."""

    label: str
    explains: str
    tokens: list[str]
    scores: np.ndarray


def attribution_rows(
    attribution: Attribution, items: Iterable[int] | None = None, label: str | None = None
) -> list[TokenRow]:
    """Token rows of ``items`` (default: all) of one Attribution (real tokens only)."""
    picked = range(len(attribution)) if items is None else items
    return [
        TokenRow(
            label=label or attribution.method,
            explains=attribution.explained_label(i),
            tokens=list(attribution.tokens[i]),
            scores=np.asarray(attribution.numpy(i), dtype=np.float64),
        )
        for i in picked
    ]


def _max_abs(scores: np.ndarray) -> float:
    finite = np.abs(scores[np.isfinite(scores)])
    return float(finite.max()) if finite.size else 0.0


def colour_legend_html(note: str) -> str:
    """The colour bar (−1 … 0 … +1) with a sentence saying what 1 is."""
    stops = ", ".join(_css_rgb(diverging_rgb(v)) for v in (-1.0, -0.5, 0.0, 0.5, 1.0))
    bar = (
        f'<span style="display:inline-block;width:180px;height:12px;border:1px solid #d1d9e0;'
        f'background:linear-gradient(to right, {stops})"></span>'
    )
    return (
        '<div class="la-legend" style="display:flex;align-items:center;gap:6px;'
        'font-size:0.85em;color:#59636e;margin:4px 0 8px">'
        f"<span>−1</span>{bar}<span>+1</span><span>{html.escape(note)}</span></div>"
    )


def token_map_html(rows: Sequence[TokenRow], *, shared_scale: bool = False) -> str:
    """Rows of coloured tokens: colour = score ÷ scale on a diverging map centred at 0.

    ``shared_scale=False``: each row is divided by its own max |score| (given in the last
    column); ``True``: every row by the largest max |score| of all rows. Hovering a token shows
    its position and raw score. Inline styles only (renders in Jupyter as in a report).
    """
    if not rows:
        raise ValueError("token_map_html needs at least one row.")
    shared = max(_max_abs(r.scores) for r in rows)
    cell = "padding:3px 8px;border-bottom:1px solid #eaeef2;vertical-align:top;text-align:left"
    lines = [
        '<div class="la-tokmap" style="font-size:14px;margin:6px 0">',
        '<table style="border-collapse:collapse">',
        f'<tr><th style="{cell}">method</th><th style="{cell}">explains</th>'
        f'<th style="{cell}">tokens</th><th style="{cell}">max |score|</th></tr>',
    ]
    for row in rows:
        row_max = _max_abs(row.scores)
        scale = shared if shared_scale else row_max
        spans = []
        for pos, (tok, score) in enumerate(zip(row.tokens, row.scores.tolist())):
            rel = score / scale if scale > 0 else 0.0
            rgb = diverging_rgb(rel)
            fg = "#fff" if abs(rel) > 0.6 else "#1f2328"
            spans.append(
                f'<span class="tok" title="{pos}: {html.escape(visible_token(tok), quote=True)}'
                f' = {score:+.4g}" style="background:{_css_rgb(rgb)};color:{fg};'
                "padding:1px 2px;margin:0 1px;border-radius:3px;white-space:pre;"
                'font-family:ui-monospace,Menlo,Consolas,monospace">'
                f"{escape_token(tok)}</span>"
            )
        lines.append(
            f'<tr><td style="{cell}"><b>{html.escape(row.label)}</b></td>'
            f'<td style="{cell};white-space:nowrap">{html.escape(row.explains)}</td>'
            f'<td style="{cell};line-height:1.9">{"<wbr>".join(spans)}</td>'
            f'<td style="{cell};text-align:right">{row_max:.3g}</td></tr>'
        )
    lines.append("</table>")
    if shared_scale:
        note = f"colour = score ÷ {shared:.3g} (the largest max |score| of all rows)"
    else:
        note = "colour = score ÷ the row's max |score| (last column)"
    lines.append(
        colour_legend_html(
            f"{note}; red = positive, blue = negative relevance, white = 0; "
            "␣ space, ⏎ newline; hover a token for its raw score"
        )
    )
    lines.append("</div>")
    return "\n".join(lines)


# --------------------------------------------------------------------------- figures and tables
def figure_html(figure: Any, caption: str | None = None) -> str:
    """A plotly figure as a ``<figure>`` without plotly.js (the page inlines it once)."""
    body = figure.to_html(
        full_html=False, include_plotlyjs=False, config={"displaylogo": False, "responsive": True}
    )
    cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return f'<figure class="fig">{body}{cap}</figure>'


def format_number(value: Any, digits: int = 3) -> str:
    """Numbers as fixed-point (``–`` for None/NaN), everything else as text."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int | np.integer):
        return str(int(value))
    if isinstance(value, float | np.floating):
        return "–" if not math.isfinite(float(value)) else f"{float(value):.{digits}f}"
    return str(value)


def table_html(
    header: Sequence[str], rows: Sequence[Sequence[Any]], *, caption: str | None = None
) -> str:
    """A data table; numbers right-aligned, every cell escaped."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = []
    for row in rows:
        cells = []
        for value in row:
            numeric = isinstance(value, int | float | np.integer | np.floating) or value is None
            cls = ' class="num"' if numeric else ""
            cells.append(f"<td{cls}>{html.escape(format_number(value))}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f'<table class="data">{cap}<tr>{head}</tr>{"".join(body)}</table>'


def ci_rows(
    records: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    *,
    value: str = "value",
    level: float = 0.95,
    n_resamples: int = 1000,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One row per distinct ``keys`` of ``records``: the keys, ``n``, ``mean``, ``ci_low``,
    ``ci_high`` (:func:`lens_attrib.evaluation.records.summarize`: percentile bootstrap over the
    records of the group, i.e. over items)."""
    from lens_attrib.evaluation.records import summarize

    return summarize(
        records,
        keys,
        value=value,
        level=level,
        n_resamples=n_resamples,
        seed=seed,
        ordered=False,
    )


def _ci_cell(row: Mapping[str, Any] | None, digits: int) -> str:
    if row is None or row["n"] == 0:
        return '<td class="num">–</td>'
    mean = format_number(row["mean"], digits)
    low, high = format_number(row["ci_low"], digits), format_number(row["ci_high"], digits)
    return (
        f'<td class="num">{mean}<br><span class="ci">[{low}, {high}]</span>'
        f'<br><span class="ci">n={row["n"]}</span></td>'
    )


def ci_table_html(
    records: Sequence[Mapping[str, Any]],
    row_keys: Sequence[str] = ("method",),
    column_key: str = "metric",
    *,
    value: str = "value",
    digits: int = 3,
    level: float = 0.95,
    n_resamples: int = 1000,
    seed: int = 0,
    collapse_over: int = 40,
) -> str:
    """Rows ``row_keys`` (e.g. method) × columns ``column_key`` (metric); each cell is the mean
    of ``value`` over the group's records, its ``level`` bootstrap interval and ``n``. Tables
    longer than ``collapse_over`` rows are folded into a ``<details>``."""
    if not records:
        return ""
    rows = ci_rows(
        records,
        [*row_keys, column_key],
        value=value,
        level=level,
        n_resamples=n_resamples,
        seed=seed,
    )
    columns = list(dict.fromkeys(r[column_key] for r in rows))
    index = {(*(r[k] for k in row_keys), r[column_key]): r for r in rows}
    row_ids = list(dict.fromkeys(tuple(r[k] for k in row_keys) for r in rows))
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in [*row_keys, *columns])
    body = []
    for rid in row_ids:
        left = "".join(f"<td>{html.escape(format_number(v))}</td>" for v in rid)
        cells = "".join(_ci_cell(index.get((*rid, c)), digits) for c in columns)
        body.append(f"<tr>{left}{cells}</tr>")
    note = (
        f'<p class="note">Mean over items [{100 * level:.0f}% percentile-bootstrap interval, '
        f"{n_resamples} resamples of the items, seed {seed}] and n (items with a finite "
        "value).</p>"
    )
    table = (
        f'<div class="wide"><table class="data"><tr>{head}</tr>{"".join(body)}</table></div>{note}'
    )
    if len(row_ids) > collapse_over:
        return f"<details><summary>{len(row_ids)} rows (click to open)</summary>{table}</details>"
    return table


# --------------------------------------------------------------------------- page
def footer_html(
    *,
    command: str,
    model: str | None,
    seconds: float | None,
    date: _dt.datetime | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """Command, model, date (UTC) and wall time: how to make this page again."""
    when = (date or _dt.datetime.now(_dt.UTC)).strftime("%Y-%m-%d %H:%M UTC")
    items = {
        "command": f"<code>{html.escape(command)}</code>",
        "model": html.escape(model or "–"),
        "date": when,
        "wall time": "–" if seconds is None else f"{seconds:.1f} s",
    }
    items.update({k: html.escape(str(v)) for k, v in (extra or {}).items()})
    rows = "".join(f"<dt>{html.escape(k)}</dt><dd>{v}</dd>" for k, v in items.items())
    return f"<footer><dl>{rows}</dl></footer>"


PLOTLY_CDN_DEFAULT = "https://cdn.plot.ly/un/"
LOCAL_TOPOJSON = "./topojson/"
"""plotly.js's one network default, ``topojsonURL`` (maps for geo traces, which no report
draws), is pointed at a folder beside the page so that nothing in a page names the CDN."""


@lru_cache(maxsize=1)
def plotly_js() -> str:
    """The installed plotly package's plotly.min.js (no network), ``topojsonURL`` made local."""
    from plotly.offline import get_plotlyjs

    return str(get_plotlyjs()).replace(PLOTLY_CDN_DEFAULT, LOCAL_TOPOJSON)


def section(title: str, *parts: str, intro: str | None = None) -> str:
    """``<section>`` with a heading, an optional lead sentence and its parts."""
    lead = f'<p class="lead">{html.escape(intro)}</p>' if intro else ""
    return f"<section><h2>{html.escape(title)}</h2>{lead}{''.join(parts)}</section>"


def page_html(title: str, body: Sequence[str], *, footer: str, subtitle: str | None = None) -> str:
    """A complete page: the stylesheet, plotly.js inlined once (when a figure is present), the
    body parts and the footer. Nothing is loaded from the network."""
    content = "\n".join(body)
    script = ""
    if "plotly-graph-div" in content:
        script = f'<script type="text/javascript">{plotly_js()}</script>'
    if "cdn.plot.ly" in content or "<script src=" in content:
        raise ValueError(
            "A page part loads a script from elsewhere (e.g. a figure written with "
            "include_plotlyjs='cdn'): pass figures through figure_html, the page inlines plotly.js."
        )
    sub = f'<p class="lead">{html.escape(subtitle)}</p>' if subtitle else ""
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{html.escape(title)}</title><style>{STYLESHEET}</style>{script}</head>"
        f"<body><h1>{html.escape(title)}</h1>{sub}\n{content}\n{footer}</body></html>\n"
    )


def write_page(path: str | Path, title: str, body: Sequence[str], **kwargs: Any) -> Path:
    """Write :func:`page_html` to ``path`` (parents created) and return the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(page_html(title, body, **kwargs), encoding="utf-8")
    return target


__all__ = [
    "STYLESHEET",
    "TokenRow",
    "attribution_rows",
    "ci_rows",
    "ci_table_html",
    "colour_legend_html",
    "diverging_rgb",
    "figure_html",
    "footer_html",
    "page_html",
    "plotly_js",
    "section",
    "table_html",
    "token_map_html",
    "write_page",
]
