"""Gradient baselines: saliency (ℓ1/ℓ2 gradient norms) and Gradient×Input.

For input embeddings ``e_i = Σ_k e_i^k`` (token + positional + token-type, or token only with
``embeddings="partial"``) and the explained scalar ``f``:

- ``gradient``:      ``R_i = ‖∂f/∂e_i‖_p``  (Simonyan et al. 2014; p = 1 or 2)
- ``grad_x_input``:  ``R_i = Σ_k Σ_d e_{i,d}^k · ∂f/∂e_{i,d}^k``  (Shrikumar et al. 2016)
- ``integrated_gradients``: ``R_i = Σ_k Σ_d (e^k − b^k)_{i,d} ∫₀¹ ∂f/∂e^k_{i,d}(b + α(e − b)) dα``
  (Sundararajan et al. 2017), the integral by a quadrature over ``n_steps`` points, batched.

One forward and one backward pass for the whole batch; parameters stay frozen.

Per-head relevances (``heads=True``), read in the same backward pass at every ``attn.hook_z``
(the head outputs ``z`` ``[batch, pos, head, d_head]`` before ``W_O``):
``head_dim_relevance[b, l, h, p, d] = z · ∂f/∂z`` (Gradient×Input; for ``gradient``: ``|∂f/∂z|``),
``head_token_scores`` pools it over ``d_head``, ``head_scores`` over ``pos`` and ``d_head``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_attrib.backend import (
    EMBEDDINGS,
    Arch,
    arch_of,
    embedding_hooks,
    head_output_hooks,
    token_embedding_matrix,
)
from lens_attrib.forward import FwdHooks, resid_of, run
from lens_attrib.inputs import Batch
from lens_attrib.methods.backprop import grad_x_input_scores, gradients_at, head_relevances
from lens_attrib.methods.registry import (
    MethodOutput,
    Option,
    is_bool,
    positive_int,
    positive_int_or_none,
    register,
)
from lens_attrib.target import ResolvedTarget, Target

EMBEDDING_OPTION = Option("full", choices=EMBEDDINGS, help="'full': token + positional (+ type)")
HEADS_OPTION = Option(False, check=is_bool, help="also per-head relevances at attn.hook_z")


@register(
    "gradient",
    label="Gradient (ℓ2)",
    uses_gradient=True,
    head_relevances=True,
    options={
        "norm": Option("l2", choices=("l1", "l2")),
        "embeddings": EMBEDDING_OPTION,
        "heads": HEADS_OPTION,
    },
)
def gradient(
    model: Any, batch: Batch, target: Target, *, norm: str, embeddings: str, heads: bool
) -> MethodOutput:
    """Saliency: ``R_i = ‖∂f/∂e_i‖_p`` over ``d_model`` (``norm="l1"`` or ``"l2"``).

    The gradient of the summed embedding: with ``embeddings="full"`` the gradients at the
    token and positional embeddings are equal, so one of them is read.

    ``heads=True``: per-head gradient norms at ``attn.hook_z`` with the same ``norm``
    (see :func:`~lens_attrib.methods.backprop.head_relevances`; ``head_dim_relevance = |∂f/∂z|``).
    """
    names = embedding_hooks(batch.arch, "partial")
    names += head_output_hooks(batch.arch) if heads else []
    xs, grads, result = gradients_at(model, batch, target, names)
    g: Float[Tensor, "batch pos d"] = grads[0]
    scores = g.abs().sum(-1) if norm == "l1" else g.norm(dim=-1)
    fields = head_relevances(xs[1:], grads[1:], batch.mask, norm) if heads else {}
    return MethodOutput(scores, result.resolved, **fields)


@register(
    "grad_x_input",
    label="Gradient×Input",
    uses_gradient=True,
    head_relevances=True,
    options={
        "embeddings": Option(
            None,
            choices=(None, *EMBEDDINGS),
            help="default: 'full' on decoders, 'partial' (token embedding) on encoders",
        ),
        "heads": HEADS_OPTION,
    },
)
def grad_x_input(
    model: Any, batch: Batch, target: Target, *, embeddings: str | None, heads: bool
) -> MethodOutput:
    """Gradient×Input: ``R_i = Σ_k Σ_d e^k_{i,d} ∂f/∂e^k_{i,d}`` (signed; Shrikumar et al. 2016).

    ``embeddings``: decoders default to ``"full"`` (token + learned positional embedding).
    Encoders default to ``"partial"``, the token embedding before the embedding LayerNorm (what
    Captum/Inseq call ``inputs_embeds``): their full embedding ``x = e_tok + e_pos + e_type``
    enters a LayerNorm, which is scale-invariant per token, so ``x · ∂f/∂x = 0`` for every token
    (Euler's theorem; MiniLM gives |R| ~ 1e-8 for f ~ 1) and ``"full"`` would rank noise.

    ``heads=True``: per-head ``z ⊙ ∂f/∂z`` at ``attn.hook_z`` (see
    :func:`~lens_attrib.methods.backprop.head_relevances`).
    """
    used = embeddings or ("partial" if batch.arch.encoder else "full")
    if embeddings == "full" and batch.arch.encoder:
        warnings.warn(
            "grad_x_input with embeddings='full' on an encoder: the embedding LayerNorm is "
            "scale-invariant, so x·∇x is ~0 for every token; use embeddings='partial' (default).",
            RuntimeWarning,
            stacklevel=4,
        )
    emb = embedding_hooks(batch.arch, used)
    names = emb + (head_output_hooks(batch.arch) if heads else [])
    xs, grads, result = gradients_at(model, batch, target, names)
    n = len(emb)
    scores = grad_x_input_scores(xs[:n], grads[:n])
    fields = head_relevances(xs[n:], grads[n:], batch.mask) if heads else {}
    assert result.value is not None
    return MethodOutput(
        scores,
        result.resolved,
        meta={"explained_value": result.value.detach().cpu()},
        options={"embeddings": used},
        **fields,
    )


# ----------------------------------------------------------------------------- integrated gradients
RULES = ("trapezoid", "riemann", "riemann_left", "riemann_right", "riemann_middle")
BASELINES = ("zero", "pad", "bos", "mean")


def quadrature(n_steps: int, rule: str = "trapezoid") -> tuple[list[float], list[float]]:
    """Points ``α_k`` in [0, 1] and weights ``w_k`` with ``Σ_k w_k h(α_k) ≈ ∫₀¹ h(α) dα``.

    ``trapezoid``: ``α_k = k/(n−1)``, end weights halved; ``riemann`` (= ``riemann_middle``):
    midpoints ``(k + ½)/n``; ``riemann_left``/``riemann_right``: ``k/n`` / ``(k + 1)/n``.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if n_steps < (2 if rule == "trapezoid" else 1):
        raise ValueError(f"n_steps={n_steps} is too few for the {rule} rule.")
    if rule == "trapezoid":
        h = 1.0 / (n_steps - 1)
        alphas = [k * h for k in range(n_steps)]
        weights = [h] * n_steps
        weights[0] = weights[-1] = h / 2
        return alphas, weights
    offset = {"riemann": 0.5, "riemann_middle": 0.5, "riemann_left": 0.0, "riemann_right": 1.0}
    alphas = [(k + offset[rule]) / n_steps for k in range(n_steps)]
    return alphas, [1.0 / n_steps] * n_steps


def zero_start(arch: Arch, embeddings: str) -> bool:
    """Whether the zero baseline makes the first block's input exactly zero.

    True when every embedding component is on the path (``"full"``) or when the model adds no
    positional embedding to the residual stream (rotary/ALiBi decoders).
    """
    if embeddings == "full":
        return True
    return not arch.learned_positions


def default_baseline(model: Any, embeddings: str = "partial") -> str:
    """``"zero"`` where that keeps the input away from zero, else ``"pad"``.

    See :func:`integrated_gradients` for why a zero input is a degenerate baseline.
    """
    arch = model if isinstance(model, Arch) else arch_of(model)
    return "pad" if zero_start(arch, embeddings) else "zero"


def _special_id(model: Any, kind: str) -> int:
    tokenizer = model.tokenizer
    order: tuple[str, ...] = ("pad_token_id", "eos_token_id", "bos_token_id")
    if kind == "bos":
        order = ("bos_token_id", "cls_token_id", "pad_token_id", "eos_token_id")
    for name in order:
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if value is not None:
            return int(value)
    raise ValueError(f"baseline={kind!r} needs a tokenizer with a {kind} token; pass a tensor.")


def sink_positions(batch: Batch) -> Tensor:
    """Special tokens (BOS/CLS/SEP) and the first real token of every item: ``[batch, pos]``."""
    first = torch.zeros_like(batch.mask)
    first[torch.arange(batch.size), batch.first_real.clamp_max(batch.length - 1)] = True
    return (batch.special | first) & batch.mask


def embedding_baselines(
    model: Any,
    arch: Arch,
    names: Sequence[str],
    xs: Sequence[Tensor],
    baseline: str | Tensor,
    keep: Tensor | None = None,
) -> list[Tensor]:
    """Baseline of every embedding component (same shapes as ``xs``).

    The token embedding (``names[0]``) starts from the chosen baseline, except at the positions
    ``keep`` (``[batch, pos]``, named baselines only) where it keeps its value; the other
    components (positional, token-type) start from zero for ``"zero"`` and from their own value
    otherwise, so that a token baseline keeps the positions and they receive no relevance.
    """
    token = xs[0]
    if isinstance(baseline, Tensor):
        base = baseline.to(token.device, token.dtype).expand_as(token).clone()
    elif baseline == "zero":
        base = torch.zeros_like(token)
    elif baseline in ("pad", "bos"):
        row = token_embedding_matrix(model, arch)[_special_id(model, baseline)]
        base = row.to(token.dtype).expand_as(token).clone()
    elif baseline == "mean":
        base = token_embedding_matrix(model, arch).mean(0).to(token.dtype).expand_as(token).clone()
    else:
        raise ValueError(f"baseline must be one of {BASELINES} or a tensor, got {baseline!r}")
    if keep is not None and not isinstance(baseline, Tensor):
        base = torch.where(keep.to(base.device)[..., None], token.expand_as(base), base)
    others = [torch.zeros_like(x) if baseline == "zero" else x.clone() for x in xs[1:]]
    return [base.detach(), *[o.detach() for o in others]]


def _interpolation_hook(start: Tensor, delta: Tensor, alphas: Tensor, store: list[Tensor]) -> Any:
    """Replace an embedding by ``b + α (x − b)`` (a leaf), one α per repeated item."""

    def hook(x: Tensor, hook: Any) -> Tensor:
        k = alphas.shape[0] // start.shape[0]
        a = alphas[:, None, None].to(x.dtype)
        out = start.repeat(k, 1, 1) + a * delta.repeat(k, 1, 1)
        out = out.detach().requires_grad_(True)
        store.append(out)
        return out

    return hook


def _value_at(
    model: Any,
    batch: Batch,
    resolved: ResolvedTarget,
    head: Any,
    hooks: FwdHooks,
    repeats: int,
) -> Tensor:
    """The explained scalar of a ``repeats``-times repeated batch under ``hooks``."""
    index = torch.arange(batch.size).repeat(repeats)
    big = batch.select(index)
    with model.hooks(fwd_hooks=list(hooks)):
        resid = resid_of(model, big)
    target = resolved.index(index.to(resolved.positions.device))
    rows = resid[torch.arange(big.size, device=resid.device), target.positions]
    return target.select(head(rows))


def _baseline_check(value: Any) -> str | None:
    ok = value is None or isinstance(value, Tensor) or value in BASELINES
    return None if ok else f"one of {list(BASELINES)}, a tensor, or None (the default)"


@register(
    "integrated_gradients",
    label="Integrated Gradients",
    uses_gradient=True,
    options={
        "n_steps": Option(50, check=positive_int),
        "baseline": Option(None, check=_baseline_check),
        "rule": Option("trapezoid", choices=RULES),
        "embeddings": Option("partial", choices=EMBEDDINGS),
        "step_batch": Option(None, check=positive_int_or_none),
        "keep_sink": Option(True, check=is_bool),
    },
)
def integrated_gradients(
    model: Any,
    batch: Batch,
    target: Target,
    *,
    n_steps: int,
    baseline: str | Tensor | None,
    rule: str,
    embeddings: str,
    step_batch: int | None,
    keep_sink: bool,
) -> MethodOutput:
    """Integrated Gradients (Sundararajan et al. 2017) over the input embeddings.

    ``R_i = Σ_k Σ_d (e^k − b^k)_{i,d} · Σ_s w_s ∂f/∂e^k_{i,d}(b + α_s (e − b))`` with the
    quadrature ``(α_s, w_s)`` of ``rule`` (``"trapezoid"``, default, or ``"riemann"``/
    ``"riemann_left"``/``"riemann_right"``) over ``n_steps`` points; completeness
    ``Σ_i R_i ≈ f(e) − f(b)`` holds up to the quadrature error, reported as
    ``meta["completeness_gap"] = f(e) − f(b) − Σ_i R_i`` (per item).

    baseline:  ``"zero"`` (zero token embedding), ``"pad"``/``"bos"`` (that token's embedding
               at every position), ``"mean"`` (mean token embedding), or a tensor broadcastable to
               the token embeddings ``[batch, pos, d_model]``.
    embeddings: ``"partial"`` (default): only the token embedding moves along the path, the
               positional (and token-type) embeddings keep their values and get no relevance.
               ``"full"``: with ``baseline="zero"`` they start from zero too (other baselines
               keep them), so the path starts at a zero input.
    Why the default baseline (``None``) is ``"zero"`` only where positional embeddings keep the
    input away from zero (GPT-2-, BERT-shaped models) and ``"pad"`` elsewhere (rotary models such
    as SmolLM2, or ``embeddings="full"``): at a zero input every norm divides by ``sqrt(ε)``.
    On RMSNorm models (SmolLM2) the gradient near α = 0 grows by ``≈ 1/sqrt(ε)`` per norm through
    the 30 layers (to ~1e96, NaN in float32); on LayerNorm models the first norm turns the
    integrand into a spike of width ``≈ sqrt(ε)/‖e‖`` (α ~ 1e-4) that no 50-point quadrature
    resolves (completeness errors of several hundred percent on a tiny GPT-2 with
    ``embeddings="full"``). The zero baseline is degenerate there, and the pad-token embedding is
    the non-degenerate choice.
    keep_sink: named baselines keep the embedding of special tokens (BOS/CLS/SEP) and of the first
               real token of every item (the attention sink of models without BOS, e.g.
               SmolLM2): these tokens are not on the path and get no relevance. Moving the sink
               changes where every head attends; on SmolLM2 the logit along the path then jumps
               by ~20 within Δα = 0.02 and 50 steps miss completeness by 100–600 %; with the sink
               kept the path is smooth (completeness error ≲ 1e-4 on "The capital of France is",
               ~2 % on harder prompts at 50 steps).
    The target token (default: the prediction on the real input) is fixed before integrating.
    Steps run batched, ``step_batch`` interpolation points per forward (default: a memory budget).
    """
    alphas_list, weights_list = quadrature(n_steps, rule)
    arch = batch.arch
    baseline_used: str | Tensor = (
        default_baseline(arch, embeddings) if baseline is None else baseline
    )
    names = embedding_hooks(arch, embeddings)
    with torch.no_grad():
        real = run(model, batch, target, capture=names)
    assert real.value is not None
    xs = [real.captured[n].detach() for n in names]
    resolved = real.resolved
    keep = sink_positions(batch) if keep_sink else None
    bases = embedding_baselines(model, arch, names, xs, baseline_used, keep)
    xs = [x.expand_as(b) if x.shape != b.shape else x for x, b in zip(xs, bases)]
    deltas = [x - b for x, b in zip(xs, bases)]
    head = target.head_fn(model)
    with torch.no_grad():
        zero_alpha = torch.zeros(batch.size, dtype=xs[0].dtype, device=xs[0].device)
        hooks0 = [
            (n, _interpolation_hook(b, d, zero_alpha, [])) for n, b, d in zip(names, bases, deltas)
        ]
        base_value = _value_at(model, batch, resolved, head, hooks0, 1)
    tokens, pairs = batch.size * batch.length, batch.size * batch.length**2
    per_step = step_batch or max(1, min(n_steps, 2**12 // tokens, 2**19 // pairs))
    total = [torch.zeros_like(x) for x in xs]
    for start in range(0, n_steps, per_step):
        a = torch.tensor(alphas_list[start : start + per_step], dtype=xs[0].dtype)
        w = torch.tensor(weights_list[start : start + per_step], dtype=xs[0].dtype)
        k = a.shape[0]
        a_rows = a.repeat_interleave(batch.size).to(xs[0].device)
        stores: list[list[Tensor]] = [[] for _ in names]
        hooks = [
            (n, _interpolation_hook(b, d, a_rows, st))
            for n, b, d, st in zip(names, bases, deltas, stores)
        ]
        value = _value_at(model, batch, resolved, head, hooks, k)
        leaves = [st[0] for st in stores]
        grads = torch.autograd.grad(value.sum(), leaves, allow_unused=True)
        for i, g in enumerate(grads):
            if g is None:
                continue
            g = g.reshape(k, batch.size, *g.shape[1:])
            total[i] += torch.einsum("k,kbpd->bpd", w.to(g.device), g.detach())
    scores = grad_x_input_scores(deltas, total)
    scores = scores.masked_fill(~batch.mask.to(scores.device), 0.0)
    explained = real.value.detach()
    relevance_sum = scores.sum(-1)
    return MethodOutput(
        scores,
        resolved,
        options={"baseline": baseline_used if isinstance(baseline_used, str) else "tensor"},
        meta={
            "explained_value": explained.cpu(),
            "baseline_value": base_value.detach().cpu(),
            "relevance_sum": relevance_sum.cpu(),
            "completeness_gap": (explained - base_value - relevance_sum).detach().cpu(),
            "step_batch": per_step,
        },
    )
