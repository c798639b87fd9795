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
- **mixture of experts**: the routing weight is treated like the gate of a gated MLP (detached
  in CP-LRP, uniform rule in AttnLRP), see :func:`_moe_hooks`.

The rules themselves (identity, uniform, the autograd pieces) are in :mod:`lens_attrib.hooks.rules`;
this module places them in the model. Every custom backward saves at most one tensor of the size
of the activation it replaces.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lens_attrib.backend import arch_of, hook_name, layer_norm_activation, mlp_activation
from lens_attrib.errors import ModelError
from lens_attrib.hooks import HookFn
from lens_attrib.hooks.rules import (
    IDENTITY_EPS,
    UNIFORM_SHARE,
    identity_rule,
    linearized,
    mlm_head_activation,
    safe_ratio,
    scale_grad,
    uniform_rule,
)

VARIANTS = ("lrp", "attnlrp")


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
    if getattr(cfg, "num_experts", None):
        return _moe_hooks(model, variant, identity_eps)
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
        m_act, m_up = uniform_rule(act, up)  # uniform rule on act·up: (up/2, act/2)
        with torch.no_grad():  # identity rule through act
            m_pre = m_act * safe_ratio(act, pre + identity_eps)
        return linearized(post, (pre, m_pre), (up, m_up))

    for layer in range(cfg.n_layers):
        hooks.append((hook_name("pre", layer), keep(layer, "pre")))
        if gated:
            hooks.append((hook_name("pre_linear", layer), keep(layer, "up")))
        hooks.append((hook_name("post", layer), post_hook(layer)))
    return hooks


def _moe_hooks(model: Any, variant: str, identity_eps: float) -> list[tuple[str, HookFn]]:
    """Mixture of experts (TransformerLens ``MoE``): ``out = Σ_e w_e(x) · W_out(φ(x W_gate) ⊙ x
    W_in)`` over the token's top-k experts, ``w = topk(softmax(x W_router))`` (renormalised).

    The routing weight ``w_e`` multiplies the expert's output as the gate multiplies ``up`` in a
    gated MLP, and gets the same rule (LXT 2's Qwen3-MoE patch, ``lxt/efficient/models/
    qwen3_moe.py``; its explicit Mixtral composite likewise):

    - CP-LRP: routing weights detached at ``mlp.hook_expert_weights`` (the softmax output; top-k
      and renormalisation follow) and the expert gate detached: the block is linear in ``x``.
    - AttnLRP: uniform rule on ``w_e · expert_e(x)``: half of the relevance to the router (its
      gradient scaled by 1/2 at ``hook_expert_weights``; the softmax, top-k and renormalisation
      keep their plain gradient, as in LXT), half to the expert, where the uniform rule on
      ``φ(gate) ⊙ up`` halves it again (identity rule through ``φ``).

    A shared expert gated by a sigmoid (Qwen2-MoE on the TransformerBridge:
    ``+ σ(x w_s) · shared(x)``) takes the same rules: ``σ(x w_s)`` as a routing weight (detached
    at ``shared_expert_gate.hook_out`` / gradient halved there, the sigmoid keeping its plain
    gradient), ``shared`` as an expert.
    """
    store: dict[tuple[int, int], dict[str, Tensor]] = {}
    share = 1.0 if variant == "lrp" else 0.5  # of the expert in w_e · expert_e(x)
    hooks: list[tuple[str, HookFn]] = []

    # keyed by (layer, expert), not by ``hook.name`` (a TransformerBridge names hooks differently)
    def keep(layer: int, expert: int, key: str) -> HookFn:
        def hook(x: Tensor, hook: Any) -> None:
            store.setdefault((layer, expert), {})[key] = x

        return hook

    def post_hook(layer: int, expert: int) -> HookFn:
        return lambda post, hook: rule(layer, expert, post)

    def rule(layer: int, expert: int, post: Tensor) -> Tensor:
        saved = store.pop((layer, expert))
        gate, up = saved["gate"], saved["up"]
        with torch.no_grad():
            act = mlp_activation(model, layer)(gate)  # the experts share one activation
        if variant == "lrp":
            return linearized(post, (up, act))
        with torch.no_grad():
            m_gate = 0.5 * share * up * safe_ratio(act, gate + identity_eps)
        return linearized(post, (gate, m_gate), (up, 0.5 * share * act))

    names = set(model.hook_dict)
    for layer in range(model.cfg.n_layers):
        router = f"blocks.{layer}.mlp.hook_expert_weights"
        hooks.append((router, _detach if variant == "lrp" else _grad_scaler(0.5)))
        shared = f"blocks.{layer}.mlp.shared_expert"
        if f"{shared}.hook_post" in names:  # Qwen2-MoE: + σ(x w_s) · shared_expert(x)
            # the sigmoid gate as the routing weight (detached / half of the relevance with
            # its plain gradient), the shared expert as a routed one (key -1)
            gate_logit = f"blocks.{layer}.mlp.shared_expert_gate.hook_out"
            hooks.append((gate_logit, _detach if variant == "lrp" else _grad_scaler(0.5)))
            hooks.append((f"{shared}.hook_pre", keep(layer, -1, "gate")))
            hooks.append((f"{shared}.hook_pre_linear", keep(layer, -1, "up")))
            hooks.append((f"{shared}.hook_post", post_hook(layer, -1)))
        for expert in range(model.cfg.num_experts):
            prefix = f"blocks.{layer}.mlp.experts.{expert}"
            hooks.append((f"{prefix}.hook_gate", keep(layer, expert, "gate")))
            hooks.append((f"{prefix}.hook_pre", keep(layer, expert, "up")))
            hooks.append((f"{prefix}.hook_post", post_hook(layer, expert)))
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
            # uniform rule at A·v (v: one half) and at q·k (q, k: half of the half)
            hooks.append((hook_name("q", layer), _grad_scaler(UNIFORM_SHARE * UNIFORM_SHARE)))
            hooks.append((hook_name("k", layer), _grad_scaler(UNIFORM_SHARE * UNIFORM_SHARE)))
            hooks.append((hook_name("v", layer), _grad_scaler(UNIFORM_SHARE)))
    return hooks + _mlp_hooks(model, variant, identity_eps)


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


# identity_rule … scale_grad live in rules.py; re-exported here, where they were defined before
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
