"""The item type shared by every task, and the map from evidence words to token positions.

A :class:`TaskItem` is model-agnostic: its ``prompt`` is plain text and its evidence is given as
*word* indices into ``prompt.split()``. :func:`evidence_token_positions` turns those into token
positions for a particular (fast) tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Dataset",
    "TaskItem",
    "as_prompts",
    "evidence_token_positions",
    "word_spans",
    "word_token_positions",
]

_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class TaskItem:
    """One example of a task.

    Attributes:
        prompt: text up to (not including) the predicted word, e.g. ``"The keys to the cabinet"``;
            for classification data, the text to classify.
        target: the correct next word as the model should predict it, *with* its leading space,
            e.g. ``" are"``; ``None`` where the task has no next-word target.
        foil: the contrastive wrong form, e.g. ``" is"``; ``None`` where there is none.
        evidence_words: indices into ``prompt.split()`` of the words that carry the evidence for
            the target (e.g. ``(1,)`` for "keys"); empty where unknown.
        task: short task name, e.g. ``"sva"``, ``"anaphora"``, ``"dna"``, ``"blimp"``.
        meta: free-form details (attractor counts, source ids, the original fields...).
            Excluded from hashing so that items stay hashable.
        label: class label for classification data, else ``None``.
    """

    prompt: str
    target: str | None
    foil: str | None
    evidence_words: tuple[int, ...]
    task: str
    meta: dict[str, Any] = field(hash=False)
    label: int | None = None

    @property
    def words(self) -> list[str]:
        """The whitespace-split words of the prompt (what ``evidence_words`` indexes)."""
        return self.prompt.split()

    @property
    def evidence_text(self) -> list[str]:
        """The evidence words themselves."""
        words = self.words
        return [words[i] for i in self.evidence_words]


Dataset = list[TaskItem]
"""A dataset is simply a list of items."""


def as_prompts(items: Iterable[TaskItem]) -> list[str]:
    """Return the prompts of ``items`` in order (ready to pass to a model as a batch)."""
    return [item.prompt for item in items]


def word_spans(text: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the whitespace-separated words of ``text``.

    The i-th span belongs to ``text.split()[i]``.
    """
    return [(m.start(), m.end()) for m in _WORD.finditer(text)]


def word_token_positions(
    text: str, word_indices: Sequence[int], tokenizer: Any, offset: int = 0
) -> list[int]:
    """Token positions, in the tokenization of ``text``, of the words at ``word_indices``.

    ``text`` is tokenized with ``add_special_tokens=False`` and ``return_offsets_mapping=True``
    (so ``tokenizer`` must be a Hugging Face *fast* tokenizer). A word maps to *every* token whose
    character span overlaps the word's span; a token that only holds the whitespace before a word
    does not overlap it. ``offset`` is added to each position: 1 when the model sees a BOS or
    [CLS] token in front of the text. Positions refer to the unpadded sequence.

    Returns:
        Sorted, de-duplicated positions.

    Raises:
        IndexError: a word index is outside ``text.split()``.
        TypeError: the tokenizer cannot return offsets.
        ValueError: a word overlaps no token (e.g. a tokenizer that drops characters).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            "evidence positions need a fast tokenizer (return_offsets_mapping=True); got "
            f"{type(tokenizer).__name__}"
        )
    spans = word_spans(text)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    token_spans = [(int(s), int(e)) for s, e in encoding["offset_mapping"]]
    positions: set[int] = set()
    for index in word_indices:
        if not 0 <= index < len(spans):
            raise IndexError(f"word index {index} outside the {len(spans)} words of {text!r}")
        start, end = spans[index]
        hits = [i for i, (s, e) in enumerate(token_spans) if s < end and e > start]
        if not hits:
            raise ValueError(f"word {text[start:end]!r} of {text!r} overlaps no token")
        positions.update(hits)
    return sorted(p + offset for p in positions)


def evidence_token_positions(
    item: TaskItem, tokenizer: Any, prepend_bos: bool = False, offset: int = 0
) -> list[int]:
    """Token positions of ``item``'s evidence words in the tokenization of ``item.prompt``.

    Args:
        item: the item; its ``evidence_words`` index ``item.prompt.split()``.
        tokenizer: a Hugging Face fast tokenizer (e.g. ``model.tokenizer``).
        prepend_bos: the model input starts with a BOS token (TransformerLens' default for
            decoders); adds 1 to every position.
        offset: any further shift, e.g. 1 for an encoder input that starts with [CLS].
            The total shift is ``offset + int(prepend_bos)``.

    Returns:
        Sorted token positions (all tokens overlapping each evidence word); empty when the item
        has no evidence.
    """
    return word_token_positions(
        item.prompt, item.evidence_words, tokenizer, offset=offset + int(prepend_bos)
    )
