"""Gradient machinery shared by the gradient baselines, LRPx and Grad-ELLM.

:func:`gradients_at` runs one hooked forward (:func:`lens_attrib.forward.run`) and one backward
pass of ``Σ_b f_b`` to the captured activations; :func:`grad_x_input_scores` and
:func:`head_relevances` turn activations and gradients into token and head relevances.
:data:`EMBEDDING_OPTION` and :data:`HEADS_OPTION` are the options every method that reads
gradients at the embeddings (and at ``attn.hook_z``) takes, with one meaning everywhere.

Generation step batches (every step of a prompt a row holding the same sequence, see
:mod:`lens_attrib.methods.generation`) share work across steps (:func:`step_gradients_at`): one
forward per sequence, then the ``S`` step scalars ``f_s`` (read at positions ``P − 1 + s`` of
that one forward) are differentiated by ``S`` vector–Jacobian products on the same graph,
batched into one vectorized backward pass (``torch.autograd.grad(..., is_grads_batched=True)``)
that starts at the final residual with each step's own gradient there as cotangent. Causal
attention makes ``∂f_s/∂x`` on the full sequence equal the gradient on the prefix
``prompt + continuation[:s]`` (zero after ``P − 1 + s``), so this is exactly explaining every
prefix on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lens_attrib.backend import EMBEDDINGS, resid_hook_names
from lens_attrib.forward import Forward, FwdHooks, run, run_shared, select_steps, step_groups
from lens_attrib.inputs import Batch
from lens_attrib.methods.registry import Option, is_bool
from lens_attrib.target import ResolvedTarget, Target

VJP_TOKENS = 2**13
"""Cotangent rows × sequence length per vectorized backward pass of :func:`batched_vjp`."""

EMBEDDING_OPTION = Option("full", choices=EMBEDDINGS, help="'full': token + positional (+ type)")
HEADS_OPTION = Option(False, check=is_bool, help="also per-head relevances at attn.hook_z")


def gradients_at(
    model: Any,
    batch: Batch,
    target: Target,
    names: Sequence[str],
    fwd_hooks: FwdHooks = (),
    *,
    share_steps: bool = True,
) -> tuple[list[Tensor], list[Tensor], Forward]:
    """(activations at ``names``, ``∂f/∂`` them, the forward) in one backward pass.

    ``fwd_hooks`` (e.g. LRP detach patches) are applied before the activations are captured, so a
    patch at a captured hook point acts upstream of the captured tensor. Must run with autograd
    on (the registry's wrapper does so for ``uses_gradient`` methods).

    A generation step batch goes through :func:`step_gradients_at` (one forward per sequence)
    unless ``share_steps=False`` (for ``fwd_hooks`` that treat batch rows differently, e.g.
    DeepLIFT's per-row reference activations); the result is the same either way.
    """
    groups = step_groups(batch) if share_steps else None
    if groups is not None:
        return step_gradients_at(model, batch, target, names, groups, fwd_hooks)
    result = run(model, batch, target, capture=list(names), fwd_hooks=fwd_hooks)
    assert result.value is not None
    inputs = [result.captured[n] for n in names]
    grads = torch.autograd.grad(result.value.sum(), inputs, allow_unused=True)
    grads_filled = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]
    return [x.detach() for x in inputs], [g.detach() for g in grads_filled], result


def batched_vjp(
    output: Tensor,
    inputs: Sequence[Tensor],
    cotangents: Float[Tensor, "n *out"],
    chunk: int | None = None,
    retain: bool = False,
) -> list[Float[Tensor, "n *shape"]]:
    """``cotangents[i] · ∂output/∂inputs[k]`` for every ``i``: ``[n, *inputs[k].shape]`` per input.

    ``n`` vector–Jacobian products on one graph, ``chunk`` of them (default: ``VJP_TOKENS``
    divided by the inputs' sequence length) per vectorized backward pass
    (``torch.autograd.grad(..., is_grads_batched=True)``). Where an operation of the graph has no
    batching rule, the products run one by one (same numbers). Inputs ``output`` does not depend
    on get zero gradients. The graph is freed after the last product unless ``retain``.
    """
    n = int(cotangents.shape[0])
    length = int(inputs[0].shape[1]) if inputs and inputs[0].ndim > 1 else 1
    chunk = chunk or max(1, VJP_TOKENS // max(length, 1))
    parts: list[list[Tensor]] = [[] for _ in inputs]
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        keep = retain or stop < n
        try:
            grads = torch.autograd.grad(
                output,
                list(inputs),
                grad_outputs=cotangents[start:stop],
                is_grads_batched=True,
                retain_graph=True if keep else None,
                allow_unused=True,
            )
        except RuntimeError as err:
            if "batch" not in str(err).lower() and "vmap" not in str(err).lower():
                raise
            one_by_one = [
                torch.autograd.grad(
                    output,
                    list(inputs),
                    grad_outputs=cotangents[i],
                    retain_graph=keep or i < stop - 1,
                    allow_unused=True,
                )
                for i in range(start, stop)
            ]
            grads = tuple(
                torch.stack([torch.zeros_like(x) if g[k] is None else g[k] for g in one_by_one])
                for k, x in enumerate(inputs)
            )
        for k, (x, g) in enumerate(zip(inputs, grads, strict=True)):
            rows = stop - start
            parts[k].append(x.new_zeros(rows, *x.shape) if g is None else g.detach())
    return [torch.cat(p) for p in parts]


def step_gradients_at(
    model: Any,
    batch: Batch,
    target: Target,
    names: Sequence[str],
    groups: Sequence[Tensor],
    fwd_hooks: FwdHooks = (),
) -> tuple[list[Tensor], list[Tensor], Forward]:
    """:func:`gradients_at` for a step batch whose rows in each of ``groups`` are one sequence.

    For each group: one forward of its sequence (:func:`lens_attrib.forward.run_shared`, hooks
    as in :func:`gradients_at`, the final residual ``x`` ``[1, pos, d]`` captured too); one
    ordinary backward of ``Σ_s f_s`` through the head to the step rows of ``x`` (step ``s``
    reads only its row, so this gives every ``g_s = ∂f_s/∂x`` at once, nonzero at position
    ``P − 1 + s`` only); then :func:`batched_vjp` from ``x`` with the cotangents ``g_s``.
    Starting the vectorized pass at ``x`` instead of the head keeps it from carrying an
    ``[S, S, d_vocab]`` cotangent through the unembedding (S² · d_vocab · d_model
    multiply-adds, more than a forward pass for S = 32 on SmolLM2). Groups run one after the
    other (a group's backward never passes through another's graph). Returns the same shapes
    as :func:`gradients_at` (``[batch, pos, ...]``: every row its sequence's activations and
    its own step's gradient); ``Forward.resid`` holds each row's sequence.
    """
    device = batch.tokens.device
    xs: list[Tensor | None] = [None] * len(names)
    grads: list[Tensor | None] = [None] * len(names)
    value: Tensor | None = None
    head_out: Tensor | None = None
    resid: Tensor | None = None
    positions = torch.empty(batch.size, dtype=torch.long, device=device)
    token_ids = torch.empty(batch.size, dtype=torch.long, device=device)
    foil_ids: Tensor | None = None
    regression = False
    final = resid_hook_names(batch.arch)[-1]
    capture = list(dict.fromkeys([*names, final]))
    for rows in groups:
        sub = batch.select(rows)
        result = run_shared(
            model,
            sub,
            select_steps(target, rows),
            [torch.arange(len(rows), device=device)],
            capture=capture,
            fwd_hooks=fwd_hooks,
        )
        assert result.value is not None and result.head_out is not None
        inputs = [result.captured[n] for n in names]
        step_rows = torch.autograd.grad(result.value.sum(), result.resid, retain_graph=True)[0]
        row_grads = batched_vjp(result.captured[final], inputs, step_rows[:, None])
        idx = rows.to(device)
        for k, (x, g) in enumerate(zip(inputs, row_grads, strict=True)):
            g = g[:, 0]  # one sequence: [steps, 1, ...] -> [steps, ...]
            if xs[k] is None:
                xs[k] = x.new_zeros(batch.size, *x.shape[1:])
                grads[k] = g.new_zeros(batch.size, *g.shape[1:])
            xs[k][idx] = x.detach()[0]  # type: ignore[index]
            grads[k][idx] = g  # type: ignore[index]
        if value is None:
            value = result.value.new_zeros(batch.size)
            head_out = result.head_out.new_zeros(batch.size, result.head_out.shape[-1])
            resid = result.resid.new_zeros(batch.size, *result.resid.shape[1:])
        assert head_out is not None and resid is not None
        value[idx] = result.value.detach()
        head_out[idx] = result.head_out.detach()
        resid[idx] = result.resid.detach()
        got = result.resolved
        positions[idx] = got.positions.to(device)
        token_ids[idx] = got.token_ids.to(device)
        regression = got.regression
        if got.foil_ids is not None:
            foil_ids = torch.empty_like(token_ids) if foil_ids is None else foil_ids
            foil_ids[idx] = got.foil_ids.to(device)
    assert value is not None and head_out is not None and resid is not None
    resolved = ResolvedTarget(positions, token_ids, foil_ids, regression)
    forward = Forward(value, resolved, head_out, resid)
    return [x for x in xs if x is not None], [g for g in grads if g is not None], forward


def _broadcast(x: Tensor, like: Tensor) -> Tensor:
    return x.expand_as(like) if x.shape != like.shape else x


TOKEN_POOLINGS = ("sum", "l1", "l2")
"""How a token's relevance vector over ``d_model`` becomes one score (:func:`pool_tokens`)."""

TOKEN_POOLING_OPTION = Option(
    "sum",
    choices=TOKEN_POOLINGS,
    help="'sum' (signed Σ_d; conserves), 'l1'/'l2': the norm over d_model (unsigned)",
)


def pool_tokens(vectors: Float[Tensor, "batch pos d"], pooling: str) -> Float[Tensor, "batch pos"]:
    """``Σ_d v_d`` (``"sum"``), ``Σ_d |v_d|`` (``"l1"``) or ``‖v‖₂`` (``"l2"``) per token."""
    if pooling == "sum":
        return vectors.sum(-1)
    if pooling == "l1":
        return vectors.abs().sum(-1)
    if pooling == "l2":
        return vectors.norm(dim=-1)
    raise ValueError(f"pooling must be one of {TOKEN_POOLINGS}, got {pooling!r}")


def grad_x_input_scores(
    xs: Sequence[Float[Tensor, "batch pos d"]],
    grads: Sequence[Float[Tensor, "batch pos d"]],
    pooling: str = "sum",
) -> Float[Tensor, "batch pos"]:
    """``Σ_k Σ_d x^k ⊙ g^k`` over embedding components ``k``: ``[batch, pos]``.

    ``pooling="l1"``/``"l2"``: the norm over ``d`` of the relevance vector ``Σ_k x^k ⊙ g^k``
    instead of its sum (:func:`pool_tokens`) — e.g. the ℓ1 aggregation with which the NormXLogit
    paper (its Section 4, "Input Attribution Methods") scores Gradient×Input and IG.
    """
    if pooling == "sum":
        scores = sum(
            ((_broadcast(x, g) * g).sum(-1) for x, g in zip(xs, grads)), start=torch.zeros(())
        )
        assert isinstance(scores, Tensor)
        return scores
    vectors = sum((_broadcast(x, g) * g for x, g in zip(xs, grads)), start=torch.zeros(()))
    assert isinstance(vectors, Tensor)
    return pool_tokens(vectors, pooling)


POOLINGS = ("grad_x_input", "l1", "l2")


def head_relevances(
    zs: Sequence[Tensor],
    grads: Sequence[Tensor],
    mask: Bool[Tensor, "batch pos"],
    pooling: str = "grad_x_input",
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
    if pooling in ("grad_x_input", "l1"):
        token = r.sum(-1)
        total = token.sum(-1)
    elif pooling == "l2":
        token = r.pow(2).sum(-1).sqrt()
        total = r.pow(2).sum((-2, -1)).sqrt()
    else:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    return {
        "head_scores": total.detach(),
        "head_token_scores": token.detach(),
        "parts": {"head_dim_relevance": r.detach()},
    }


__all__ = [
    "EMBEDDING_OPTION",
    "HEADS_OPTION",
    "POOLINGS",
    "TOKEN_POOLINGS",
    "TOKEN_POOLING_OPTION",
    "batched_vjp",
    "grad_x_input_scores",
    "gradients_at",
    "head_relevances",
    "pool_tokens",
    "step_gradients_at",
]
