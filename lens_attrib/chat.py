"""Chat prompts: a conversation rendered once by the tokenizer's chat template, with the token
range of every role's segment.

``chat_prompt(model, messages)`` renders ``messages`` (``[{"role": ..., "content": ...}, ...]``)
with ``tokenizer.apply_chat_template(..., tokenize=False)`` and tokenizes the text **once** with
the library's start-token policy (:func:`lens_attrib.inputs.prompt_ids`): the text is tokenized
without the tokenizer's own special tokens, and the start token of
:func:`~lens_attrib.inputs.start_token_of` is put in front only when the rendered text does not
already begin with a special token (``<|im_start|>``, ``<|begin_of_text|>``, ``<s>``). So a BOS
that the template writes is never doubled, and a template without one gets the same start token
as any text prompt.

Segments (character ranges of the rendered text, then token ranges by each token's first
character, from the fast tokenizer's offsets):

* message ``k``: from the end of the rendering of ``messages[:k]`` to the end of the rendering of
  ``messages[:k + 1]`` (its header, content and end marker), role ``messages[k]["role"]``;
* ``"template"``: what the template writes before the first message's own turn — a BOS, or a
  default system prompt that the template inserts when the conversation has none (SmolLM2's
  "You are a helpful AI assistant named SmolLM…"), found as the part of the first message's
  rendering before the text that the same message renders to when it follows itself — and the
  start token the library put in front;
* ``"assistant"``: the generation prompt (``add_generation_prompt=True``, e.g.
  ``<|im_start|>assistant\\n``), the header of the reply to be explained.

Passing a :class:`ChatPrompt` (or a list of them) as ``inputs`` to
:func:`lens_attrib.attribute` explains its tokens and records the segments in
``Attribution.meta["chat"]`` (one list per row), from where
:func:`lens_attrib.aggregate.to_roles` reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lens_attrib.errors import InputError
from lens_attrib.inputs import StartTokenLike, prompt_ids, start_token_of, str_tokens_of


@dataclass(frozen=True)
class ChatSegment:
    """Tokens ``ids[start:end]`` of a :class:`ChatPrompt` written for ``role``; ``message`` is
    the index of the message they render (``None`` for template text and the reply header)."""

    role: str
    start: int
    end: int
    message: int | None

    def record(self) -> dict[str, Any]:
        return {"role": self.role, "start": self.start, "end": self.end, "message": self.message}


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: ``ids`` (what the model reads), ``text`` (the template's output),
    ``tokens`` (string tokens), ``segments`` (role token ranges covering every id in order) and
    ``start_token`` (the start token the library put in front, or ``None``)."""

    ids: list[int]
    text: str
    tokens: list[str]
    segments: list[ChatSegment]
    start_token: str | None

    def __len__(self) -> int:
        return len(self.ids)

    def roles(self) -> list[str]:
        """The role of every token."""
        out: list[str] = []
        for seg in self.segments:
            out.extend([seg.role] * (seg.end - seg.start))
        return out

    def records(self) -> list[dict[str, Any]]:
        """The segments as plain dicts (what ``Attribution.meta["chat"]`` stores)."""
        return [seg.record() for seg in self.segments]


def _check_messages(messages: Any) -> list[dict[str, str]]:
    if isinstance(messages, str) or not isinstance(messages, Sequence) or not messages:
        raise InputError(
            f"chat_prompt needs a non-empty list of messages [{{'role': 'user', 'content': "
            f"'...'}}, ...], got {type(messages).__name__} {messages!r}."
        )
    out = []
    for k, msg in enumerate(messages):
        if (
            not isinstance(msg, dict)
            or not isinstance(msg.get("role"), str)
            or not isinstance(msg.get("content"), str)
        ):
            raise InputError(
                f"Message {k} must be a dict with string 'role' and 'content', got {msg!r}."
            )
        out.append(dict(msg))
    return out


def _preamble_end(render: Any, messages: list[dict[str, str]], first: str) -> int:
    """Characters of the first message's rendering that precede its own turn (0 if none can be
    told apart: templates that reject a repeated role)."""
    try:
        twice = render([messages[0], messages[0]], False)
    except Exception:  # a template may refuse two turns of one role: nothing to split off
        return 0
    if not twice.startswith(first):
        return 0
    turn = twice[len(first) :]
    if turn and first.endswith(turn):
        return len(first) - len(turn)
    return 0


def chat_prompt(
    model: Any,
    messages: Sequence[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    start_token: StartTokenLike = None,
    **template_kwargs: Any,
) -> ChatPrompt:
    """Render ``messages`` with the model's chat template once and record the role segments
    (module docstring). ``add_generation_prompt``: end with the assistant's reply header (the
    prompt to generate or force a reply after); ``start_token``: as in
    :func:`lens_attrib.attribute`; ``template_kwargs`` go to ``apply_chat_template``."""
    msgs = _check_messages(messages)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise InputError("chat_prompt needs the model's tokenizer; this model has none.")
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(
            "The model's tokenizer has no chat template (tokenizer.chat_template is empty): set "
            "one (tokenizer.chat_template = '...jinja...'), or write the prompt text yourself."
        )
    if not getattr(tokenizer, "is_fast", False):
        raise InputError(
            "chat_prompt places role segments with a fast (Rust) tokenizer's character offsets; "
            "this tokenizer is not fast: load it with use_fast=True."
        )

    def render(conversation: list[dict[str, str]], generation: bool) -> str:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=generation, **template_kwargs
        )
        return str(text)

    text = render(msgs, add_generation_prompt)
    ends: list[int] = []
    for k in range(1, len(msgs) + 1):
        prefix = render(msgs[:k], False)
        if not text.startswith(prefix) or (ends and len(prefix) < ends[-1]):
            raise InputError(
                f"The chat template renders the first {k} message(s) as text that does not begin "
                "the whole conversation's rendering, so the messages cannot be given token "
                f"ranges: {prefix[-80:]!r} is not a prefix. Pass the prompt text yourself."
            )
        ends.append(len(prefix))
    chars: list[tuple[str, int, int, int | None]] = []
    pre = _preamble_end(render, msgs, text[: ends[0]])
    if pre:
        chars.append(("template", 0, pre, None))
    for k, end in enumerate(ends):
        chars.append((msgs[k]["role"], pre if k == 0 else ends[k - 1], end, k))
    if ends[-1] < len(text):
        tail = "assistant" if add_generation_prompt else "template"
        chars.append((tail, ends[-1], len(text), None))

    start = start_token_of(model, start_token)
    ids, added = prompt_ids(model, text, start)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != ids[added:]:
        raise InputError("The chat text tokenizes differently with offsets; cannot place roles.")
    # the start token belongs with the template's own preamble (or is a template segment)
    front = 0 if chars[0][0] == "template" else -1
    owner: list[int] = [front] * added
    for a, _ in enc["offset_mapping"]:
        k = next((i for i, (_, s, e, _) in enumerate(chars) if s <= a < e), len(chars) - 1)
        owner.append(k)
    segments: list[ChatSegment] = []
    for t, k in enumerate(owner):
        if t > 0 and owner[t - 1] == k:
            last = segments[-1]
            segments[-1] = ChatSegment(last.role, last.start, t + 1, last.message)
        else:
            role, message = ("template", None) if k < 0 else (chars[k][0], chars[k][3])
            segments.append(ChatSegment(role, t, t + 1, message))
    return ChatPrompt(
        ids=ids,
        text=text,
        tokens=str_tokens_of(model, ids),
        segments=segments,
        start_token=start.text if added else None,
    )


def chat_inputs(inputs: Any) -> tuple[Any, list[list[dict[str, Any]]] | None]:
    """``inputs`` for :func:`lens_attrib.inputs.to_batch`: a :class:`ChatPrompt` (or a list of
    them) becomes its token ids, with the segments of every prompt; anything else is returned
    unchanged with ``None``."""
    if isinstance(inputs, ChatPrompt):
        return [list(inputs.ids)], [inputs.records()]
    if (
        isinstance(inputs, list | tuple)
        and inputs
        and all(isinstance(x, ChatPrompt) for x in inputs)
    ):
        return [list(x.ids) for x in inputs], [x.records() for x in inputs]
    if isinstance(inputs, list | tuple) and any(isinstance(x, ChatPrompt) for x in inputs):
        kinds = sorted({type(x).__name__ for x in inputs})
        raise InputError(
            f"The inputs mix ChatPrompts with other inputs ({kinds}): pass a list of "
            "ChatPrompts only (chat_prompt(model, messages) for each conversation)."
        )
    return inputs, None


def chat_meta(extra: dict[str, Any], n_rows: int) -> dict[str, Any]:
    """``meta["chat"]``: the segments of every row's prompt (a generation's rows are steps of
    the prompt ``extra["generation"]["step_prompt"][row]``)."""
    records = extra.get("chat")
    if records is None:
        return {}
    generation = extra.get("generation")
    rows = generation["step_prompt"] if generation else list(range(n_rows))
    return {"chat": [records[b] for b in rows]}


__all__ = ["ChatPrompt", "ChatSegment", "chat_inputs", "chat_meta", "chat_prompt"]
