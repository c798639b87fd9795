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

import time
from collections.abc import Sequence
from typing import Any

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from lens_attrib.attribution import Attribution
from lens_attrib.inputs import Batch
from lens_attrib.methods.common import (
    FwdHooks,
    check_finite,
    embedding_hooks,
    final_residual,
    grad_context,
    hooked_forward,
    make_attribution,
    prepare,
)
from lens_attrib.methods.registry import register
from lens_attrib.models import is_encoder
from lens_attrib.target import Target


def gradients_at(
    model: Any, batch: Any, target: Target, names: Sequence[str], fwd_hooks: FwdHooks = ()
) -> tuple[list[Tensor], list[Tensor], Any]:
    """(activations at ``names``, ``∂f/∂`` them, forward result) in one backward pass.

    ``fwd_hooks`` (e.g. LRP detach patches) are applied before the activations are captured, so a
    patch at a captured hook point acts upstream of the captured tensor.
    """
    result = hooked_forward(model, batch, target, capture=list(names), fwd_hooks=fwd_hooks)
    inputs = [result.captured[n] for n in names]
    grads = torch.autograd.grad(result.value.sum(), inputs, allow_unused=True)
    grads_filled = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]
    return [x.detach() for x in inputs], [g.detach() for g in grads_filled], result


def embedding_gradients(
    model: Any, batch: Any, target: Target, embeddings: str = "full"
) -> tuple[list[Tensor], list[Tensor], Any]:
    """(embedding activations, their gradients, forward result) in one backward pass."""
    return gradients_at(model, batch, target, embedding_hooks(model, embeddings))


def head_hooks(model: Any) -> list[str]:
    """``blocks.L.attn.hook_z`` of every layer (head outputs before ``W_O``)."""
    return [f"blocks.{layer}.attn.hook_z" for layer in range(model.cfg.n_layers)]


def head_relevances(
    zs: Sequence[Tensor], grads: Sequence[Tensor], mask: Tensor, pooling: str = "grad_x_input"
) -> dict[str, Any]:
    """Attribution fields for per-head relevances from ``z`` and ``∂f/∂z`` of every layer.

    ``pooling="grad_x_input"`` (Gradient×Input / LRP): ``r = z ⊙ ∂f/∂z`` (signed),
    ``head_token_scores = Σ_d r``, ``head_scores = Σ_pos Σ_d r``. With LRP patches and zero
    biases the head scores of one layer sum to the relevance of that attention layer's output.

    ``pooling="l1"``/``"l2"`` (saliency): ``r = |∂f/∂z|``, ``head_token_scores = ‖∂f/∂z_{p,h}‖``
    over ``d_head`` and ``head_scores = ‖∂f/∂z_h‖`` over ``(pos, d_head)`` together — the
    gradient-norm head importance of the decomposition paper (a norm, not a sum of token norms).

    Returns ``head_scores [batch, layer, head]``, ``head_token_scores [batch, layer, head, pos]``
    and ``parts["head_dim_relevance"] [batch, layer, head, pos, d_head]`` (``r``, unpooled;
    zero at padding).
    """
    z = torch.stack(list(zs), dim=1)
    g = torch.stack(list(grads), dim=1)
    keep = mask.to(g.device)[:, None, :, None, None].to(g.dtype)
    r = (z * g if pooling == "grad_x_input" else g.abs()) * keep
    r = einops.rearrange(r, "batch layer pos head d -> batch layer head pos d")
    if pooling == "grad_x_input":
        token = r.sum(-1)
        total = token.sum(-1)
    elif pooling == "l1":
        token = r.sum(-1)
        total = token.sum(-1)
    elif pooling == "l2":
        token = r.pow(2).sum(-1).sqrt()
        total = r.pow(2).sum((-2, -1)).sqrt()
    else:
        raise ValueError(f"pooling must be 'grad_x_input', 'l1' or 'l2', got {pooling!r}")
    return {
        "head_scores": total.detach().cpu(),
        "head_token_scores": token.detach().cpu(),
        "parts": {"head_dim_relevance": r.detach().cpu()},
    }


def _broadcast(x: Tensor, like: Tensor) -> Tensor:
    return x.expand_as(like) if x.shape != like.shape else x


def grad_x_input_scores(xs: Sequence[Tensor], grads: Sequence[Tensor]) -> Tensor:
    """``Σ_k Σ_d x^k ⊙ g^k`` over embedding components ``k``: ``[batch, pos]``."""
    scores = sum(((_broadcast(x, g) * g).sum(-1) for x, g in zip(xs, grads)), start=torch.zeros(()))
    assert isinstance(scores, Tensor)
    return scores


@register("gradient", uses_gradient=True)
def gradient(
    model: Any,
    inputs: Any,
    target: Target | None = None,
    *,
    norm: str = "l2",
    embeddings: str = "full",
    heads: bool = False,
) -> Attribution:
    """Saliency: ``R_i = ‖∂f/∂e_i‖_p`` over ``d_model`` (``norm="l1"`` or ``"l2"``).

    The gradient of the summed embedding: with ``embeddings="full"`` the gradients at the
    token and positional embeddings are equal, so one of them is read.

    ``heads=True``: per-head gradient norms at ``attn.hook_z`` with the same ``norm``
    (see :func:`head_relevances`; ``head_dim_relevance = |∂f/∂z|``).
    """
    if norm not in ("l1", "l2"):
        raise ValueError(f"norm must be 'l1' or 'l2', got {norm!r}")
    started = time.perf_counter()
    batch, target = prepare(model, inputs, target)
    names = embedding_hooks(model, "partial") + (head_hooks(model) if heads else [])
    with grad_context(model):
        xs, grads, result = gradients_at(model, batch, target, names)
    g: Float[Tensor, "batch pos d"] = grads[0]
    scores = g.abs().sum(-1) if norm == "l1" else g.norm(dim=-1)
    check_finite("gradient", scores)
    fields = head_relevances(xs[1:], grads[1:], batch.mask, norm) if heads else {}
    return make_attribution(
        model,
        batch,
        result.resolved,
        "gradient",
        scores,
        started=started,
        options={"norm": norm, "embeddings": embeddings, "heads": heads},
        **fields,
    )


@register("grad_x_input", uses_gradient=True)
def grad_x_input(
    model: Any,
    inputs: Any,
    target: Target | None = None,
    *,
    embeddings: str = "full",
    heads: bool = False,
) -> Attribution:
    """Gradient×Input: ``R_i = Σ_k Σ_d e^k_{i,d} ∂f/∂e^k_{i,d}`` (signed).

    ``heads=True``: per-head ``z ⊙ ∂f/∂z`` at ``attn.hook_z`` (see :func:`head_relevances`).
    """
    started = time.perf_counter()
    batch, target = prepare(model, inputs, target)
    emb = embedding_hooks(model, embeddings)
    names = emb + (head_hooks(model) if heads else [])
    with grad_context(model):
        xs, grads, result = gradients_at(model, batch, target, names)
    n = len(emb)
    scores = grad_x_input_scores(xs[:n], grads[:n])
    check_finite("grad_x_input", scores)
    fields = head_relevances(xs[n:], grads[n:], batch.mask) if heads else {}
    return make_attribution(
        model,
        batch,
        result.resolved,
        "grad_x_input",
        scores,
        started=started,
        options={"embeddings": embeddings, "heads": heads},
        meta={"explained_value": result.value.detach().cpu()},
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


def zero_start(model: Any, embeddings: str) -> bool:
    """Whether the zero baseline makes the first block's input exactly zero.

    True when every embedding component is on the path (``"full"``) or when the model adds no
    positional embedding to the residual stream (rotary/ALiBi decoders).
    """
    if embeddings == "full":
        return True
    return not is_encoder(model) and model.cfg.positional_embedding_type not in (
        "standard",
        "shortformer",
    )


def default_baseline(model: Any, embeddings: str = "partial") -> str:
    """``"zero"`` where that keeps the input away from zero, else ``"pad"``.

    See :func:`integrated_gradients` for why a zero input is a degenerate baseline.
    """
    return "pad" if zero_start(model, embeddings) else "zero"


def _token_embedding_matrix(model: Any) -> Tensor:
    embed = model.embed.embed if is_encoder(model) else model.embed
    return embed.W_E  # type: ignore[no-any-return]


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
        row = _token_embedding_matrix(model)[_special_id(model, baseline)]
        base = row.to(token.dtype).expand_as(token).clone()
    elif baseline == "mean":
        base = _token_embedding_matrix(model).mean(0).to(token.dtype).expand_as(token).clone()
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
    resolved: Any,
    head: Any,
    hooks: FwdHooks,
    repeats: int,
) -> Tensor:
    """The explained scalar of a ``repeats``-times repeated batch under ``hooks``."""
    index = torch.arange(batch.size).repeat(repeats)
    big = batch.select(index)
    with model.hooks(fwd_hooks=list(hooks)):
        resid = final_residual(model, big)
    target = resolved.index(index.to(resolved.positions.device))
    rows = resid[torch.arange(big.size, device=resid.device), target.positions]
    return target.select(head(rows))


@register("integrated_gradients", uses_gradient=True)
def integrated_gradients(
    model: Any,
    inputs: Any,
    target: Target | None = None,
    *,
    n_steps: int = 50,
    baseline: str | Tensor | None = None,
    rule: str = "trapezoid",
    embeddings: str = "partial",
    step_batch: int | None = None,
    keep_sink: bool = True,
) -> Attribution:
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
    started = time.perf_counter()
    alphas_list, weights_list = quadrature(n_steps, rule)
    baseline_used: str | Tensor = (
        default_baseline(model, embeddings) if baseline is None else baseline
    )
    batch, target = prepare(model, inputs, target)
    names = embedding_hooks(model, embeddings)
    with grad_context(model):
        with torch.no_grad():
            real = hooked_forward(model, batch, target, capture=names)
        xs = [real.captured[n].detach() for n in names]
        resolved = real.resolved
        keep = sink_positions(batch) if keep_sink else None
        bases = embedding_baselines(model, names, xs, baseline_used, keep)
        xs = [x.expand_as(b) if x.shape != b.shape else x for x, b in zip(xs, bases)]
        deltas = [x - b for x, b in zip(xs, bases)]
        head = target.head_fn(model)
        with torch.no_grad():
            zero_alpha = torch.zeros(batch.size, dtype=xs[0].dtype, device=xs[0].device)
            hooks0 = [
                (n, _interpolation_hook(b, d, zero_alpha, []))
                for n, b, d in zip(names, bases, deltas)
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
    check_finite("integrated_gradients", scores)
    scores = scores.masked_fill(~batch.mask.to(scores.device), 0.0)
    value = real.value.detach()
    relevance_sum = scores.sum(-1)
    return make_attribution(
        model,
        batch,
        resolved,
        "integrated_gradients",
        scores,
        started=started,
        options={
            "n_steps": n_steps,
            "baseline": baseline_used if isinstance(baseline_used, str) else "tensor",
            "rule": rule,
            "embeddings": embeddings,
            "keep_sink": keep_sink,
        },
        meta={
            "explained_value": value.cpu(),
            "baseline_value": base_value.detach().cpu(),
            "relevance_sum": relevance_sum.cpu(),
            "completeness_gap": (value - base_value - relevance_sum).detach().cpu(),
            "step_batch": per_step,
        },
    )
