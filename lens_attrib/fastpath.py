"""Forward passes without per-call weight copies: store each matrix in the layout its kernel reads.

TransformerLens 3.9 keeps its weights in the "mathematical" layout (``W_U: [d_model, d_vocab]``,
``W_Q: [head, d_model, d_head]``, ``W_O: [head, d_head, d_model]``, gated-MLP ``W_in: [d_model,
d_mlp]``) but multiplies them with ``F.linear``, which wants Hugging Face's ``[out, in]`` layout.
So every forward re-lays them out into a fresh contiguous tensor: ``W_U.T.contiguous()``
(``Unembed``), ``W_gate/W_in/W_out.T.contiguous()`` (``GatedMLP``), ``rearrange(W_Q, "h m d ->
(h d) m")`` (``simple_attn_linear``, also for ``W_K``/``W_V``) and ``rearrange(W_O, "h d m -> m
(h d)").contiguous()`` (attention output). On SmolLM2-135M that is 211 weight copies per forward
(the 113 MB ``W_U`` copy alone on every unembedding) and about a fifth of the forward's CPU time.

:func:`enable_fast_forward` changes none of the code: it re-stores each such parameter so that the
tensor the forward builds is a *view* of the parameter's memory, already in ``[out, in]`` order::

    W_U      [d_model, d_vocab]      = storage[d_vocab, d_model].T
    W_in     [d_model, d_mlp]        = storage[d_mlp, d_model].T       (W_gate likewise)
    W_out    [d_mlp, d_model]        = storage[d_model, d_mlp].T
    W_Q      [head, d_model, d_head] = storage[head, d_head, d_model].transpose(1, 2)  (K, V alike)
    W_O      [head, d_head, d_model] = storage[d_model, head, d_head].permute(1, 2, 0)

Then ``W_U.T.contiguous()`` returns the storage itself and ``rearrange`` only reshapes, so the
forward hands ``F.linear`` the very values, in the very layout, that it copied before: outputs are
bit-for-bit those of the unpatched model. The parameters stay the same ``nn.Parameter`` objects
with the same names, shapes and values (``model.W_U``, ``state_dict()``, hooks, gradients, the
model guard all see nothing new); only their strides change (``is_contiguous()`` is ``False``;
``torch.save`` keeps the layout, ``safetensors`` needs ``.contiguous()`` on save).
``Module.to(dtype/device)`` keeps the layout (``preserve_format``); a ``load_state_dict(...,
assign=True)`` replaces it with the loaded tensors' layout, which is correct but slower again
(call :func:`enable_fast_forward` after it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Storage order (logical dimensions, outermost first) of each re-laid parameter, by module kind.
_MATRIX_T = (1, 0)
_QKV_ORDER = (0, 2, 1)  # [head, d_model, d_head] stored as [head, d_head, d_model]
_OUT_ORDER = (2, 0, 1)  # [head, d_head, d_model] stored as [d_model, head, d_head]


def _layouts(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The parameters of ``module`` to re-lay and their storage orders (empty: leave as is)."""
    from transformer_lens.components import AbstractAttention, Unembed
    from transformer_lens.components.mlps.gated_mlp import GatedMLP

    if isinstance(module, Unembed):
        return {"W_U": _MATRIX_T}
    if isinstance(module, GatedMLP):
        return {"W_in": _MATRIX_T, "W_gate": _MATRIX_T, "W_out": _MATRIX_T}
    if isinstance(module, AbstractAttention) and not module.cfg.load_in_4bit:
        return {
            "W_Q": _QKV_ORDER,
            "W_K": _QKV_ORDER,
            "W_V": _QKV_ORDER,
            "_W_K": _QKV_ORDER,  # grouped-query attention stores K/V weights privately
            "_W_V": _QKV_ORDER,
            "W_O": _OUT_ORDER,
        }
    return {}


def _relaid_parameters(model: nn.Module) -> list[tuple[nn.Parameter, tuple[int, ...]]]:
    found: list[tuple[nn.Parameter, tuple[int, ...]]] = []
    for module in model.modules():
        for name, order in _layouts(module).items():
            param = module._parameters.get(name)
            if isinstance(param, nn.Parameter) and param.ndim == len(order):
                found.append((param, order))
    return found


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(range(len(order)), key=order.__getitem__))


def _in_storage_order(tensor: torch.Tensor, order: tuple[int, ...]) -> bool:
    return tensor.permute(order).is_contiguous()


def _check_model(model: Any) -> None:
    from transformer_lens import HookedEncoder, HookedTransformer

    if not isinstance(model, HookedTransformer | HookedEncoder):
        raise TypeError(
            f"enable_fast_forward expects a TransformerLens HookedTransformer or HookedEncoder, "
            f"got {type(model).__name__}."
        )


def enable_fast_forward(model: Any) -> Any:
    """Re-store ``model``'s matrices so that no forward copies a weight; returns ``model``.

    In place and idempotent. Outputs, hooks, gradients and ``state_dict`` are unchanged (see the
    module docstring); parameters already in the fast layout are left alone.
    """
    _check_model(model)
    with torch.no_grad():
        for param, order in _relaid_parameters(model):
            if _in_storage_order(param, order):
                continue
            stored = param.detach().permute(order).contiguous()
            param.data = stored.permute(_inverse(order))
    return model


def disable_fast_forward(model: Any) -> Any:
    """Give every re-laid parameter back its ordinary contiguous layout; returns ``model``."""
    _check_model(model)
    with torch.no_grad():
        for param, _ in _relaid_parameters(model):
            if not param.is_contiguous():
                param.data = param.detach().contiguous()
    return model


def is_fast_forward(model: Any) -> bool:
    """Whether every matrix :func:`enable_fast_forward` handles is in its copy-free layout."""
    return all(_in_storage_order(p, order) for p, order in _relaid_parameters(model))
