"""Target: the scalar an attribution explains.

For item ``b`` the explained scalar is

    f_b = head(x_b[p_b])[y_b] − head(x_b[p_b])[y'_b]      (the second term only with a foil)

where ``x_b`` is the final residual stream, ``p_b`` the target position (default: the last real
token), ``y_b`` the target token or class (default: the model's own prediction, the argmax of the
head's output), ``y'_b`` the optional contrastive foil (Yin & Neubig 2022), and ``head`` the model's
head-on-top: ``ln_final`` + ``unembed`` for decoders, the MLM head + ``unembed`` for encoders that
have one, or any callable mapping ``[n, d_model]`` residual rows to ``[n, n_out]`` scores (a class
head). With ``regression=True`` the head has one output and ``f_b = head(x_b[p_b])[0]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_attrib.inputs import Batch
from lens_attrib.models import has_lm_head, is_encoder

TokenSpec = str | int | Sequence[str | int] | Tensor | None
Head = Callable[[Tensor], Tensor]


class TargetError(ValueError):
    """Raised for a target that cannot be explained as given."""


@dataclass(frozen=True)
class Target:
    """What is explained (see the module docstring for the formula).

    token:     target token/class per item: a string (must be exactly one token), an id, a list
               of either (one per item), or ``None`` for the model's prediction.
    foil:      optional contrastive token/class, same forms; the explained scalar becomes the
               target-minus-foil logit difference.
    position:  index among the *real* tokens of each item (negative counts from the end), one int
               or one per item; ``None`` means the last real token.
    head:      ``[n, d_model] -> [n, n_out]`` callable; ``None`` means the model's own head.
    regression: the head has a single output that is explained directly (``token`` is ignored).
    generate:  number of greedy generation steps to explain (one target per generated token);
               supported by the methods that say so.
    """

    token: TokenSpec = None
    foil: TokenSpec = None
    position: int | Sequence[int] | None = None
    head: Head | None = None
    regression: bool = False
    generate: int = 0

    def with_(self, **changes: Any) -> Target:
        return replace(self, **changes)

    @property
    def contrastive(self) -> bool:
        return self.foil is not None

    def positions(self, batch: Batch) -> Int[Tensor, "batch"]:
        """Absolute (padded) index of the target position of every item."""
        if self.position is None:
            return batch.last_real
        spec = self.position
        per_item = [spec] * batch.size if isinstance(spec, int) else list(spec)
        if len(per_item) != batch.size:
            raise TargetError(
                f"{len(per_item)} target positions for a batch of {batch.size} items."
            )
        return torch.tensor(
            [batch.real_index(b, int(p)) for b, p in enumerate(per_item)],
            dtype=torch.long,
            device=batch.tokens.device,
        )

    def head_fn(self, model: Any) -> Head:
        """The callable mapping residual rows to head outputs."""
        if self.head is not None:
            return self.head
        return default_head(model)

    def resolve(
        self, model: Any, batch: Batch, head_out: Float[Tensor, "batch n_out"]
    ) -> ResolvedTarget:
        """Fix token and foil ids; ``head_out`` (head at the target rows) gives predictions."""
        n_out = int(head_out.shape[-1])
        if self.regression:
            if n_out != 1:
                raise TargetError(f"regression=True needs a head with one output, got {n_out}.")
            zeros = torch.zeros(batch.size, dtype=torch.long, device=head_out.device)
            return ResolvedTarget(self.positions(batch), zeros, None, True)
        if self.token is None:
            token_ids = head_out.detach().argmax(-1)
        else:
            token_ids = token_ids_of(model, self.token, batch.size, n_out, "token").to(
                head_out.device
            )
        foil_ids = None
        if self.foil is not None:
            foil_ids = token_ids_of(model, self.foil, batch.size, n_out, "foil").to(head_out.device)
        return ResolvedTarget(self.positions(batch), token_ids, foil_ids, False)


@dataclass(frozen=True)
class ResolvedTarget:
    """A target with concrete positions and ids for one batch."""

    positions: Int[Tensor, "batch"]
    token_ids: Int[Tensor, "batch"]
    foil_ids: Int[Tensor, "batch"] | None
    regression: bool = False

    def select(self, head_out: Float[Tensor, "batch n_out"]) -> Float[Tensor, "batch"]:
        """The explained scalar of every item: ``head_out[y] − head_out[y']``."""
        idx = torch.arange(head_out.shape[0], device=head_out.device)
        value = head_out[idx, self.token_ids]
        if self.foil_ids is not None:
            value = value - head_out[idx, self.foil_ids]
        return value

    def direction(self, weight: Float[Tensor, "d n_out"]) -> Float[Tensor, "batch d"]:
        """Columns of a linear head's weight for target minus foil, ``[batch, d]``."""
        cols = weight[:, self.token_ids].T
        if self.foil_ids is not None:
            cols = cols - weight[:, self.foil_ids].T
        return cols

    def to(self, device: torch.device | str) -> ResolvedTarget:
        return ResolvedTarget(
            self.positions.to(device),
            self.token_ids.to(device),
            None if self.foil_ids is None else self.foil_ids.to(device),
            self.regression,
        )

    def index(self, items: Tensor) -> ResolvedTarget:
        return ResolvedTarget(
            self.positions[items],
            self.token_ids[items],
            None if self.foil_ids is None else self.foil_ids[items],
            self.regression,
        )


def default_head(model: Any) -> Head:
    """``ln_final`` + ``unembed`` (decoders) or ``mlm_head`` + ``unembed`` (encoders)."""
    if is_encoder(model):
        if not has_lm_head(model):
            raise TargetError(
                "This encoder has no masked-LM head (e.g. all-MiniLM-L6-v2 ships only the "
                "encoder), so token logits do not exist. Pass Target(head=...) with a class head "
                "(a callable on [n, d_model] residual rows), or use a method that needs no head "
                "(alti, attention, rollout, embed_norm)."
            )

        def encoder_head(x: Tensor) -> Tensor:
            return model.unembed(model.mlm_head(x[:, None, :]))[:, 0, :]

        return encoder_head

    def decoder_head(x: Tensor) -> Tensor:
        return model.unembed(model.ln_final(x[:, None, :]))[:, 0, :]

    return decoder_head


def token_ids_of(model: Any, spec: TokenSpec, batch_size: int, n_out: int, what: str) -> Tensor:
    """Ids of a token spec, one per item; strings must be exactly one token."""
    if isinstance(spec, Tensor):
        ids = spec.reshape(-1).long()
        values: list[int] = ids.tolist()
    elif isinstance(spec, str | int):
        values = [single_token_id(model, spec, what)] * batch_size
    else:
        assert spec is not None
        values = [single_token_id(model, s, what) for s in spec]
    if len(values) == 1 and batch_size > 1:
        values = values * batch_size
    if len(values) != batch_size:
        raise TargetError(f"{len(values)} {what}s for a batch of {batch_size} items.")
    for v in values:
        if not 0 <= v < n_out:
            raise TargetError(f"{what} id {v} is outside the head's {n_out} outputs.")
    return torch.tensor(values, dtype=torch.long)


def single_token_id(model: Any, spec: str | int, what: str = "token") -> int:
    """The id of a one-token string (or an id passed through)."""
    if isinstance(spec, int):
        return spec
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise TargetError(f"The model has no tokenizer: pass the {what} as an integer id.")
    ids = tokenizer(spec, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = [tokenizer.decode([i]) for i in ids]
        hint = ""
        if not spec.startswith(" ") and not is_encoder(model):
            with_space = tokenizer(" " + spec, add_special_tokens=False)["input_ids"]
            if len(with_space) == 1:
                hint = f" Did you mean {' ' + spec!r} (with its leading space), one token?"
        raise TargetError(
            f"The {what} {spec!r} is {len(ids)} tokens under this tokenizer: {pieces}. "
            f"A {what} must be exactly one token: pass one of them or its id.{hint}"
        )
    return int(ids[0])
