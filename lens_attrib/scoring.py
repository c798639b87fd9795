"""How well the model does a contrastive task: accuracy and logit differences, batched.

An item is correct when ``logit(target) > logit(foil)`` at its last real token (the BLiMP
one-prefix and template protocol), computed without gradients inside the model guard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lens_attrib.forward import no_grad_context, resid_of
from lens_attrib.inputs import to_batch
from lens_attrib.progress import progress_bar
from lens_attrib.target import Target


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
    """``logit(target) − logit(foil)`` of every item (objects with prompt/target/foil)."""
    diffs: list[Tensor] = []
    chunks = range(0, len(items), batch_size)
    with no_grad_context(model), model.hooks(fwd_hooks=list(fwd_hooks)):
        for start in progress_bar(chunks, desc="scoring", enabled=progress):
            chunk = items[start : start + batch_size]
            batch = to_batch(model, [it.prompt for it in chunk])
            target = Target(token=[it.target for it in chunk], foil=[it.foil for it in chunk])
            value, _, _ = target.evaluate(model, batch, resid_of(model, batch))
            diffs.append(value.float().cpu())
    diff = torch.cat(diffs) if diffs else torch.zeros(0)
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
