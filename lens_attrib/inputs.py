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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def str_tokens_of(model: Any, ids: Sequence[int]) -> list[str]:
    tokenizer = model.tokenizer
    if tokenizer is None:
        return [f"<{int(i)}>" for i in ids]
    return [tokenizer.decode([int(i)]) for i in ids]


def _encode(model: Any, text: str, prepend_bos: bool, encoder: bool) -> list[int]:
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise InputError("The model has no tokenizer: pass token ids instead of strings.")
    if encoder:
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if prepend_bos:
        bos = tokenizer.bos_token_id
        if bos is None:
            raise InputError("prepend_bos=True but the tokenizer has no BOS token.")
        ids = [int(bos), *ids]
    return ids


def default_prepend_bos(model: Any) -> bool:
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
    prepend_bos: bool | None = None,
    attention_mask: Any = None,
    mask: Tensor | None = None,
    token_type_ids: Any = None,
) -> Batch:
    """Tokenize and pad ``inputs`` for ``model`` (see the module docstring for the forms).

    Strings get BOS when ``prepend_bos`` (default: ``model.cfg.default_prepend_bos``) for
    decoders, and ``[CLS] … [SEP]`` for encoders. ``mask`` is an alias of ``attention_mask``.
    Encoders also take sentence pairs and segment ids (:func:`sentence_pairs`,
    :func:`token_type_rows`).
    """
    if isinstance(inputs, Batch):
        return inputs
    arch = arch_of(model)
    encoder = arch.encoder
    if prepend_bos is None:
        prepend_bos = default_prepend_bos(model)
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
    if isinstance(inputs, str):
        sequences = [_encode(model, inputs, prepend_bos, encoder)]
        texts = [inputs]
    elif isinstance(inputs, Tensor | np.ndarray):
        sequences = _sequences_from_ids(inputs, attention_mask)
    elif (
        isinstance(inputs, Sequence) and len(inputs) > 0 and all(isinstance(x, str) for x in inputs)
    ):
        sequences = [_encode(model, x, prepend_bos, encoder) for x in inputs]  # type: ignore[arg-type]
        texts = list(inputs)  # type: ignore[arg-type]
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

    vocab = int(model.cfg.d_vocab)
    for i, seq in enumerate(sequences):
        n_content = len(seq) - (1 if prepend_bos and not encoder and texts is not None else 0)
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
    weight = getattr(embed, "W_token_type", None)
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
