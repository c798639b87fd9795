"""Grad-ELLM: gradient-weighted, similarity-weighted values of the attention (Huang & Chan).

For layer ``k``, the explained scalar ``l`` (a step's target logit) at query position ``p`` and
every head ``h`` (GQA: ``g(h)`` is the key/value head that query head reads):

- channel weights  ``w_{h,c} = ∂l / ∂z_{p,h,c}``, the gradient at the attention output of the
  query position (``hook_z``, before ``W_O``);
- token weights    ``λ_{h,i} = Φ(q_{p,h} · k_{i,g(h)})`` over the key positions ``i`` the query
  sees (real tokens, ``i ≤ p`` for causal models), with ``Φ`` the min–max normalization
  (``similarity="minmax"``, the paper's loosened attention), the plain attention pattern
  (``"softmax"``: the model's ``hook_pattern`` row), or one min–max similarity of the concatenated
  heads, ``Φ(Σ_h q_{p,h} · k_{i,g(h)})`` shared by all heads (``"concat"``, as in Grad-ECLIP). A
  constant similarity row gives ``λ = 0`` (never NaN). Rotary models use the rotated q and k;
- map              ``H^(k)_i = ReLU(Σ_h Σ_c w_{h,c} λ_{h,i} v_{i,g(h),c})``.

The maps of the selected layers (the last ``n_layers``, or ``layers=[...]``) are summed and
normalized to sum 1 over the real tokens (all zero when the sum is zero). ``layer_scores`` holds
the raw per-layer maps ``[batch, n_selected, pos]`` (layer indices in ``meta["layers"]``).
Against the paper (π-Soft / Grad-ELLM, Sec. 3.3 and Appendix B): the map is Eq. (11),
``H_i^(k) = ReLU(Σ_c w_c^(k) λ_i^(k) v_ic^(k))`` with ``w_c^(k) = ∂l_t/∂o_t^(k)[c]`` (Eq. 10),
``o_t^(k)`` the attention output before the output projection, whose channels ``c`` run over
all heads — so the ReLU sits *per layer*, on the sum over every head's channels, before the
layers are aggregated ("We aggregate H_i^(k) over the selected decoder layers and normalize the
resulting token scores"). The selected layers are the last ones: the derivation starts from the
last layer ("using the last layer value v as the feature map", as Grad-ECLIP does).

Depth. The paper picks the number of aggregated layers per dataset and model from
{1, 4, 8, 16, 32} by the π-Soft-NC/NS AUCs (Appendix I, layer aggregation analysis); do the same
with :func:`lens_attrib.evaluation.depth_selection.select_grad_ellm_depth` on a tuning split
disjoint from the reported items. Without a tuning split, the default ``n_layers=None`` takes the
**last quarter of the layers**, ``ceil(L / 4)``: 8 on the paper's 32-layer models (the middle of
its grid) and on SmolLM2-135M (30 layers). Reason: with one layer, when every real token's
contribution at that layer is negative (all the positive part sits on the start token, the
attention sink), the ReLU zeroes them all and the normalized map is constant (all zero) on the
real tokens — measured on SmolLM2 with contrastive targets (start token excluded) on 6–32 of 60
held-out agreement items per set, none with ``n_layers=8``, whose pointing game is higher on
four of five sets (e.g. 19 → 53 % and 12 → 37 %). A quarter (not a fixed 8) keeps the default
valid and comparable on shallow models (GPT-2 small: 3 of 12; a 4-layer model: 1). The
resolved value is in ``meta["options"]["n_layers"]``. Rank metrics with ``ties="expected"`` score
constant maps as random (:mod:`lens_attrib.evaluation.plausibility`).

q, k, v come from one forward (hooks), the gradient from one backward pass to the earliest
selected ``hook_z`` (``torch.autograd.grad``); no second forward. With ``Target(generate=N)`` or
``Target(continuation=...)`` the steps of one sequence share that forward: q, k, v are recorded
once per sequence and the ``S`` step gradients at ``hook_z`` are batched vector–Jacobian products
on its graph (:func:`lens_attrib.methods.backprop.step_gradients_at`); every step equals its
prefix explained alone (causal attention). Every generated step is a row of the batch
(``scores`` ``[steps, pos]``) and ``meta["step_aggregate"]`` is the mean of the step maps
``[pos]`` (prompt tokens: ``[:meta["prompt_length"]]``); for a batch of prompts, whose rows
differ in length, it is left out (take the mean of ``attr.prompt_steps(b).scores`` per prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lens_attrib.backend import attn_hook, query_key_hooks
from lens_attrib.forward import group_rows, run, step_groups
from lens_attrib.inputs import Batch
from lens_attrib.methods.backprop import step_gradients_at
from lens_attrib.methods.registry import MethodOutput, Option, positive_int_or_none, register
from lens_attrib.target import Target

SIMILARITIES = ("minmax", "softmax", "concat")


def default_depth(total: int) -> int:
    """The default number of aggregated layers: the last quarter, ``ceil(total / 4)``."""
    return -(-total // 4)


def select_layers(
    model: Any, n_layers: int | None = None, layers: Sequence[int] | None = None
) -> list[int]:
    """Explicit ``layers`` (negative counts from the end) or the last ``n_layers`` (``None``:
    :func:`default_depth`)."""
    total = int(model.cfg.n_layers)
    if n_layers is None:
        n_layers = default_depth(total)
    if layers is not None:
        raw = [int(layer) for layer in layers]
        chosen = sorted({layer % total for layer in raw})
        if not raw or len(chosen) != len(raw) or not all(-total <= x < total for x in raw):
            raise ValueError(
                f"layers must be one or more distinct indices in [-{total}, {total}), got {raw}."
            )
        return chosen
    if not 1 <= n_layers <= total:
        raise ValueError(f"n_layers must be in 1..{total}, got {n_layers}.")
    return list(range(total - n_layers, total))


def key_mask(batch: Batch, positions: Tensor, causal: bool) -> Bool[Tensor, "batch pos"]:
    """Key positions each query sees: real tokens, and ``i ≤ p`` for causal attention."""
    mask = batch.mask.clone()
    if causal:
        idx = torch.arange(batch.length, device=mask.device)
        mask &= idx[None, :] <= positions[:, None]
    return mask


def minmax(
    s: Float[Tensor, "batch head pos"], allowed: Bool[Tensor, "batch pos"]
) -> Float[Tensor, "batch head pos"]:
    """``(s − min) / (max − min)`` over the allowed positions; 0 elsewhere and for constant rows."""
    allow = allowed[:, None, :]
    hi = s.masked_fill(~allow, float("-inf")).amax(-1, keepdim=True)
    lo = s.masked_fill(~allow, float("inf")).amin(-1, keepdim=True)
    span = hi - lo
    ok = span > 0
    out = (s - lo) / torch.where(ok, span, torch.ones_like(span))
    return out.masked_fill(~(allow & ok), 0.0)


def layer_map(
    q: Float[Tensor, "batch head d_head"],
    k: Float[Tensor, "batch pos kv_head d_head"],
    v: Float[Tensor, "batch pos kv_head d_head"],
    w: Float[Tensor, "batch head d_head"],
    allowed: Bool[Tensor, "batch pos"],
    similarity: str,
    pattern: Float[Tensor, "batch head pos"] | None = None,
) -> Float[Tensor, "batch pos"]:
    """``H_i = ReLU(Σ_h Σ_c w_{h,c} λ_{h,i} v_{i,g(h),c})`` for one layer (module docstring)."""
    n_heads, n_kv = q.shape[1], k.shape[2]
    group = n_heads // n_kv
    k_h = k.repeat_interleave(group, dim=2) if group > 1 else k  # [batch, pos, head, d_head]
    v_h = v.repeat_interleave(group, dim=2) if group > 1 else v
    if similarity == "softmax":
        if pattern is None:
            raise ValueError("similarity='softmax' needs the attention pattern row.")
        lam = pattern.masked_fill(~allowed[:, None, :], 0.0)
    else:
        s = torch.einsum("bhc,bihc->bhi", q, k_h)
        if similarity == "concat":
            lam = minmax(s.sum(1, keepdim=True), allowed).expand_as(s)
        else:
            lam = minmax(s, allowed)
    wv = torch.einsum("bhc,bihc->bhi", w, v_h)
    return torch.relu((lam * wv).sum(1))


def _row_hook(store: dict[str, Tensor], name: str, rows: Tensor, dim: int) -> Any:
    """Keep only each item's query row of an activation (``dim``: the query-position axis)."""

    def hook(x: Tensor, hook: Any) -> None:
        x = x.detach()
        items = torch.arange(x.shape[0], device=x.device)
        store[name] = x[items, rows] if dim == 1 else x[items, :, rows]

    return hook


def _keep_hook(store: dict[str, Tensor], name: str) -> Any:
    def hook(x: Tensor, hook: Any) -> None:
        store[name] = x.detach()

    return hook


Activations = dict[int, tuple[Tensor, Tensor, Tensor, Tensor | None]]
"""Per layer: ``q`` at each row's query position ``[batch, head, d_head]``, ``k`` and ``v``
``[batch, pos, kv_head, d_head]``, and the pattern row ``[batch, head, pos]`` (softmax only)."""


def _activation_hooks(
    store: dict[str, Tensor], chosen: Sequence[int], arch: Any, similarity: str, rows: Tensor
) -> list[tuple[str, Any]]:
    """Hooks recording q (at each row's query position ``rows``), k, v (and the pattern row) of
    the chosen layers."""
    hooks: list[tuple[str, Any]] = []
    for layer in chosen:
        qn, kn = query_key_hooks(arch, layer)
        hooks += [
            (qn, _row_hook(store, f"{layer}.q", rows, 1)),
            (kn, _keep_hook(store, f"{layer}.k")),
            (attn_hook("v", layer), _keep_hook(store, f"{layer}.v")),
        ]
        if similarity == "softmax":
            name = f"{layer}.pattern"
            hooks.append((attn_hook("pattern", layer), _row_hook(store, name, rows, 2)))
    return hooks


def _one_forward(
    model: Any, batch: Batch, target: Target, chosen: Sequence[int], similarity: str
) -> tuple[Tensor, Any, Activations, dict[int, Tensor]]:
    """q, k, v from one forward of ``batch`` and ``w = ∂l/∂z`` at every row's query position
    from one backward pass (``torch.autograd.grad``)."""
    positions = target.positions(batch)
    store: dict[str, Tensor] = {}
    hooks = _activation_hooks(store, chosen, batch.arch, similarity, positions)
    z_names = [attn_hook("z", layer) for layer in chosen]
    result = run(model, batch, target, capture=z_names, fwd_hooks=hooks)
    assert result.value is not None
    zs = [result.captured[n] for n in z_names]
    grads = torch.autograd.grad(result.value.sum(), zs, allow_unused=True)
    items = torch.arange(batch.size, device=positions.device)
    acts: Activations = {}
    weights: dict[int, Tensor] = {}
    for layer, z, g in zip(chosen, zs, grads, strict=True):
        g = torch.zeros_like(z) if g is None else g
        weights[layer] = g[items, positions].detach()  # [batch, head, d_head]
        acts[layer] = (
            store[f"{layer}.q"],
            store[f"{layer}.k"],
            store[f"{layer}.v"],
            store.get(f"{layer}.pattern"),
        )
    return result.value, result.resolved, acts, weights


def _shared_steps(
    model: Any,
    batch: Batch,
    target: Target,
    chosen: Sequence[int],
    similarity: str,
    groups: Sequence[Tensor],
) -> tuple[Tensor, Any, Activations, dict[int, Tensor]]:
    """:func:`_one_forward` for a generation step batch: one forward per sequence (q, k, v and
    the pattern recorded at every position, once per sequence) and every step's ``∂l_s/∂z`` as
    batched vector–Jacobian products on that one graph
    (:func:`lens_attrib.methods.backprop.step_gradients_at`); each row then reads its own step's
    query position. By causality this equals each step's prefix explained alone."""
    positions = target.positions(batch)
    per_group: dict[str, list[Tensor]] = {}

    def collect(name: str) -> Any:
        def hook(x: Tensor, hook: Any) -> None:
            per_group.setdefault(name, []).append(x.detach())

        return hook

    hooks: list[tuple[str, Any]] = []
    for layer in chosen:
        qn, kn = query_key_hooks(batch.arch, layer)
        names = [(qn, "q"), (kn, "k"), (attn_hook("v", layer), "v")]
        if similarity == "softmax":
            names.append((attn_hook("pattern", layer), "pattern"))
        hooks += [(point, collect(f"{layer}.{what}")) for point, what in names]
    z_names = [attn_hook("z", layer) for layer in chosen]
    _, grads, forward = step_gradients_at(model, batch, target, z_names, groups, hooks)
    seq = group_rows(groups, batch.size, batch.tokens.device)
    items = torch.arange(batch.size, device=positions.device)
    acts: Activations = {}
    weights: dict[int, Tensor] = {}
    for layer, g in zip(chosen, grads, strict=True):
        weights[layer] = g[items, positions].detach()
        q, k, v = (torch.cat(per_group[f"{layer}.{w}"])[seq] for w in ("q", "k", "v"))
        pattern = None
        if similarity == "softmax":
            pattern = torch.cat(per_group[f"{layer}.pattern"])[seq][items, :, positions]
        acts[layer] = (q[items, positions], k, v, pattern)
    assert forward.value is not None
    return forward.value, forward.resolved, acts, weights


def _layers_check(value: Any) -> str | None:
    ok = value is None or (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )
    return None if ok else "None or a list of layer indices"


@register(
    "grad_ellm",
    label="Grad-ELLM",
    per_layer=True,
    uses_gradient=True,
    options={
        "n_layers": Option(
            None,
            check=positive_int_or_none,
            help="the last n layers (when layers is None); None: the last quarter, ceil(L/4)",
        ),
        "layers": Option(None, check=_layers_check, help="explicit layer indices"),
        "similarity": Option("minmax", choices=SIMILARITIES),
    },
)
def grad_ellm(
    model: Any,
    batch: Batch,
    target: Target,
    *,
    n_layers: int | None,
    layers: Sequence[int] | None,
    similarity: str,
) -> MethodOutput:
    """Grad-ELLM over the last ``n_layers`` (or ``layers``); see the module docstring."""
    chosen = select_layers(model, n_layers, layers)
    positions = target.positions(batch)
    groups = step_groups(batch)
    if groups is None:
        value, explained, acts, weights = _one_forward(model, batch, target, chosen, similarity)
    else:
        value, explained, acts, weights = _shared_steps(
            model, batch, target, chosen, similarity, groups
        )
    allowed = key_mask(batch, positions, causal=batch.arch.causal)
    maps = [
        layer_map(*acts[layer][:3], weights[layer], allowed, similarity, acts[layer][3])
        for layer in chosen
    ]
    per_layer = torch.stack(maps, dim=1).masked_fill(~batch.mask[:, None, :], 0.0)
    total = per_layer.sum(1)
    norm = total.sum(-1, keepdim=True)
    scores = torch.where(norm > 0, total / torch.where(norm > 0, norm, 1.0), 0.0)
    meta: dict[str, Any] = {"explained_value": value.detach().cpu()}
    generation = batch.extra.get("generation")
    if generation and len(set(generation.get("step_prompt", [0]))) == 1:  # one prompt's steps
        meta["step_aggregate"] = scores.detach().mean(0).cpu()
    resolved = {"n_layers": len(chosen)} if n_layers is None and layers is None else {}
    return MethodOutput(
        scores,
        explained,
        layer_scores=per_layer,
        meta=meta,
        layers=chosen,
        options=resolved,
    )


__all__ = ["default_depth", "grad_ellm", "layer_map", "minmax", "select_layers"]
