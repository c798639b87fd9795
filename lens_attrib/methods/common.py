"""Shared machinery: one hooked forward to the explained scalar, embedding capture, results.

Every gradient-based method runs :func:`hooked_forward`: inside the model guard, with the
method's forward hooks installed, it records the activations named in ``capture`` (making the
embeddings differentiable leaves, since parameters are frozen) and returns the explained scalar of
every item. Methods then take ``torch.autograd.grad`` of its sum with respect to the captured
activations: items of a batch never interact, so this gives every item's own gradient in one pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_attrib.attribution import Attribution
from lens_attrib.hooks.guard import model_guard
from lens_attrib.inputs import Batch, InputError, to_batch
from lens_attrib.models import is_encoder
from lens_attrib.target import ResolvedTarget, Target

HookFn = Callable[[Tensor, Any], Tensor | None]
FwdHooks = Sequence[tuple[str | Callable[[str], bool], HookFn]]


def embedding_hooks(model: Any, embeddings: str = "full") -> list[str]:
    """Hook names of the input embeddings whose sum enters the first block.

    ``"full"``: token + learned positional (+ token-type for encoders); ``"partial"``: token only.
    Rotary models have no positional embedding, so both are the token embedding.
    """
    if embeddings not in ("full", "partial"):
        raise ValueError(f"embeddings must be 'full' or 'partial', got {embeddings!r}")
    if is_encoder(model):
        names = ["embed.hook_embed"]
        if embeddings == "full":
            names += ["embed.hook_pos_embed", "embed.hook_token_type_embed"]
        return names
    names = ["hook_embed"]
    if embeddings == "full" and model.cfg.positional_embedding_type in ("standard", "shortformer"):
        names.append("hook_pos_embed")
    return names


@dataclass
class ForwardResult:
    """The explained scalar of every item and the captured activations."""

    value: Float[Tensor, "batch"]
    resolved: ResolvedTarget
    head_out: Float[Tensor, "batch n_out"]
    captured: dict[str, Tensor] = field(default_factory=dict)
    resid: Tensor | None = None


def final_residual(model: Any, batch: Batch) -> Float[Tensor, "batch pos d_model"]:
    """The residual stream after the last block (before ``ln_final``), one forward pass."""
    if is_encoder(model):
        return model.encoder_output(batch.tokens, None, batch.mask.long())
    return model(batch.tokens, stop_at_layer=model.cfg.n_layers, **batch.model_kwargs())


def target_value(
    model: Any, batch: Batch, target: Target, resid: Float[Tensor, "batch pos d_model"]
) -> tuple[Float[Tensor, "batch"], ResolvedTarget, Tensor]:
    """Apply the head at every item's target row and select the explained scalar."""
    positions = target.positions(batch)
    rows = resid[torch.arange(batch.size, device=resid.device), positions]
    head_out = target.head_fn(model)(rows)
    resolved = target.resolve(model, batch, head_out)
    return resolved.select(head_out), resolved, head_out


def _capture_hook(store: dict[str, Tensor], name: str) -> HookFn:
    def hook(x: Tensor, hook: Any) -> Tensor:
        if not x.requires_grad:
            x = x.detach().requires_grad_(True)
        store[name] = x
        return x

    return hook


def hooked_forward(
    model: Any,
    batch: Batch,
    target: Target,
    *,
    capture: Sequence[str] = (),
    fwd_hooks: FwdHooks = (),
) -> ForwardResult:
    """Forward with ``fwd_hooks`` (applied first), capturing ``capture``; returns the scalar.

    Must run inside ``model_guard`` with gradients enabled when gradients are needed.
    """
    store: dict[str, Tensor] = {}
    hooks: list[tuple[Any, HookFn]] = list(fwd_hooks)
    hooks += [(name, _capture_hook(store, name)) for name in capture]
    with model.hooks(fwd_hooks=hooks):
        resid = final_residual(model, batch)
        value, resolved, head_out = target_value(model, batch, target, resid)
    missing = [n for n in capture if n not in store]
    if missing:
        raise RuntimeError(f"Hooks {missing} did not fire: not part of this model's forward.")
    if not torch.isfinite(value).all():
        raise FloatingPointError(
            "The explained scalar is not finite (NaN/inf) for items "
            f"{torch.nonzero(~torch.isfinite(value)).flatten().tolist()}: check the inputs and "
            "the model's dtype (bf16/fp16 overflow)."
        )
    return ForwardResult(value, resolved, head_out, store, resid)


@contextmanager
def grad_context(model: Any) -> Iterator[None]:
    """Guard the model and enable autograd (also under ``torch.no_grad``/``inference_mode``)."""
    with model_guard(model), torch.inference_mode(False), torch.enable_grad():
        yield


def prepare(
    model: Any, inputs: Any, target: Target | None, *, prepend_bos: bool | None = None
) -> tuple[Batch, Target]:
    """Batch the inputs and default the target."""
    batch = to_batch(model, inputs, prepend_bos=prepend_bos)
    target = target or Target()
    if target.generate > 0:  # one row per greedily generated step (methods/generation.py)
        from lens_attrib.methods.generation import generation_batch

        batch, target, _ = generation_batch(model, batch, target)
    return batch, target


def token_labels(model: Any, ids: Tensor | None) -> list[str] | None:
    if ids is None or model.tokenizer is None:
        return None
    return [model.tokenizer.decode([int(i)]) for i in ids.tolist()]


def make_attribution(
    model: Any,
    batch: Batch,
    resolved: ResolvedTarget,
    method: str,
    scores: Tensor,
    *,
    started: float,
    options: dict[str, Any] | None = None,
    **fields: Any,
) -> Attribution:
    """Package scores (zeroed at padding, detached, on CPU) into an Attribution."""
    mask = batch.mask.to(scores.device)
    scores = scores.detach().masked_fill(~mask, 0.0)
    meta: dict[str, Any] = {
        "dtype": str(scores.dtype),
        "seconds": time.perf_counter() - started,
        "options": dict(options or {}),
        "model": getattr(model.cfg, "model_name", None),
    }
    if not resolved.regression:
        meta["target_tokens"] = token_labels(model, resolved.token_ids)
        meta["foil_tokens"] = token_labels(model, resolved.foil_ids)
    meta.update(batch.extra.get("generation", {}))  # prompt_length, generated ids (generate>0)
    meta.update(fields.pop("meta", {}))
    extra: dict[str, Any] = {
        k: (v.detach().cpu() if isinstance(v, Tensor) else v) for k, v in fields.items()
    }
    attribution = Attribution(
        scores=scores.cpu(),
        tokens=batch.str_tokens,
        token_ids=batch.tokens.cpu(),
        mask=batch.mask.cpu(),
        target=resolved.to("cpu"),
        method=method,
        meta=meta,
        **extra,
    )
    return attribution


def check_finite(name: str, tensor: Tensor) -> None:
    if not torch.isfinite(tensor).all():
        raise FloatingPointError(
            f"{name} produced non-finite relevances (NaN/inf). In float32/bf16 this is usually an "
            "overflow: retry in float64 (model.to(torch.float64)) or with another baseline."
        )


__all__ = [
    "ForwardResult",
    "InputError",
    "embedding_hooks",
    "final_residual",
    "grad_context",
    "hooked_forward",
    "make_attribution",
    "prepare",
    "target_value",
]
