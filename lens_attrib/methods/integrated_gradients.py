"""Integrated Gradients (Sundararajan et al. 2017) over the input embeddings.

For input embeddings ``e^k`` (token, and positional/token-type with ``embeddings="full"``), their
baselines ``b^k`` (:mod:`.baselines`) and the explained scalar ``f``:

``R_i = Σ_k Σ_d (e^k − b^k)_{i,d} ∫₀¹ ∂f/∂e^k_{i,d}(b + α(e − b)) dα``,

the integral by Gauss–Legendre panels bisected where the local completeness check fails, until
completeness holds to 1 % (:mod:`.path_quadrature`); every item on its own unpadded path, the
rounds of all items of a batch advanced together (:func:`lockstep_adaptive`).

Generation step batches (:mod:`.generation`: every step of a prompt a row holding the same
sequence) with a fixed ``n_steps`` share the path across the steps of one sequence
(:func:`group_path`, :func:`group_path_integral`): per batch of nodes ``α`` one forward of the
interpolated full sequence and the ``S`` step gradients as batched vector–Jacobian products
(:func:`lens_attrib.methods.backprop.batched_vjp`); ``f(x)`` and ``f(b)`` of all steps from one
forward each. The baselines are per position, so by causality step ``s`` equals IG on its prefix.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from einops import einsum, rearrange
from jaxtyping import Float
from torch import Tensor

from lens_attrib.backend import EMBEDDINGS, Arch, backward_bytes_per_row, embedding_hooks
from lens_attrib.forward import (
    FwdHooks,
    available_memory,
    resid_of,
    run,
    run_shared,
    step_groups,
)
from lens_attrib.inputs import Batch
from lens_attrib.length_buckets import plan_forwards
from lens_attrib.methods.backprop import (
    TOKEN_POOLING_OPTION,
    VJP_TOKENS,
    batched_vjp,
    grad_x_input_scores,
    pool_tokens,
)
from lens_attrib.methods.baselines import (
    SINK_MODES,
    baseline_check,
    default_baseline,
    embedding_baselines,
    sink_needed,
    sink_positions,
    sink_token_id,
)
from lens_attrib.methods.path_quadrature import (
    QuadratureResult,
    Request,
    adaptive_quadrature,
    adaptive_rounds,
)
from lens_attrib.methods.prefix_chunks import chunk_bounds, chunked_forward, chunked_vjps
from lens_attrib.methods.registry import (
    MethodOutput,
    Option,
    positive_int,
    positive_int_or_none,
    register,
)
from lens_attrib.progress import advance, progress_bar
from lens_attrib.target import ResolvedTarget, Target

RULES = ("gausslegendre", "trapezoid", "riemann", "riemann_left", "riemann_right", "riemann_middle")
PANEL_POINTS = 8
"""Nodes per panel of ``n_steps="auto"`` (two panels first, then bisection: path_quadrature)."""


def quadrature(n_steps: int, rule: str = "gausslegendre") -> tuple[list[float], list[float]]:
    """Points ``α_k`` in [0, 1] and weights ``w_k`` with ``Σ_k w_k h(α_k) ≈ ∫₀¹ h(α) dα``.

    ``gausslegendre``: the Gauss–Legendre nodes ``t_k`` and weights ``v_k`` of [−1, 1]
    (``numpy.polynomial.legendre.leggauss``) mapped to ``α_k = (t_k + 1)/2``, ``w_k = v_k/2``:
    exact for polynomials of degree ≤ 2n − 1, error ``O(h^{(2n)})`` for smooth integrands (as
    Captum's default ``method="gausslegendre"``). ``trapezoid``: ``α_k = k/(n−1)``, end weights
    halved (error ``O(n^{−2})``); ``riemann`` (= ``riemann_middle``): midpoints ``(k + ½)/n``;
    ``riemann_left``/``riemann_right``: ``k/n`` / ``(k + 1)/n``.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if n_steps < (2 if rule == "trapezoid" else 1):
        raise ValueError(f"n_steps={n_steps} is too few for the {rule} rule.")
    if rule == "gausslegendre":
        nodes, gauss_weights = np.polynomial.legendre.leggauss(n_steps)
        return [float(t + 1) / 2 for t in nodes], [float(v) / 2 for v in gauss_weights]
    if rule == "trapezoid":
        h = 1.0 / (n_steps - 1)
        alphas = [k * h for k in range(n_steps)]
        weights = [h] * n_steps
        weights[0] = weights[-1] = h / 2
        return alphas, weights
    offset = {"riemann": 0.5, "riemann_middle": 0.5, "riemann_left": 0.0, "riemann_right": 1.0}
    alphas = [(k + offset[rule]) / n_steps for k in range(n_steps)]
    return alphas, [1.0 / n_steps] * n_steps


@dataclass
class ItemPath:
    """One item's straight-line path, unpadded: ``b + α (x − b)`` for every embedding component.

    ``batch`` is the item alone (``[1, pos']``, with the prepended sink when ``prepended``),
    ``resolved`` its target in that batch's coordinates, ``columns`` the item's positions in the
    caller's padded batch (the returned scores), ``value``/``base_value`` ``f(x)``/``f(b)``.
    """

    batch: Batch
    resolved: ResolvedTarget
    starts: list[Tensor]
    deltas: list[Tensor]
    columns: Tensor
    prepended: bool
    value: Tensor
    base_value: Tensor


def _capture_hook(store: list[Tensor]) -> Any:
    def hook(x: Tensor, hook: Any) -> Tensor:
        store.append(x.detach())
        return x

    return hook


def _interpolation_hook(start: Tensor, delta: Tensor, alphas: Tensor, store: list[Tensor]) -> Any:
    """Replace an embedding ``[1, pos, d]`` by the rows ``b + α_s (x − b)`` (leaves), one per α."""

    def hook(x: Tensor, hook: Any) -> Tensor:
        a = alphas[:, None, None].to(x.dtype)
        out = (start + a * delta).detach().requires_grad_(True)
        store.append(out)
        return out

    return hook


def _value_at(
    model: Any, item: Batch, resolved: ResolvedTarget, head: Any, hooks: FwdHooks, rows: int
) -> Float[Tensor, "rows"]:
    """The explained scalar of ``rows`` copies of the one-item batch ``item`` under ``hooks``."""
    index = torch.zeros(rows, dtype=torch.long)
    big = item.select(index)
    with model.hooks(fwd_hooks=list(hooks)):
        resid = resid_of(model, big)
    target = resolved.index(index.to(resolved.positions.device))
    at = resid[torch.arange(rows, device=resid.device), target.positions.to(resid.device)]
    return target.select(head(at))


def _item_batch(model: Any, batch: Batch, b: int, prepend: bool) -> tuple[Batch, Tensor]:
    """Item ``b`` without padding, a sink token prepended when ``prepend``; its columns."""
    columns = batch.mask[b].nonzero()[:, 0]
    tokens = batch.tokens[b, columns][None]
    special = batch.special[b, columns][None]
    str_tokens = list(batch.str_tokens[b])
    if prepend:
        sink = sink_token_id(model)
        tokens = torch.cat([tokens.new_full((1, 1), sink), tokens], 1)
        special = torch.cat([special.new_ones((1, 1)), special], 1)
        str_tokens = [model.tokenizer.decode([sink]), *str_tokens]
    mask = torch.ones_like(tokens, dtype=torch.bool)
    item = Batch(tokens, mask, [str_tokens], special, batch.arch, batch.padding_side)
    if batch.token_types is not None:  # encoders (no sink): the item's segment ids
        item.token_types = batch.token_types[b, columns][None]
    return item, columns


def item_path(
    model: Any,
    batch: Batch,
    b: int,
    resolved: ResolvedTarget,
    names: Sequence[str],
    baseline: str | Tensor,
    keep_sink: str | bool,
    head: Any,
) -> ItemPath:
    """The path of item ``b`` (see :func:`integrated_gradients` for ``keep_sink``)."""
    named = isinstance(baseline, str)
    prepend = named and sink_needed(batch, b, keep_sink)
    item, columns = _item_batch(model, batch, b, prepend)
    position = int(batch.mask[b, : int(resolved.positions[b])].sum()) + int(prepend)
    one = resolved.index(torch.tensor([b], device=resolved.positions.device))
    one = ResolvedTarget(
        torch.tensor([position], device=one.positions.device),
        one.token_ids,
        one.foil_ids,
        one.regression,
    )
    stores: list[list[Tensor]] = [[] for _ in names]
    hooks = [(n, _capture_hook(st)) for n, st in zip(names, stores)]
    with torch.no_grad():
        value = _value_at(model, item, one, head, hooks, 1)
    starts, deltas, hooks0 = _path_starts(
        model, batch, b, item, columns, names, [st[0] for st in stores], baseline, keep_sink
    )
    with torch.no_grad():
        base_value = _value_at(model, item, one, head, hooks0, 1)
    return ItemPath(item, one, starts, deltas, columns, prepend, value[0], base_value[0])


def _path_starts(
    model: Any,
    batch: Batch,
    b: int,
    item: Batch,
    columns: Tensor,
    names: Sequence[str],
    xs: list[Tensor],
    baseline: str | Tensor,
    keep_sink: str | bool,
) -> tuple[list[Tensor], list[Tensor], FwdHooks]:
    """``(b^k, x^k − b^k, hooks putting the input at α = 0)`` of item ``b``'s embeddings ``xs``."""
    if isinstance(baseline, Tensor):
        full = baseline.to(xs[0].device, xs[0].dtype)
        full = full.expand(batch.size, batch.length, xs[0].shape[-1])
        baseline = full[b, columns.to(full.device)][None]
    keep = {"special": item.special, True: sink_positions(item), False: None}[keep_sink]
    starts = embedding_baselines(model, batch.arch, names, xs, baseline, keep)
    xs = [x.expand_as(s) for x, s in zip(xs, starts)]
    deltas = [x - s for x, s in zip(xs, starts)]
    zero = torch.zeros(1, dtype=xs[0].dtype, device=xs[0].device)
    hooks0 = [(n, _interpolation_hook(s, d, zero, [])) for n, s, d in zip(names, starts, deltas)]
    return starts, deltas, hooks0


def _step_values(
    per_step: Float[Tensor, "steps rows pos d"], steps: ResolvedTarget, head: Any
) -> Float[Tensor, "steps rows"]:
    """``f_s`` of every step ``s`` (read at its position of ``per_step[s]``) on every row."""
    n_steps, rows = int(per_step.shape[0]), int(per_step.shape[1])
    device = per_step.device
    s_idx = torch.arange(n_steps, device=device)[:, None]
    r_idx = torch.arange(rows, device=device)[None, :]
    at = per_step[s_idx, r_idx, steps.positions.to(device)[:, None]]
    flat = rearrange(at, "s r d -> (s r) d")
    target = steps.index(
        torch.arange(n_steps, device=steps.positions.device).repeat_interleave(rows)
    )
    return rearrange(target.select(head(flat)), "(s r) -> s r", s=n_steps)


def _group_values(
    model: Any, path_batch: Batch, steps: ResolvedTarget, head: Any, hooks: FwdHooks
) -> Float[Tensor, "steps"]:
    """``f_s`` of every step from **one** forward of the sequence ``path_batch`` under ``hooks``."""
    with model.hooks(fwd_hooks=list(hooks)):
        resid = resid_of(model, path_batch)
    per_step = resid[None].expand(int(steps.positions.shape[0]), -1, -1, -1)
    return _step_values(per_step, steps, head)[:, 0]


def group_path(
    model: Any,
    batch: Batch,
    rows: Tensor,
    resolved: ResolvedTarget,
    names: Sequence[str],
    baseline: str | Tensor,
    keep_sink: str | bool,
    head: Any,
) -> ItemPath:
    """The path shared by the step rows ``rows`` of one sequence (:func:`item_path` of its first
    row): ``resolved`` holds every step in the item's coordinates, ``value``/``base_value``
    ``f_s(x)``/``f_s(b)`` ``[steps]``, each from one forward of the sequence."""
    b = int(rows[0])
    prepend = isinstance(baseline, str) and sink_needed(batch, b, keep_sink)
    item, columns = _item_batch(model, batch, b, prepend)
    picked = resolved.index(rows.to(resolved.positions.device))
    shift = [int(batch.mask[b, : int(p)].sum()) + int(prepend) for p in picked.positions.tolist()]
    steps = ResolvedTarget(
        torch.tensor(shift, device=picked.positions.device),
        picked.token_ids,
        picked.foil_ids,
        picked.regression,
    )
    stores: list[list[Tensor]] = [[] for _ in names]
    with torch.no_grad():
        hooks = [(n, _capture_hook(st)) for n, st in zip(names, stores)]
        value = _group_values(model, item, steps, head, hooks)
        starts, deltas, hooks0 = _path_starts(
            model, batch, b, item, columns, names, [st[0] for st in stores], baseline, keep_sink
        )
        base_value = _group_values(model, item, steps, head, hooks0)
    return ItemPath(item, steps, starts, deltas, columns, prepend, value, base_value)


def group_path_integral(
    model: Any,
    path: ItemPath,
    names: Sequence[str],
    head: Any,
    alphas: Sequence[float],
    weights: Sequence[float],
    rows: int,
) -> list[Float[Tensor, "steps pos d"]]:
    """:func:`path_integral` of every step of a :func:`group_path`: per ``rows`` nodes one
    forward of the interpolated sequence, then the ``S`` step integrands
    ``Σ_a w_a ∂f_s/∂e^k(b + α_a (x − b))`` as ``S`` batched vector–Jacobian products from the
    final residual (cotangent of step ``s``: ``w_a ∂f_s/∂resid``, nonzero at its position)."""
    dtype, device = path.deltas[0].dtype, path.deltas[0].device
    n_steps = int(path.resolved.positions.shape[0])
    total = [d.new_zeros(n_steps, *d.shape[1:]) for d in path.deltas]
    for start in range(0, len(alphas), rows):
        a = torch.tensor(alphas[start : start + rows], dtype=dtype, device=device)
        w = torch.tensor(weights[start : start + rows], dtype=dtype, device=device)
        stores: list[list[Tensor]] = [[] for _ in names]
        big = path.batch.select(torch.zeros(int(a.shape[0]), dtype=torch.long))
        with model.hooks(fwd_hooks=list(_path_hooks(path, names, a, stores))):
            resid = resid_of(model, big)
        per_step = resid[None].expand(n_steps, -1, -1, -1)
        values = _step_values(per_step, path.resolved, head)
        weighted = (values * w.to(values)).sum()
        cotangents = torch.autograd.grad(weighted, per_step, retain_graph=True)[0]
        chunk = max(1, VJP_TOKENS // (int(a.shape[0]) * path.batch.length))
        grads = batched_vjp(resid, [st[0] for st in stores], cotangents.detach(), chunk)
        for i, g in enumerate(grads):
            total[i] += g.sum(1)
        advance(len(a))
    return total


def chunked_path_integral(
    model: Any,
    path: ItemPath,
    names: Sequence[str],
    head: Any,
    alphas: Sequence[float],
    weights: Sequence[float],
    rows: int,
    bounds: Sequence[int],
) -> list[Float[Tensor, "steps pos d"]]:
    """:func:`group_path_integral` with every step's backward stopped at its chunk's end.

    Per ``rows`` nodes the interpolated sequence runs as the chunks of positions ending at
    ``bounds`` (:func:`lens_attrib.methods.prefix_chunks.chunked_forward`, each chunk's
    embeddings put on the path), ``f_s`` of every step is read from the whole sequence's final
    residual, and the weighted step cotangents ``w_a ∂f_s/∂resid`` are taken back from each
    step's own chunk (:func:`~lens_attrib.methods.prefix_chunks.chunked_vjps`). A step at
    position ``p`` needs only rows ``≤ p`` (causal attention), so this is the same integral with
    less backward work (``Σ_k S_k e_k`` instead of ``S · L`` step-positions; on SmolLM2 with
    64 + 32 tokens and 4 chunks about 0.84× the time of :func:`group_path_integral`)."""
    dtype, device = path.deltas[0].dtype, path.deltas[0].device
    steps = path.resolved
    n_steps = int(steps.positions.shape[0])
    total = [d.new_zeros(n_steps, *d.shape[1:]) for d in path.deltas]
    for first in range(0, len(alphas), rows):
        a = torch.tensor(alphas[first : first + rows], dtype=dtype, device=device)
        w = torch.tensor(weights[first : first + rows], dtype=dtype, device=device)

        def on_path(k: int, x: Tensor, cols: slice, a: Tensor = a) -> Tensor:
            point = path.starts[k][:, cols] + a[:, None, None].to(x.dtype) * path.deltas[k][:, cols]
            return point.detach().requires_grad_(True)

        tokens = path.batch.tokens.expand(int(a.shape[0]), -1)
        forward = chunked_forward(model, path.batch.arch, tokens, names, on_path, bounds)
        per_step = forward.resid[None].expand(n_steps, -1, -1, -1)
        values = _step_values(per_step, steps, head)
        weighted = (values * w.to(values)).sum()
        cotangents = torch.autograd.grad(weighted, per_step, retain_graph=True)[0]
        for k, g in enumerate(chunked_vjps(forward, steps.positions, cotangents)):
            total[k] += g.sum(1)
        advance(len(a))
    return total


def _path_hooks(
    path: ItemPath, names: Sequence[str], a: Tensor, stores: Sequence[list[Tensor]] | None = None
) -> FwdHooks:
    """Hooks putting the path points ``b + α (x − b)``, one row per α, on every component."""
    stores = stores if stores is not None else [[] for _ in names]
    return [
        (n, _interpolation_hook(s, d, a, st))
        for n, s, d, st in zip(names, path.starts, path.deltas, stores)
    ]


def _point_gradients(
    model: Any, path: ItemPath, names: Sequence[str], head: Any, a: Tensor
) -> list[Tensor | None]:
    """``∂f/∂e^k`` at the points ``α = a`` (``[len(a), pos, d]`` per component; None if unused)."""
    stores: list[list[Tensor]] = [[] for _ in names]
    hooks = _path_hooks(path, names, a, stores)
    value = _value_at(model, path.batch, path.resolved, head, hooks, int(a.shape[0]))
    grads = torch.autograd.grad(value.sum(), [st[0] for st in stores], allow_unused=True)
    return [None if g is None else g.detach() for g in grads]


def path_integral(
    model: Any,
    path: ItemPath,
    names: Sequence[str],
    head: Any,
    alphas: Sequence[float],
    weights: Sequence[float],
    rows: int,
) -> list[Float[Tensor, "1 pos d"]]:
    """``Σ_s w_s ∂f/∂e^k(b + α_s (x − b))`` for every component, ``rows`` points per forward."""
    dtype, device = path.deltas[0].dtype, path.deltas[0].device
    total = [torch.zeros_like(d) for d in path.deltas]
    for start in range(0, len(alphas), rows):
        a = torch.tensor(alphas[start : start + rows], dtype=dtype, device=device)
        w = torch.tensor(weights[start : start + rows], dtype=dtype, device=device)
        for i, g in enumerate(_point_gradients(model, path, names, head, a)):
            if g is not None:
                total[i] += einsum(w, g, "s, s p d -> p d")[None]
        advance(len(a))
    return total


def final_rule_vectors(
    model: Any,
    path: ItemPath,
    names: Sequence[str],
    head: Any,
    edges: Sequence[float],
    rule: str,
    rows: int,
) -> list[Float[Tensor, "1 pos d"]]:
    """``Σ_s w_s ∂f/∂e^k`` per component at the nodes of the panels ending at ``edges`` (the
    final rule of an adaptive result, ``PANEL_POINTS`` ``rule`` nodes per panel): the
    per-dimension integrand whose ``Σ_d (x − b)^k_d ·`` is the result's signed scores."""
    a0, w0 = quadrature(PANEL_POINTS, rule)
    ends = torch.tensor(list(edges), dtype=torch.float64)
    lo, width = ends[:-1], ends[1:] - ends[:-1]
    nodes = lo[:, None] + width[:, None] * torch.tensor(a0, dtype=torch.float64)[None]
    weights = width[:, None] * torch.tensor(w0, dtype=torch.float64)[None]
    return path_integral(
        model, path, names, head, nodes.reshape(-1).tolist(), weights.reshape(-1).tolist(), rows
    )


def path_node_scores(
    model: Any, path: ItemPath, names: Sequence[str], head: Any, alphas: Tensor, rows: int
) -> Float[Tensor, "n pos"]:
    """Every token's integrand ``Σ_k Σ_d (x − b)^k_d ∂f/∂e^k_d(b + α (x − b))`` at each α."""
    dtype, device = path.deltas[0].dtype, path.deltas[0].device
    out = []
    for start in range(0, int(alphas.numel()), rows):
        a = alphas[start : start + rows].to(device, dtype)
        grads = _point_gradients(model, path, names, head, a)
        per_row = torch.zeros(int(a.shape[0]), path.batch.length, dtype=dtype, device=device)
        for d, g in zip(path.deltas, grads):
            if g is not None:
                per_row += (d * g).sum(-1)
        out.append(per_row.cpu())
        advance(int(a.shape[0]))
    return torch.cat(out)


def path_values(
    model: Any, path: ItemPath, names: Sequence[str], head: Any, alphas: Tensor, rows: int
) -> Float[Tensor, "n"]:
    """``f(b + α (x − b))`` at each α (no gradients)."""
    out = []
    with torch.no_grad():
        for start in range(0, int(alphas.numel()), rows):
            a = alphas[start : start + rows].to(path.deltas[0].device, path.deltas[0].dtype)
            hooks = _path_hooks(path, names, a)
            out.append(_value_at(model, path.batch, path.resolved, head, hooks, int(a.shape[0])))
            advance(0)
    return torch.cat(out).detach().cpu()


LOCKSTEP = True
"""``n_steps="auto"``: advance the adaptive rounds of all items of a batch together
(:func:`lockstep_adaptive`); ``False``: every item alone, its values in separate forwards (the
earlier implementation, kept as the oracle of ``tests/test_ig_lockstep.py``)."""


def _padded_rows(paths: Sequence[ItemPath], item_of_row: Sequence[int]) -> tuple[Batch, list[int]]:
    """One row per entry of ``item_of_row`` (the item's unpadded tokens), padded on the
    batch's side to the longest; the column offset of every row's first real token."""
    first = paths[item_of_row[0]].batch
    lengths = [paths[b].batch.length for b in item_of_row]
    length, rows = max(lengths), len(item_of_row)
    left = first.padding_side == "left"
    offsets = [length - n if left else 0 for n in lengths]
    device = first.tokens.device
    tokens = torch.zeros(rows, length, dtype=first.tokens.dtype, device=device)
    mask = torch.zeros(rows, length, dtype=torch.bool, device=device)
    special = torch.zeros(rows, length, dtype=torch.bool, device=device)
    types = None if first.token_types is None else torch.zeros_like(tokens)
    for r, (b, off, n) in enumerate(zip(item_of_row, offsets, lengths)):
        item = paths[b].batch
        tokens[r, off : off + n] = item.tokens[0]
        mask[r, off : off + n] = True
        special[r, off : off + n] = item.special[0]
        if types is not None and item.token_types is not None:
            types[r, off : off + n] = item.token_types[0]
    str_tokens = [paths[b].batch.str_tokens[0] for b in item_of_row]
    batch = Batch(tokens, mask, str_tokens, special, first.arch, first.padding_side)
    batch.token_types = types
    return batch, offsets


def _lockstep_hook(
    start: Tensor, delta: Tensor, alphas: Tensor, mask: Tensor, store: list[Tensor]
) -> Any:
    """:func:`_interpolation_hook` for padded rows of many items: ``b + α (x − b)`` at the real
    positions (``start``/``delta`` ``[rows, pos, d]``, one ``α`` per row), the input elsewhere."""

    def hook(x: Tensor, hook: Any) -> Tensor:
        a = alphas[:, None, None].to(x.dtype)
        out = torch.where(mask[..., None], start + a * delta, x).detach().requires_grad_(True)
        store.append(out)
        return out

    return hook


def lockstep_forward(
    model: Any,
    paths: Sequence[ItemPath],
    names: Sequence[str],
    head: Any,
    item_of_row: Sequence[int],
    alphas: Float[Tensor, "rows"],
    node: Sequence[bool],
    vectors: bool = False,
) -> tuple[list[Tensor], Float[Tensor, "rows"]]:
    """One forward of path points of several items (padded rows, :func:`_padded_rows`): every
    row's ``f(b + α (x − b))`` and, for the ``node`` rows, its per-token integrand
    ``Σ_k Σ_d (x − b)^k_d ∂f/∂e^k_d`` (its own positions, ``[len]``; other rows: empty);
    ``vectors``: the integrand per dimension instead, ``Σ_k (x − b)^k ∂f/∂e^k`` (``[len, d]``)."""
    batch, offsets = _padded_rows(paths, item_of_row)
    dtype, device = paths[0].deltas[0].dtype, batch.tokens.device
    rows, length = batch.size, batch.length
    starts, deltas = [], []
    for k in range(len(names)):
        d_model = paths[item_of_row[0]].deltas[k].shape[-1]
        start = torch.zeros(rows, length, d_model, dtype=dtype, device=device)
        delta = torch.zeros_like(start)
        for r, (b, off) in enumerate(zip(item_of_row, offsets)):
            n = paths[b].batch.length
            start[r, off : off + n] = paths[b].starts[k][0]
            delta[r, off : off + n] = paths[b].deltas[k][0]
        starts.append(start)
        deltas.append(delta)
    stores: list[list[Tensor]] = [[] for _ in names]
    a = alphas.to(device, dtype)
    hooks = [
        (n, _lockstep_hook(s, d, a, batch.mask, st))
        for n, s, d, st in zip(names, starts, deltas, stores)
    ]
    with model.hooks(fwd_hooks=hooks):
        resid = resid_of(model, batch)
    picked = [paths[b].resolved for b in item_of_row]
    positions = torch.tensor(
        [off + int(t.positions[0]) for off, t in zip(offsets, picked)], device=resid.device
    )
    foils = [t.foil_ids for t in picked if t.foil_ids is not None]
    target = ResolvedTarget(
        positions,
        torch.cat([t.token_ids for t in picked]),
        torch.cat(foils) if foils else None,
        picked[0].regression,
    )
    value = target.select(head(resid[torch.arange(rows, device=resid.device), positions]))
    grad_rows = torch.tensor(list(node), dtype=torch.bool, device=value.device)
    scores: list[Tensor] = [value.new_zeros(0).cpu()] * rows
    if bool(grad_rows.any()):
        grads = torch.autograd.grad(
            value[grad_rows].sum(), [st[0] for st in stores], allow_unused=True
        )
        shape = (rows, length, int(deltas[0].shape[-1])) if vectors else (rows, length)
        per_row = torch.zeros(shape, dtype=dtype, device=device)
        for d, g in zip(deltas, grads):
            if g is not None:
                per_row += d * g if vectors else (d * g).sum(-1)
        per_row = per_row.detach().cpu()
        for r, (b, off) in enumerate(zip(item_of_row, offsets)):
            if node[r]:
                scores[r] = per_row[r, off : off + paths[b].batch.length]
    return scores, value.detach().cpu()


def lockstep_round(
    model: Any,
    paths: Sequence[ItemPath],
    names: Sequence[str],
    head: Any,
    requests: dict[int, Request],
    max_rows: Any,
    vectors: bool = False,
) -> tuple[dict[int, tuple[Tensor, Tensor]], dict[int, int], dict[int, Tensor]]:
    """The answers ``(node scores [n, len], values [m])`` to one round's ``requests`` of many
    items, their rows run together (:func:`~lens_attrib.length_buckets.plan_forwards`:
    neighbouring lengths padded together where that is cheaper); also the largest forward each
    item's rows were in, and with ``vectors`` every requested panel's per-dimension integral
    ``Σ_s w_s Σ_k (x − b)^k ∂f/∂e^k(α_s)`` (``[panels, len, d]`` per item, the node vectors
    added into their panel as each forward ends; else empty)."""
    item_of_row: list[int] = []
    alphas: list[Tensor] = []
    node: list[bool] = []
    node_index: list[int] = []
    for b, req in requests.items():
        for part, is_node in ((req.nodes, True), (req.values, False)):
            item_of_row += [b] * int(part.numel())
            alphas.append(part)
            node += [is_node] * int(part.numel())
            node_index += list(range(int(part.numel())))
    alpha = torch.cat(alphas)
    lengths = [paths[b].batch.length for b in item_of_row]
    scores: list[Tensor | None] = [None] * len(item_of_row)
    values = torch.zeros(len(item_of_row), dtype=torch.float64)
    largest: dict[int, int] = {}
    panel_vectors: dict[int, Tensor] = {}
    for rows in plan_forwards(lengths, max_rows):
        items = [item_of_row[r] for r in rows]
        with torch.enable_grad():
            got, val = lockstep_forward(
                model, paths, names, head, items, alpha[rows], [node[r] for r in rows], vectors
            )
        for r, g, v in zip(rows, got, val.tolist()):
            scores[r], values[r] = g, v
            if vectors and node[r]:
                b, j = item_of_row[r], node_index[r]
                scores[r] = add_node_vector(panel_vectors, requests, b, j, g)
        for b in items:
            largest[b] = max(largest.get(b, 0), len(rows))
        advance(sum(node[r] for r in rows))
    answers: dict[int, tuple[Tensor, Tensor]] = {}
    for b in requests:
        mine = [r for r in range(len(item_of_row)) if item_of_row[r] == b]
        node_scores = [scores[r] for r in mine if node[r]]
        f = values[[r for r in mine if not node[r]]].to(paths[b].value.dtype)
        answers[b] = (torch.stack([s for s in node_scores if s is not None]), f)
    return answers, largest, panel_vectors


def add_node_vector(
    panel_vectors: dict[int, Tensor],
    requests: dict[int, Request],
    item: int,
    j: int,
    vector: Float[Tensor, "len d"],
) -> Float[Tensor, "len"]:
    """Add node ``j``'s weighted vector into its panel's integral (``panel_vectors[item]``,
    ``[panels, len, d]``, made at the item's first node); return its per-token integrand."""
    req = requests[item]
    assert req.weights is not None
    per_panel = int(req.nodes.numel()) // len(req.panels)
    if item not in panel_vectors:
        panel_vectors[item] = vector.new_zeros(len(req.panels), *vector.shape)
    panel_vectors[item][j // per_panel] += float(req.weights[j]) * vector
    return vector.sum(-1)


def lockstep_adaptive(
    model: Any,
    paths: Sequence[ItemPath],
    names: Sequence[str],
    head: Any,
    *,
    rule: str,
    tolerance: float,
    max_steps: int,
    step_batch: int | None,
    vectors: bool = False,
) -> tuple[list[QuadratureResult], list[int], int]:
    """The adaptive panels of every item (:func:`~.path_quadrature.adaptive_rounds`) advanced
    together: per round one set of forwards holds every unfinished item's nodes and the
    midpoint values of its new panels (the same panels, splits and numbers as each item alone,
    up to floating-point summation order). Returns the results, the largest forward each
    item's rows were in, and the number of rounds. ``vectors``: every result also holds the
    per-dimension integral over its final panels (``QuadratureResult.vectors``, ``[len, d]``),
    each panel's kept from the round that made it (a bisected panel's is dropped), so the
    norm poolings need no second pass over the final nodes."""
    a0, w0 = quadrature(PANEL_POINTS, rule)
    alphas = torch.tensor(a0, dtype=torch.float64)
    weights = torch.tensor(w0, dtype=torch.float64)
    rounds = {
        b: adaptive_rounds(
            float(p.base_value),
            float(p.value),
            alphas=alphas,
            weights=weights,
            tolerance=tolerance,
            max_points=max_steps,
        )
        for b, p in enumerate(paths)
    }
    requests = {b: next(g) for b, g in rounds.items()}
    results: dict[int, QuadratureResult] = {}
    kept: dict[int, dict[tuple[float, float], Tensor]] = {b: {} for b in rounds}
    largest = [0] * len(paths)
    n_rounds = 0
    device = paths[0].batch.tokens.device
    arch = paths[0].batch.arch
    while requests:
        total = sum(int(r.nodes.numel() + r.values.numel()) for r in requests.values())

        def max_rows(length: int, total: int = total) -> int:
            return rows_per_forward(arch, length, total, step_batch, device)

        answers, used, panel_vectors = lockstep_round(
            model, paths, names, head, requests, max_rows, vectors
        )
        n_rounds += 1
        for b, rows in used.items():
            largest[b] = max(largest[b], rows)
        for b, got in panel_vectors.items():
            keep_panels(kept[b], requests[b].panels, got)
        for b, answer in answers.items():
            try:
                requests[b] = rounds[b].send(answer)
            except StopIteration as done:
                results[b] = done.value
                if vectors:
                    results[b].vectors = final_vectors(kept.pop(b), results[b].edges)
                del requests[b]
    return [results[b] for b in range(len(paths))], largest, n_rounds


def keep_panels(
    kept: dict[tuple[float, float], Tensor],
    panels: Sequence[tuple[float, float]],
    integrals: Float[Tensor, "panels len d"],
) -> None:
    """Keep a round's new panels' integrals; drop the panels they halve (each pair of halves
    ``(lo, m), (m, hi)`` replaces ``(lo, hi)``)."""
    for left, right in zip(panels[::2], panels[1::2]):
        kept.pop((left[0], right[1]), None)
    for panel, integral in zip(panels, integrals):
        kept[panel] = integral


def final_vectors(
    kept: dict[tuple[float, float], Tensor], edges: Sequence[float]
) -> Float[Tensor, "len d"]:
    """The per-dimension integral over the final panels (``edges``), from the kept panels."""
    return torch.stack([kept[(lo, hi)] for lo, hi in itertools.pairwise(edges)]).sum(0)


STEP_MEMORY_SHARE = 0.25
"""Share of the free memory (host or GPU) one IG forward's interpolation rows may take."""


def vectors_fit(paths: Sequence[ItemPath], max_steps: int) -> bool:
    """Whether the per-dimension panel integrals of the norm poolings may be kept while the
    adaptive rounds run (:func:`lockstep_adaptive`): at most ``max_steps / PANEL_POINTS`` panels
    of ``[len, d]`` per item, in host memory, within ``STEP_MEMORY_SHARE`` of the free memory.
    Else the vectors are taken in one more pass over the final nodes."""
    panels = max(1, max_steps // PANEL_POINTS)
    per_value = paths[0].deltas[0].element_size() * int(paths[0].deltas[0].shape[-1])
    need = sum(panels * p.batch.length * per_value for p in paths)
    return need <= STEP_MEMORY_SHARE * available_memory(torch.device("cpu"))


def rows_per_forward(
    arch: Arch, length: int, n_points: int, step_batch: int | None, device: torch.device
) -> int:
    """Interpolation rows per forward: ``step_batch``, else as many points as fit (at most all
    of them) in ``STEP_MEMORY_SHARE`` of the free memory on ``device``
    (:func:`~lens_attrib.backend.backward_bytes_per_row`), and at most 4096 tokens."""
    if step_batch:
        return step_batch
    budget = int(STEP_MEMORY_SHARE * available_memory(device))
    fit = budget // max(backward_bytes_per_row(arch, length), 1)
    return max(1, min(n_points, 2**12 // length, fit))


def _steps_check(value: Any) -> str | None:
    ok = value == "auto" or positive_int(value) is None
    return None if ok else '"auto" or a positive integer'


def _tolerance_check(value: Any) -> str | None:
    ok = isinstance(value, float | int) and not isinstance(value, bool) and 0 < value < 1
    return None if ok else "a number in (0, 1) (a fraction of |f(x) − f(b)|)"


@register(
    "integrated_gradients",
    label="Integrated Gradients",
    uses_gradient=True,
    options={
        "n_steps": Option("auto", check=_steps_check),
        "baseline": Option(None, check=baseline_check),
        "rule": Option("gausslegendre", choices=RULES),
        "embeddings": Option("partial", choices=EMBEDDINGS),
        "step_batch": Option(None, check=positive_int_or_none),
        "keep_sink": Option("special", choices=SINK_MODES),
        "tolerance": Option(0.01, check=_tolerance_check),
        "max_steps": Option(1024, check=positive_int),
        "pooling": TOKEN_POOLING_OPTION,
    },
)
def integrated_gradients(
    model: Any,
    batch: Batch,
    target: Target,
    *,
    n_steps: int | str,
    baseline: str | Tensor | None,
    rule: str,
    embeddings: str,
    step_batch: int | None,
    keep_sink: str | bool,
    tolerance: float,
    max_steps: int,
    pooling: str,
) -> MethodOutput:
    """Integrated Gradients (Sundararajan et al. 2017) over the input embeddings.

    ``R_i = Σ_k Σ_d (e^k − b^k)_{i,d} · Σ_s w_s ∂f/∂e^k_{i,d}(b + α_s (e − b))`` with the
    quadrature ``(α_s, w_s)`` of ``rule`` (see :func:`quadrature`; default ``"gausslegendre"``,
    also ``"trapezoid"``, ``"riemann"``/``"riemann_left"``/``"riemann_right"``). Completeness
    ``Σ_i R_i = f(e) − f(b)`` holds up to the quadrature error, reported per item as
    ``meta["completeness_gap"] = f(e) − f(b) − Σ_i R_i``.

    n_steps:   ``"auto"`` (default): adaptive panels (:mod:`.path_quadrature`): two panels of
               8 ``rule`` nodes, then the panels with the largest local gap
               ``f(c) − f(a) − Σ_i R_i^{[a,c]}`` (its reference ``f(c) − f(a)`` costs one
               forward) are bisected until ``|gap| ≤ tolerance · |f(e) − f(b)|`` (default 1 %)
               or ``max_steps`` (1024) integrand evaluations are spent, then a warning names the
               items and their gaps. ``meta["n_steps"]``: evaluations spent per item,
               ``meta["panels"]``: panels of the final rule. An integer: exactly that many
               nodes of ``rule`` on [0, 1] (as Captum). On 50 SmolLM2 agreement items
               (``benchmarks/bench_ig.py``) 50 trapezoid points left a median gap of 7.7 % (only
               30 % of items within 1 %), on 10 anaphora items 47 %.
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
    resolves. The zero baseline is degenerate there, and the pad-token embedding is the
    non-degenerate choice.
    pooling:   ``"sum"`` (default): the signed ``Σ_d`` above, which conserves ``f(e) − f(b)``.
               ``"l1"``/``"l2"``: the norm over ``d`` of each token's integrated vector
               ``Σ_k (e − b)^k_i ⊙ Σ_s w_s ∂f/∂e^k_i`` (unsigned), the ℓ1 aggregation of the
               NormXLogit paper's faithfulness tables (its Section 4). The completeness gap in
               ``meta`` still refers to the signed sum, and ``meta["signed_scores"]`` holds the
               signed scores of the same pass (what ``pooling="sum"`` returns), so one call
               gives both (:func:`lens_attrib.method_variants.signed_variant`). Under
               ``n_steps="auto"`` the panels are those of the signed rule, and each panel's
               vector integral is kept from the round that evaluated its nodes
               (:func:`lockstep_adaptive`), so the poolings cost what the signed sum costs;
               where those integrals would not fit in memory (:func:`vectors_fit`), the vectors
               are taken in one more pass over the final nodes (:func:`final_rule_vectors`).
    keep_sink: which tokens keep their embedding (are not on the path, get no relevance) under a
               named baseline. ``"special"`` (default): the special tokens only (BOS/CLS/SEP), so
               every real token is attributed. Text prompts already begin with the model's start
               token (:func:`lens_attrib.inputs.start_token_of`), which is then the sink; token
               ids (or ``start_token=False``) without a leading special token get
               :func:`sink_token_id` prepended for the explanation, as attention sink fixed
               along the path (``meta["prepended_sink"]`` per item; ``f`` is then the model's
               output on ``sink + prompt``, ``meta["input_value"]`` its output on the prompt as
               given); the returned scores cover the user's tokens only. ``True``: also the first
               real token of every item (the attention sink of models without BOS, e.g.
               SmolLM2), which then gets no relevance; its path is smoother (on SmolLM2 agreement
               items about half the evaluations of ``"special"``). ``False``: nothing is kept;
               moving the sink itself changes where every head attends (the logit jumps by ~20
               within Δα = 0.02). With ``"special"`` on SmolLM2 ``f`` along the path can change
               by several logits within Δα ≈ 0.01 (−3.40 → −1.92 within α ∈ [0.3200, 0.3225] on
               "The paintings that the manager hates"); a global rule misses that by 22–149 % at
               512 points, the adaptive panels of ``n_steps="auto"`` reach 0.08 % at 384 evaluations
               ("The capital of France is": 0.5 % at 560).
    The target token (default: the prediction on the real input as given) is fixed before
    integrating. Every item has its own path (its real tokens, no padding in its numbers); its
    interpolation points are rows of a batch, ``step_batch`` rows per forward (default: as many
    as fit in a quarter of the free memory, :func:`rows_per_forward`; ``meta["step_batch"]``:
    the largest forward an item's points were in). With ``n_steps="auto"`` the items advance
    their rounds together (:func:`lockstep_adaptive`): one round's nodes and midpoint values of
    every unfinished item share forwards, neighbouring lengths padded together where
    :func:`~lens_attrib.length_buckets.plan_forwards` finds that cheaper — the same panels and
    numbers as each item alone, in fewer sequential forwards. Exception: the steps of a
    generation (``Target(generate=N)`` / ``Target(continuation=...)``) with an integer
    ``n_steps`` share one path per sequence (:func:`shared_integrated_gradients`; the same
    numbers as each step alone, which by causality equal IG on the step's prefix).
    """
    if isinstance(n_steps, int):
        quadrature(n_steps, rule)  # bad counts are errors before any forward
    arch = batch.arch
    baseline_used: str | Tensor = (
        default_baseline(arch, embeddings) if baseline is None else baseline
    )
    names = embedding_hooks(arch, embeddings)
    groups = shared_steps(batch, n_steps, baseline_used)
    with torch.no_grad():
        real = (
            run(model, batch, target)
            if groups is None
            else run_shared(model, batch, target, groups)
        )
    assert real.value is not None
    resolved, head = real.resolved, target.head_fn(model)
    if groups is not None:
        assert isinstance(n_steps, int)
        return shared_integrated_gradients(
            model,
            batch,
            real,
            groups,
            names,
            head,
            baseline_used,
            keep_sink,
            n_steps,
            rule,
            step_batch,
            pooling,
        )
    paths = [
        item_path(model, batch, b, resolved, names, baseline_used, keep_sink, head)
        for b in range(batch.size)
    ]
    scores = torch.zeros(batch.size, batch.length, dtype=real.value.dtype)
    scores = scores.to(batch.tokens.device)
    signed = torch.zeros_like(scores)
    gaps = torch.zeros(batch.size, dtype=real.value.dtype)
    used, panels, batches = [0] * batch.size, [1] * batch.size, [0] * batch.size
    device = batch.tokens.device
    points = batch.size * n_steps if isinstance(n_steps, int) else None
    bar = progress_bar(desc="integrated_gradients", total=points, unit="point")
    lockstep = n_steps == "auto" and LOCKSTEP
    if lockstep:
        results, largest, _ = lockstep_adaptive(
            model,
            paths,
            names,
            head,
            rule=rule,
            tolerance=tolerance,
            max_steps=max_steps,
            step_batch=step_batch,
            vectors=pooling != "sum" and vectors_fit(paths, max_steps),
        )
        for b, (path, result) in enumerate(zip(paths, results)):
            item_scores = result.scores
            signed[b, path.columns] = item_scores[int(path.prepended) :].to(signed)
            if result.vectors is not None:
                item_scores = pool_tokens(result.vectors[None], pooling)[0]
            elif pooling != "sum":
                rows = rows_per_forward(
                    arch, path.batch.length, PANEL_POINTS * (len(result.edges) - 1), step_batch,
                    device,
                )  # fmt: skip
                total = final_rule_vectors(model, path, names, head, result.edges, rule, rows)
                item_scores = grad_x_input_scores(path.deltas, total, pooling)[0]
            scores[b, path.columns] = item_scores[int(path.prepended) :].to(scores)
            gaps[b] = result.gap
            used[b], panels[b] = result.n_points, len(result.edges) - 1
            batches[b] = largest[b]
    for b, path in enumerate(paths):
        if lockstep:
            break
        bar.set_postfix_str(f"item {b + 1}/{batch.size}", refresh=False)
        if isinstance(n_steps, int):
            alphas, weights = quadrature(n_steps, rule)
            rows = rows_per_forward(arch, path.batch.length, n_steps, step_batch, device)
            total = path_integral(model, path, names, head, alphas, weights, rows)
            item_scores = grad_x_input_scores(path.deltas, total)[0]
            gap = float(path.value - path.base_value - item_scores.sum())
            signed[b, path.columns] = item_scores[int(path.prepended) :].to(signed)
            if pooling != "sum":
                item_scores = grad_x_input_scores(path.deltas, total, pooling)[0]
            used[b] = n_steps
        else:
            a0, w0 = quadrature(PANEL_POINTS, rule)
            rows = rows_per_forward(arch, path.batch.length, max_steps, step_batch, device)
            result = adaptive_quadrature(
                functools.partial(path_node_scores, model, path, names, head, rows=rows),
                functools.partial(path_values, model, path, names, head, rows=rows),
                float(path.base_value),
                float(path.value),
                alphas=torch.tensor(a0, dtype=torch.float64),
                weights=torch.tensor(w0, dtype=torch.float64),
                tolerance=tolerance,
                max_points=max_steps,
            )
            item_scores, gap = result.scores, result.gap
            signed[b, path.columns] = item_scores[int(path.prepended) :].to(signed)
            if pooling != "sum":
                total = final_rule_vectors(model, path, names, head, result.edges, rule, rows)
                item_scores = grad_x_input_scores(path.deltas, total, pooling)[0]
            used[b], panels[b] = result.n_points, len(result.edges) - 1
        batches[b] = rows
        scores[b, path.columns] = item_scores[int(path.prepended) :].to(scores)
        gaps[b] = gap
    bar.close()
    value = torch.stack([p.value for p in paths]).detach().cpu()
    base_value = torch.stack([p.base_value for p in paths]).detach().cpu()
    if n_steps == "auto":
        warn_unconverged(gaps, value - base_value, tolerance, max_steps)
    return MethodOutput(
        scores,
        resolved,
        options={"baseline": baseline_used if isinstance(baseline_used, str) else "tensor"},
        meta={
            **({} if pooling == "sum" else {"signed_scores": signed}),
            "explained_value": value,
            "baseline_value": base_value,
            "relevance_sum": (value - base_value - gaps),
            "completeness_gap": gaps,
            "n_steps": used,
            "prepended_sink": [p.prepended for p in paths],
            "input_value": real.value.detach().cpu(),
            "panels": panels,
            "step_batch": batches,
        },
    )


def shared_steps(batch: Batch, n_steps: int | str, baseline: str | Tensor) -> list[Tensor] | None:
    """The sequences of a generation step batch (:func:`lens_attrib.forward.step_groups`) whose
    steps can share one path: ``n_steps`` fixed (the adaptive nodes are per step) and the
    baseline the same for every row of a sequence (a named one, or a tensor equal on those rows);
    else ``None``."""
    if not isinstance(n_steps, int):
        return None
    groups = step_groups(batch)
    if groups is None or isinstance(baseline, str):
        return groups
    full = baseline.expand(batch.size, batch.length, baseline.shape[-1])
    for rows in groups:
        picked = full[rows.to(full.device)]
        if not bool((picked == picked[:1]).all()):
            return None
    return groups


def shared_integrated_gradients(
    model: Any,
    batch: Batch,
    real: Any,
    groups: Sequence[Tensor],
    names: Sequence[str],
    head: Any,
    baseline: str | Tensor,
    keep_sink: str | bool,
    n_steps: int,
    rule: str,
    step_batch: int | None,
    pooling: str = "sum",
) -> MethodOutput:
    """:func:`integrated_gradients` with ``n_steps`` nodes for a generation step batch, every
    sequence's steps on one path (:func:`group_path`, :func:`group_path_integral`); same
    scores and meta as explaining each step row alone."""
    dtype, device = real.value.dtype, batch.tokens.device
    scores = torch.zeros(batch.size, batch.length, dtype=dtype, device=device)
    signed = torch.zeros_like(scores)
    gaps = torch.zeros(batch.size, dtype=dtype)
    value = torch.zeros(batch.size, dtype=dtype)
    base_value = torch.zeros(batch.size, dtype=dtype)
    prepended, batches = [False] * batch.size, [0] * batch.size
    alphas, weights = quadrature(n_steps, rule)
    bar = progress_bar(desc="integrated_gradients", total=len(groups) * n_steps, unit="point")
    for g, rows in enumerate(groups):
        bar.set_postfix_str(f"sequence {g + 1}/{len(groups)}", refresh=False)
        path = group_path(model, batch, rows, real.resolved, names, baseline, keep_sink, head)
        per_forward = rows_per_forward(batch.arch, path.batch.length, n_steps, step_batch, device)
        bounds = chunk_bounds(model, batch.arch, path.resolved.positions.tolist())
        if bounds is not None:
            total = chunked_path_integral(
                model, path, names, head, alphas, weights, per_forward, bounds
            )
        else:
            total = group_path_integral(model, path, names, head, alphas, weights, per_forward)
        step_scores = grad_x_input_scores(path.deltas, total)
        idx = rows.cpu()
        value[idx] = path.value.detach().cpu().to(dtype)
        base_value[idx] = path.base_value.detach().cpu().to(dtype)
        gaps[idx] = (path.value - path.base_value - step_scores.sum(-1)).detach().cpu().to(dtype)
        cols = path.columns.to(device)
        signed[rows.to(device)[:, None], cols[None]] = step_scores[:, int(path.prepended) :].to(
            signed
        )
        if pooling != "sum":
            step_scores = grad_x_input_scores(path.deltas, total, pooling)
        scores[rows.to(device)[:, None], cols[None]] = step_scores[:, int(path.prepended) :].to(
            scores
        )
        for r in idx.tolist():
            prepended[r], batches[r] = path.prepended, per_forward
    bar.close()
    return MethodOutput(
        scores,
        real.resolved,
        options={"baseline": baseline if isinstance(baseline, str) else "tensor"},
        meta={
            **({} if pooling == "sum" else {"signed_scores": signed}),
            "explained_value": value,
            "baseline_value": base_value,
            "relevance_sum": (value - base_value - gaps),
            "completeness_gap": gaps,
            "n_steps": [n_steps] * batch.size,
            "prepended_sink": prepended,
            "input_value": real.value.detach().cpu(),
            "panels": [1] * batch.size,
            "step_batch": batches,
        },
    )


def warn_unconverged(gaps: Tensor, deltas: Tensor, tolerance: float, max_steps: int) -> None:
    """Warn about items whose gap stayed above ``tolerance · |f(x) − f(b)|``."""
    bad = [i for i in range(len(gaps)) if abs(float(gaps[i])) > tolerance * abs(float(deltas[i]))]
    if bad:
        listed = ", ".join(
            f"item {i}: gap {float(gaps[i]):.3g} of f(x) − f(b) = {float(deltas[i]):.3g}"
            for i in bad[:10]
        )
        warnings.warn(
            f"integrated_gradients: {len(bad)} item(s) did not converge to |gap| ≤ "
            f"{tolerance:.1%} of |f(x) − f(b)| at max_steps={max_steps} ({listed}). Raise "
            "max_steps, or use a baseline closer to the input.",
            stacklevel=2,
        )
