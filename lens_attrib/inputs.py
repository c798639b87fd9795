"""Turn user inputs (strings or token tensors) into a padded, masked :class:`Batch`.

Decoders (``HookedTransformer``) are padded on the left so that the last real token of every item
sits at the same index, and the model receives the real-token mask as ``attention_mask`` (which
TransformerLens also uses to shift learned and rotary positions, so a padded item computes exactly
what it computes alone). Encoders (``HookedEncoder``) are padded on the right, as BERT expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from lens_attrib.models import is_encoder


class InputError(ValueError):
    """Raised for inputs a method cannot explain (empty, too long, malformed)."""


@dataclass
class Batch:
    """Token ids of a batch with their real-token mask and string tokens.

    ``tokens[b, t]`` is a pad id where ``mask[b, t]`` is False; ``special[b, t]`` marks BOS, CLS,
    SEP and similar tokens that evaluations may exclude.
    """

    tokens: Int[Tensor, "batch pos"]
    mask: Bool[Tensor, "batch pos"]
    str_tokens: list[list[str]]
    special: Bool[Tensor, "batch pos"]
    encoder: bool = False
    padding_side: str = "left"
    extra: dict[str, Any] = field(default_factory=dict)

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
            self.encoder,
            self.padding_side,
            dict(self.extra),
        )

    def select(self, index: Sequence[int] | Tensor) -> Batch:
        """Sub-batch of the given items (padding is kept, masks stay valid)."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.tokens.device)
        return Batch(
            self.tokens[index],
            self.mask[index],
            [self.str_tokens[int(i)] for i in index],
            self.special[index],
            self.encoder,
            self.padding_side,
            dict(self.extra),
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
        if self.encoder:
            return {"one_zero_attention_mask": self.mask.long()}
        return {"attention_mask": self.mask.long()} if self.padded else {}


InputsLike = str | Sequence[str] | Tensor | Sequence[Sequence[int]] | Batch


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(tokenizer, name, None)
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


def to_batch(
    model: Any,
    inputs: InputsLike,
    *,
    prepend_bos: bool | None = None,
    mask: Tensor | None = None,
) -> Batch:
    """Tokenize and pad ``inputs`` for ``model``.

    ``inputs``: a string, a list of strings, a ``[pos]`` or ``[batch, pos]`` tensor of token ids
    (all real unless ``mask`` says otherwise), a list of id lists, or an existing :class:`Batch`.
    Strings get BOS when ``prepend_bos`` (default: ``model.cfg.default_prepend_bos``) for
    decoders, and ``[CLS] … [SEP]`` for encoders.
    """
    if isinstance(inputs, Batch):
        return inputs
    encoder = is_encoder(model)
    if prepend_bos is None:
        prepend_bos = default_prepend_bos(model)
    device = model.cfg.device
    n_ctx = int(model.cfg.n_ctx)

    sequences: list[list[int]]
    if isinstance(inputs, str):
        sequences = [_encode(model, inputs, prepend_bos, encoder)]
        texts: list[str] | None = [inputs]
    elif isinstance(inputs, Tensor):
        if inputs.dtype.is_floating_point:
            raise InputError("Token tensors must hold integer ids, got a floating tensor.")
        t = inputs if inputs.ndim == 2 else inputs.unsqueeze(0)
        if t.ndim != 2:
            raise InputError(
                f"Token tensors must be [pos] or [batch, pos], got {tuple(inputs.shape)}."
            )
        m = (
            torch.ones_like(t, dtype=torch.bool)
            if mask is None
            else mask.to(torch.bool).reshape(t.shape)
        )
        sequences = [row[mrow].tolist() for row, mrow in zip(t.cpu(), m.cpu())]
        texts = None
    elif (
        isinstance(inputs, Sequence) and len(inputs) > 0 and all(isinstance(x, str) for x in inputs)
    ):
        sequences = [_encode(model, x, prepend_bos, encoder) for x in inputs]  # type: ignore[arg-type]
        texts = list(inputs)  # type: ignore[arg-type]
    elif isinstance(inputs, Sequence) and len(inputs) > 0:
        sequences = [[int(i) for i in seq] for seq in inputs]  # type: ignore[union-attr]
        texts = None
    else:
        raise InputError("No inputs: pass a prompt string, a list of prompts or token ids.")

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

    length = max(len(s) for s in sequences)
    pad = _pad_id(model.tokenizer) if model.tokenizer is not None else 0
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
    return Batch(
        tokens.to(device),
        real.to(device),
        str_tokens,
        special.to(device),
        encoder=encoder,
        padding_side=padding_side,
    )
