"""Rescale-rule patches that turn one backward pass into DeepLIFT (Shrikumar et al. 2017).

DeepLIFT's Rescale rule replaces the local derivative ``φ'(h)`` of every element-wise
nonlinearity ``a = φ(h)`` by the secant multiplier against a reference forward pass,

    m(h, h₀) = (φ(h) − φ(h₀)) / (h − h₀)        (φ'(h) where |h − h₀| < eps)

so that ``Δa = m · Δh`` holds exactly. Every other operation keeps its ordinary gradient at the
explained input, as in Captum's ``DeepLift`` (the "gradient formulation" of Ancona et al. 2018):
norms, the attention softmax and the bilinear products ``q·k``, ``A·v`` and ``φ(gate)·up`` are
differentiated at ``x``. The patches leave the forward values unchanged (they forward the
activation itself) and only change what flows backward. The multiplier of a plain MLP is read from
``mlp.hook_post`` and ``mlp.hook_pre`` after the user's own hooks, so an element-wise user hook
there (ablation, scaling) is part of ``φ``; in a gated MLP a user hook on ``hook_post`` changes
the forward values, but the backward is the product rule below.

Every multiplier is taken in float64 from the model's values (``rescale_multiplier`` and
``hooked_secant`` in :mod:`lens_attrib.hooks.rules`): in float32,
``φ(h) − φ(h₀)`` cancels where ``h`` is close to ``h₀``, as it is for most elements deep in a
model, and single multipliers there were wrong by up to 450× (float32 DeepLIFT was 7–90× further
from float64 than Gradient×Input on SmolLM2 and MiniLM, and the device's last bits of ``φ``
decided them; see ``docs/results/gpu_runs.md``). A user's edit of the activation enters with
the precision of its float32 values.

Where the rule applies (``activations``):

- ``"all"`` (DeepLIFT as published): the MLP activation of every block (``mlp.hook_post`` from
  ``mlp.hook_pre``, whatever ``φ`` is), the GELU inside BERT's MLM head, and every element-wise
  activation module inside a ``Target.head`` (:func:`head_rescale`: the pooler's Tanh of a
  sequence classifier, ReLU, GELU, SiLU, sigmoid, …; linear layers keep their gradient).
- ``"captum"``: only activations whose Hugging Face module Captum 0.9 lists in
  ``SUPPORTED_NON_LINEAR`` (``nn.ReLU``; TransformerLens' ``"relu"``); GELU/SiLU/GELU-new are
  modules Captum does not know and get the plain gradient there, which is what Captum (and Inseq's
  ``deeplift``, built on it) computes on GPT-2, Llama or BERT. Inside a ``Target.head`` the
  modules Captum lists (``nn.ReLU``, ``nn.ELU``, ``nn.Sigmoid``, ``nn.Tanh``) get the rule, as
  Captum gives it to BERT's pooler (also ``LeakyReLU`` and ``Softplus``).

The Rescale multiplier itself and the autograd pieces are in :mod:`lens_attrib.hooks.rules`;
this module places them in the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lens_attrib.backend import MlmHead, hook_name, layer_norm_activation, mlp_activation
from lens_attrib.errors import ModelError
from lens_attrib.hooks import HookFn
from lens_attrib.hooks.rules import (
    RESCALE_EPS,
    derivative,
    hooked_secant,
    linearized,
    mlm_head_activation,
    rescale_multiplier,
)

ACTIVATIONS = ("all", "captum")
CAPTUM_ACTIVATIONS = ("relu",)
"""TransformerLens ``act_fn`` names whose Hugging Face module is in Captum's nonlinear list."""


def rescale_applies(act_fn: str | None, activations: str) -> bool:
    """Whether the MLP activation ``act_fn`` gets the Rescale rule under ``activations``."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    return activations == "all" or act_fn in CAPTUM_ACTIVATIONS


def _check_activation(model: Any) -> None:
    cfg = model.cfg
    if layer_norm_activation(model):
        raise ModelError(
            f"DeepLIFT's Rescale rule for the LayerNorm activation {cfg.act_fn!r} (SoLU) is not "
            "implemented: it is not element-wise. Use integrated_gradients instead."
        )


def reference_hooks(model: Any, store: dict[str, Tensor]) -> list[tuple[str, HookFn]]:
    """Record every block's MLP input ``h₀`` (``mlp.hook_pre``) and output ``a₀``
    (``mlp.hook_post``) on the reference pass in ``store`` (after the user's own hooks)."""
    _check_activation(model)

    # keyed by TransformerLens 3.9's name, not ``hook.name`` (a TransformerBridge's differs)
    def keep(name: str) -> HookFn:
        def hook(x: Tensor, hook: Any) -> None:
            store[name] = x.detach()

        return hook

    names = [
        hook_name(kind, layer) for layer in range(model.cfg.n_layers) for kind in ("pre", "post")
    ]
    return [(name, keep(name)) for name in names]


def _secant_or_gradient(post: Tensor, pre: Tensor, m: Tensor, exact: Tensor) -> Tensor:
    """``post`` forward; backward ``m ⊙ g`` to ``pre`` where ``exact``, else through ``post``'s
    own graph (the plain gradient, user hooks included)."""
    keep = (~exact).to(post.dtype)
    return post.detach() + m * (pre - pre.detach()) + keep * (post - post.detach())


def rescale_hooks(
    model: Any, reference: dict[str, Tensor], *, activations: str = "all", eps: float = RESCALE_EPS
) -> list[tuple[str, HookFn]]:
    """Forward hooks that give every MLP activation the Rescale rule against ``reference``.

    ``reference``: ``mlp.hook_pre``/``mlp.hook_post`` of the reference pass
    (:func:`reference_hooks`), same shapes. Plain MLP ``a = φ(h)``: backward
    ``(a − a₀)/(h − h₀) ⊙ g`` with ``a``, ``a₀`` read at ``hook_post`` (so an element-wise user
    hook there is part of ``φ``), the plain gradient where ``|h − h₀| < eps``. Gated MLP
    ``a = φ(h)·u``: ``u ⊙ m ⊙ g`` to the gate pre-activation ``h`` (``m`` the multiplier of ``φ``)
    and ``φ(h) ⊙ g`` to ``u`` (the product keeps its gradient at ``x``, as in Captum).
    """
    _check_activation(model)
    cfg = model.cfg
    if not rescale_applies(cfg.act_fn, activations):
        return []
    gated = bool(getattr(cfg, "gated_mlp", False))
    kept: dict[int, dict[str, Tensor]] = {}

    # keyed by layer, not by ``hook.name`` (a TransformerBridge names its hook points differently)
    def keep(layer: int, key: str) -> HookFn:
        def hook(x: Tensor, hook: Any) -> None:
            kept.setdefault(layer, {})[key] = x

        return hook

    def plain_activation(layer: int) -> Any:
        """``φ`` of a plain MLP for the float64 secant; ``None`` where the backend cannot name it
        (the hook values are then divided as read)."""
        try:
            return mlp_activation(model, layer)
        except ModelError:
            return None

    def post_hook(layer: int) -> HookFn:
        return lambda post, hook: rule(layer, post)

    def rule(layer: int, post: Tensor) -> Tensor:
        saved = kept.pop(layer)
        pre = saved["pre"]
        h0 = reference[hook_name("pre", layer)].to(pre.device, pre.dtype)
        if not gated:
            a0 = reference[hook_name("post", layer)].to(post.device, post.dtype)
            m, exact = hooked_secant(
                plain_activation(layer), pre.detach(), h0, post.detach(), a0, eps
            )
            return _secant_or_gradient(post, pre, m, exact)
        act = mlp_activation(model, layer)
        m = rescale_multiplier(act, pre.detach(), h0, eps)
        up = saved["up"]
        with torch.no_grad():
            phi = act(pre.detach())
        return linearized(post, (pre, up.detach() * m), (up, phi))

    hooks: list[tuple[str, HookFn]] = []
    for layer in range(cfg.n_layers):
        hooks.append((hook_name("pre", layer), keep(layer, "pre")))
        if gated:
            hooks.append((hook_name("pre_linear", layer), keep(layer, "up")))
        hooks.append((hook_name("post", layer), post_hook(layer)))
    return hooks


@contextmanager
def mlm_head_rescale(
    model: Any, reference_rows: Tensor | None, *, eps: float = RESCALE_EPS
) -> Iterator[None]:
    """Rescale rule through the GELU inside BERT's MLM head (it has no hook point).

    ``reference_rows``: the head's input ``x₀`` on the reference pass (the final residual at the
    target rows, ``[n, d_model]``); ``None`` leaves the head alone. A forward pre-hook on
    ``mlm_head`` keeps the explained input ``x``; one on ``mlm_head.ln`` linearises
    ``GELU(h)``, ``h = x W + b``, with the multiplier against ``h₀ = x₀ W + b``.
    """
    if reference_rows is None or getattr(model, "mlm_head", None) is None:
        yield
        return

    def rescaled(head: MlmHead, h: Tensor, post: Tensor) -> Tensor:
        x0 = reference_rows.to(h.device, h.dtype).reshape(*h.shape[:-1], -1)
        h0 = torch.matmul(x0, head.weight) + head.bias
        m = rescale_multiplier(head.act, h.detach(), h0.detach(), eps)
        return linearized(post, (h, m))

    with mlm_head_activation(model, rescaled):
        yield


CAPTUM_HEAD_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ELU,
    nn.LeakyReLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Softplus,
)
"""Element-wise activation modules that Captum 0.9's ``DeepLift`` gives the Rescale rule (its
``SUPPORTED_NON_LINEAR``)."""
HEAD_MODULES: tuple[type[nn.Module], ...] = (
    *CAPTUM_HEAD_MODULES,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
)
"""Element-wise activation modules that get the Rescale rule with ``activations="all"``."""


def head_rescale_modules(head: Any, activations: str) -> list[nn.Module]:
    """The activation modules inside a ``Target.head`` that get the Rescale rule: Captum's
    (``nn.ReLU``, ``ELU``, ``LeakyReLU``, ``Sigmoid``, ``Tanh``, ``Softplus``) under both
    settings, and the other element-wise ones (GELU, SiLU, Mish) under ``"all"``. Linear layers
    (and anything else) keep their gradient. A plain function (not an ``nn.Module``) has none."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    if not isinstance(head, nn.Module):
        return []
    kinds = CAPTUM_HEAD_MODULES if activations == "captum" else HEAD_MODULES
    return [m for m in head.modules() if isinstance(m, kinds)]


@contextmanager
def head_rescale(
    head: Any,
    reference_rows: Tensor | None,
    *,
    activations: str = "all",
    eps: float = RESCALE_EPS,
) -> Iterator[None]:
    """Rescale rule at every activation module inside a ``Target.head`` (e.g. the Tanh of BERT's
    pooler in a ``*ForSequenceClassification`` head), as Captum applies it to every module.

    ``reference_rows``: the head's input on the reference pass (the final residual at the target
    rows). One pass of the head on them records each activation's reference input ``h₀``; while
    the context is open, each activation ``a = φ(h)`` forwards its value and passes
    ``(φ(h) − φ(h₀))/(h − h₀)`` backward (``φ'(h)`` where ``|h − h₀| < eps``). Modules called
    several times are matched call by call.
    """
    modules = head_rescale_modules(head, activations)
    if reference_rows is None or not modules:
        yield
        return
    inputs: dict[int, list[Tensor]] = {}

    def record(module: nn.Module, args: tuple[Tensor, ...]) -> None:
        inputs.setdefault(id(module), []).append(args[0].detach())

    handles = [m.register_forward_pre_hook(record) for m in modules]
    try:
        with torch.no_grad():
            head(reference_rows)
    finally:
        for handle in handles:
            handle.remove()
    calls: dict[int, int] = {}

    def rescaled(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
        h = args[0]
        k = calls.get(id(module), 0)
        calls[id(module)] = k + 1
        refs = inputs.get(id(module), [])
        if k >= len(refs) or refs[k].shape != h.shape:
            raise RuntimeError(
                f"deeplift: the head's {type(module).__name__} saw other inputs on the explained "
                "pass than on the reference pass; the head must map each row on its own."
            )
        # module.forward: φ itself, without re-entering this hook
        m = rescale_multiplier(module.forward, h.detach(), refs[k].to(h.device, h.dtype), eps)
        return linearized(output, (h, m))

    handles = [m.register_forward_hook(rescaled) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


__all__ = [
    "ACTIVATIONS",
    "CAPTUM_ACTIVATIONS",
    "CAPTUM_HEAD_MODULES",
    "HEAD_MODULES",
    "RESCALE_EPS",
    "derivative",
    "head_rescale",
    "head_rescale_modules",
    "mlm_head_rescale",
    "reference_hooks",
    "rescale_applies",
    "rescale_hooks",
    "rescale_multiplier",
]
