"""Token relevances aggregated to words, character spans or chat roles.

Every real token of an item gets a character span in the item's text; tokens are grouped into
units (words, or the user's spans) and each unit's relevance is a reduction over its tokens:

* ``"sum"``  — ``R_u = Σ_{i∈u} R_i``. The right choice for *conservative* / additive methods
  (AttnLRP, LRP, Gradient×Input, Integrated Gradients, DeepLIFT, ALTI-Logit, DecompX): their
  token relevances add up to the explained logit (up to the method's stated gap), and so do the
  word relevances, since ``Σ_u R_u = Σ_i R_i``.
* ``"mean"`` — ``R_u = (1/|u|) Σ_{i∈u} R_i``: for intensity-like scores that do not add up
  (attention, rollout, ALTI, gradient norms, embedding norms, LogAt/NormXLogit), so that a word
  split into many pieces is not favoured for its length.
* ``"absmax"`` — the signed ``R_i`` of largest ``|R_i|`` in the unit (first on ties): a word is as
  relevant as its most relevant piece (saliency-style display; Inseq's ``absmax``).

Words: a token starts a new word when it begins with whitespace, when the character before it in
the text is whitespace (tokenizers whose offsets leave the space out), or after a special token;
special tokens (BOS, ``[CLS]``, ``<|im_start|>``…) are words of their own and carry no text.
Character spans come from the tokenizer's offsets when a fast tokenizer is given
(``tokenizer=model.tokenizer``: needed for word-level and WordPiece tokenizers, whose pieces do not
carry their spaces), otherwise from concatenating the token strings (byte-level BPE and
SentencePiece pieces carry their leading space, e.g. ``' Tam' 'ara'`` → ``' Tamara'``). The
non-special words of an item concatenate back to its text.

The result is an :class:`~lens_attrib.attribution.Attribution` whose ``tokens`` are the units:
``scores`` ``[batch, unit]``, ``layer_scores`` ``[batch, layer, unit]`` and ``head_token_scores``
``[batch, layer, head, unit]`` reduced the same way, ``head_scores`` unchanged, ``token_ids`` −1
(a unit is not a token: any use as ids fails loudly), the target position mapped to the unit that
holds the explained token, ``parts`` dropped (method-specific layouts). ``meta["aggregation"]``
records the unit and reduction; ``meta["unit_tokens"]`` (per item) the real-token positions of
every unit, ``meta["explained_token"]`` (per item) the real-token position of the explained token
and ``meta["unit_chars"]`` their character spans (``None`` for special tokens).

Chat roles (:func:`to_roles`): the units are the role segments of a chat prompt
(:mod:`lens_attrib.chat`): every role (``by="role"``: all its segments together) or every segment
(``by="turn"``), plus ``"generated"`` for the tokens after the prompt (a generation's earlier
steps). Generations aggregate row by row (every step row has its own scores), so words, spans and
roles all work on ``[step, pos]`` results, their layer scores and per-head token scores alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

if TYPE_CHECKING:
    from lens_attrib.attribution import Attribution

REDUCTIONS = ("sum", "mean", "absmax")
CharSpan = tuple[int, int]


def reduce_last(values: Float[Tensor, "... n"], reduce: str) -> Float[Tensor, "..."]:
    """Reduce the last axis: sum, mean, or the signed entry of largest magnitude (first on ties)."""
    if reduce == "sum":
        return values.sum(-1)
    if reduce == "mean":
        return values.mean(-1)
    if reduce == "absmax":
        idx = values.abs().argmax(-1, keepdim=True)
        return values.gather(-1, idx)[..., 0]
    raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}.")


def _looks_special(token: str) -> bool:
    """Without a tokenizer: ``<...>`` / ``<|...|>`` / ``[CLS]``-style tokens with no whitespace."""
    if not token or any(c.isspace() for c in token):
        return False
    bracketed = token[0] == "<" and token[-1] == ">" and len(token) > 2
    upper = token[0] == "[" and token[-1] == "]" and token[1:-1].isupper()
    return bracketed or upper


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    unk = getattr(tokenizer, "unk_token_id", None)
    ids.discard(unk)  # an unknown word is still a word of the text
    return ids


def token_chars(
    tokens: Sequence[str],
    ids: Sequence[int],
    text: str | None = None,
    tokenizer: Any = None,
    first_is_start: bool = False,
) -> tuple[str, list[CharSpan | None]]:
    """The text of one item and every token's character span in it (``None``: special token).

    ``first_is_start``: the first token is the start token the library put in front of the text
    (``meta["start_token"]``), a special token even where the tokenizer counts its id as the
    unknown word (SmolLM2's ``<|endoftext|>``).

    With a fast ``tokenizer`` the spans are its offsets for ``text`` (default: the decoded
    non-special ids), which must tokenize back to exactly these ids. Without one the text is the
    concatenation of the non-special token strings (``text``, when given, must equal it).
    """
    if tokenizer is not None:
        specials = _special_ids(tokenizer)
        special = [int(i) in specials or (k == 0 and first_is_start) for k, i in enumerate(ids)]
        plain = [int(i) for i, s in zip(ids, special, strict=True) if not s]
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                "to_words(tokenizer=...) reads character offsets, which only fast (Rust) "
                "tokenizers give; pass tokenizer=None to use the leading-space rule."
            )
        if text is None:
            text = tokenizer.decode(plain, clean_up_tokenization_spaces=False)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(enc["input_ids"]) != plain:
            raise ValueError(
                f"The text {text!r} tokenizes to {len(enc['input_ids'])} ids that differ from "
                f"this item's {len(plain)} non-special tokens {list(tokens)[:12]}…: pass the "
                "item's exact text, or tokenizer=None for the leading-space rule."
            )
        offsets = iter([(int(a), int(b)) for a, b in enc["offset_mapping"]])
        return text, [None if s else next(offsets) for s in special]
    spans: list[CharSpan | None] = []
    pieces: list[str] = []
    at = 0
    for k, tok in enumerate(tokens):
        if _looks_special(tok) or (k == 0 and first_is_start):
            spans.append(None)
            continue
        spans.append((at, at + len(tok)))
        pieces.append(tok)
        at += len(tok)
    joined = "".join(pieces)
    if text is not None and text != joined:
        raise ValueError(
            f"The tokens concatenate to {joined!r}, not to the given text {text!r}; pass "
            "tokenizer=model.tokenizer to align them with the tokenizer's offsets."
        )
    return joined, spans


def word_units(text: str, spans: Sequence[CharSpan | None]) -> tuple[list[list[int]], list[Any]]:
    """Group token indices into words (module docstring); returns (groups, word char spans).

    Word ``k``'s character span runs from the end of word ``k − 1`` (0 for the first) to its last
    token's end (the text's end for the last word), so the words concatenate to ``text``.
    """
    groups: list[list[int]] = []
    chars: list[Any] = []
    previous_special = True
    for i, span in enumerate(spans):
        if span is None:
            groups.append([i])
            chars.append(None)
            previous_special = True
            continue
        start = span[0]
        new_word = (
            previous_special
            or (start < len(text) and text[start].isspace())
            or (start > 0 and text[start - 1].isspace())
        )
        if new_word:
            groups.append([i])
            chars.append([start, span[1]])
        else:
            groups[-1].append(i)
            chars[-1][1] = span[1]
        previous_special = False
    words = [k for k, c in enumerate(chars) if c is not None]
    for n, k in enumerate(words):  # absorb gaps: word k starts where word k − 1 ended
        chars[k][0] = 0 if n == 0 else chars[words[n - 1]][1]
        if n == len(words) - 1:
            chars[k][1] = len(text)
    return groups, [None if c is None else (c[0], c[1]) for c in chars]


def aggregate(
    attribution: Attribution,
    groups: Sequence[Sequence[Sequence[int]]],
    labels: Sequence[Sequence[str]],
    reduce: str,
    unit: str,
    chars: Sequence[Sequence[CharSpan | None]] | None = None,
) -> Attribution:
    """Reduce every item's real tokens ``groups[b][u]`` (real-token positions) to unit ``u``."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}.")
    n = len(attribution)
    width = max((len(g) for g in groups), default=0)

    def reduced(values: Tensor | None) -> Tensor | None:
        if values is None:
            return None
        out = values.new_zeros((*values.shape[:-1], width))
        for b in range(n):
            real = torch.nonzero(attribution.mask[b]).flatten().to(values.device)
            for u, members in enumerate(groups[b]):
                idx = real[torch.as_tensor(list(members), dtype=torch.long, device=values.device)]
                out[b, ..., u] = reduce_last(values[b, ..., idx], reduce)
        return out

    positions, explained = [], []
    for b in range(n):
        real = torch.nonzero(attribution.mask[b]).flatten().tolist()
        at = real.index(int(attribution.target.positions[b])) if real else 0
        explained.append(at)
        holding = [u for u, g in enumerate(groups[b]) if at in g]  # units need not be contiguous
        starts = [min(g) for g in groups[b] if len(g)]
        positions.append(holding[0] if holding else max(0, sum(s <= at for s in starts) - 1))
    target = replace(
        attribution.target,
        positions=torch.tensor(positions, dtype=attribution.target.positions.dtype),
    )
    mask = torch.zeros((n, width), dtype=torch.bool)
    for b in range(n):
        mask[b, : len(groups[b])] = True
    scores = reduced(attribution.scores)
    assert scores is not None
    meta = dict(attribution.meta)
    if isinstance(meta.get("signed_scores"), Tensor):
        meta["signed_scores"] = reduced(meta["signed_scores"])  # the same units as the scores
    meta["aggregation"] = {
        "unit": unit,
        "reduce": reduce,
        "dropped_parts": sorted(attribution.parts),
    }
    meta["unit_tokens"] = [[list(g) for g in item] for item in groups]
    meta["explained_token"] = explained
    if chars is not None:
        meta["unit_chars"] = [list(c) for c in chars]
    return replace(
        attribution,
        scores=scores,
        tokens=[list(words) for words in labels],
        token_ids=torch.full((n, width), -1, dtype=torch.long),
        mask=mask,
        target=target,
        layer_scores=reduced(attribution.layer_scores),
        head_token_scores=reduced(attribution.head_token_scores),
        parts={},
        meta=meta,
    )


def _per_item(value: Any, n: int, what: str) -> list[Any]:
    if value is None or isinstance(value, str):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{len(value)} {what} for an Attribution of {n} items.")
    return value


def _starts_with_start_token(attribution: Attribution) -> list[bool]:
    """Per item: whether its first real token is the start token (``meta["start_token"]``)."""
    recorded = attribution.meta.get("start_token")
    if not isinstance(recorded, list) or len(recorded) != len(attribution):
        return [False] * len(attribution)
    return [value is not None for value in recorded]


def _real(attribution: Attribution, b: int) -> tuple[list[str], list[int]]:
    ids = attribution.token_ids[b][attribution.mask[b]].tolist()
    if ids and min(ids) < 0:
        raise ValueError("This Attribution is already aggregated (its units are not tokens).")
    return list(attribution.tokens[b]), ids


def to_words(
    attribution: Attribution,
    reduce: str = "sum",
    *,
    text: str | Sequence[str] | None = None,
    tokenizer: Any = None,
) -> Attribution:
    """Aggregate subword tokens to words (module docstring: the rule and the reductions).

    ``text``: the item's text (one string, or one per item); ``tokenizer``: a fast tokenizer
    whose offsets place the tokens in the text (e.g. ``model.tokenizer``).
    """
    texts = _per_item(text, len(attribution), "texts")
    starts = _starts_with_start_token(attribution)
    groups, labels, chars = [], [], []
    for b in range(len(attribution)):
        tokens, ids = _real(attribution, b)
        item_text, spans = token_chars(tokens, ids, texts[b], tokenizer, starts[b])
        g, c = word_units(item_text, spans)
        groups.append(g)
        chars.append(c)
        labels.append(
            [
                tokens[m[0]] if s is None else item_text[s[0] : s[1]]
                for m, s in zip(g, c, strict=True)
            ]
        )
    return aggregate(attribution, groups, labels, reduce, "word", chars)


def to_spans(
    attribution: Attribution,
    spans: Sequence[CharSpan] | Sequence[Sequence[CharSpan]],
    reduce: str = "sum",
    *,
    text: str | Sequence[str] | None = None,
    tokenizer: Any = None,
    labels: Sequence[str] | Sequence[Sequence[str]] | None = None,
) -> Attribution:
    """Aggregate tokens to character spans ``[(start, end), ...]`` of the text (one list for
    every item, or one per item); texts and offsets as in :func:`to_words`.

    A token belongs to the span holding its first non-whitespace character (so ``' cat'`` belongs
    to the span of ``cat``); tokens in no span (and special tokens) are left out. Spans must not
    overlap and come in text order. ``labels`` name the spans (default: their text).
    """
    n = len(attribution)
    given: list[Any] = list(spans)
    nested = bool(given) and isinstance(given[0][0], Sequence)
    per_item_spans: list[list[Any]] = [list(x) for x in given] if nested else [given] * n
    if len(per_item_spans) != n:
        raise ValueError(f"{len(per_item_spans)} span lists for an Attribution of {n} items.")
    texts = _per_item(text, n, "texts")
    starts = _starts_with_start_token(attribution)
    nested_labels = labels is not None and len(labels) > 0 and not isinstance(labels[0], str)
    label_lists = (
        [list(x) for x in labels] if nested_labels else [labels] * n  # type: ignore[union-attr]
    )
    groups, names, chars = [], [], []
    for b in range(n):
        tokens, ids = _real(attribution, b)
        item_text, token_spans = token_chars(tokens, ids, texts[b], tokenizer, starts[b])
        item_spans = [(int(pair[0]), int(pair[1])) for pair in per_item_spans[b]]
        for (s0, e0), (s1, e1) in pairwise(item_spans):
            if s1 < e0:
                raise ValueError(
                    f"Spans {(s0, e0)} and {(s1, e1)} overlap or are out of order; give "
                    "non-overlapping spans in text order."
                )
        for s, e in item_spans:
            if not 0 <= s < e <= len(item_text):
                raise ValueError(
                    f"Span {(s, e)} is not inside the text of {len(item_text)} characters."
                )
        members: list[list[int]] = [[] for _ in item_spans]
        for i, span in enumerate(token_spans):
            if span is None:
                continue
            piece = item_text[span[0] : span[1]]
            first = span[0] + (len(piece) - len(piece.lstrip())) if piece.strip() else span[0]
            for u, (s, e) in enumerate(item_spans):
                if s <= first < e:
                    members[u].append(i)
                    break
        empty = [item_spans[u] for u, m in enumerate(members) if not m]
        if empty:
            raise ValueError(f"Spans {empty} of item {b} hold no token.")
        groups.append(members)
        chars.append(item_spans)
        named = label_lists[b]
        names.append(list(named) if named is not None else [item_text[s:e] for s, e in item_spans])
    return aggregate(attribution, groups, names, reduce, "span", chars)


def _chat_rows(attribution: Attribution, chat: Any) -> list[tuple[list[dict[str, Any]], Any]]:
    """Per row: the chat segments (dicts with role, start, end, message) and the prompt's ids
    (``None`` when read from ``meta["chat"]``, which the same call recorded)."""
    from lens_attrib.chat import ChatPrompt
    from lens_attrib.tidy import is_generation, step_labels

    n = len(attribution)
    if chat is None:
        recorded = attribution.meta.get("chat")
        if not isinstance(recorded, list) or len(recorded) != n:
            raise ValueError(
                "to_roles needs the chat segments: explain a lens_attrib.chat_prompt(...) "
                "(attribute(model, chat_prompt(model, messages), ...) records them), or pass "
                "chat=the ChatPrompt."
            )
        return [(list(r), None) for r in recorded]
    prompts = [chat] if isinstance(chat, ChatPrompt) else list(chat)
    if not all(isinstance(p, ChatPrompt) for p in prompts):
        raise ValueError(f"chat must be a ChatPrompt or a list of them, got {chat!r}.")
    if len(prompts) == 1:
        owners = [0] * n
    elif is_generation(attribution):
        owners = [b for b, _ in step_labels(attribution)]
    else:
        owners = list(range(n)) if len(prompts) == n else [len(prompts)]
    if max(owners, default=0) >= len(prompts):
        raise ValueError(
            f"{len(prompts)} chat prompts for an Attribution of {n} rows: pass one ChatPrompt, "
            "or one per item (per prompt for a generation)."
        )
    return [(prompts[b].records(), list(prompts[b].ids)) for b in owners]


def to_roles(
    attribution: Attribution,
    chat: Any = None,
    reduce: str = "sum",
    *,
    by: str = "role",
) -> Attribution:
    """Aggregate tokens to the roles of a chat prompt (module docstring).

    ``chat``: the :class:`~lens_attrib.chat.ChatPrompt` the Attribution explains (or one per
    item, per prompt for a generation); default ``meta["chat"]`` (recorded when the
    ChatPrompt was the input). ``by="role"``: one unit per role (``"template"``, ``"system"``,
    ``"user"``, ``"assistant"``, … in order of first appearance, each the union of its
    segments), ``by="turn"``: one unit per segment (labelled ``role[message index]``). Tokens
    after the prompt (a continuation's earlier tokens) form the unit ``"generated"``.
    """
    if by not in ("role", "turn"):
        raise ValueError(f"to_roles(by=...) takes 'role' or 'turn', got {by!r}.")
    rows = _chat_rows(attribution, chat)
    groups, labels = [], []
    for b, (segments, prompt) in enumerate(rows):
        _, ids = _real(attribution, b)
        length = max(int(seg["end"]) for seg in segments)
        if len(ids) < length or (prompt is not None and ids[:length] != prompt):
            raise ValueError(
                f"Item {b}'s tokens do not begin with its chat prompt's {length} tokens: pass "
                "the ChatPrompt this Attribution explains."
            )
        units: dict[str, list[int]] = {}
        for seg in segments:
            name = seg["role"]
            if by == "turn":
                name = f"{seg['role']}[{seg['message']}]" if seg["message"] is not None else name
                while name in units:  # e.g. two template segments
                    name += "'"
            units.setdefault(name, []).extend(range(int(seg["start"]), int(seg["end"])))
        if len(ids) > length:
            units["generated"] = list(range(length, len(ids)))
        groups.append(list(units.values()))
        labels.append(list(units))
    return aggregate(attribution, groups, labels, reduce, f"chat {by}")


__all__ = [
    "REDUCTIONS",
    "aggregate",
    "reduce_last",
    "to_roles",
    "to_spans",
    "to_words",
    "token_chars",
    "word_units",
]
