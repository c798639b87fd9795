"""Attribution: the result every method returns and every evaluation consumes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lens_attrib import display
from lens_attrib.target import ResolvedTarget

_META_NOT_PER_ITEM = {
    "options",
    "layers",
    "hooks",
    "generated_ids",
    "generated_tokens",
    "step_aggregate",
    "prompt_length",
    "steps",
    "sampling",
    "contrast_ids",
    "contrast_tokens",
    "contrast_alignments",
}
"""Meta entries that describe the whole call, never one value per item (a generation's
per-prompt entries included: its items are step rows, ``meta["step_prompt"]`` says whose)."""

PER_LAYER_METHODS = (
    "alti_logit",
    "alti",
    "rollout",
    "globenc",
    "grad_ellm",
    "logat",
    "normxlogit",
    "value_zeroing",
)
"""The registered methods that return ``layer_scores`` (``MethodSpec.per_layer``; named here, not
read from the registry, which imports this module; ``tests/test_structure.py`` keeps the two
equal)."""

_PER_PROMPT = (
    "prompt_length",
    "generated_ids",
    "generated_tokens",
    "steps",
    "contrast_ids",
    "contrast_tokens",
    "contrast_alignments",
)
"""Generation meta with one entry per prompt when a batch of prompts was explained."""


@dataclass
class Attribution:
    """Relevance of every input token (and optionally of every layer and head) for a Target.

    scores:            ``[batch, pos]`` token relevances (zero at padding).
    tokens:            string tokens per item (unpadded).
    token_ids:         ``[batch, pos]`` padded token ids.
    mask:              ``[batch, pos]`` True at real tokens.
    target:            the resolved target (positions, token and foil ids).
    method:            registered name of the method.
    layer_scores:      optional ``[batch, layer, pos]`` per-layer token relevances (ALTI-Logit,
                       LogAt/NormXLogit, Grad-ELLM per layer, …).
    head_scores:       optional ``[batch, layer, head]`` per-head relevances.
    head_token_scores: optional ``[batch, layer, head, pos]`` per-head-per-token relevances.
    parts:             optional named non-token parts (e.g. ALTI-Logit's MLP contributions).
    meta:              dtype, seconds, options, and method-specific facts; every key, its meaning
                       and its writers are in :data:`lens_attrib.meta_keys.META_KEYS`.
    token_types:       encoders: ``[batch, pos]`` segment ids the model was run with (sentence
                       pairs); ``None`` is segment 0 everywhere.
    """

    scores: Float[Tensor, "batch pos"]
    tokens: list[list[str]]
    token_ids: Int[Tensor, "batch pos"]
    mask: Bool[Tensor, "batch pos"]
    target: ResolvedTarget
    method: str
    layer_scores: Float[Tensor, "batch layer pos"] | None = None
    head_scores: Float[Tensor, "batch layer head"] | None = None
    head_token_scores: Float[Tensor, "batch layer head pos"] | None = None
    parts: dict[str, Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    token_types: Int[Tensor, "batch pos"] | None = None

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return int(self.scores.shape[0])

    def __getitem__(self, index: int | slice | list[int] | Tensor) -> Attribution:
        """Sub-batch (an int keeps a batch dimension of one)."""
        if isinstance(index, int):
            index = [index]
        idx = torch.arange(len(self))[index]
        if idx.ndim == 0:
            idx = idx[None]

        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[idx.to(t.device)]

        n = len(self)

        def per_item(value: Any) -> Any:
            """Slice meta entries that hold one value per item (lists, batch-first tensors)."""
            if isinstance(value, Tensor) and value.ndim >= 1 and value.shape[0] == n:
                return value[idx.to(value.device)]
            if isinstance(value, list) and len(value) == n and n > 1:
                return [value[int(i)] for i in idx]
            if (
                isinstance(value, dict)
                and value
                and all(
                    isinstance(v, Tensor) and v.ndim >= 1 and v.shape[0] == n
                    for v in value.values()
                )
            ):  # step_scores: one tensor of rows per score
                return {k: v[idx.to(v.device)] for k, v in value.items()}
            return value

        return replace(
            self,
            scores=self.scores[idx],
            tokens=[self.tokens[int(i)] for i in idx],
            token_ids=self.token_ids[idx],
            mask=self.mask[idx],
            target=self.target.index(idx.to(self.target.positions.device)),
            layer_scores=pick(self.layer_scores),
            head_scores=pick(self.head_scores),
            head_token_scores=pick(self.head_token_scores),
            token_types=pick(self.token_types),
            parts={k: v[idx.to(v.device)] for k, v in self.parts.items()},
            meta={
                k: (per_item(v) if k not in _META_NOT_PER_ITEM else v) for k, v in self.meta.items()
            },
        )

    def prompt_steps(self, prompt: int = 0) -> Attribution:
        """The step rows of one prompt of a generation (``Target(generate=N)`` or
        ``Target(continuation=...)``), as if that prompt had been explained alone: rows in step
        order, and the per-prompt ``meta`` entries (``prompt_length``, ``generated_ids``,
        ``steps``, …) that prompt's own. ``attr[i]`` by contrast selects rows (steps) and
        keeps the per-prompt entries of the whole batch, with ``meta["step_prompt"]`` /
        ``meta["step_index"]`` saying whose step each row is."""
        from lens_attrib.tidy import is_generation, step_labels

        if not is_generation(self):
            raise ValueError(
                "prompt_steps() selects the steps of one prompt of a generation; this "
                f"{self.method!r} Attribution explains no Target(generate=N) or "
                "Target(continuation=...): index its items with attr[i]."
            )
        labels = step_labels(self)
        prompts = sorted({b for b, _ in labels})
        if prompt not in prompts:
            raise IndexError(f"prompt={prompt!r} is not one of this Attribution's {prompts}.")
        rows = sorted(
            (r for r, (b, _) in enumerate(labels) if b == prompt), key=lambda r: labels[r][1]
        )
        picked = self[rows]
        meta = dict(picked.meta)
        batched = isinstance(self.meta.get("prompt_length"), list)
        for key in _PER_PROMPT:
            if batched and key in meta:
                meta[key] = meta[key][prompt]
        meta["step_prompt"] = [0] * len(rows)
        meta["step_index"] = [labels[r][1] for r in rows]
        return replace(picked, meta=meta)

    def check_item(self, item: Any, who: str = "item") -> int:
        """``item`` as an index of this Attribution; else an error naming the valid range."""
        if isinstance(item, bool) or not isinstance(item, int | np.integer):
            kind = type(item).__name__
            raise TypeError(f"{who} must be an item index (int), got {kind} {item!r}.")
        n = len(self)
        if not -n <= int(item) < n:
            raise IndexError(
                f"{who}={int(item)} is outside this Attribution of {n} item(s): pass 0..{n - 1} "
                "(negative counts from the end)."
            )
        return int(item)

    def item_scores(self, item: int = 0) -> Float[Tensor, "pos"]:
        """Scores of one item at its real tokens only."""
        item = self.check_item(item)
        return self.scores[item][self.mask[item]]

    def numpy(self, item: int | None = None) -> np.ndarray | list[np.ndarray]:
        """Scores as numpy: one item's real-token scores, or a list over the batch."""
        if item is not None:
            return self.item_scores(item).detach().cpu().double().numpy()
        return [self.item_scores(i).detach().cpu().double().numpy() for i in range(len(self))]

    def top(self, k: int = 5, item: int = 0) -> list[tuple[int, str, float]]:
        """The ``k`` most relevant real tokens of ``item``: (real position, token, score).

        Tokens after the explained position of a causal model (which cannot influence it) are
        not candidates.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"top(k) needs a positive number of tokens k, got {k!r}.")
        if not -len(self) <= item < len(self):
            raise IndexError(f"item {item} is outside this Attribution of {len(self)} items.")
        scores = self.item_scores(item).detach().cpu().double()
        n_valid = self.n_context(item)
        order = torch.argsort(scores[:n_valid], descending=True, stable=True)[:k]
        return [(int(i), self.tokens[item][int(i)], float(scores[i])) for i in order]

    def n_context(self, item: int = 0) -> int:
        """How many real tokens of ``item`` can influence its explained scalar.

        All of them for encoders; for causal models those up to the target position.
        """
        real = int(self.mask[item].sum())
        if not self.meta.get("causal", False):
            return real
        first = int(torch.nonzero(self.mask[item]).min())
        return min(real, int(self.target.positions[item]) - first + 1)

    def normalized(self) -> Attribution:
        """Scores divided by the max |score| over real tokens of every item (for display)."""
        masked = self.scores.abs().masked_fill(~self.mask.to(self.scores.device), 0.0)
        denom = masked.amax(-1, keepdim=True).clamp_min(torch.finfo(self.scores.dtype).tiny)
        return replace(self, scores=self.scores / denom)

    def with_head(self, head: Any) -> Attribution:
        """This Attribution with ``head`` as its Target's head (a shallow copy: tensors shared).

        A loaded Attribution whose Target had a head (``Target(head=...)``, e.g. a built-in
        classifier's) keeps only that it had one (a :class:`~lens_attrib.target.DetachedHead`,
        which refuses to be read): the metrics, pruning and verification read the head, so give
        it back first, ``Attribution.load(path).with_head(clf.head)``. ``None``: the model's own
        output.
        """
        return replace(self, target=replace(self.target, head=head))

    def cpu(self) -> Attribution:
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach().cpu()

        return replace(
            self,
            scores=self.scores.detach().cpu(),
            token_ids=self.token_ids.cpu(),
            mask=self.mask.cpu(),
            target=self.target.to("cpu"),
            layer_scores=move(self.layer_scores),
            head_scores=move(self.head_scores),
            head_token_scores=move(self.head_token_scores),
            parts={k: v.detach().cpu() for k, v in self.parts.items()},
        )

    # ----------------------------------------------------------------- display
    def explained_label(self, item: int = 0) -> str:
        """What ``item``'s scores explain, as display text (not escaped): the target token,
        ``' were' − ' was'`` for a contrastive target, a class name of a class head, or
        ``target-free (…)`` for a method whose scores ignore the target token
        (:func:`lens_attrib.display.explained_label`)."""
        return display.explained_label(self, self.check_item(item))

    def to_html(self, item: int | None = None) -> str:
        """Tokens coloured by signed relevance, one row per item (``item``: just that one).

        Diverging colours centred at 0 (red positive, blue negative), each row scaled to its
        max |score| (shown), with a legend; tokens HTML-escaped, whitespace shown as ␣ ⏎.
        Self-contained inline HTML: renders in Jupyter, exported notebooks and reports.
        """
        from lens_attrib.report import attribution_rows, token_map_html

        if item is not None:
            item = self.check_item(item)
        return token_map_html(attribution_rows(self, None if item is None else [item]))

    def _repr_html_(self) -> str:
        return self.to_html()

    def __repr__(self) -> str:
        shape = tuple(self.scores.shape)
        extra = []
        if self.layer_scores is not None:
            extra.append(f"layer_scores={tuple(self.layer_scores.shape)}")
        if self.head_scores is not None:
            extra.append(f"head_scores={tuple(self.head_scores.shape)}")
        more = (", " + ", ".join(extra)) if extra else ""
        return f"Attribution(method={self.method!r}, scores={shape}{more})"

    def plot(self, item: int = 0, layers: bool | None = None, **kwargs: Any) -> Any:
        """Plotly figure: token heatmap, or layer × token heatmap when per-layer scores exist."""
        from lens_attrib import plot

        self.check_item(item)
        if layers and self.layer_scores is None:
            per_layer = ", ".join(repr(name) for name in PER_LAYER_METHODS)
            raise ValueError(
                f"{self.method!r} has no layer_scores, so plot(layers=True) has nothing to show: "
                f"drop layers=True, or use a per-layer method ({per_layer})."
            )
        if layers or (layers is None and self.layer_scores is not None):
            return plot.layer_heatmap(self, item=item, **kwargs)
        return plot.token_heatmap(self, item=item, **kwargs)

    def plot_heads(self, item: int = 0, **kwargs: Any) -> Any:
        """Plotly figure: layer × head heatmap of ``head_scores`` (:func:`plot.head_heatmap`)."""
        from lens_attrib import plot

        return plot.head_heatmap(self, item=item, **kwargs)

    def plot_steps(self, prompt: int = 0, **kwargs: Any) -> Any:
        """Plotly figure: step × token heatmap of a generation (:func:`plot.step_heatmap`)."""
        from lens_attrib import plot

        return plot.step_heatmap(self, prompt=prompt, **kwargs)

    # ------------------------------------------------------------- files, tables, words
    def save(self, path: str | Path) -> Path:
        """Write to one ``.safetensors`` file (tensors) with a JSON header (everything else).

        No pickle; :meth:`load` needs no model. Format: :mod:`lens_attrib.attribution_io`.
        """
        from lens_attrib.attribution_io import save_attribution

        return save_attribution(self, path, Attribution)

    @classmethod
    def load(cls, path: str | Path) -> Attribution:
        """Read a file written by :meth:`save`: every field bit-identical, tensors on the CPU."""
        from lens_attrib.attribution_io import load_attribution

        loaded: Attribution = load_attribution(path, cls)
        return loaded

    def to_pandas(self, what: str = "scores") -> Any:
        """Tidy ``pandas.DataFrame``, one row per real token (padding excluded).

        ``what``: ``"scores"`` (columns item, [step], position, token, token_id, target, score),
        ``"layer_scores"`` (+ layer), ``"head_scores"`` (item, [step], layer, head, target,
        score) or ``"head_token_scores"`` (+ layer, head). ``step`` appears for generations
        (``Target(generate=N)`` / ``Target(continuation=...)``), whose rows are steps: ``item``
        is then the prompt and ``step`` the step within its continuation.
        See :func:`lens_attrib.tidy.to_pandas`.
        """
        from lens_attrib.tidy import to_pandas

        return to_pandas(self, what)

    def to_words(self, reduce: str = "sum", **kwargs: Any) -> Attribution:
        """Scores aggregated from subword tokens to words (:func:`aggregate.to_words`)."""
        from lens_attrib.aggregate import to_words

        return to_words(self, reduce, **kwargs)

    def to_spans(self, spans: Any, reduce: str = "sum", **kwargs: Any) -> Attribution:
        """Scores aggregated to character spans (:func:`lens_attrib.aggregate.to_spans`)."""
        from lens_attrib.aggregate import to_spans

        return to_spans(self, spans, reduce, **kwargs)

    def to_roles(self, chat: Any = None, reduce: str = "sum", **kwargs: Any) -> Attribution:
        """Scores aggregated to chat roles (:func:`lens_attrib.aggregate.to_roles`)."""
        from lens_attrib.aggregate import to_roles

        return to_roles(self, chat, reduce, **kwargs)


def save_attributions(
    collection: list[Attribution] | tuple[Attribution, ...] | dict[str, Attribution],
    path: str | Path,
) -> Path:
    """Write a sweep's list or dict (string keys) of Attributions to one ``.safetensors`` file.

    Same format as :meth:`Attribution.save` (:mod:`lens_attrib.attribution_io`); each item's
    tensors are named ``{index or key}/{field}``.
    """
    from lens_attrib import attribution_io

    return attribution_io.save_attributions(collection, path, Attribution)


def load_attributions(path: str | Path) -> list[Attribution] | dict[str, Attribution]:
    """Read a file of :func:`save_attributions`: the same container, order and keys."""
    from lens_attrib import attribution_io

    loaded: list[Attribution] | dict[str, Attribution] = attribution_io.load_attributions(
        path, Attribution
    )
    return loaded
