"""Turn user inputs (strings, token ids, tokenizer outputs) into a padded, masked :class:`Batch`.

Decoders (``HookedTransformer``) are padded on the left so that the last real token of every item
sits at the same index, and the model receives the real-token mask as ``attention_mask`` (which
TransformerLens also uses to shift learned and rotary positions, so a padded item computes exactly
what it computes alone). Encoders (``HookedEncoder``) are padded on the right, as BERT expects.

Accepted inputs: a string, a list of strings, token ids (a ``[pos]`` or ``[batch, pos]`` tensor,
numpy array or nested list) with an optional ``attention_mask`` of the same shape (1 = real
token; pads are dropped and never scored, on either side), a Hugging Face ``BatchEncoding`` or a
dict with ``input_ids`` (and ``attention_mask``, ``token_type_ids``), or an existing :class:`Batch`.

Sentence pairs (encoders): a ``(first, second)`` tuple of two strings or a list of them is encoded
as the tokenizer's pair encoding ``[CLS] first [SEP] second [SEP]`` with its segment ids
(``token_type_ids``: 0 for the first segment, 1 for the second), which the Batch carries into
every forward. Segment ids can also be given explicitly (``token_type_ids=``) or come with a
``BatchEncoding``.

Start token: decoder prompts given as text get the one start token of :func:`start_token_of`
(the tokenizer's BOS where the model's config prepends one, else the document separator
``<|endoftext|>`` where the tokenizer has it as a special token, e.g. SmolLM2), chosen per call
with ``start_token=`` / ``prepend_bos=`` or per model with :func:`set_start_token`. Token ids
are never changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from lens_attrib.backend import Arch, arch_of, forward_kwargs
from lens_attrib.errors import InputError


@dataclass
class Batch:
    """Token ids of a batch with their real-token mask, string tokens and architecture facts.

    ``tokens[b, t]`` is a pad id where ``mask[b, t]`` is False; ``special[b, t]`` marks BOS, CLS,
    SEP and similar tokens that evaluations may exclude.
    """

    tokens: Int[Tensor, "batch pos"]
    mask: Bool[Tensor, "batch pos"]
    str_tokens: list[list[str]]
    special: Bool[Tensor, "batch pos"]
    arch: Arch
    padding_side: str = "left"
    extra: dict[str, Any] = field(default_factory=dict)
    token_types: Int[Tensor, "batch pos"] | None = None
    """Encoders: the segment of every token (``token_type_ids``: 0 for ``[CLS] a [SEP]``, 1 for
    ``b [SEP]`` of a pair; 0 at padding); ``None`` is segment 0 everywhere."""

    @property
    def encoder(self) -> bool:
        return self.arch.encoder

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def lengths(self) -> Int[Tensor, "batch"]:
        return self.mask.sum(-1)

    @property
    def last_real(self) -> Int[Tensor, "batch"]:
        """Index of the last real token of every item (in padded coordinates)."""
        idx = torch.arange(self.length, device=self.mask.device).expand_as(self.mask)
        return torch.where(self.mask, idx, -1).max(-1).values

    @property
    def first_real(self) -> Int[Tensor, "batch"]:
        idx = torch.arange(self.length, device=self.mask.device).expand_as(self.mask)
        return torch.where(self.mask, idx, self.length).min(-1).values

    @property
    def padded(self) -> bool:
        return not bool(self.mask.all())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.tokens.to(device),
            self.mask.to(device),
            self.str_tokens,
            self.special.to(device),
            self.arch,
            self.padding_side,
            dict(self.extra),
            None if self.token_types is None else self.token_types.to(device),
        )

    def select(self, index: Sequence[int] | Tensor) -> Batch:
        """Sub-batch of the given items (padding is kept, masks stay valid)."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.tokens.device)
        return Batch(
            self.tokens[index],
            self.mask[index],
            [self.str_tokens[int(i)] for i in index],
            self.special[index],
            self.arch,
            self.padding_side,
            dict(self.extra),
            None if self.token_types is None else self.token_types[index],
        )

    def real_index(self, item: int, real_position: int) -> int:
        """Padded index of ``item``'s ``real_position``-th real token (negative: from the end)."""
        n = int(self.lengths[item])
        if not -n <= real_position < n:
            raise InputError(
                f"Position {real_position} is outside item {item}, which has {n} real tokens "
                f"(valid: {-n}..{n - 1})."
            )
        real_position %= n
        return (
            int(self.first_real[item]) + real_position
            if self.padding_side == "left"
            else (real_position)
        )

    def model_kwargs(self) -> dict[str, Tensor]:
        """Keyword arguments for the model's forward (``attention_mask`` when padded)."""
        return forward_kwargs(self.arch, self.mask, self.padded, self.token_types)


InputsLike = str | Sequence[str] | Tensor | Sequence[Sequence[int]] | Batch | Mapping[str, Any]


def pad_id_of(tokenizer: Any) -> int:
    """The id used for padding: the tokenizer's pad, else EOS, else BOS, else 0."""
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if value is not None:
            return int(value)
    return 0


def _special_ids(tokenizer: Any) -> set[int]:
    ids = getattr(tokenizer, "all_special_ids", None) or []
    return {int(i) for i in ids}


def special_token_mask(model: Any, ids: Sequence[int]) -> Bool[Tensor, "pos"]:
    """Which of ``ids`` are special tokens of the model's tokenizer (the rule of
    :func:`to_batch`'s ``Batch.special``; all False without a tokenizer)."""
    special = _special_ids(model.tokenizer) if model.tokenizer is not None else set()
    return torch.tensor([int(i) in special for i in ids], dtype=torch.bool)


def str_tokens_of(model: Any, ids: Sequence[int]) -> list[str]:
    tokenizer = model.tokenizer
    if tokenizer is None:
        return [f"<{int(i)}>" for i in ids]
    return [tokenizer.decode([int(i)]) for i in ids]


def default_prepend_bos(model: Any) -> bool:
    """TransformerLens' ``cfg.default_prepend_bos`` (one input of :func:`start_token_of`)."""
    return bool(getattr(model.cfg, "default_prepend_bos", True))


def _as_id_tensor(values: Any, what: str) -> Tensor:
    """Token ids (or a mask) as a 2-d tensor; floats and ragged lists are errors."""
    if isinstance(values, Tensor):
        t = values
    elif isinstance(values, np.ndarray):
        t = torch.from_numpy(values)
    else:
        try:
            t = torch.as_tensor(values)
        except (ValueError, TypeError) as err:
            raise InputError(
                f"Could not read {what} as a tensor ({err}). Pass equal-length rows with an "
                "attention_mask, a list of prompt strings, or a list of id lists."
            ) from err
    if t.dtype.is_floating_point or t.dtype.is_complex:
        raise InputError(
            f"{what} must hold integer token ids, got {t.dtype} values (e.g. {t.flatten()[:3]}): "
            "convert with .long() only if they are whole numbers."
        )
    if t.ndim == 1:
        t = t.unsqueeze(0)
    if t.ndim != 2:
        raise InputError(f"{what} must be [pos] or [batch, pos], got shape {tuple(t.shape)}.")
    return t


def _from_mapping(inputs: Mapping[str, Any]) -> tuple[Any, Any]:
    if "input_ids" not in inputs:
        raise InputError(
            f"A dict/BatchEncoding input needs 'input_ids' (got keys {sorted(inputs)}): pass "
            "tokenizer(texts, return_tensors='pt') or a list of prompt strings."
        )
    return inputs["input_ids"], inputs.get("attention_mask")


def _sequences_from_ids(ids: Any, attention_mask: Any) -> list[list[int]]:
    t = _as_id_tensor(ids, "input ids").long()
    if attention_mask is None:
        m = torch.ones_like(t, dtype=torch.bool)
    else:
        mt = (
            _as_id_tensor(attention_mask, "attention_mask")
            if not isinstance(attention_mask, Tensor) or attention_mask.dtype != torch.bool
            else attention_mask
        )
        if mt.ndim == 1:
            mt = mt.unsqueeze(0)
        if tuple(mt.shape) != tuple(t.shape):
            raise InputError(
                f"attention_mask has shape {tuple(mt.shape)} but the ids have {tuple(t.shape)}: "
                "pass one mask entry per token."
            )
        if not bool(((mt == 0) | (mt == 1)).all()):
            raise InputError("attention_mask must hold 0/1 (or booleans): 1 marks a real token.")
        m = mt.to(torch.bool)
    return [row[mrow].tolist() for row, mrow in zip(t.cpu(), m.cpu())]


def to_batch(
    model: Any,
    inputs: InputsLike,
    *,
    start_token: StartTokenLike = None,
    prepend_bos: bool | None = None,
    attention_mask: Any = None,
    mask: Tensor | None = None,
    token_type_ids: Any = None,
) -> Batch:
    """Tokenize and pad ``inputs`` for ``model`` (see the module docstring for the forms).

    Decoder strings get the start token of :func:`start_token_of` (the library's one policy:
    the tokenizer's BOS where the config prepends one, else ``<|endoftext|>`` where it is a
    special token; ``start_token=`` / ``prepend_bos=`` choose per call); encoder strings get
    ``[CLS] … [SEP]``. Token ids are used exactly as given. ``mask`` is an alias of
    ``attention_mask``. The policy is kept in ``extra["start_token"]`` (see
    :func:`start_token_meta`).
    Encoders also take sentence pairs and segment ids (:func:`sentence_pairs`,
    :func:`token_type_rows`).
    """
    if isinstance(inputs, Batch):
        if (start_token is not None and start_token is not False) or prepend_bos:
            raise InputError(
                "A Batch is already tokenized: its token ids are used as given. Build it with "
                "to_batch(model, texts, start_token=...) instead of passing start_token here."
            )
        return inputs
    arch = arch_of(model)
    encoder = arch.encoder
    start = start_token_of(model, start_token, prepend_bos)
    attention_mask = attention_mask if attention_mask is not None else mask
    device = model.cfg.device
    n_ctx = arch.n_ctx

    pairs = sentence_pairs(inputs) if encoder else None
    if pairs is not None:
        inputs, pair_types, pair_mask = encode_pairs(model, pairs)
        token_type_ids = pair_types if token_type_ids is None else token_type_ids
        attention_mask = pair_mask
    if isinstance(inputs, Mapping) and token_type_ids is None:
        token_type_ids = inputs.get("token_type_ids")
    if isinstance(inputs, Mapping):
        inputs, mapped_mask = _from_mapping(inputs)
        attention_mask = attention_mask if attention_mask is not None else mapped_mask

    sequences: list[list[int]]
    texts: list[str] | None = None
    added: list[int] = []
    if isinstance(inputs, str):
        ids, n_added = prompt_ids(model, inputs, start)
        sequences, added, texts = [ids], [n_added], [inputs]
    elif isinstance(inputs, Tensor | np.ndarray):
        sequences = _sequences_from_ids(inputs, attention_mask)
    elif (
        isinstance(inputs, Sequence) and len(inputs) > 0 and all(isinstance(x, str) for x in inputs)
    ):
        texts = list(inputs)  # type: ignore[arg-type]
        encoded = [prompt_ids(model, x, start) for x in texts]
        sequences, added = [ids for ids, _ in encoded], [n for _, n in encoded]
    elif isinstance(inputs, Sequence) and len(inputs) > 0:
        if attention_mask is not None:
            sequences = _sequences_from_ids(inputs, attention_mask)
        else:
            sequences = []
            for i, seq in enumerate(inputs):
                odd = isinstance(seq, str) or not isinstance(seq, Sequence | Tensor | np.ndarray)
                if not odd and isinstance(seq, Sequence):
                    odd = any(isinstance(x, str) or x is None for x in seq)
                if odd:
                    raise InputError(
                        f"Input {i} is {type(seq).__name__} {seq!r}: pass a list of prompt "
                        "strings or a list of token-id lists, not a mix."
                    )
                row = _as_id_tensor(list(seq) if not isinstance(seq, Tensor) else seq, "ids")
                sequences.append(row[0].tolist())
    else:
        raise InputError(
            f"No inputs (got {type(inputs).__name__}): pass a prompt string, a list of prompts, "
            "token ids, or a tokenizer output (BatchEncoding / dict with input_ids)."
        )

    if texts is None and start.id is not None and (start_token is not None or prepend_bos):
        raise InputError(
            f"{start.describe()} was asked for, but the inputs are token ids, which are used "
            f"exactly as given: put id {start.id} in front of each row yourself, or pass text."
        )
    vocab = int(model.cfg.d_vocab)
    for i, seq in enumerate(sequences):
        n_content = len(seq) - (added[i] if texts is not None else 0)
        if encoder and texts is not None:
            n_content = len(seq) - 2
        if n_content <= 0:
            shown = repr(texts[i]) if texts is not None else "token ids"
            raise InputError(
                f"Input {i} ({shown}) is empty: it has no tokens to attribute. "
                "Pass a non-empty prompt."
            )
        if len(seq) > n_ctx:
            raise InputError(
                f"Input {i} has {len(seq)} tokens but the model's context is n_ctx={n_ctx}. "
                "Shorten or truncate the prompt (e.g. keep its last n_ctx tokens)."
            )
        bad = [t for t in seq if not 0 <= int(t) < vocab]
        if bad:
            raise InputError(
                f"Input {i} holds token ids {bad[:5]} outside the vocabulary [0, {vocab}): "
                "pass ids from this model's tokenizer."
            )

    length = max(len(s) for s in sequences)
    pad = pad_id_of(model.tokenizer)
    special_ids = _special_ids(model.tokenizer) if model.tokenizer is not None else set()
    tokens = torch.full((len(sequences), length), pad, dtype=torch.long)
    real = torch.zeros((len(sequences), length), dtype=torch.bool)
    padding_side = "right" if encoder else "left"
    for i, seq in enumerate(sequences):
        if padding_side == "left":
            tokens[i, length - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            real[i, length - len(seq) :] = True
        else:
            tokens[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            real[i, : len(seq)] = True
    special = torch.zeros_like(real)
    if special_ids:
        special = real & torch.isin(tokens, torch.tensor(sorted(special_ids), dtype=torch.long))
    str_tokens = [str_tokens_of(model, seq) for seq in sequences]
    types = token_type_rows(model, token_type_ids, attention_mask, sequences)
    return Batch(
        tokens.to(device),
        real.to(device),
        str_tokens,
        special.to(device),
        arch,
        padding_side=padding_side,
        token_types=None if types is None else padded_token_types(types, real).to(device),
        extra={"start_token": start_token_record(start, texts is not None)},
    )


# --------------------------------------------------------------------------- sentence pairs
def sentence_pairs(inputs: Any) -> list[tuple[str, str]] | None:
    """The sentence pairs in ``inputs``: a ``(first, second)`` tuple of two strings, or a list of
    them; ``None`` for any other input. (Only encoders read a 2-tuple of strings as a pair.)"""

    def is_pair(x: Any) -> bool:
        return isinstance(x, tuple) and len(x) == 2 and all(isinstance(s, str) for s in x)

    if is_pair(inputs):
        return [inputs]
    if isinstance(inputs, list) and inputs and all(is_pair(x) for x in inputs):
        return list(inputs)
    return None


def encode_pairs(
    model: Any, pairs: Sequence[tuple[str, str]]
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"], Bool[Tensor, "batch pos"]]:
    """The tokenizer's pair encoding ``[CLS] a [SEP] b [SEP]`` of every pair, padded on the right:
    token ids, segment ids (0 for ``[CLS] a [SEP]``, 1 for ``b [SEP]``) and the real-token mask."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise InputError(
            "The model has no tokenizer, so sentence pairs cannot be encoded: pass token ids "
            "with token_type_ids= (0 for the first segment, 1 for the second)."
        )
    ids: list[list[int]] = []
    types: list[list[int]] = []
    for first, second in pairs:
        enc = tokenizer(first, second, add_special_tokens=True, return_token_type_ids=True)
        row = [int(t) for t in enc["input_ids"]]
        check_encoder_framing(tokenizer, row)
        ids.append(row)
        types.append([int(t) for t in enc.get("token_type_ids") or [0] * len(row)])
    length = max(len(r) for r in ids)
    mask = torch.zeros((len(ids), length), dtype=torch.bool)
    id_t = torch.zeros((len(ids), length), dtype=torch.long)
    type_t = torch.zeros((len(ids), length), dtype=torch.long)
    for i, (row, trow) in enumerate(zip(ids, types)):
        id_t[i, : len(row)] = torch.tensor(row)
        type_t[i, : len(row)] = torch.tensor(trow)
        mask[i, : len(row)] = True
    return id_t, type_t, mask


def n_token_types(model: Any) -> int:
    """How many segments the model's token-type embedding has (0: none, e.g. decoders)."""
    embed = getattr(getattr(model, "embed", None), "token_type_embed", None)
    weight = getattr(embed, "W_token_type", None)  # HookedEncoder
    if weight is None:  # an encoder bridge: the segment table is its own component
        weight = getattr(getattr(model, "token_type_embed", None), "W_E", None)
    return 0 if weight is None else int(weight.shape[0])


def token_type_rows(
    model: Any, token_type_ids: Any, attention_mask: Any, sequences: Sequence[Sequence[int]]
) -> list[list[int]] | None:
    """Every item's segment ids at its real tokens, checked against the ids (``None``: none given).

    ``token_type_ids`` has the layout of the ids: padded like them when an ``attention_mask`` of
    the same shape was given (its real positions are kept), otherwise one row per item holding
    exactly that item's tokens (e.g. ``[CLS] … [SEP]`` of a string). Decoders have no segments:
    any non-zero id is an error there.
    """
    if token_type_ids is None:
        return None
    if (
        attention_mask is not None
        and hasattr(token_type_ids, "shape")
        and tuple(token_type_ids.shape) == tuple(torch.as_tensor(attention_mask).shape)
    ):
        rows = _sequences_from_ids(token_type_ids, attention_mask)
    elif isinstance(token_type_ids, Tensor | np.ndarray):
        rows = [list(map(int, r)) for r in _as_id_tensor(token_type_ids, "token_type_ids")]
    else:
        seqs = list(token_type_ids)
        if seqs and not isinstance(seqs[0], Sequence | Tensor | np.ndarray):
            seqs = [seqs]  # one item's row
        rows = [[int(t) for t in r] for r in seqs]
    n_types = n_token_types(model)
    if n_types == 0:
        if any(t != 0 for r in rows for t in r):
            raise InputError(
                "token_type_ids were given but this model has no segment embedding (a decoder): "
                "sentence pairs and segments apply to encoders (BERT-style)."
            )
        return None
    if len(rows) != len(sequences) or any(len(r) != len(s) for r, s in zip(rows, sequences)):
        raise InputError(
            f"token_type_ids give {[len(r) for r in rows]} segment ids per item but the inputs "
            f"have {[len(s) for s in sequences]} tokens: pass one segment id per token, in the "
            "layout of the ids (e.g. the tokenizer's own token_type_ids for the same call)."
        )
    bad = sorted({t for r in rows for t in r if not 0 <= t < n_types})
    if bad:
        raise InputError(
            f"token_type_ids hold {bad} but the model has {n_types} segment(s) "
            f"(valid: 0..{n_types - 1}); RoBERTa-style models have one: pass none."
        )
    return rows


def padded_token_types(
    rows: Sequence[Sequence[int]], real: Bool[Tensor, "batch pos"]
) -> Int[Tensor, "batch pos"]:
    """Segment ids laid out like the padded tokens (0 at padding)."""
    types = torch.zeros(real.shape, dtype=torch.long)
    for i, row in enumerate(rows):
        types[i][real[i]] = torch.tensor(list(row), dtype=torch.long)
    return types


# --------------------------------------------------------------------------- start token
DOCUMENT_SEPARATOR = "<|endoftext|>"
"""The document separator of GPT-2-style vocabularies: what a pretraining document follows."""

_MODEL_SETTING = "lens_attrib_start_token"
"""Attribute of a model that :func:`set_start_token` writes (copied with the model)."""

StartTokenLike = str | int | bool | None
"""A start-token choice: ``None`` (the default), ``False`` (none), a special token's text or id."""


@dataclass(frozen=True)
class StartToken:
    """The start token that text prompts get in one call, and the rule that chose it.

    ``id``/``text`` are ``None`` when no token is put in front of the text. ``rule`` says where
    the choice came from (``"model default: …"``, ``"set_start_token"``, ``"start_token=… (this
    call)"``, ``"prepend_bos=… (this call)"``, ``"encoder: …"``); :meth:`describe` is what
    ``Attribution.meta["start_token_policy"]`` and the runner's manifest record.
    """

    id: int | None
    text: str | None
    rule: str

    def describe(self) -> str:
        return f"{self.text!r} ({self.rule})" if self.text is not None else f"none ({self.rule})"


def _special_token_id(model: Any, value: str | int, where: str) -> int:
    """``value`` (a token's text or id) as the id of one special token of the model's tokenizer."""
    tokenizer = model.tokenizer
    specials = sorted(_special_ids(tokenizer)) if tokenizer is not None else []
    names = list(getattr(tokenizer, "all_special_tokens", None) or [])
    if isinstance(value, str):
        if tokenizer is None:
            raise InputError(
                f"{where}={value!r}: the model has no tokenizer to read it with; pass the token's "
                "id, or put it in front of your token ids yourself."
            )
        ids = list(tokenizer(value, add_special_tokens=False)["input_ids"])
        if len(ids) != 1 or int(ids[0]) not in specials:
            raise InputError(
                f"{where}={value!r} is not one special token of this tokenizer (it becomes ids "
                f"{ids}); a start token must be a special token so that evaluations never "
                f"perturb it and evidence never includes it. Choose one of {names}, or False "
                "for none."
            )
        return int(ids[0])
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InputError(
            f"{where}={value!r}: pass a special token's text (e.g. {names[:3]}) or id, False for "
            "no start token, or None for the model's default."
        )
    if tokenizer is not None and int(value) not in specials:
        raise InputError(
            f"{where}={int(value)} is not the id of a special token of this tokenizer (special "
            f"ids: {specials}); a start token must be special so that evaluations never "
            "perturb it."
        )
    if not 0 <= int(value) < int(model.cfg.d_vocab):
        raise InputError(
            f"{where}={int(value)} is outside the vocabulary [0, {model.cfg.d_vocab})."
        )
    return int(value)


def _start_token(model: Any, value: StartTokenLike, rule: str, where: str) -> StartToken:
    if value is False:
        return StartToken(None, None, rule)
    if value is True:
        raise InputError(
            f"{where}=True does not say which token: name it (e.g. {where}='<|endoftext|>'), "
            "or leave it None for the model's default, or pass False for none."
        )
    assert value is not None
    token_id = _special_token_id(model, value, where)
    text = model.tokenizer.decode([token_id]) if model.tokenizer is not None else f"<{token_id}>"
    return StartToken(token_id, text, rule)


def default_start_token(model: Any) -> StartToken:
    """The default rule of :func:`start_token_of` (no per-call choice, no model setting)."""
    if arch_of(model).encoder:
        return StartToken(None, None, "encoder: the tokenizer's own [CLS] … [SEP]")
    tokenizer = model.tokenizer
    if tokenizer is None:
        return StartToken(None, None, "model default: no tokenizer")
    bos = getattr(tokenizer, "bos_token_id", None)
    if default_prepend_bos(model) and bos is not None:
        rule = "model default: the tokenizer's BOS (cfg.default_prepend_bos)"
        return StartToken(int(bos), tokenizer.decode([int(bos)]), rule)
    if DOCUMENT_SEPARATOR in (getattr(tokenizer, "all_special_tokens", None) or []):
        ids = tokenizer(DOCUMENT_SEPARATOR, add_special_tokens=False)["input_ids"]
        rule = "model default: the document separator (the config prepends no BOS)"
        return StartToken(int(ids[0]), DOCUMENT_SEPARATOR, rule)
    return StartToken(None, None, "model default: no BOS and no document separator")


def set_start_token(model: Any, token: StartTokenLike) -> None:
    """Choose the start token of every later call on ``model`` (see :func:`start_token_of`).

    ``token``: a special token's text or id, ``False`` for none, ``None`` to go back to the
    default rule. Stored on the model (``model.lens_attrib_start_token``), so copies of the model
    (e.g. a fine-tuned classifier) keep it; a per-call ``start_token=`` still wins.
    """
    if token is None:
        model.__dict__.pop(_MODEL_SETTING, None)
        return
    if arch_of(model).encoder:
        raise InputError(
            f"set_start_token({token!r}) on an encoder: encoders get the tokenizer's own "
            "[CLS] … [SEP] and no start token; the choice applies to decoders only."
        )
    chosen = _start_token(model, token, "set_start_token", "set_start_token")
    model.__dict__[_MODEL_SETTING] = chosen.id if chosen.id is not None else False


@contextlib.contextmanager
def start_token_setting(model: Any, token: StartTokenLike) -> Iterator[StartToken]:
    """Within the block, ``model``'s start token is ``token`` (:func:`set_start_token`); the
    model's previous setting comes back afterwards, also on an exception. ``None`` changes
    nothing. Yields the policy in force (what to record)."""
    had = _MODEL_SETTING in model.__dict__
    before = model.__dict__.get(_MODEL_SETTING)
    try:
        if token is not None:
            set_start_token(model, token)
        yield start_token_of(model)
    finally:
        if had:
            model.__dict__[_MODEL_SETTING] = before
        else:
            model.__dict__.pop(_MODEL_SETTING, None)


def start_token_of(
    model: Any, start_token: StartTokenLike = None, prepend_bos: bool | None = None
) -> StartToken:
    """Which start token a text prompt gets for ``model``: the library's one policy.

    Every entry point builds its inputs with :func:`to_batch`, which asks this function:
    :func:`~lens_attrib.attribute`, :func:`~lens_attrib.evaluation.runner.evaluate` and its CLI,
    the experiments, the evidence positions of data items
    (:func:`~lens_attrib.data.item_evidence_positions`), the classifiers' training and
    explanation, and Integrated Gradients' / DeepLIFT's attention sink
    (:func:`~lens_attrib.methods.baselines.sink_token_id`).

    Order of precedence:

    1. this call: ``start_token=`` (a special token's text or id; ``False``: none) or
       ``prepend_bos=`` (TransformerLens' flag: ``True`` the tokenizer's BOS, ``False`` none);
    2. the model: :func:`set_start_token`;
    3. the default rule:

       - encoders: none; their tokenizer frames the text as ``[CLS] … [SEP]`` (BERT);
       - decoders whose config prepends BOS (``cfg.default_prepend_bos``, TransformerLens'
         default, e.g. GPT-2, Pythia, Llama): the tokenizer's BOS token;
       - other decoders: the document separator ``<|endoftext|>`` when it is a special token of
         their tokenizer (SmolLM2, whose BOS ``<|im_start|>`` is a chat marker, so that its
         config does not prepend it);
       - else none.

    Why a start token by default: causal language models put most of each head's attention on
    the first token of the context, the *attention sink* (Xiao et al. 2024, "Efficient streaming
    language models with attention sinks"). Without a start token the first word becomes the
    sink, and methods that follow attention (ALTI-Logit, rollout, attention, AttnLRP, Grad-ELLM)
    give it the relevance of the sink. On 20 SmolLM2 subject–verb agreement items
    (``generate_sva(40, seed=5)[:20]``, contrastive target) ALTI-Logit's largest relevance falls
    on the first word for 10 items without a start token and for none with ``<|endoftext|>``,
    and its pointing game drops from 95 % to 40 %. A prompt after the document separator is
    also what pretraining saw.

    A text whose first token is already a special token (the start token written into the
    text, or a chat template's ``<|im_start|>``) gets nothing more. Token ids (tensors, lists,
    tokenizer outputs) are never changed: they are used exactly as given (``meta`` still says
    whether they begin with the start token). Positions count the start token: it is real
    token 0, so ``Target(position=k)`` and evidence positions include it.
    """
    encoder = arch_of(model).encoder
    if start_token is not None and prepend_bos is not None:
        raise InputError(
            f"start_token={start_token!r} and prepend_bos={prepend_bos!r} both given: pass one "
            "(start_token names the token; prepend_bos=True is the tokenizer's BOS)."
        )
    if encoder and (start_token is not None or prepend_bos is not None):
        given = f"start_token={start_token!r}" if start_token is not None else "prepend_bos"
        raise InputError(
            f"{given} on an encoder: encoders get the tokenizer's own [CLS] … [SEP] and no "
            "start token; leave it None."
        )
    if start_token is not None:
        return _start_token(
            model, start_token, f"start_token={start_token!r} (this call)", "start_token"
        )
    if prepend_bos is not None:
        rule = f"prepend_bos={bool(prepend_bos)} (this call)"
        if not prepend_bos:
            return StartToken(None, None, rule)
        bos = getattr(model.tokenizer, "bos_token_id", None) if model.tokenizer else None
        if bos is None:
            raise InputError(
                "prepend_bos=True but the tokenizer has no BOS token: name a start token "
                "(start_token='<|endoftext|>') or pass prepend_bos=False."
            )
        return StartToken(int(bos), model.tokenizer.decode([int(bos)]), rule)
    if _MODEL_SETTING in getattr(model, "__dict__", {}):
        setting = model.__dict__[_MODEL_SETTING]
        return _start_token(model, setting, "set_start_token", "set_start_token")
    return default_start_token(model)


def check_encoder_framing(tokenizer: Any, ids: list[int]) -> None:
    """An encoder's text encoding starts with the tokenizer's ``[CLS]`` and ends with its
    ``[SEP]`` (when it has them), as the model was trained; else an :class:`InputError`."""
    cls, sep = getattr(tokenizer, "cls_token_id", None), getattr(tokenizer, "sep_token_id", None)
    if cls is None or sep is None or (ids and ids[0] == cls and ids[-1] == sep):
        return
    raise InputError(
        f"The model's tokenizer does not frame texts as {tokenizer.cls_token} … "
        f"{tokenizer.sep_token} (a TransformerBridge from boot_transformers gets a tokenizer "
        "re-loaded with add_bos_token=True, which drops BERT's framing). Load the model with "
        "load_model(folder), give the bridge the folder's own tokenizer "
        "(lens_attrib.backend_bridge.use_tokenizer(model, AutoTokenizer.from_pretrained(folder))), "
        "or pass token ids."
    )


def prompt_ids(model: Any, text: str, start: StartToken) -> tuple[list[int], int]:
    """The token ids ``model`` sees for ``text`` under ``start``, and how many were put in front.

    Decoders: the text without special tokens, ``start.id`` in front unless the text's first
    token is already a special token (1 or 0 added). Encoders: the tokenizer's encoding with
    its special tokens (``[CLS] … [SEP]``; 0 added by the policy).
    """
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise InputError("The model has no tokenizer: pass token ids instead of strings.")
    if arch_of(model).encoder:
        ids = [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]]
        check_encoder_framing(tokenizer, ids)
        return ids, 0
    ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    if start.id is None or (ids and ids[0] in _special_ids(tokenizer)):
        return ids, 0
    return [start.id, *ids], 1


def start_token_record(start: StartToken, text: bool) -> dict[str, Any]:
    """What :func:`to_batch` keeps in ``Batch.extra["start_token"]``."""
    inputs = (
        "text prompts (added unless the text begins with a special token)"
        if text
        else "token ids used as given"
    )
    return {"policy": start, "inputs": inputs}


def start_token_meta(batch: Batch) -> dict[str, Any]:
    """``meta`` entries of a batch built by :func:`to_batch`: ``start_token`` (per item, the
    start token's text where the item's first real token is it, else ``None``) and
    ``start_token_policy`` (the rule, and whether inputs were text or token ids)."""
    info = batch.extra.get("start_token")
    if info is None:
        return {}
    start: StartToken = info["policy"]
    first = batch.tokens[torch.arange(batch.size), batch.first_real.clamp_max(batch.length - 1)]
    per_item = [
        start.text if start.id is not None and int(t) == start.id else None for t in first.tolist()
    ]
    return {
        "start_token": per_item,
        "start_token_policy": f"{start.describe()}; {info['inputs']}",
    }
