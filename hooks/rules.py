"""Rule primitives of modified-gradient attribution: LRP's identity and uniform rules, DeepLIFT's
Rescale rule, and the autograd pieces they are written with.

Every primitive leaves the forward value unchanged (bit for bit) and only changes what flows
backward, so that Gradient×Input read at the input embeddings is the relevance the rule
propagates. A rule is a gradient *multiplier* ``m`` per input of an operation
``out = op(x_1, …)``: backward sends ``∂f/∂out ⊙ m_i`` to ``x_i`` (:func:`linearized`).

- identity rule (LRP, element-wise ``a = φ(h)``): ``m = φ(h)/(h + ε)``, so ``R_h = R_a``
  (:func:`identity_rule`; ``ε = 1e-10`` as LXT 2.1).
- uniform rule (AttnLRP, a product ``c = a·b``): half of ``R_c`` to each factor, ``m_a = b/2``,
  ``m_b = a/2`` (:func:`uniform_rule`); where the factors only meet linearly downstream (the
  attention products ``q·k`` and ``A·v``) the halving is a constant gradient scale
  (:func:`scale_grad`).
- Rescale rule (DeepLIFT, element-wise ``a = φ(h)`` against a reference ``h₀``):
  ``m = (φ(h) − φ(h₀))/(h − h₀)``, ``φ'(h)`` where ``|h − h₀| < eps`` (:func:`rescale_multiplier`,
  :func:`hooked_secant`), computed in float64 (:func:`lens_attrib.precision.widened`).

The patches that place these rules in a model are in :mod:`lens_attrib.hooks.lrp` (CP-LRP,
AttnLRP) and :mod:`lens_attrib.hooks.deeplift`; :func:`mlm_head_activation` is the one patch
point both need where TransformerLens has no hook (the GELU inside BERT's MLM head).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lens_attrib.backend import MlmHead, mlm_head_parts
from lens_attrib.precision import widened

IDENTITY_EPS = 1e-10  # LXT 2.1, lxt/efficient/rules.py: identity_rule_implicit_fn(epsilon=1e-10)
RESCALE_EPS = 1e-10  # Captum 0.9, DeepLift(eps=1e-10): |Δh| below it falls back to φ'(h)
UNIFORM_SHARE = 0.5
"""The share of a product's relevance the uniform rule gives each of its two factors."""


class _ScaleGrad(torch.autograd.Function):
    """Identity forward (a view), gradient multiplied by a constant backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


def scale_grad(x: Tensor, factor: float) -> Tensor:
    """``x`` unchanged forward; ``factor · ∂f/∂x`` flows backward."""
    return _ScaleGrad.apply(x, factor)  # type: ignore[no-any-return]


class _Linearized(torch.autograd.Function):
    """Forward returns ``value`` unchanged; backward sends ``g ⊙ m_i`` to input ``x_i``.

    Called as ``apply(value, x_1, m_1, x_2, m_2, …)`` with detached multipliers ``m_i``.
    """

    @staticmethod
    def forward(ctx: Any, value: Tensor, *pairs: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(*pairs[1::2])
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        out: list[Tensor | None] = [None]
        for m in ctx.saved_tensors:
            out += [grad * m, None]
        return tuple(out)


def linearized(value: Tensor, *pairs: tuple[Tensor, Tensor]) -> Tensor:
    """``value`` forward; backward ``∂f/∂x_i = ∂f/∂value ⊙ m_i`` for every ``(x_i, m_i)``."""
    flat: list[Tensor] = []
    for x, m in pairs:
        flat += [x, m.detach()]
    return _Linearized.apply(value.detach(), *flat)  # type: ignore[no-any-return]


def safe_ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` with 0 where ``den == 0`` (there ``R = den · g · ratio`` is 0 anyway)."""
    zero = den == 0
    return torch.where(zero, torch.zeros_like(num), num / torch.where(zero, 1.0, den))


def identity_rule(pre: Tensor, post: Tensor, eps: float = IDENTITY_EPS) -> Tensor:
    """``post = φ(pre)`` forward, backward multiplied by ``φ(pre)/(pre + eps)``: ``R_pre ≈ R_post``.

    ``eps`` is LXT's stabiliser (default ``1e-10``); with ``eps=0`` the rule is exact.
    """
    with torch.no_grad():
        ratio = safe_ratio(post, pre + eps)
    return linearized(post, (pre, ratio))


def uniform_rule(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Gradient multipliers ``(m_a, m_b) = (b/2, a/2)`` of the uniform rule on ``c = a·b``
    (Achtibat et al. 2024): ``a ⊙ m_a ⊙ g = b ⊙ m_b ⊙ g = c ⊙ g / 2``, half of ``R_c`` each.
    Detached; pass them to :func:`linearized` (composed with a rule through ``a`` where ``a``
    is itself ``φ(h)``)."""
    with torch.no_grad():
        return UNIFORM_SHARE * b, UNIFORM_SHARE * a


def derivative(act: Callable[[Tensor], Tensor], h: Tensor) -> Tensor:
    """``φ'(h)`` of an element-wise ``φ`` (one autograd call on a detached copy)."""
    with torch.enable_grad():
        x = h.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(act(x).sum(), x)
    return grad


def takes_float64(act: Callable[[Tensor], Tensor]) -> bool:
    """Whether ``act`` can be called on float64 tensors: a plain function, or a module (or a
    module's bound method) without floating parameters or buffers of another dtype."""
    owner = getattr(act, "__self__", act)
    if not isinstance(owner, nn.Module):
        return True
    tensors = [*owner.parameters(), *owner.buffers()]
    return all(t.dtype == torch.float64 for t in tensors if t.is_floating_point())


def rescale_multiplier(
    act: Callable[[Tensor], Tensor], h: Tensor, h0: Tensor, eps: float = RESCALE_EPS
) -> Tensor:
    """``(φ(h) − φ(h₀))/(h − h₀)``, and ``φ'(h)`` where ``|h − h₀| < eps`` (Captum's rule),
    computed in float64 (:func:`widened`; in ``h``'s dtype where ``act`` holds parameters of
    another dtype) and returned in ``h``'s dtype and device."""
    with torch.no_grad():
        wide = takes_float64(act)
        x, x0 = (widened(h), widened(h0)) if wide else (h, h0)
        dh = x - x0
        secant = safe_ratio(act(x) - act(x0), dh)
        m = torch.where(dh.abs() < eps, derivative(act, x), secant)
        return m.to(h.device, h.dtype)


def hooked_secant(
    act: Callable[[Tensor], Tensor] | None,
    h: Tensor,
    h0: Tensor,
    a: Tensor,
    a0: Tensor,
    eps: float = RESCALE_EPS,
) -> tuple[Tensor, Tensor]:
    """The secant ``(a − a₀)/(h − h₀)`` of an activation read at hook points, where ``a = ψ(φ(h))``
    may include the user's element-wise edits ``ψ`` (identity when there are none), and the mask
    ``|h − h₀| ≥ eps`` of the elements it applies to (elsewhere the caller keeps the gradient).

    In float64 (:func:`widened`) as ``a − a₀ = [φ(h) − φ(h₀)] + [(a − φ(h)) − (a₀ − φ(h₀))]``:
    the first difference in float64, the edits (0 where the hook values are ``φ``'s own, as when
    no user hook edits them) in ``h``'s dtype. So the user's edits stay part of the rule, and
    without edits the multiplier is :func:`rescale_multiplier`'s. Float64 inputs, an ``act`` that
    takes none, or no ``act`` (a backend that cannot name the activation): divided as read, in
    ``h``'s dtype. Returned in ``h``'s dtype and device.
    """
    with torch.no_grad():
        if act is None or h.dtype == torch.float64 or not takes_float64(act):
            dh = h - h0
            exact = dh.abs() >= eps
            return torch.where(exact, safe_ratio(a - a0, dh), 0.0), exact
        edits = (a - act(h)) - (a0 - act(h0))
        x, x0 = widened(h), widened(h0)
        dh = x - x0
        exact = dh.abs() >= eps
        secant = safe_ratio(act(x) - act(x0) + widened(edits), dh)
        m = torch.where(exact, secant, 0.0)
        return m.to(h.device, h.dtype), exact.to(h.device)


@contextmanager
def mlm_head_activation(
    model: Any, replace: Callable[[MlmHead, Tensor, Tensor], Tensor]
) -> Iterator[None]:
    """Replace the output of the activation inside BERT's MLM head (it has no hook point).

    The head's parts come from the backend (:func:`lens_attrib.backend.mlm_head_parts`): a
    forward pre-hook on its ``entry`` keeps its input ``x``; a forward pre-hook on its ``norm``
    recomputes ``h = x W + b`` (target rows only, cheap) and passes ``replace(parts, h, φ(h))``
    on to the LayerNorm instead of ``φ(h)``.
    """
    parts = mlm_head_parts(model)
    kept: dict[str, Tensor] = {}

    def keep_input(module: Any, args: tuple[Tensor, ...]) -> None:
        kept["x"] = args[0]

    def swap(module: Any, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        x = kept.pop("x")
        h = torch.matmul(x, parts.weight) + parts.bias
        return (replace(parts, h, args[0]), *args[1:])

    handles = [
        parts.entry.register_forward_pre_hook(keep_input),
        parts.norm.register_forward_pre_hook(swap),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


__all__ = [
    "IDENTITY_EPS",
    "RESCALE_EPS",
    "UNIFORM_SHARE",
    "derivative",
    "identity_rule",
    "linearized",
    "mlm_head_activation",
    "rescale_multiplier",
    "safe_ratio",
    "scale_grad",
    "uniform_rule",
]
