"""Fixed routing: replay cached clean attention patterns during perturbed forwards.

Under *dynamic* routing a perturbed input computes its own attention patterns. Under *fixed*
routing every ``blocks.L.attn.hook_pattern`` is replaced by the pattern of the clean (unperturbed)
run of the same item, so that a perturbation changes only what is moved (values, residuals, MLPs)
and not where it is moved. A clean input run with fixed routing therefore computes exactly the
clean forward.

Batched use: the clean patterns are cached once per item (``[item, head, query, key]``) and each
perturbed row ``r`` reads the pattern of its item ``index[r]`` (the item's patterns broadcast over
all of its Monte-Carlo draws).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_attrib.backend import hook_name
from lens_attrib.hooks import HookFn


def pattern_hook_names(n_layers: int) -> list[str]:
    """Names of the attention-pattern hooks of every layer."""
    return [hook_name("pattern", layer) for layer in range(n_layers)]


def pattern_cache_hooks(
    store: dict[str, list[Tensor]],
) -> Callable[[int], list[tuple[str, HookFn]]]:
    """``make(n_layers)`` gives hooks that append every layer's (detached) pattern to ``store``.

    Use with any forward (decoder or encoder, chunked or not); concatenate the lists afterwards.
    """

    # keyed by the name asked for, not ``hook.name`` (a TransformerBridge's may differ)
    def saver(name: str) -> HookFn:
        def save(pattern: Tensor, hook: Any) -> Tensor:
            store.setdefault(name, []).append(pattern.detach())
            return pattern

        return save

    def make(n_layers: int) -> list[tuple[str, HookFn]]:
        return [(name, saver(name)) for name in pattern_hook_names(n_layers)]

    return make


def cache_patterns(
    model: Any, tokens: Int[Tensor, "batch pos"], **forward_kwargs: Any
) -> dict[str, Float[Tensor, "batch head q k"]]:
    """Run ``model`` once on ``tokens`` and return every layer's attention pattern (detached).

    ``forward_kwargs`` go to the model (``attention_mask`` / ``one_zero_attention_mask``).
    """
    store: dict[str, Tensor] = {}

    def saver(name: str) -> HookFn:
        def save(pattern: Tensor, hook: Any) -> Tensor:
            store[name] = pattern.detach()
            return pattern

        return save

    names = pattern_hook_names(int(model.cfg.n_layers))
    with torch.inference_mode(), model.hooks(fwd_hooks=[(n, saver(n)) for n in names]):
        model(tokens, **forward_kwargs)
    return store


def fixed_routing_hooks(
    patterns: dict[str, Float[Tensor, "item head q k"]],
    index: Int[Tensor, "rows"] | None = None,
) -> list[tuple[str, HookFn]]:
    """Hooks replacing each layer's pattern by the cached clean one.

    ``index[r]`` is the item whose clean pattern row ``r`` of the perturbed batch replays; ``None``
    means row ``r`` replays item ``r``. A single item broadcast over all rows uses ``expand``
    (no copy).
    """

    def make(clean: Tensor) -> HookFn:
        def hook(pattern: Tensor, hook: Any) -> Tensor:
            source = clean.to(device=pattern.device, dtype=pattern.dtype)
            if index is None:
                replay = source
            elif bool((index == index[0]).all()):
                replay = source[int(index[0])].expand(pattern.shape[0], *source.shape[1:])
            else:
                replay = source[index.to(source.device)]
            if replay.shape != pattern.shape:
                raise ValueError(
                    f"{hook.name}: cached pattern {tuple(replay.shape)} does not match the "
                    f"perturbed run's {tuple(pattern.shape)} (same tokens and padding needed)."
                )
            return replay

        return hook

    return [(name, make(clean)) for name, clean in patterns.items()]


__all__ = ["cache_patterns", "fixed_routing_hooks", "pattern_cache_hooks", "pattern_hook_names"]
