"""ModelGuard: run a method on a user's model and leave it exactly as it was found.

Every method enters ``model_guard(model)`` before it touches the model. Inside, parameters do not
require gradients (attributions need gradients with respect to activations only, which also spares
the backward pass all weight-gradient products) and the model is in eval mode. On exit, normal or
by exception, the guard restores: the set of hooks on every module (TransformerLens ``HookPoint``
handles and raw PyTorch hooks added inside are removed, the user's own hooks stay), each
parameter's ``requires_grad`` and ``.grad`` (the very tensor object it had, or ``None``), the
training mode of every module, and every parameter's dtype and device.

Inside, a user hook may also edit in place a tensor that TransformerLens' own autograd graph keeps
(a norm's ``hook_scale``; see :func:`lens_attrib.fastpath.protect_saved_outputs`): there hooks
get a copy, so the edit acts like a clone-then-edit instead of breaking the backward pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lens_attrib.backend import call_context
from lens_attrib.fastpath import protect_saved_outputs, unprotect_saved_outputs

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
)


@dataclass
class _Snapshot:
    training: dict[str, bool]
    requires_grad: dict[str, bool]
    grads: dict[str, torch.Tensor | None]
    dtypes: dict[str, torch.dtype]
    devices: dict[str, torch.device]
    hook_keys: dict[str, dict[str, set[int]]]
    hookpoint_handles: dict[str, tuple[int, int]]
    params: dict[str, nn.Parameter] = field(default_factory=dict, repr=False)


def named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``list(model.named_modules())`` (the same names, in the same order: pre-order, each module
    once under the first path that reaches it) by an explicit stack instead of nested
    generators, whose cost grows with the depth: a TransformerBridge reaches each of its ~2000
    modules along ~16 edges (Hugging Face's modules hang under the bridge's components too)."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        name, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        out.append((name, module))
        prefix = name + "." if name else ""
        children = [
            (prefix + key, child) for key, child in module._modules.items() if child is not None
        ]
        stack.extend(reversed(children))
    return out


def named_parameters(modules: list[tuple[str, nn.Module]]) -> dict[str, nn.Parameter]:
    """``dict(model.named_parameters())`` from :func:`named_modules`' list (each parameter once,
    under its first name)."""
    out: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for name, module in modules:
        prefix = name + "." if name else ""
        for key, param in module._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                out[prefix + key] = param
    return out


def _snapshot(model: nn.Module) -> _Snapshot:
    modules = named_modules(model)  # one walk (a bridge's tree is large)
    params = named_parameters(modules)
    hook_keys: dict[str, dict[str, set[int]]] = {}
    handles: dict[str, tuple[int, int]] = {}
    training: dict[str, bool] = {}
    for name, module in modules:
        # read the instance dict, not getattr/hasattr: a TransformerBridge component's
        # __getattr__ fallback is slow, and a bridge has ~2000 modules
        state = vars(module)
        training[name] = state["training"] if "training" in state else module.training
        hook_keys[name] = {attr: set(state[attr]) for attr in _HOOK_DICTS if state.get(attr)}
        if "fwd_hooks" in state and "bwd_hooks" in state:
            handles[name] = (len(state["fwd_hooks"]), len(state["bwd_hooks"]))
    return _Snapshot(
        training=training,
        requires_grad={n: p.requires_grad for n, p in params.items()},
        grads={n: p.grad for n, p in params.items()},
        dtypes={n: p.dtype for n, p in params.items()},
        devices={n: p.device for n, p in params.items()},
        hook_keys=hook_keys,
        hookpoint_handles=handles,
        params=params,
    )


def _restore(model: nn.Module, snap: _Snapshot) -> None:
    # Hooks: remove whatever was added inside the guard, keep the user's own.
    modules = named_modules(model)
    for name, module in modules:
        state = vars(module)  # as in _snapshot: no slow attribute fallback
        if name in snap.hookpoint_handles:
            n_fwd, n_bwd = snap.hookpoint_handles[name]
            fwd_hooks, bwd_hooks = state["fwd_hooks"], state["bwd_hooks"]
            for handle in fwd_hooks[n_fwd:]:
                handle.hook.remove()
            for handle in bwd_hooks[n_bwd:]:
                handle.hook.remove()
            del fwd_hooks[n_fwd:]
            del bwd_hooks[n_bwd:]
        before = snap.hook_keys.get(name, {})
        for attr in _HOOK_DICTS:
            hooks = state.get(attr)
            if not hooks:
                continue
            for key in hooks.keys() - before.get(attr, set()):
                del hooks[key]
        if name in snap.training and state.get("training", module.training) != snap.training[name]:
            module.training = snap.training[name]
    for name, param in named_parameters(modules).items():
        if param.dtype != snap.dtypes[name] or param.device != snap.devices[name]:
            param.data = param.data.to(device=snap.devices[name], dtype=snap.dtypes[name])
        if param.requires_grad != snap.requires_grad[name]:
            param.requires_grad_(snap.requires_grad[name])
        if param.grad is not snap.grads[name]:
            param.grad = snap.grads[name]


@contextmanager
def model_guard(model: nn.Module, *, eval_mode: bool = True) -> Iterator[nn.Module]:
    """Context in which methods may hook and back-propagate through ``model``.

    Inside: parameters frozen (``requires_grad=False``), eval mode (unless ``eval_mode=False``).
    On exit, even by exception: the model is restored exactly (see the module docstring).
    """
    snap = _snapshot(model)
    protected = protect_saved_outputs(model)
    try:
        for param in snap.params.values():
            if param.requires_grad:
                param.requires_grad_(False)
        if eval_mode and any(snap.training.values()):  # eval() walks every module (slow on
            model.eval()  # a TransformerBridge, whose module tree holds Hugging Face's twice)
        with call_context(model):  # a backend's per-call settings (TransformerBridge norms)
            yield model
    finally:
        unprotect_saved_outputs(protected)
        _restore(model, snap)


def model_state_fingerprint(model: nn.Module) -> dict[str, Any]:
    """Everything the guard promises to restore, in a comparable form (used by tests)."""
    snap = _snapshot(model)
    return {
        "training": snap.training,
        "requires_grad": snap.requires_grad,
        "grads": {n: (None if g is None else id(g)) for n, g in snap.grads.items()},
        "dtypes": snap.dtypes,
        "devices": snap.devices,
        "hooks": {n: {a: len(k) for a, k in d.items()} for n, d in snap.hook_keys.items()},
        "hookpoint_handles": snap.hookpoint_handles,
    }
