"""Prefix chunks: the steps of a generation, each differentiated only up to its own chunk's end.

The rows of a generation step batch (:mod:`lens_attrib.methods.generation`) share one sequence
``x_1..x_L``; step ``s`` explains a scalar ``f_s`` read at position ``p_s``. Causal attention
makes ``∂f_s/∂x_i = 0`` for ``i > p_s``, yet a backward from the final residual of the whole
sequence spans all ``L`` positions for every step. Here the sequence runs as consecutive chunks
of positions ``[0, e_1), [e_1, e_2), …, [e_{K−1}, e_K)`` through the model's key–value cache
(:func:`chunked_forward`: chunk ``k`` attends to the earlier chunks' cached keys and values,
which keep their graph; together one forward's work), and the steps whose position lies in chunk
``k`` are differentiated by batched vector–Jacobian products from chunk ``k``'s final residual
(:func:`chunked_vjps`), which reach only positions ``< e_k``: ``Σ_k S_k e_k`` step-positions
back-propagated instead of ``S · L`` (``S_k`` steps in chunk ``k``). The gradients are the same
(the graph of chunk ``k`` is that of positions ``< e_k`` of the full forward).

Used by Saliency and Gradient×Input (:func:`chunked_step_gradients_at`) and by Integrated
Gradients' shared path (each node batch one chunked forward), where :func:`chunk_bounds` allows
it: a decoder, TransformerLens 3's ``HookedTransformer`` or TransformerLens 4's bridge (both
caches keep the graph; the bridge's through Hugging Face's ``DynamicCache``, see
:func:`lens_attrib.backend_bridge.cached_final_residual`), whose cache reproduces the full
forward on a short probe (:func:`cache_agrees`), with no hook on any hook point — a user's hook
must see whole sequences (a position-indexed edit would land elsewhere in a chunk), so under
user hooks the one-forward path runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor

from lens_attrib.backend import Arch, cached_final_residual, final_residual, key_value_cache
from lens_attrib.errors import ModelError
from lens_attrib.finite import check_activations
from lens_attrib.forward import Forward, check_value, select_steps, step_groups
from lens_attrib.inputs import Batch
from lens_attrib.methods.backprop import VJP_TOKENS, batched_vjp, gradients_at
from lens_attrib.module_hooks import has_hooks
from lens_attrib.target import ResolvedTarget, Target

PREFIX_CHUNKS = 4
"""Chunks per sequence (fewer where there are fewer distinct step positions); 4 measured fastest
for Integrated Gradients on SmolLM2 (64 + 32 tokens). Below 2: no chunks (the one-forward
path)."""

STEP_GRADIENT_CHUNKS = False
"""Whether Saliency and Gradient×Input (:func:`prefix_gradients_at`) run in chunks (Integrated
Gradients always may). Off: on SmolLM2 (CPU, float32, one thread) the chunked run took 1.4–2.5×
the one-forward path's time (in-process pairs, 64 + 12 and 16 + 8 tokens; the benchmark's
64 + 32: 1.9× in one pair, 0.62× in another under load 7–14): the cached forward runs
TransformerLens' eager attention, whose backward has no vectorising rule for ``where`` and
``_softmax_backward_data`` (per-cotangent loops), while the one-forward path's fused attention
does; the positions saved (2,656 of 3,040 step-positions) do not pay for that."""

LeafFn = Callable[[int, Tensor, slice], Tensor]
"""``(k, activation of a chunk at hook name k, the chunk's columns) -> the tensor the forward
continues with`` (what the gradients are taken to: a leaf, or the activation itself when it
already depends on an earlier leaf)."""


def prefix_bounds(positions: Sequence[int], n_chunks: int) -> list[int]:
    """Ends (exclusive) of the position chunks: the sorted distinct step positions split into
    ``n_chunks`` runs of near-equal size, each chunk ending after its run's last position."""
    distinct = sorted(set(int(p) for p in positions))
    n = max(1, min(n_chunks, len(distinct)))
    return [distinct[(i + 1) * len(distinct) // n - 1] + 1 for i in range(n)]


def can_chunk(model: Any, arch: Arch) -> bool:
    """Whether a sequence of ``model`` may run in chunks: a decoder (TransformerLens 3's
    ``HookedTransformer`` or TransformerLens 4's bridge) on which no hook point has a hook, with
    ``PREFIX_CHUNKS ≥ 2``, whose key–value cache reproduces the full forward
    (:func:`cache_agrees`)."""
    if PREFIX_CHUNKS < 2 or arch.encoder or not hasattr(model, "hook_dict"):
        return False
    if any(has_hooks(point) for point in model.hook_dict.values()):
        return False
    return cache_agrees(model, arch)


PROBE_TOKENS = 3
PROBE_TOLERANCE = 1e-3
"""The probe of :func:`cache_agrees`: its length, and the largest difference allowed, relative
to the full forward's largest entry (float32 rounding and another attention kernel: ~1e-6)."""


def cache_agrees(model: Any, arch: Arch) -> bool:
    """Whether the final residual of a ``PROBE_TOKENS``-token probe (ids 1, 2, …; distinct, so
    that attending to the cached keys matters) run one token at a time through
    :func:`lens_attrib.backend.key_value_cache` equals the full forward's. A backend whose
    attention ignores the cache (or does not extend it, a ModelError) gets the one-forward path
    instead of wrong chunks. No graph; three forwards of at most ``PROBE_TOKENS`` tokens."""
    tokens = torch.arange(1, PROBE_TOKENS + 1, device=model.cfg.device)[None]
    tokens = tokens % int(model.cfg.d_vocab)
    with torch.no_grad():
        full = final_residual(model, arch, tokens, torch.ones_like(tokens, dtype=torch.bool), False)
        cache = key_value_cache(model, arch, 1, tokens.device)
        try:
            parts = [
                cached_final_residual(model, arch, tokens[:, i : i + 1], cache)
                for i in range(PROBE_TOKENS)
            ]
        except ModelError:
            return False
    gap = float((torch.cat(parts, dim=1) - full).abs().max())
    return gap <= PROBE_TOLERANCE * float(full.abs().max())


def chunk_bounds(model: Any, arch: Arch, positions: Sequence[int]) -> list[int] | None:
    """:func:`prefix_bounds` of the step ``positions`` with :data:`PREFIX_CHUNKS` chunks, or
    ``None`` where the one-forward path runs (:func:`can_chunk` false, or a single distinct
    position: nothing to cut)."""
    if len(set(int(p) for p in positions)) < 2 or not can_chunk(model, arch):
        return None
    return prefix_bounds(positions, PREFIX_CHUNKS)


@dataclass
class ChunkedForward:
    """One sequence run chunk by chunk: every chunk's final residual ``[rows, e_k − e_{k−1}, d]``
    and, per hook name, every chunk's differentiated tensor (:data:`LeafFn`)."""

    bounds: list[int]
    resids: list[Tensor]
    leaves: list[list[Tensor]]

    @property
    def resid(self) -> Float[Tensor, "rows pos d_model"]:
        """The final residual of the whole sequence (on the graph of every chunk)."""
        return torch.cat(self.resids, dim=1)

    def inputs(self, k: int) -> Tensor:
        """The differentiated tensors of hook name ``k`` over the whole sequence, detached."""
        return torch.cat([leaf.detach() for leaf in self.leaves[k]], dim=1)


def chunked_forward(
    model: Any,
    arch: Arch,
    tokens: Int[Tensor, "rows pos"],
    names: Sequence[str],
    leaf: LeafFn,
    bounds: Sequence[int],
) -> ChunkedForward:
    """``tokens`` (unpadded rows) up to the final residual, as the chunks ending at ``bounds``
    (``bounds[-1]`` the length), through the model's key–value cache
    (:func:`lens_attrib.backend.key_value_cache`,
    :func:`~lens_attrib.backend.cached_final_residual`); at each hook of ``names`` the forward
    continues with ``leaf(k, x, columns)``. Runs under the caller's hooks
    context and autograd mode; non-finite activations are errors naming the weight
    (:func:`lens_attrib.finite.check_activations`)."""
    if int(bounds[-1]) != int(tokens.shape[1]):
        raise ValueError(f"The last chunk ends at {bounds[-1]}, the sequence at {tokens.shape[1]}.")
    leaves: list[list[Tensor]] = [[] for _ in names]
    where = {"start": 0}

    def hook_of(k: int) -> Any:
        def hook(x: Tensor, hook: Any) -> Tensor:
            out = leaf(k, x, slice(where["start"], where["start"] + int(x.shape[1])))
            leaves[k].append(out)
            return out

        return hook

    cache = key_value_cache(model, arch, int(tokens.shape[0]), tokens.device)
    resids: list[Tensor] = []
    with model.hooks(fwd_hooks=[(n, hook_of(k)) for k, n in enumerate(names)]):
        for end in bounds:
            chunk = tokens[:, where["start"] : end]
            resid = cached_final_residual(model, arch, chunk, cache)
            check_activations(model, resid, torch.ones_like(chunk, dtype=torch.bool))
            resids.append(resid)
            where["start"] = end
    missing = [n for n, got in zip(names, leaves, strict=True) if len(got) != len(bounds)]
    if missing:
        raise RuntimeError(f"Hooks {missing} did not fire in every chunk of the forward.")
    return ChunkedForward(list(bounds), resids, leaves)


def chunked_vjps(
    forward: ChunkedForward,
    positions: Int[Tensor, "steps"],
    cotangents: Float[Tensor, "steps rows pos d_model"],
) -> list[Float[Tensor, "steps rows pos *shape"]]:
    """``cotangents[s] · ∂resid/∂(inputs of name k)`` for every step ``s`` and hook name ``k``.

    ``cotangents[s]`` is step ``s``'s gradient at the final residual of the whole sequence,
    nonzero at or before ``positions[s]`` only (a step's own position). The steps of chunk
    ``c`` take their products from chunk ``c``'s residual to the tensors of chunks ``≤ c``
    (:func:`lens_attrib.methods.backprop.batched_vjp`); positions of later chunks get 0. The
    graph is freed after the last chunk.
    """
    device = forward.resids[0].device
    step_pos = positions.to(device)
    n_steps, rows = int(cotangents.shape[0]), int(cotangents.shape[1])
    out = [
        leaves[0].new_zeros(n_steps, rows, forward.bounds[-1], *leaves[0].shape[2:])
        for leaves in forward.leaves
    ]
    begin = 0
    last = len(forward.bounds) - 1
    for c, (end, resid) in enumerate(zip(forward.bounds, forward.resids, strict=True)):
        members = ((step_pos >= begin) & (step_pos < end)).nonzero()[:, 0]
        if len(members):
            inputs = [leaf for leaves in forward.leaves for leaf in leaves[: c + 1]]
            per_pass = max(1, VJP_TOKENS // (rows * end))
            grads = batched_vjp(
                resid,
                inputs,
                cotangents[members][:, :, begin:end].detach(),
                per_pass,
                retain=c < last,
            )
            for k in range(len(forward.leaves)):
                parts = grads[k * (c + 1) : (k + 1) * (c + 1)]
                out[k][members, :, :end] = torch.cat(parts, dim=2)
        begin = end
    return out


def backward_step_positions(positions: Sequence[int], bounds: Sequence[int]) -> int:
    """``Σ_s e_{k(s)}``: the positions every step's backward spans with chunks ending at
    ``bounds`` (``k(s)`` the chunk of step ``s``); ``S · L`` for the one chunk ``[L]``."""
    return sum(next(int(e) for e in bounds if int(p) < int(e)) for p in positions)


def _capture_leaf(k: int, x: Tensor, cols: slice) -> Tensor:
    """The activation as it is, made a leaf where it does not yet depend on one (the embeddings:
    parameters are frozen) — the captures of :func:`lens_attrib.forward.run`."""
    return x if x.requires_grad else x.detach().requires_grad_(True)


def _unpadded(batch: Batch, rows: Tensor) -> tuple[Batch, Tensor]:
    """The step rows ``rows`` (one sequence) without their padding columns; those columns."""
    sub = batch.select(rows)
    cols = sub.mask[0].nonzero()[:, 0]
    tokens = sub.tokens[:, cols]
    mask = torch.ones_like(tokens, dtype=torch.bool)
    alone = Batch(
        tokens, mask, sub.str_tokens, sub.special[:, cols], batch.arch, batch.padding_side
    )
    return alone, cols


def chunked_step_gradients_at(
    model: Any,
    batch: Batch,
    target: Target,
    names: Sequence[str],
    groups: Sequence[Tensor],
) -> tuple[list[Tensor], list[Tensor], Forward]:
    """:func:`lens_attrib.methods.backprop.step_gradients_at` with prefix chunks: per sequence
    (each of ``groups``, without its padding) one :func:`chunked_forward` capturing ``names``,
    ``f_s`` of every step from the whole sequence's final residual
    (:meth:`~lens_attrib.target.Target.evaluate`), the step gradients ``g_s = ∂f_s/∂x`` there
    (one backward through the head), then :func:`chunked_vjps`. Same returns: activations and
    every row's own step gradient ``[batch, pos, ...]`` (zero at padding), and the forward.
    Groups whose steps share one position (nothing to cut) run as one chunk."""
    device = batch.tokens.device
    xs: list[Tensor | None] = [None] * len(names)
    grads: list[Tensor | None] = [None] * len(names)
    value = torch.zeros(0)
    head_out = torch.zeros(0)
    resid = torch.zeros(0)
    positions = torch.empty(batch.size, dtype=torch.long, device=device)
    token_ids = torch.empty(batch.size, dtype=torch.long, device=device)
    foil_ids: Tensor | None = None
    regression = False
    for g, rows in enumerate(groups):
        alone, cols = _unpadded(batch, rows)
        steps = select_steps(target, rows)
        at = steps.positions(alone).tolist()
        bounds = prefix_bounds(at, PREFIX_CHUNKS)
        fwd = chunked_forward(model, batch.arch, alone.tokens[:1], names, _capture_leaf, bounds)
        per_step = fwd.resid.expand(len(rows), -1, -1)
        f, got, out = steps.evaluate(model, alone, per_step)
        check_value(f, model)
        step_rows = torch.autograd.grad(f.sum(), per_step, retain_graph=True)[0]
        row_grads = chunked_vjps(fwd, got.positions, step_rows[:, None])
        idx = rows.to(device)
        scatter = (idx[:, None], cols.to(device)[None])
        for k, gk in enumerate(row_grads):
            x = fwd.inputs(k)[0]
            if xs[k] is None:
                xs[k] = x.new_zeros(batch.size, batch.length, *x.shape[1:])
                grads[k] = gk.new_zeros(batch.size, batch.length, *gk.shape[3:])
            xs[k][scatter] = x  # type: ignore[index]
            grads[k][scatter] = gk[:, 0]  # type: ignore[index]
        if g == 0:
            value = f.new_zeros(batch.size)
            head_out = out.new_zeros(batch.size, out.shape[-1])
            resid = per_step.new_zeros(batch.size, batch.length, per_step.shape[-1])
        value[idx] = f.detach()
        head_out[idx] = out.detach()
        resid[scatter] = rearrange(fwd.resid.detach(), "1 pos d -> pos d")
        positions[idx] = cols.to(device)[got.positions.to(device)]
        token_ids[idx] = got.token_ids.to(device)
        regression = got.regression
        if got.foil_ids is not None:
            foil_ids = torch.empty_like(token_ids) if foil_ids is None else foil_ids
            foil_ids[idx] = got.foil_ids.to(device)
    resolved = ResolvedTarget(positions, token_ids, foil_ids, regression)
    forward = Forward(value, resolved, head_out, resid)
    return [x for x in xs if x is not None], [g for g in grads if g is not None], forward


def prefix_gradients_at(
    model: Any, batch: Batch, target: Target, names: Sequence[str]
) -> tuple[list[Tensor], list[Tensor], Forward]:
    """:func:`lens_attrib.methods.backprop.gradients_at` (no extra hooks), with a generation
    step batch's sequences in prefix chunks (:func:`chunked_step_gradients_at`) where
    :data:`STEP_GRADIENT_CHUNKS` is on, :func:`can_chunk` allows it and some sequence has more
    than one step; the same numbers."""
    groups = step_groups(batch)
    if (
        STEP_GRADIENT_CHUNKS
        and groups is not None
        and max(len(g) for g in groups) > 1
        and can_chunk(model, batch.arch)
    ):
        return chunked_step_gradients_at(model, batch, target, names, groups)
    return gradients_at(model, batch, target, names)


__all__ = [
    "PREFIX_CHUNKS",
    "STEP_GRADIENT_CHUNKS",
    "ChunkedForward",
    "LeafFn",
    "backward_step_positions",
    "can_chunk",
    "chunk_bounds",
    "chunked_forward",
    "chunked_step_gradients_at",
    "chunked_vjps",
    "prefix_bounds",
    "prefix_gradients_at",
]
