"""The item type shared by every task, and the map from evidence words to token positions.

A :class:`TaskItem` is model-agnostic: its ``prompt`` is plain text and its evidence is given as
*word* indices into ``prompt.split()``. :func:`evidence_token_positions` turns those into token
positions for a particular (fast) tokenizer; :func:`item_evidence_positions` gives the positions
in the very input the library builds for a model (its start token included, see
:func:`lens_attrib.inputs.start_token_of`).
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
    "evidence_spans",
    "evidence_token_positions",
    "item_evidence_positions",
    "span_token_positions",
    "start_token_length",
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


def _special_ids(tokenizer: Any) -> set[int]:
    return {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}


def span_token_positions(
    text: str, spans: Sequence[tuple[int, int]], tokenizer: Any, offset: int = 0
) -> list[int]:
    """Token positions, in the tokenization of ``text``, overlapping the character ``spans``.

    ``text`` is tokenized with ``add_special_tokens=False`` and ``return_offsets_mapping=True``
    (so ``tokenizer`` must be a Hugging Face *fast* tokenizer). A span maps to *every* token whose
    character span overlaps it, except special tokens written literally into the text: a start
    token such as ``"<|endoftext|>"`` in ``"<|endoftext|>The women"`` is never part of the word
    it is glued to (an unknown-word token such as ``[UNK]`` still stands for its word).
    ``offset`` is added to each position.

    Raises:
        TypeError: the tokenizer cannot return offsets.
        IndexError: a span lies outside ``text`` or is empty.
        ValueError: a span overlaps no (non-special) token.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            "evidence positions need a fast tokenizer (return_offsets_mapping=True); got "
            f"{type(tokenizer).__name__}"
        )
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    special = _special_ids(tokenizer)
    written = set(getattr(tokenizer, "all_special_tokens", None) or [])
    # a special token written into the text ("<|endoftext|>"); not an [UNK] standing for a word
    token_spans = [
        (int(s), int(e), int(i) in special and text[int(s) : int(e)] in written)
        for (s, e), i in zip(encoding["offset_mapping"], encoding["input_ids"])
    ]
    positions: set[int] = set()
    for start, end in spans:
        if not 0 <= start < end <= len(text):
            raise IndexError(f"character span ({start}, {end}) outside the text {text!r}")
        hits = [
            i
            for i, (s, e, literal) in enumerate(token_spans)
            if s < end and e > start and not literal
        ]
        if not hits:
            raise ValueError(f"span {text[start:end]!r} of {text!r} overlaps no token")
        positions.update(hits)
    return sorted(p + offset for p in positions)


def word_token_positions(
    text: str, word_indices: Sequence[int], tokenizer: Any, offset: int = 0
) -> list[int]:
    """Token positions, in the tokenization of ``text``, of the words at ``word_indices``.

    Words are ``text.split()``; each maps to the tokens overlapping its character span (see
    :func:`span_token_positions`: special tokens never count; a token that only holds the
    whitespace before a word does not overlap it). ``offset`` is added to each position: 1 when
    the model sees a BOS or [CLS] token in front of the text. Positions refer to the unpadded
    sequence.

    Returns:
        Sorted, de-duplicated positions.

    Raises:
        IndexError: a word index is outside ``text.split()``.
        TypeError: the tokenizer cannot return offsets.
        ValueError: a word overlaps no token (e.g. a tokenizer that drops characters).
    """
    spans = word_spans(text)
    for index in word_indices:
        if not 0 <= index < len(spans):
            raise IndexError(f"word index {index} outside the {len(spans)} words of {text!r}")
    return span_token_positions(text, [spans[i] for i in word_indices], tokenizer, offset)


def evidence_spans(item: TaskItem) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of ``item``'s evidence in ``item.prompt``.

    ``item.meta["evidence_spans"]`` when the item carries character spans (user data), else the
    spans of its ``evidence_words``.
    """
    given = item.meta.get("evidence_spans")
    if given is not None:
        return [(int(s), int(e)) for s, e in given]
    words = word_spans(item.prompt)
    for index in item.evidence_words:
        if not 0 <= index < len(words):
            raise IndexError(
                f"word index {index} outside the {len(words)} words of {item.prompt!r}"
            )
    return [words[i] for i in item.evidence_words]


def start_token_length(tokenizer: Any, start_token: str) -> int:
    """Number of tokens ``start_token`` (text put before every prompt) becomes.

    Raises:
        ValueError: ``start_token`` is not made of the tokenizer's special tokens, so it would be
        split as ordinary text (and could merge with the first word).
    """
    ids = list(tokenizer(start_token, add_special_tokens=False)["input_ids"])
    special = _special_ids(tokenizer)
    if not ids or any(i not in special for i in ids):
        raise ValueError(
            f"start token {start_token!r} is not a special token of this tokenizer (it becomes "
            f"{ids}); use one of {list(getattr(tokenizer, 'all_special_tokens', []) or [])} or "
            "prepend_bos=True"
        )
    return len(ids)


def evidence_token_positions(
    item: TaskItem,
    tokenizer: Any,
    prepend_bos: bool = False,
    offset: int = 0,
    start_token: str | None = None,
) -> list[int]:
    """Token positions of ``item``'s evidence in the model input built from ``item.prompt``.

    Args:
        item: the item; its evidence is ``meta["evidence_spans"]`` (character spans) when given,
            else ``evidence_words`` (indices into ``item.prompt.split()``).
        tokenizer: a Hugging Face fast tokenizer (e.g. ``model.tokenizer``).
        prepend_bos: the model input starts with a BOS token the tokenizer does not see
            (TransformerLens' default for decoders); adds 1 to every position.
        offset: any further shift, e.g. 1 for an encoder input that starts with [CLS].
        start_token: special-token text the caller puts in front of the prompt
            (``start_token + item.prompt``, e.g. ``"<|endoftext|>"`` for a model that has no
            BOS); the positions are those in that joined text, and the start token itself never
            counts as evidence. It must be a special token (checked).

    The total shift is ``offset + int(prepend_bos)`` plus, with ``start_token``, its tokens.

    Returns:
        Sorted token positions (all tokens overlapping each evidence span); empty when the item
        has no evidence.
    """
    spans = evidence_spans(item)
    shift = offset + int(prepend_bos)
    if start_token:
        start_token_length(tokenizer, start_token)
        n = len(start_token)
        return span_token_positions(
            start_token + item.prompt, [(s + n, e + n) for s, e in spans], tokenizer, shift
        )
    return span_token_positions(item.prompt, spans, tokenizer, shift)


def item_evidence_positions(
    model: Any,
    item: TaskItem,
    *,
    start_token: Any = None,
    prepend_bos: bool | None = None,
) -> list[int]:
    """Token positions of ``item``'s evidence in the input that ``model`` gets for
    ``item.prompt`` from :func:`lens_attrib.inputs.to_batch` (and so from ``attribute``,
    ``evaluate`` and the experiments), under the same start-token policy
    (:func:`lens_attrib.inputs.start_token_of`; ``start_token=`` / ``prepend_bos=`` as there).

    Decoders: shifted by 1 where the policy puts a start token in front of the text (never
    evidence itself); a special token written into the prompt is never evidence either.
    Encoders: shifted by 1 for ``[CLS]``. Positions refer to the unpadded sequence.
    """
    from lens_attrib.backend import arch_of
    from lens_attrib.inputs import prompt_ids, start_token_of

    start = start_token_of(model, start_token, prepend_bos)  # refuses one on an encoder
    if arch_of(model).encoder:
        return evidence_token_positions(item, model.tokenizer, offset=1)
    _, added = prompt_ids(model, item.prompt, start)
    return evidence_token_positions(item, model.tokenizer, offset=added)
