"""Test helper: what a model's state is, and whether a call left it exactly as it was.

The state is the model guard's fingerprint (:func:`lens_attrib.hooks.guard.model_state_fingerprint`:
hooks, the identity of every ``.grad``, ``requires_grad``, training mode, dtype, device) and a copy
of every parameter's values, compared exactly (NaN equal to NaN: some tests poison weights on
purpose).
"""

from __future__ import annotations

from typing import Any

import torch

from lens_attrib.hooks.guard import model_state_fingerprint


def model_state(model: torch.nn.Module) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The guard's fingerprint and a copy of every parameter."""
    return model_state_fingerprint(model), [p.detach().clone() for p in model.parameters()]


def state_changes(
    model: torch.nn.Module, before: tuple[dict[str, Any], list[torch.Tensor]]
) -> list[str]:
    """What differs from ``before`` (empty when nothing does)."""
    fingerprint, params = before
    now_fingerprint = model_state_fingerprint(model)
    changes = [
        f"{key} changed" for key in fingerprint if now_fingerprint.get(key) != fingerprint[key]
    ]
    now = dict(model.named_parameters())
    if len(now) != len(params):
        return [*changes, f"{len(params)} parameters before, {len(now)} after"]
    for (name, param), old in zip(now.items(), params, strict=True):
        same = (
            param.dtype == old.dtype
            and param.shape == old.shape
            and torch.allclose(param.detach(), old, rtol=0.0, atol=0.0, equal_nan=True)
        )
        if not same:
            changes.append(f"the values of {name} changed")
    return changes


def assert_unchanged(
    model: torch.nn.Module, before: tuple[dict[str, Any], list[torch.Tensor]]
) -> None:
    """The guard's fingerprint and every weight are as they were."""
    assert state_changes(model, before) == []
