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

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_attrib.backend import Head, arch_of
from lens_attrib.backend import default_head as model_default_head
from lens_attrib.errors import TargetError
from lens_attrib.inputs import Batch

TokenSpec = str | int | Sequence[str | int] | Tensor | None


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
    continuation: a given continuation to explain by forced decoding (one target per token,
               as with ``generate``): a string (tokenized on its own, without special tokens),
               token ids, or for a batch of prompts one string / id list per prompt. With it,
               ``foil`` may be a list aligned with the steps (a list per prompt for a batch).
    labels:    names of a class head's outputs (for display: ``labels[y]``); class heads are
               otherwise shown as ``class y``. With labels, a class head's token/foil may be
               given by name.
    label:     alias of ``token`` for class heads (``Target(label="positive")``).
    sample, seed, temperature, top_k, top_p: how ``generate`` picks each token (see
               :func:`lens_attrib.methods.generation.sample_generate`): greedy (the argmax, the
               default) or, with ``sample=True``, a draw from the model's next-token
               distribution divided by ``temperature`` and restricted to the ``top_k`` most
               likely tokens and then to the smallest set of probability ``>= top_p`` (the
               order and rules of Hugging Face ``generate``). ``seed`` fixes the draws: the same
               seed gives the same tokens, and every prompt of a batch is sampled with its own
               generator seeded with it (so a batch equals its prompts one at a time); without a
               seed one is drawn from torch's global generator and recorded in
               ``meta["sampling"]``.
    contrast:  a contrastive continuation for ``continuation`` (Inseq's ``contrast_targets``),
               same forms (one per prompt for a batch). Step ``s`` then explains
               ``logit(c[s]) − logit(contrast[a(s)])``, both logits at the step's position of
               the *original* sequence ``prompt + c[:s]`` (Inseq's default for an attributed
               contrastive function, ``contrast_force_inputs=False``): the contrast supplies one
               foil per step. ``a`` aligns steps with contrast tokens: ``contrast_alignments``
               pairs ``(step, contrast index)`` (one list per prompt for a batch), and steps
               without a pair are aligned right to left, the last step with the last contrast
               token (Inseq's fill rule; 1:1 for equal lengths). ``meta["step_scores"]`` also
               reports the contrast token under its *own* prefix ``prompt + contrast[:a(s)]``
               (Inseq's contrastive step scores), see :func:`generation.contrast_step_scores`.
               Inseq's ``contrast_force_inputs=True`` (the contrast logit on its own prefix as
               part of the explained scalar) is not offered: that term does not depend on the
               explained input, so gradients ignore it and conservation would break.
    contrast_alignments: ``[(step, contrast index), ...]`` (see ``contrast``).

    A single token, foil or position is used for every item of the batch.
    """

    token: TokenSpec = None
    foil: TokenSpec = None
    position: int | Sequence[int] | None = None
    head: Head | None = None
    regression: bool = False
    generate: int = 0
    labels: Sequence[str] | None = None
    label: TokenSpec = None
    continuation: Any = None
    sample: bool = False
    seed: int | None = None
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    contrast: Any = None
    contrast_alignments: Any = None

    def __post_init__(self) -> None:
        _check_sampling(self)
        _check_contrast(self)
        if self.continuation is not None:
            object.__setattr__(self, "continuation", _normalize_continuation(self.continuation))
            if not isinstance(self.generate, bool) and self.generate != 0:
                raise TargetError(
                    f"Target got continuation= and generate={self.generate!r}: a continuation is "
                    "given (forced decoding) or generated greedily, pass one of them."
                )
            foil: Any = self.foil
            if _is_nested(foil):
                object.__setattr__(self, "foil", [_normalize_spec(f, "foil") for f in foil])
        if self.label is not None:
            if self.token is not None:
                raise TargetError(
                    f"Target got token={self.token!r} and label={self.label!r}: label is an "
                    "alias of token, pass one of them."
                )
            object.__setattr__(self, "token", self.label)
            object.__setattr__(self, "label", None)
        for what in ("token", "foil"):
            if what == "foil" and self.continuation is not None and _is_nested(self.foil):
                continue  # one foil list per prompt, normalized above
            object.__setattr__(self, what, _normalize_spec(getattr(self, what), what))
        object.__setattr__(self, "position", _normalize_position(self.position))
        if self.head is not None and not callable(self.head):
            raise TargetError(
                f"head must be a callable [n, d_model] -> [n, n_out] (e.g. a torch.nn.Module), "
                f"got {type(self.head).__name__}."
            )
        check_flags(self.regression, self.labels)
        generate = self.generate
        if isinstance(generate, bool) or not isinstance(generate, int | np.integer) or generate < 0:
            raise TargetError(f"generate must be a number of steps >= 0, got {generate!r}.")
        object.__setattr__(self, "generate", int(generate))

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
        if len(per_item) == 1 and batch.size > 1:  # one position for every item, like tokens
            per_item = per_item * batch.size
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
            return ResolvedTarget(self.positions(batch), zeros, None, True, self.head)
        if self.head is not None and self.labels is None:
            for what, spec in (("token", self.token), ("foil", self.foil)):
                if isinstance(spec, str) or (
                    isinstance(spec, Sequence) and any(isinstance(x, str) for x in spec)
                ):
                    raise TargetError(
                        f"With a class head (Target(head=...)) the {what} is a class index "
                        f"(0..{n_out - 1}), got {spec!r}; name the classes with labels=[...]."
                    )
        names = self.labels if self.head is not None else None
        if self.token is None:
            token_ids = head_out.detach().argmax(-1)
        else:
            token_ids = token_ids_of(model, self.token, batch.size, n_out, "token", names).to(
                head_out.device
            )
        foil_ids = None
        if self.foil is not None:
            foil_ids = token_ids_of(model, self.foil, batch.size, n_out, "foil", names).to(
                head_out.device
            )
            if self.token is not None and bool((foil_ids == token_ids).any()):
                same = torch.nonzero(foil_ids == token_ids).flatten().tolist()
                warnings.warn(
                    f"Target: the foil equals the token for items {same}, so the explained "
                    "difference is 0 and every relevance is 0 there.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return ResolvedTarget(self.positions(batch), token_ids, foil_ids, False, self.head)

    def evaluate(
        self, model: Any, batch: Batch, resid: Float[Tensor, "batch pos d_model"]
    ) -> tuple[Float[Tensor, "batch"], ResolvedTarget, Float[Tensor, "batch n_out"]]:
        """The explained scalar of every item from the final residual ``resid``.

        Applies the head at every item's target row only, fixes token and foil ids (the
        prediction when no token is given) and selects ``f_b`` (module docstring). Returns
        ``(f, resolved, head_out)``; every method and evaluation goes through here.
        """
        positions = self.positions(batch).to(resid.device)
        rows = resid[torch.arange(batch.size, device=resid.device), positions]
        head_out = self.head_fn(model)(rows)
        if not isinstance(head_out, Tensor) or head_out.ndim != 2 or head_out.shape[0] != len(rows):
            shape = tuple(head_out.shape) if isinstance(head_out, Tensor) else type(head_out)
            raise TargetError(
                f"The head must map residual rows [n, d_model] to [n, n_out]; for n={len(rows)} "
                f"rows it returned {shape}. A regression head returns [n, 1] (keep the last axis)."
            )
        resolved = self.resolve(model, batch, head_out)
        return resolved.select(head_out), resolved, head_out


DETACHED_HEAD_MESSAGE = (
    "This Attribution was explained through Target(head=...) and then loaded from a file; a "
    "head is a module, not data, so the file does not hold it, and reading the model's own "
    "output instead would score another quantity. Give the head back before scoring, pruning "
    "or verifying: attr = attr.with_head(head) (for a built-in classifier: clf.head)."
)


class DetachedHead:
    """Stands for the head of a loaded Attribution whose Target had one (``Target(head=...)``):
    the file keeps that there was a head but not the head. Calling it raises
    :class:`~lens_attrib.errors.TargetError` naming the fix,
    :meth:`Attribution.with_head <lens_attrib.attribution.Attribution.with_head>`."""

    def __call__(self, rows: Tensor) -> Tensor:
        raise TargetError(DETACHED_HEAD_MESSAGE)

    def __repr__(self) -> str:
        return "DetachedHead()"


def check_head_attached(head: Any) -> None:
    """Raise :class:`~lens_attrib.errors.TargetError` if ``head`` is a :class:`DetachedHead`."""
    if isinstance(head, DetachedHead):
        raise TargetError(DETACHED_HEAD_MESSAGE)


@dataclass(frozen=True)
class ResolvedTarget:
    """A target with concrete positions and ids for one batch."""

    positions: Int[Tensor, "batch"]
    token_ids: Int[Tensor, "batch"]
    foil_ids: Int[Tensor, "batch"] | None
    regression: bool = False
    head: Head | None = field(default=None, compare=False, repr=False)
    """The Target's head (``None``: the model's own), so that whatever consumes the result
    (faithfulness metrics, pruning) reads the same head without being told again. Not saved
    with an Attribution (a module is not data): a loaded one has a :class:`DetachedHead`
    here when the Target had a head (give it back with ``Attribution.with_head``), ``None``
    when it had none."""

    def select(self, head_out: Float[Tensor, "batch n_out"]) -> Float[Tensor, "batch"]:
        """The explained scalar of every item: ``head_out[y] − head_out[y']``."""
        idx = torch.arange(head_out.shape[0], device=head_out.device)
        value = head_out[idx, self.token_ids]
        if self.foil_ids is not None:
            value = value - head_out[idx, self.foil_ids]
        return value

    def select_grid(
        self, head_out: Float[Tensor, "batch *grid n_out"]
    ) -> Float[Tensor, "batch *grid"]:
        """``select`` at every grid cell of ``[batch, *grid, n_out]`` (e.g. layer × position)."""
        shape = (head_out.shape[0],) + (1,) * (head_out.ndim - 1)
        idx = self.token_ids.to(head_out.device).reshape(shape).expand(*head_out.shape[:-1], 1)
        value = head_out.gather(-1, idx)[..., 0]
        if self.foil_ids is not None:
            fidx = self.foil_ids.to(head_out.device).reshape(shape).expand_as(idx)
            value = value - head_out.gather(-1, fidx)[..., 0]
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
            self.head,
        )

    def index(self, items: Tensor) -> ResolvedTarget:
        return ResolvedTarget(
            self.positions[items],
            self.token_ids[items],
            None if self.foil_ids is None else self.foil_ids[items],
            self.regression,
            self.head,
        )


def default_head(model: Any) -> Head:
    """The model's own class head (a loaded ``*ForSequenceClassification``), else ``ln_final`` +
    ``unembed`` (decoders) or ``mlm_head`` + ``unembed`` (encoders)."""
    return model_default_head(model, arch_of(model))


def _normalize_spec(spec: Any, what: str) -> TokenSpec:
    """Check a token/foil spec's type (numpy integers become ints); errors say what to pass."""
    if isinstance(spec, np.ndarray):
        spec = torch.as_tensor(spec)
    if isinstance(spec, Tensor) and (spec.dtype.is_floating_point or spec.dtype.is_complex):
        raise TargetError(
            f"{what} ids must be integers, got a {spec.dtype} tensor {spec.flatten()[:4].tolist()}"
            ": pass token ids (e.g. torch.tensor([522])) or strings."
        )
    if spec is None or isinstance(spec, str | Tensor):
        return spec  # type: ignore[no-any-return]
    if isinstance(spec, bool):
        raise TargetError(f"{what} must be a string, an id or a list of them, got {spec!r}.")
    if isinstance(spec, int | np.integer):
        return int(spec)
    if isinstance(spec, np.ndarray):
        return torch.as_tensor(spec)
    if isinstance(spec, Sequence):
        items: list[str | int] = []
        for x in spec:
            if isinstance(x, str):
                items.append(x)
            elif isinstance(x, int | np.integer) and not isinstance(x, bool):
                items.append(int(x))
            else:
                raise TargetError(
                    f"{what} list entries must be strings or ids, got {type(x).__name__} {x!r} "
                    f"in {list(spec)!r}."
                )
        return items
    raise TargetError(
        f"{what} must be a string, an id, a list of them or a tensor, got "
        f"{type(spec).__name__} {spec!r}."
    )


def _is_nested(spec: Any) -> bool:
    """A list whose entries are lists / tensors (one foil list per prompt)."""
    return (
        isinstance(spec, Sequence)
        and not isinstance(spec, str)
        and len(spec) > 0
        and all(
            isinstance(x, Sequence | Tensor | np.ndarray) and not isinstance(x, str) for x in spec
        )
    )


def _one_continuation(spec: Any, where: str) -> str | list[int]:
    """A single continuation: a non-empty string or a non-empty list of token ids."""
    if isinstance(spec, np.ndarray):
        spec = torch.as_tensor(spec)
    if isinstance(spec, Tensor):
        if spec.dtype.is_floating_point or spec.dtype.is_complex or spec.ndim != 1:
            raise TargetError(
                f"A continuation given as a tensor must hold integer token ids in one dimension, "
                f"got a {spec.dtype} tensor of shape {tuple(spec.shape)}{where}."
            )
        spec = spec.tolist()
    if isinstance(spec, str):
        if not spec:
            raise TargetError(
                f"The continuation{where} is an empty string: there is no token to explain. "
                "Pass at least one token of text."
            )
        return spec
    if isinstance(spec, Sequence) and all(
        isinstance(x, int | np.integer) and not isinstance(x, bool) for x in spec
    ):
        if not spec:
            raise TargetError(
                f"The continuation{where} is empty: there is no token to explain. Pass at "
                "least one token id."
            )
        return [int(x) for x in spec]
    raise TargetError(
        f"continuation{where} must be a string or a list of token ids, got "
        f"{type(spec).__name__} {spec!r}."
    )


def _normalize_continuation(spec: Any) -> str | list[int] | list[str | list[int]]:
    """One continuation (string / ids) or one per prompt (a list of strings / id lists)."""
    if (
        isinstance(spec, Sequence)
        and not isinstance(spec, str)
        and len(spec) > 0
        and all(isinstance(x, str | Sequence | Tensor | np.ndarray) for x in spec)
    ):
        return [_one_continuation(x, f" of prompt {i}") for i, x in enumerate(spec)]
    if isinstance(spec, Tensor) and spec.ndim == 2:
        return [_one_continuation(x, f" of prompt {i}") for i, x in enumerate(spec)]
    return _one_continuation(spec, "")


def _check_sampling(target: Target) -> None:
    """``sample``/``seed``/``temperature``/``top_k``/``top_p``: types, ranges, and only with
    ``generate`` (sampling options only with ``sample=True``, so greedy is never changed)."""
    if not isinstance(target.sample, bool):
        raise TargetError(f"sample must be True or False, got {target.sample!r}.")
    shaping = {
        name: getattr(target, name)
        for name, default in (("temperature", 1.0), ("top_k", None), ("top_p", None))
        if getattr(target, name) != default or isinstance(getattr(target, name), bool)
    }
    if (target.sample or target.seed is not None or shaping) and not (
        not isinstance(target.generate, bool)
        and isinstance(target.generate, int | np.integer)
        and target.generate > 0
    ):
        given = ["sample"] * target.sample + ["seed"] * (target.seed is not None) + list(shaping)
        raise TargetError(
            f"Target got {given} without generate=N: they choose how generated tokens are "
            "picked. Pass Target(generate=N, sample=True, seed=...), or explain a given text "
            "with Target(continuation=...)."
        )
    if shaping and not target.sample:
        raise TargetError(
            f"Target(generate=N) got {shaping} with sample=False: greedy decoding takes the "
            "argmax, which these do not change. Pass sample=True to sample with them."
        )
    seed = target.seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | np.integer)):
        raise TargetError(f"seed must be an int, got {type(seed).__name__} {seed!r}.")
    if seed is not None:
        object.__setattr__(target, "seed", int(seed))
    temperature = target.temperature
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float | np.floating | np.integer)
        or not float(temperature) > 0
        or not np.isfinite(float(temperature))
    ):
        raise TargetError(f"temperature must be a finite number > 0, got {temperature!r}.")
    object.__setattr__(target, "temperature", float(temperature))
    top_k = target.top_k
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, int | np.integer) or top_k < 1
    ):
        raise TargetError(f"top_k must be an int >= 1 (or None for all tokens), got {top_k!r}.")
    if top_k is not None:
        object.__setattr__(target, "top_k", int(top_k))
    top_p = target.top_p
    if top_p is not None and (
        isinstance(top_p, bool)
        or not isinstance(top_p, int | float | np.floating)
        or not 0 < float(top_p) <= 1
    ):
        raise TargetError(f"top_p must be a number in (0, 1] (or None), got {top_p!r}.")
    if top_p is not None:
        object.__setattr__(target, "top_p", float(top_p))


def _check_contrast(target: Target) -> None:
    """``contrast`` needs ``continuation`` and replaces ``foil``; alignments need a contrast."""
    if target.contrast_alignments is not None and target.contrast is None:
        raise TargetError(
            "Target got contrast_alignments= without contrast=: the alignments pair steps of "
            "the continuation with tokens of a contrastive continuation; pass contrast=... too."
        )
    if target.contrast is None:
        return
    if target.continuation is None:
        raise TargetError(
            "Target(contrast=...) needs continuation=...: the contrast is a second "
            "continuation whose tokens are the foils of the given continuation's steps. For "
            "one token, pass Target(token, foil=...)."
        )
    if target.foil is not None:
        raise TargetError(
            f"Target got contrast= and foil={target.foil!r}: the contrast supplies one foil per "
            "step, pass one of them."
        )
    object.__setattr__(target, "contrast", _normalize_continuation(target.contrast))


def check_flags(regression: Any, labels: Any) -> None:
    """``regression`` is a bool; ``labels`` a list of class names (not one string)."""
    if not isinstance(regression, bool):
        raise TargetError(f"regression must be True or False, got {regression!r}.")
    if labels is not None and (
        isinstance(labels, str)
        or not isinstance(labels, Sequence)
        or not all(isinstance(x, str) for x in labels)
    ):
        raise TargetError(
            f"labels must be a list of class names, one per head output (e.g. ['negative', "
            f"'positive']), got {labels!r}."
        )


def _normalize_position(position: Any) -> int | list[int] | None:
    if position is None:
        return None
    if isinstance(position, int | np.integer) and not isinstance(position, bool):
        return int(position)
    if isinstance(position, Tensor):
        position = position.reshape(-1).tolist()
    if (
        isinstance(position, Sequence)
        and not isinstance(position, str)
        and all(isinstance(p, int | np.integer) and not isinstance(p, bool) for p in position)
    ):
        return [int(p) for p in position]
    hint = " (None already means the last real token)" if position == "last" else ""
    raise TargetError(
        f"position must be an int index among the real tokens (negative from the end), one per "
        f"item, or None, got {position!r}{hint}."
    )


def token_ids_of(
    model: Any,
    spec: TokenSpec,
    batch_size: int,
    n_out: int,
    what: str,
    labels: Sequence[str] | None = None,
) -> Tensor:
    """Ids of a token spec, one per item; strings must be exactly one token, or, for a class head
    with ``labels``, one of the labels."""

    def one(s: str | int) -> int:
        return label_id(s, labels, what) if labels is not None else single_token_id(model, s, what)

    if isinstance(spec, Tensor):
        ids = spec.reshape(-1).long()
        values: list[int] = ids.tolist()
    elif isinstance(spec, str | int):
        values = [one(spec)] * batch_size
    else:
        assert spec is not None
        values = [one(s) for s in spec]
    if len(values) == 1 and batch_size > 1:
        values = values * batch_size
    if len(values) != batch_size:
        raise TargetError(f"{len(values)} {what}s for a batch of {batch_size} items.")
    for v in values:
        if not 0 <= v < n_out:
            raise TargetError(f"{what} id {v} is outside the head's {n_out} outputs.")
    return torch.tensor(values, dtype=torch.long)


def label_id(spec: str | int, labels: Sequence[str], what: str = "token") -> int:
    """The index of a class named ``spec`` among a class head's ``labels`` (ids pass through)."""
    if isinstance(spec, int):
        return spec
    names = list(labels)
    if spec not in names:
        raise TargetError(f"The {what} {spec!r} is not one of the head's labels {names}.")
    return names.index(spec)


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
        if not spec.startswith(" ") and not arch_of(model).encoder:
            with_space = tokenizer(" " + spec, add_special_tokens=False)["input_ids"]
            if len(with_space) == 1:
                hint = f" Did you mean {' ' + spec!r} (with its leading space), one token?"
        raise TargetError(
            f"The {what} {spec!r} is {len(ids)} tokens under this tokenizer: {pieces}. "
            f"A {what} must be exactly one token: pass one of them or its id.{hint}"
        )
    return int(ids[0])


# --------------------------------------------------------------------------- space checks
WORD_END = ",.;:!?)]}"
"""Characters after which the next word is written with a leading space (besides letters and
digits): a prompt ending in one of them, or in a word, is followed by ``" word"``."""


def starts_word(text: str) -> bool:
    """Whether ``text`` begins with an ASCII letter or digit (a word, not punctuation)."""
    return bool(text) and text[0].isascii() and text[0].isalnum()


def precedes_spaced_word(text: str) -> bool:
    """Whether the word after ``text`` is written with a leading space in running text."""
    return bool(text) and ((text[-1].isascii() and text[-1].isalnum()) or text[-1] in WORD_END)


def ends_in_space(text: str) -> bool:
    """A trailing space or tab (a trailing newline is ordinary: the next line has no space)."""
    return text.endswith((" ", "\t"))


def _item_specs(spec: TokenSpec, n: int) -> list[str | int | None]:
    if spec is None or isinstance(spec, Tensor):
        return [None] * n
    if isinstance(spec, str | int):
        return [spec] * n
    items: list[str | int | None] = list(spec)
    if len(items) == 1:
        return items * n
    return items if len(items) == n else [None] * n  # a wrong count is an error later


def _spaced_twin(tokenizer: Any, word: str) -> tuple[int, int] | None:
    """``(id of word, id of " " + word)`` when both are single, different tokens."""
    plain = tokenizer(word, add_special_tokens=False)["input_ids"]
    spaced = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
    if len(plain) == 1 and len(spaced) == 1 and plain[0] != spaced[0]:
        return int(plain[0]), int(spaced[0])
    return None


def preceding_tokens(batch: Batch, target: Target) -> list[str]:
    """The string token at every item's target position (the text the next word follows)."""
    spec = target.position
    out = []
    for b, tokens in enumerate(batch.str_tokens):
        if spec is None:
            p = -1
        else:
            per_item = [spec] if isinstance(spec, int) else list(spec)
            p = per_item[0] if len(per_item) == 1 else per_item[b] if b < len(per_item) else -1
        out.append(tokens[p] if -len(tokens) <= p < len(tokens) else "")
    return out


def warn_about_spaces(
    model: Any, batch: Batch, target: Target, texts: Sequence[str] | None = None
) -> None:
    """Warn (:class:`~lens_attrib.errors.InputWarning`) about two silent mistakes of decoders.

    1. A prompt that ends in a space: the next word's leading space is then inside the prompt,
       so the model predicts a word *after a space*, which its tokenizer almost never produces.
    2. A target or foil string without the leading space that the next word has after the
       prompt (``Target("are")`` after ``"The keys to the cabinet"``): when the tokenizer also
       has the spaced form as one token, that is the word the model predicts there.

    Not applied to encoders (masked positions), class heads, ids (explicit: pass the id to
    explain a token exactly as written) and words without a spaced one-token form.
    """
    from lens_attrib.errors import InputWarning

    tokenizer = getattr(model, "tokenizer", None)
    if batch.arch.encoder or target.head is not None or tokenizer is None:
        return
    before = preceding_tokens(batch, target)
    spaced_prompt = [b for b, tok in enumerate(before) if ends_in_space(tok)]
    if texts is not None and target.position is None:
        for b, text in enumerate(texts):
            stripped = text.rstrip(" \t")
            if b not in spaced_prompt and ends_in_space(text) and stripped:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                if ids != tokenizer(stripped, add_special_tokens=False)["input_ids"]:
                    spaced_prompt.append(b)
    if spaced_prompt:
        b = spaced_prompt[0]
        shown = repr(texts[b]) if texts is not None else f"ending in token {before[b]!r}"
        fix = f": {texts[b].rstrip(' ' + chr(9))!r}" if texts is not None else ""
        more = f" (and {len(spaced_prompt) - 1} more)" if len(spaced_prompt) > 1 else ""
        warnings.warn(
            f"Prompt {b} ({shown}) ends in a space{more}: "
            "the next word's leading space is then inside the prompt, and the model is asked "
            "for a word after a lone space, which its tokenizer almost never writes (results "
            f"differ). Remove the trailing space{fix}, and give the target with its space "
            "(Target(' are')).",
            InputWarning,
            stacklevel=5,
        )
        return  # the target check below assumes prompts without trailing spaces
    for what in ("token", "foil"):
        specs = _item_specs(getattr(target, what), batch.size)
        for b, spec in enumerate(specs):
            if not isinstance(spec, str) or not starts_word(spec):
                continue
            if not precedes_spaced_word(before[b]):
                continue
            twin = _spaced_twin(tokenizer, spec)
            if twin is None:
                continue
            plain, spaced = twin
            warnings.warn(
                f"The {what} {spec!r} (id {plain}) has no leading space, but after "
                f"{before[b]!r} (item {b}) the next word is written with one: {' ' + spec!r} "
                f"(id {spaced}) is the word the model predicts there. Pass {' ' + spec!r} "
                f"(e.g. Target({' ' + spec!r})); to explain {spec!r} as written (a word "
                f"continued without a space), pass its id {plain}.",
                InputWarning,
                stacklevel=5,
            )
            break  # one warning per token/foil
