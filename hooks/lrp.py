"""Detach patches that turn one Gradient×Input pass into LRP (CP-LRP) or AttnLRP.

"Modified Gradient×Input" (Ali et al. 2022; Achtibat et al. 2024): every patch leaves the
forward value of the model *bit for bit* unchanged and only changes what flows backward, so that
``R = x ⊙ ∂f/∂x`` read at the input embeddings equals relevance propagated with the LRP rules:

- **norms** (LayerNorm, RMSNorm, also BERT's embedding and MLM-head LayerNorms): the scale
  ``σ`` is detached at ``*.hook_scale``; the normalisation becomes the linear map
  ``(x − μ)·w/σ`` (ε-rule; identity rule for RMSNorm).
- **elementwise activation** ``a = φ(h)``: identity rule ``R_h = R_a``, i.e. the backward pass
  multiplies by ``φ(h)/(h + ε_id)`` instead of ``φ'(h)`` (at ``mlp.hook_post``, with ``h`` from
  ``mlp.hook_pre``; and inside BERT's MLM head). ``ε_id = identity_eps`` defaults to ``1e-10``,
  the stabiliser of LXT 2.1's ``identity_rule_implicit`` (Achtibat et al. 2024, reference code),
  so that the default equals LXT; ``identity_eps=0`` gives the exact ratio ``φ(h)/h``. Where
  ``h + ε_id == 0`` the multiplier is 0 (LXT would divide by zero there).
- **CP-LRP** (``variant="lrp"``): attention pattern detached at ``attn.hook_pattern`` (the
  attention is a fixed linear mixing of values), the gate of a gated MLP detached.
- **AttnLRP** (``variant="attnlrp"``): uniform rule on both bilinear products. For
  ``z = A·v`` each factor receives half of ``R_z``; for ``s = q·k`` each factor receives half of
  ``R_s``; the softmax keeps its plain gradient (the softmax rule
  ``R_s = s ⊙ (R_A − A·ΣR_A)`` of the paper *is* Gradient×Input). Since the softmax backward
  is linear in the incoming gradient, halving at the products is the same as scaling the
  gradient leaving ``v`` by 1/2 and leaving ``q`` and ``k`` by 1/4 (at ``attn.hook_q``,
  ``attn.hook_k``, ``attn.hook_v``): this adds no ``[pos, pos]``-sized tensor to the pass.
  Gated MLPs: uniform rule on ``φ(gate)·up`` (half to each factor) with the identity rule through
  ``φ``.

Every custom backward below saves at most one tensor of the size of the activation it replaces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lens_attrib.backend import arch_of, hook_name, layer_norm_activation, mlp_activation
from lens_attrib.errors import ModelError
from lens_attrib.hooks import HookFn

VARIANTS = ("lrp", "attnlrp")
IDENTITY_EPS = 1e-10  # LXT 2.1, lxt/efficient/rules.py: identity_rule_implicit_fn(epsilon=1e-10)


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


def _detach(x: Tensor, hook: Any) -> Tensor:
    return x.detach()


def _grad_scaler(factor: float) -> HookFn:
    def hook(x: Tensor, hook: Any) -> Tensor:
        return scale_grad(x, factor)

    return hook


def _mlp_hooks(model: Any, variant: str, identity_eps: float) -> list[tuple[str, HookFn]]:
    """Identity rule through the activation; gate rule (detach / uniform) in gated MLPs."""
    cfg = model.cfg
    if layer_norm_activation(model):
        raise ModelError(
            f"LRP rules for the LayerNorm activation {cfg.act_fn!r} (SoLU) are not implemented."
        )
    gated = bool(getattr(cfg, "gated_mlp", False))
    store: dict[int, dict[str, Tensor]] = {}
    hooks: list[tuple[str, HookFn]] = []

    # keyed by layer, not by ``hook.name``: a TransformerBridge names its hook points differently
    def keep(layer: int, key: str) -> HookFn:
        def hook(x: Tensor, hook: Any) -> None:
            store.setdefault(layer, {})[key] = x

        return hook

    def post_hook(layer: int) -> HookFn:
        return lambda post, hook: rule(layer, post)

    def rule(layer: int, post: Tensor) -> Tensor:
        saved = store.pop(layer)
        pre = saved["pre"]
        if not gated:
            return identity_rule(pre, post, identity_eps)
        up = saved["up"]
        with torch.no_grad():
            act = mlp_activation(model, layer)(pre)
        if variant == "lrp":  # gate detached: post = const · up
            return linearized(post, (up, act))
        with torch.no_grad():  # uniform rule on act·up, identity rule through act
            m_pre = 0.5 * up * safe_ratio(act, pre + identity_eps)
        return linearized(post, (pre, m_pre), (up, 0.5 * act))

    for layer in range(cfg.n_layers):
        hooks.append((hook_name("pre", layer), keep(layer, "pre")))
        if gated:
            hooks.append((hook_name("pre_linear", layer), keep(layer, "up")))
        hooks.append((hook_name("post", layer), post_hook(layer)))
    return hooks


def lrp_hooks(
    model: Any, variant: str, *, identity_eps: float = IDENTITY_EPS
) -> list[tuple[str, HookFn]]:
    """TransformerLens forward hooks implementing ``variant`` ("lrp" or "attnlrp").

    identity_eps: stabiliser ``ε_id`` of the identity rule ``φ(h)/(h + ε_id)`` through
                  activations (default ``1e-10`` as in LXT 2.1; ``0`` for the exact ratio).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    names = list(model.hook_dict)
    hooks: list[tuple[str, HookFn]] = [(n, _detach) for n in names if n.endswith("hook_scale")]
    for layer in range(model.cfg.n_layers):
        if variant == "lrp":
            hooks.append((hook_name("pattern", layer), _detach))
        else:
            hooks.append((hook_name("q", layer), _grad_scaler(0.25)))
            hooks.append((hook_name("k", layer), _grad_scaler(0.25)))
            hooks.append((hook_name("v", layer), _grad_scaler(0.5)))
    return hooks + _mlp_hooks(model, variant, identity_eps)


@contextmanager
def mlm_head_activation(
    model: Any, replace: Callable[[Any, Tensor, Tensor], Tensor]
) -> Iterator[None]:
    """Replace the output of the GELU inside BERT's MLM head (it has no hook point).

    A forward pre-hook on ``mlm_head`` keeps its input ``x``; a forward pre-hook on
    ``mlm_head.ln`` recomputes ``h = x W + b`` (target rows only, cheap) and passes
    ``replace(head, h, GELU(h))`` on to the LayerNorm instead of ``GELU(h)``.
    """
    head: Any = model.mlm_head
    kept: dict[str, Tensor] = {}

    def keep_input(module: Any, args: tuple[Tensor, ...]) -> None:
        kept["x"] = args[0]

    def swap(module: Any, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        x = kept.pop("x")
        h = torch.matmul(x, head.W) + head.b
        return (replace(head, h, args[0]), *args[1:])

    handles = [
        head.register_forward_pre_hook(keep_input),
        head.ln.register_forward_pre_hook(swap),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def mlm_head_patch(model: Any, *, identity_eps: float = IDENTITY_EPS) -> Iterator[None]:
    """Identity rule through the GELU inside BERT's MLM head (:func:`mlm_head_activation`).

    ``identity_eps``: the identity rule's stabiliser, as in :func:`lrp_hooks`. The LayerNorm
    scale itself is detached by its ``hook_scale``.
    """
    if not arch_of(model).encoder or getattr(model, "mlm_head", None) is None:
        yield
        return
    with mlm_head_activation(model, lambda head, h, post: identity_rule(h, post, identity_eps)):
        yield


__all__ = [
    "IDENTITY_EPS",
    "VARIANTS",
    "identity_rule",
    "linearized",
    "lrp_hooks",
    "mlm_head_activation",
    "mlm_head_patch",
    "safe_ratio",
    "scale_grad",
]
