"""NaN/inf in a model's weights or activations: found before they become a silently wrong score.

Most non-finite values propagate: a NaN weight in an MLP, a value/output projection, a norm or
an embedding row makes the residual stream NaN at the positions it touches, and the final
residual (checked by :func:`check_activations` on every forward of the engine) shows it. One
path hides it: TransformerLens replaces NaN attention-pattern rows by zeros (meant for rows with
every key masked), so a NaN in a weight that feeds the attention *scores* — ``W_Q``, ``W_K``,
their biases, the norm before attention, the rotary tables — silently turns heads off, and every
output stays finite. Those weights (about 10 % of SmolLM2's) are summed before every method call
(:func:`check_score_weights`; a sum is NaN/inf as soon as one entry is; the rotary tables only
when their storage or version changed); the full
scan that names every non-finite tensor (:func:`nonfinite_tensors`) runs only once something was
found.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor
from torch.nn import Parameter

from lens_attrib.errors import NonFiniteError

SCORE_WEIGHTS = ("W_Q", "b_Q", "W_K", "b_K", "_W_K", "_b_K")
"""Attention parameters whose NaN TransformerLens would zero out of the pattern."""

SCORE_BUFFERS = ("rotary_sin", "rotary_cos")

MASK_BUFFERS = ("IGNORE", "mask")
"""Buffers that legitimately hold -inf (or are boolean masks): never reported."""


def absent_heads(model: Any) -> tuple[str, ...]:
    """Prefixes of heads a checkpoint lacks, which the loaders fill with NaN on purpose (the NSP
    head and pooler of every BERT; the MLM head of an encoder-only checkpoint like MiniLM)."""
    if not hasattr(model, "encoder_output"):
        return ()
    prefixes: tuple[str, ...] = ("nsp_head.", "pooler.")
    if getattr(model, "lens_attrib_no_lm_head", False):
        prefixes += ("mlm_head.", "unembed.")
    return prefixes


def _named_tensors(model: Any) -> list[tuple[str, Tensor]]:
    skip = absent_heads(model)
    named = list(model.named_parameters())
    named += [
        (n, b)
        for n, b in model.named_buffers()
        if b.is_floating_point() and n.rsplit(".", 1)[-1] not in MASK_BUFFERS
    ]
    return [(n, t) for n, t in named if not (skip and n.startswith(skip))]


def score_path_tensors(model: Any) -> list[tuple[str, Tensor]]:
    """The weights and tables that feed attention scores (module docstring)."""
    chosen = []
    for name, t in _named_tensors(model):
        last = name.rsplit(".", 1)[-1]
        if (
            (".attn." in name and (last in SCORE_WEIGHTS or last in SCORE_BUFFERS))
            or ".ln1." in name
            or name.endswith("ln1.w")
        ):
            chosen.append((name, t))
    return chosen


def _sums(tensors: list[Tensor]) -> Tensor:
    """One sum per tensor (accumulated in at least float32), as one vector on one device."""
    device = tensors[0].device
    return torch.stack(
        [
            t.detach()
            .sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
            .to(device)
            for t in tensors
        ]
    )


def describe(name: str, t: Tensor) -> str:
    """``"blocks.4.attn.W_Q: 1 NaN, first at index (2, 0, 0)"``."""
    data = t.detach()
    nan, inf = int(torch.isnan(data).sum()), int(torch.isinf(data).sum())
    first = tuple(int(i) for i in torch.nonzero(~torch.isfinite(data))[0].tolist())
    counts = ", ".join(f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "inf")) if n)
    return f"{name}: {counts}, first at index {first}"


def nonfinite_tensors(model: Any) -> list[str]:
    """Every parameter and float buffer holding NaN/inf, described (a full scan: error paths)."""
    return [
        describe(name, t)
        for name, t in _named_tensors(model)
        if t.numel() and not bool(torch.isfinite(t.detach()).all())
    ]


def weights_error(found: list[str]) -> NonFiniteError:
    shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
    return NonFiniteError(
        f"The model's weights are not finite ({shown}). No method can explain this model: "
        "TransformerLens turns NaN attention rows into zeros, so scores would look finite while "
        "heads are silently dead. Restore the weights (reload the model, or undo the edit that "
        "wrote the NaN) and run again."
    )


_CLEAN_TABLES: weakref.WeakKeyDictionary[Any, set[tuple[int, int]]] = weakref.WeakKeyDictionary()


def _unchecked(model: Any, named: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """Parameters always; rotary tables (buffers TransformerLens computes, one per layer) only
    when their storage or in-place version changed since they were last found finite."""
    clean = _CLEAN_TABLES.get(model, set())
    return [
        (n, t)
        for n, t in named
        if isinstance(t, Parameter) or (t.data_ptr(), t._version) not in clean
    ]


def check_score_weights(model: Any) -> None:
    """Raise :class:`NonFiniteError` naming the tensor when a score-path weight is NaN/inf."""
    named = _unchecked(model, score_path_tensors(model))
    if not named:
        return
    if bool(torch.isfinite(_sums([t for _, t in named])).all()):
        tables = {(t.data_ptr(), t._version) for _, t in named if not isinstance(t, Parameter)}
        _CLEAN_TABLES.setdefault(model, set()).update(tables)
        return
    found = [
        describe(n, t) for n, t in named if t.numel() and not bool(torch.isfinite(t.detach()).all())
    ]
    if found:  # else a float32 sum overflowed on huge finite weights: nothing to report
        raise weights_error(found)


def raise_if_weights_nonfinite(model: Any) -> None:
    """Full scan: raise :class:`NonFiniteError` naming every non-finite weight (error paths)."""
    found = nonfinite_tensors(model)
    if found:
        raise weights_error(found)


def check_activations(
    model: Any,
    x: Float[Tensor, "batch pos d"],
    mask: Bool[Tensor, "batch pos"],
    where: str = "the final residual stream",
) -> None:
    """Raise :class:`NonFiniteError` when ``x`` is NaN/inf at a real position.

    The message names the weight responsible when one is non-finite, else the first item and
    position (a hook wrote NaN/inf, or float32/bf16 overflowed).
    """
    bad = ~torch.isfinite(x.detach()).all(-1) & mask.to(x.device)
    if not bool(bad.any()):
        return
    raise_if_weights_nonfinite(model)
    item, pos = (int(i) for i in torch.nonzero(bad)[0].tolist())
    raise NonFiniteError(
        f"{where} is NaN/inf at {int(bad.sum())} real position(s), first item {item} position "
        f"{pos}, although every weight is finite: a hook writes NaN/inf there, or "
        f"{x.dtype} overflowed (retry in float64: model.to(torch.float64))."
    )


__all__ = [
    "absent_heads",
    "check_activations",
    "check_score_weights",
    "describe",
    "nonfinite_tensors",
    "raise_if_weights_nonfinite",
    "score_path_tensors",
    "weights_error",
]
