"""Is the model right? The one correctness function, and task-level accuracy built on it.

:func:`correctness` decides, per item, whether the model gets it right at the item's last real
token, through the forward engine (:func:`lens_attrib.forward.head_outputs`, no gradients,
inside the model guard) and the Target's own selection (:meth:`ResolvedTarget.select`):

- an item with a foil is correct when ``logit(target) − logit(foil) > 0`` (the BLiMP
  one-prefix and template protocol);
- an item with a target and no foil when the target is the argmax (over ``candidates`` when
  given, e.g. the label tokens of a zero-shot prompt);
- an item without a target has no correctness (``None``); its prediction is still reported.

Every place that asks the question — the runner, the experiments, :func:`contrastive_scores` —
calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lens_attrib.forward import head_outputs, no_grad_context
from lens_attrib.inputs import StartTokenLike, to_batch
from lens_attrib.progress import progress_bar
from lens_attrib.target import Target


@dataclass
class Correctness:
    """Per item: ``correct`` (``None`` without a target), the ``prediction`` (the argmax token
    id, or with ``candidates`` the index of the preferred candidate) and ``logit_diff``
    (``logit(target) − logit(foil)``; NaN without a foil), in the model's dtype."""

    correct: list[bool | None]
    prediction: Int[Tensor, "item"]
    logit_diff: Float[Tensor, "item"]


def correctness(
    model: Any,
    prompts: Sequence[Any],
    targets: Sequence[Any] | None = None,
    foils: Sequence[Any] | None = None,
    *,
    candidates: Sequence[int] | None = None,
    batch_size: int = 32,
    max_batch: int = 64,
    start_token: StartTokenLike = None,
    fwd_hooks: Sequence[Any] = (),
    progress: bool = False,
) -> Correctness:
    """Whether the model gets each prompt right (module docstring).

    ``targets`` / ``foils``: one per prompt (a token string or id; ``None`` entries allowed);
    with ``candidates`` (token ids), targets are indices into ``candidates``. Prompts are
    batched ``batch_size`` at a time (one padded batch each) and forwarded ``max_batch`` rows
    at a time; ``fwd_hooks`` are active in every forward (e.g. head masks); ``start_token`` as
    in :func:`lens_attrib.inputs.to_batch`.
    """
    n = len(prompts)
    targets = list(targets) if targets is not None else [None] * n
    foils = list(foils) if foils is not None else [None] * n
    if len(targets) != n or len(foils) != n:
        raise ValueError(
            f"correctness: {n} prompts, {len(targets)} targets and {len(foils)} foils; pass one "
            "of each per prompt (None where an item has none)."
        )
    correct: list[bool | None] = [None] * n
    predictions: list[Tensor] = []
    diffs: list[Tensor] = []
    hooks = list(fwd_hooks)
    chunks = range(0, n, batch_size)
    for start in progress_bar(chunks, desc="scoring", enabled=progress):
        idx = list(range(start, min(start + batch_size, n)))
        batch = to_batch(model, [prompts[i] for i in idx], start_token=start_token)
        logits = head_outputs(
            model,
            batch.tokens,
            batch.mask,
            batch.last_real,
            max_batch=max_batch,
            hooks=(lambda rows: hooks) if hooks else None,
        ).cpu()
        if not bool(torch.isfinite(logits).all()):
            bad = [idx[r] for r in torch.nonzero(~torch.isfinite(logits).all(-1)).flatten()]
            raise ValueError(f"correctness: the model's outputs are NaN/inf for items {bad}.")
        if candidates is not None:
            pred = logits[:, list(candidates)].argmax(-1)
        else:
            pred = logits.argmax(-1)
        diff = torch.full((len(idx),), float("nan"), dtype=logits.dtype)
        rows = [r for r, i in enumerate(idx) if targets[i] is not None]
        if rows and candidates is not None:
            for r in rows:
                correct[idx[r]] = bool(int(pred[r]) == int(targets[idx[r]]))
        elif rows:
            with_foil = [r for r in rows if foils[idx[r]] is not None]
            gold = Target(token=[targets[idx[r]] for r in rows]).resolve(
                model, batch.select(rows), logits[rows]
            )
            for k, r in enumerate(rows):
                correct[idx[r]] = bool(pred[r] == gold.token_ids[k])
            if with_foil:
                contrast = Target(
                    token=[targets[idx[r]] for r in with_foil],
                    foil=[foils[idx[r]] for r in with_foil],
                )
                value = contrast.resolve(model, batch.select(with_foil), logits[with_foil]).select(
                    logits[with_foil]
                )
                for k, r in enumerate(with_foil):
                    diff[r] = value[k]
                    correct[idx[r]] = bool(value[k] > 0)
        predictions.append(pred)
        diffs.append(diff)
    empty = torch.zeros(0)
    return Correctness(
        correct,
        torch.cat(predictions) if predictions else empty.long(),
        torch.cat(diffs) if diffs else empty,
    )


@dataclass
class TaskScore:
    correct: Bool[Tensor, "item"]
    logit_diff: Float[Tensor, "item"]

    @property
    def accuracy(self) -> float:
        return float(self.correct.double().mean()) if len(self.correct) else float("nan")


def contrastive_scores(
    model: Any,
    items: Sequence[Any],
    *,
    batch_size: int = 32,
    fwd_hooks: Sequence[Any] = (),
    progress: bool = False,
) -> TaskScore:
    """``logit(target) − logit(foil)`` of every item (objects with prompt/target/foil), and
    whether it is positive (:func:`correctness`, one forward per ``batch_size`` items)."""
    res = correctness(
        model,
        [it.prompt for it in items],
        [it.target for it in items],
        [it.foil for it in items],
        batch_size=batch_size,
        max_batch=batch_size,
        fwd_hooks=fwd_hooks,
        progress=progress,
    )
    diff = res.logit_diff.float()
    return TaskScore(diff > 0, diff)


def single_token_items(model: Any, items: Sequence[Any]) -> tuple[list[Any], int]:
    """Items whose target and foil are each exactly one token; and how many were dropped."""
    tokenizer = model.tokenizer

    def one(word: str | None) -> bool:
        return word is not None and len(tokenizer(word, add_special_tokens=False)["input_ids"]) == 1

    kept = [it for it in items if one(it.target) and one(it.foil)]
    return kept, len(items) - len(kept)


def sentence_logprobs(
    model: Any, sentences: Sequence[str], *, batch_size: int = 32
) -> Float[Tensor, "sentence"]:
    """Σ_t log p(w_t | w_<t) over each sentence's tokens (the first token is conditioned on BOS
    when the model prepends one, and is not scored otherwise)."""
    totals: list[Tensor] = []
    with no_grad_context(model):
        for start in range(0, len(sentences), batch_size):
            batch = to_batch(model, list(sentences[start : start + batch_size]))
            logits = model(batch.tokens, **batch.model_kwargs()).double()
            logp = logits.log_softmax(-1)[:, :-1].gather(-1, batch.tokens[:, 1:, None])[..., 0]
            scored = batch.mask[:, 1:] & batch.mask[:, :-1]
            totals.append((logp * scored).sum(-1).cpu())
    return torch.cat(totals) if totals else torch.zeros(0)


def minimal_pair_accuracy(model: Any, good: Sequence[str], bad: Sequence[str]) -> float:
    """BLiMP's full-sentence protocol: fraction with log p(good) > log p(bad)."""
    return float((sentence_logprobs(model, good) > sentence_logprobs(model, bad)).double().mean())
