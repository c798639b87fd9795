"""Attributions as tidy tables (one row per observation) for analysis in pandas.

pandas is imported only when a table is asked for (it ships with TransformerLens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lens_attrib.attribution import Attribution

WHAT = ("scores", "layer_scores", "head_scores", "head_token_scores")


def is_generation(attribution: Attribution) -> bool:
    """Rows are the steps of generated or given continuations (``Target(generate=N)``,
    ``Target(continuation=...)``)."""
    return "generated_ids" in attribution.meta and "steps" in attribution.meta


def step_labels(attribution: Attribution) -> list[tuple[int, int]]:
    """``(item, step)`` of every row of a generation: the prompt (``meta["step_prompt"]``) and
    the step within its continuation (``meta["step_index"]``); results saved before those
    entries existed are one prompt whose rows are its steps in order."""
    n = len(attribution)
    prompts = attribution.meta.get("step_prompt")
    steps = attribution.meta.get("step_index")
    if isinstance(prompts, list) and isinstance(steps, list) and len(prompts) == len(steps) == n:
        return [(int(b), int(s)) for b, s in zip(prompts, steps, strict=True)]
    return [(0, r) for r in range(n)]


def _labels(attribution: Attribution) -> list[Any]:
    labels = attribution.meta.get("target_tokens")
    if isinstance(labels, list) and len(labels) == len(attribution):
        return labels
    return [None] * len(attribution)


def to_pandas(attribution: Attribution, what: str = "scores") -> Any:
    """One row per real (unpadded) token of every item, or per layer/head (``what``).

    Columns: ``item`` (for a generation, whose rows are steps: the prompt, with ``step`` the
    step within its continuation, :func:`step_labels`), ``layer`` (the real layer number from
    ``meta["layers"]``) and ``head`` where ``what`` has them, ``position`` (index among the
    item's real tokens, as in :meth:`Attribution.top`), ``token``, ``token_id``, ``target``
    (the explained token or class label) and ``score`` (float64; the stored values widened exactly).
    """
    import pandas as pd

    if what not in WHAT:
        raise ValueError(f"to_pandas(what=...) takes one of {WHAT}, got {what!r}.")
    values = getattr(attribution, what)
    if values is None:
        raise ValueError(
            f"This {attribution.method!r} Attribution has no {what}; it has "
            f"{[w for w in WHAT if getattr(attribution, w) is not None]}."
        )
    values = values.detach().cpu().double()
    generation = is_generation(attribution)
    row_labels = step_labels(attribution) if generation else []
    labels = _labels(attribution)
    layers = attribution.meta.get("layers")
    columns: dict[str, list[Any]] = {}

    def add(**row: Any) -> None:
        for key, value in row.items():
            columns.setdefault(key, []).append(value)

    for b in range(len(attribution)):
        first = {"item": row_labels[b][0], "step": row_labels[b][1]} if generation else {"item": b}
        real = torch.nonzero(attribution.mask[b]).flatten().tolist()
        ids = attribution.token_ids[b]
        if what == "head_scores":
            for layer in range(values.shape[1]):
                for head in range(values.shape[2]):
                    add(**first, layer=layer, head=head, target=labels[b],
                        score=float(values[b, layer, head]))  # fmt: skip
            continue
        for p, pos in enumerate(real):
            token = dict(position=p, token=attribution.tokens[b][p], token_id=int(ids[pos]))
            if what == "scores":
                add(**first, **token, target=labels[b], score=float(values[b, pos]))
            elif what == "layer_scores":
                for k in range(values.shape[1]):
                    layer = (
                        layers[k]
                        if isinstance(layers, list) and len(layers) == values.shape[1]
                        else k
                    )
                    add(**first, layer=layer, **token, target=labels[b],
                        score=float(values[b, k, pos]))  # fmt: skip
            else:
                for layer in range(values.shape[1]):
                    for head in range(values.shape[2]):
                        add(**first, layer=layer, head=head, **token, target=labels[b],
                            score=float(values[b, layer, head, pos]))  # fmt: skip
    return pd.DataFrame(columns)


__all__ = ["is_generation", "step_labels", "to_pandas"]
