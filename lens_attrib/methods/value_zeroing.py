"""Value zeroing (Mohebbi et al., EACL 2023): per-layer context mixing, rolled out to the input.

For every layer ``l``, with the *clean* input ``x^l`` of that layer (the output of the clean
layer ``l − 1``; the embeddings for ``l = 0``), the value vector of token ``j`` (``attn.hook_v``
of layer ``l`` only, value bias included, every key/value head) is set to 0 and layer ``l`` alone
is run again. The context-mixing score is the cosine distance between token ``i``'s layer output
with and without the zeroing::

    C̃^l[i, j] = clip(1 − cos(y^l_i, y^l_i^{¬j}), 0, 2),     C^l[i, j] = C̃^l[i, j] / Σ_j' C̃^l[i, j']

(``clip`` as scikit-learn's ``cosine_distances``, which the authors call; the row sum runs over
the item's real tokens). ``layer_scores[b, l]`` is the target position's row ``C^l[t, :]``.
``scores`` aggregates the layers as ``aggregation`` says:

- ``"rollout"`` (default, the authors' ``compute_joint_attention(C, res=False)``): ``J^0 = C^0``,
  ``J^l = C^l J^{l−1}``; ``scores[b] = J^{L−1}[t, :]`` (a distribution over the input tokens).
- ``"mean"``: the mean of the rows ``C^l[t, :]`` over layers — Inseq's default aggregation of its
  per-layer value-zeroing scores, which the π-Soft paper (Huang & Chan 2026) ran through Inseq.

Consequence in causal models, which is the authors' definition and not a departure: position
0 sees only itself, so row 0 of every ``C^l`` is ``e_0`` and the product ``C^{L−1} ⋯ C^0``
drains every row onto the start token as layers accumulate (the authors worked with encoders).
Measured on SmolLM2-135M (30 layers), 10 template SVA items with contrastive targets: the
rolled-out row puts ≥ 0.999999 on the start token in every item, leaving the real tokens'
order to the remainder (pointing game 0 / 10, start token excluded), while the last layer's
row gives the start token a median 0.30 and the layer mean (``"mean"``) scores 3 / 10. Decoder
experiments that reproduce the π-Soft paper's value-zeroing baseline (Inseq) should pass
``aggregation="mean"``; ``layer_scores`` keeps the per-layer rows either way.

The layer output is what the block returns (the next block's input; for post-LN encoders after
the second LayerNorm, as in the authors' BERT code). In causal models ``C^l[i, j] = 0`` for
``j > i`` exactly (those zeroings are not run) and positions after the target cannot matter.

Batching: per layer, the zeroings of all tokens of several items (plus one clean copy per item)
go through that one block in forwards of ``batch_size`` rows, from the cached clean layer input:
``Σ_items (T_b + 1)`` block rows per layer instead of ``L · T`` full forwards.

Target rows only (``aggregation="mean"``, :func:`target_row_mixing`): the layer mean reads only
the target's row ``C^l[t, :]``, and token ``t``'s block output depends on the zeroing of ``v_j``
only through its own head outputs: with the clean pattern ``α`` (which the values do not
change) and values ``v``, ``z^h_t(¬j) = Σ_k α^h_tk v_k − α^h_tj v_j``. Everything after
``hook_z`` (``W_O``, the residual, the norms, the MLP) acts on each position alone, so one
block row of length 1 per zeroing (input ``x^l_t``, head outputs set at ``hook_z``) gives
``y^l_t(¬j)`` exactly (to float rounding): ``Σ_items (T_b + 1)`` one-token rows per layer (forwarded
as many tokens at a time as ``batch_size`` full rows hold) instead of that many rows of ``T``
tokens. Measured on SmolLM2 (float32, one thread), a 199-token SQuAD
prompt: 132.5 → 2.9 CPU-s; against the same prompt in float64 its rows were within 2.4e-3 (the
full rows 2.7e-3) while ``1 − cos`` of nearly equal float32 vectors was taken in float32 (it is
now taken in float64, :func:`cosine_distance`); float64, tiny models
of every architecture: within 1e-12 of the full rows (``tests/test_value_zeroing.py``). Used
when no hook is on the layer's block (a hook there may read positions, or edit tensors the
shortcut does not recompute); otherwise, and for the rollout, the full rows above.

Departures, stated: the method ignores the target token and foil (it measures context mixing
at the target position; ``target_free``). Inseq differs from the authors' code in three
details that are *not* copied for ``aggregation="mean"``: it compares the last layer after the
final norm, zeroes distances below 1e-5 and sets an all-zero row's sum to 1 (here an all-zero
row stays 0). An earlier version of this library zeroed token ``j``'s values at every layer at
once and read the cosine distance of the final residual at the target; that is not the authors'
method and is no longer offered.
"""

from __future__ import annotations

from typing import Any

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lens_attrib.backend import (
    Arch,
    block_forward,
    embedded_input_hooks,
    has_hooks,
    hook_name,
    resid_hook_names,
)
from lens_attrib.forward import run
from lens_attrib.hooks.masking import value_zeroing_hooks
from lens_attrib.inputs import Batch
from lens_attrib.methods.registry import MethodOutput, Option, positive_int, register
from lens_attrib.precision import widened
from lens_attrib.progress import progress_bar
from lens_attrib.target import Target

AGGREGATIONS = ("rollout", "mean")


def cosine_distance(
    x: Float[Tensor, "*rows d"], y: Float[Tensor, "*rows d"]
) -> Float[Tensor, "*rows"]:
    """``1 − cos(x, y)`` clipped to ``[0, 2]`` (scikit-learn's ``cosine_distances``), taken in
    float64 and returned in ``x``'s dtype and device: in float32, ``1 − cos`` of nearly equal
    vectors cancels (:mod:`lens_attrib.precision`)."""
    distance = (1.0 - F.cosine_similarity(widened(x), widened(y), dim=-1)).clamp(0.0, 2.0)
    return distance.to(x.device, x.dtype)


def zeroings(batch: Batch, positions: Int[Tensor, "batch"]) -> list[tuple[int, int]]:
    """The block rows of one layer: ``(item, j)`` for every real token ``j`` to zero (causal
    models: ``j`` up to the target only) and ``(item, −1)``, the clean copy, per item."""
    rows: list[tuple[int, int]] = []
    for b in range(batch.size):
        last = int(positions[b]) if batch.arch.causal else batch.length - 1
        rows.append((b, -1))
        rows += [(b, j) for j in range(last + 1) if bool(batch.mask[b, j])]
    return rows


def layer_mixing(
    model: Any,
    arch: Arch,
    layer: int,
    layer_input: Float[Tensor, "batch pos d_model"],
    mask: Bool[Tensor, "batch pos"],
    rows: list[tuple[int, int]],
    batch_size: int,
) -> Float[Tensor, "batch pos pos"]:
    """Unnormalised ``C̃^layer[b, i, j]`` (0 where ``j`` was not zeroed), ``batch_size`` block
    rows per forward; each chunk holds its items' clean copies next to their zeroings."""
    size, length = mask.shape
    mixing = torch.zeros(size, length, length, dtype=arch.work_dtype, device=layer_input.device)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        items = sorted({b for b, _ in chunk})
        cleans = [(b, -1) for b in items if (b, -1) not in chunk]  # a clean copy in every chunk
        chunk_rows = cleans + chunk
        item = torch.tensor([b for b, _ in chunk_rows], device=layer_input.device)
        zero = torch.zeros(len(chunk_rows), length, dtype=torch.bool, device=mask.device)
        for r, (_, j) in enumerate(chunk_rows):
            if j >= 0:
                zero[r, j] = True
        sub_mask = mask[item.to(mask.device)]
        hooks = value_zeroing_hooks(arch.n_layers, zero, layers=[layer])
        with model.hooks(fwd_hooks=hooks):
            out = block_forward(
                model, arch, layer, layer_input[item], sub_mask, not bool(sub_mask.all())
            )
        out = out.to(arch.work_dtype)
        clean_row = {b: r for r, (b, j) in enumerate(chunk_rows) if j < 0}
        for r, (b, j) in enumerate(chunk_rows):
            if j >= 0:
                mixing[b, :, j] = cosine_distance(out[r], out[clean_row[b]])
    return mixing


def block_is_hooked(model: Any, layer: int) -> bool:
    """Whether any hook point of block ``layer`` has a hook (or any global module hook is set):
    then :func:`target_row_mixing` cannot stand in for the block's full rows."""
    prefix = f"blocks.{layer}."
    return any(has_hooks(p) for name, p in model.hook_dict.items() if name.startswith(prefix))


def target_row_mixing(
    model: Any,
    batch: Batch,
    layer: int,
    layer_input: Float[Tensor, "batch pos d_model"],
    positions: Int[Tensor, "batch"],
    rows: list[tuple[int, int]],
    chunk: int,
) -> Float[Tensor, "batch pos"]:
    """Unnormalised target rows ``C̃^layer[b, t_b, j]`` (0 where ``j`` is not zeroed) from one
    clean block forward (its pattern and values) and block forwards of ``chunk`` one-token rows
    whose head outputs are ``z^h_t(¬j) = Σ_k α^h_tk v_k − α^h_tj v_j`` (module docstring).
    The clean block forward re-reads this layer's pattern and values rather than keeping every
    layer's ``[batch, head, pos, pos]`` pattern from the clean run (≈ 700 MB for 10 SmolLM2
    prompts of 256 tokens): one extra full forward in all."""
    arch, mask = batch.arch, batch.mask.to(layer_input.device)
    kept: dict[str, Tensor] = {}

    def keep(what: str) -> Any:
        def hook(x: Tensor, hook: Any) -> None:
            kept[what] = x.detach()

        return hook

    padded = not bool(mask.all())
    names = [(hook_name("v", layer), keep("v")), (hook_name("pattern", layer), keep("pattern"))]
    with model.hooks(fwd_hooks=names):
        block_forward(model, arch, layer, layer_input, mask, padded)
    idx = torch.arange(mask.shape[0], device=layer_input.device)
    t = positions.to(layer_input.device)
    alpha = kept["pattern"][idx, :, t]  # [batch, head, key]
    v = kept["v"]
    v = torch.repeat_interleave(v, alpha.shape[1] // v.shape[-2], dim=-2)  # GQA: kv → heads
    z_t = einops.einsum(alpha, v, "b h k, b k h d -> b h d")
    item = torch.tensor([b for b, _ in rows], device=layer_input.device)
    source = torch.tensor([max(j, 0) for _, j in rows], device=layer_input.device)
    zeroed = torch.tensor([j >= 0 for _, j in rows], device=layer_input.device)
    removed = alpha[item, :, source, None] * v[item, source]  # α^h_tj v^h_j, [row, head, d]
    z_rows = z_t[item] - removed * zeroed[:, None, None].to(removed.dtype)
    x_rows = layer_input[item, t[item]][:, None]
    outs = []
    for start in range(0, len(rows), chunk):  # as many tokens per forward as the full rows'
        part = slice(start, start + chunk)

        def set_z(z: Tensor, hook: Any, part: slice = part) -> Tensor:
            return z_rows[part].to(z.dtype).reshape(z.shape)

        one = torch.ones(len(x_rows[part]), 1, dtype=torch.bool, device=mask.device)
        with model.hooks(fwd_hooks=[(hook_name("z", layer), set_z)]):
            outs.append(block_forward(model, arch, layer, x_rows[part], one, False)[:, 0])
    out = torch.cat(outs).to(arch.work_dtype)
    clean = {b: r for r, (b, j) in enumerate(rows) if j < 0}
    row_of = torch.tensor([clean[b] for b, _ in rows], device=out.device)
    distance = cosine_distance(out, out[row_of])
    mixing = torch.zeros(mask.shape, dtype=arch.work_dtype, device=out.device)
    z_item, z_source = item[zeroed], source[zeroed]
    mixing[z_item.to(out.device), z_source.to(out.device)] = distance[zeroed.to(out.device)]
    return mixing


def mixing_matrices(
    model: Any,
    batch: Batch,
    layer_inputs: list[Float[Tensor, "batch pos d_model"]],
    positions: Int[Tensor, "batch"],
    batch_size: int,
) -> Float[Tensor, "batch layer pos pos"]:
    """Row-normalised context-mixing matrices ``C^l`` of every layer (0 at padding and, in
    causal models, above the diagonal)."""
    arch = batch.arch
    rows = zeroings(batch, positions)
    mask = batch.mask.to(layer_inputs[0].device)
    layers = []
    for layer in progress_bar(range(arch.n_layers), desc="value_zeroing", unit="layer"):
        layers.append(layer_mixing(model, arch, layer, layer_inputs[layer], mask, rows, batch_size))
    mixing = torch.stack(layers, dim=1)
    real = mask[:, :, None] & mask[:, None, :]
    if arch.causal:
        real = real & torch.ones_like(real[0]).tril()
    return row_normalised(mixing * real[:, None].to(mixing.dtype))


def row_normalised(mixing: Float[Tensor, "*rows pos"]) -> Float[Tensor, "*rows pos"]:
    """``C = C̃ / Σ_j C̃[·, j]`` per row (an all-zero row stays 0)."""
    total = mixing.sum(-1, keepdim=True)
    return torch.where(total > 0, mixing / torch.where(total > 0, total, 1.0), 0.0)


def target_rows(
    model: Any,
    batch: Batch,
    layer_inputs: list[Float[Tensor, "batch pos d_model"]],
    positions: Int[Tensor, "batch"],
    batch_size: int,
) -> Float[Tensor, "batch layer pos"]:
    """Row-normalised target rows ``C^l[t, :]`` of every layer: by :func:`target_row_mixing`
    where the block has no hook, else from the block's full rows (:func:`layer_mixing`)."""
    rows = zeroings(batch, positions)
    mask = batch.mask.to(layer_inputs[0].device)
    idx = torch.arange(batch.size, device=mask.device)
    layers = []
    for layer in progress_bar(range(batch.arch.n_layers), desc="value_zeroing", unit="layer"):
        x = layer_inputs[layer]
        if block_is_hooked(model, layer):
            full = layer_mixing(model, batch.arch, layer, x, mask, rows, batch_size)
            layers.append(full[idx, positions.to(mask.device)])
        else:
            chunk = batch_size * batch.length  # the tokens of batch_size full rows
            layers.append(target_row_mixing(model, batch, layer, x, positions, rows, chunk))
    return row_normalised(torch.stack(layers, dim=1) * mask[:, None].to(layers[0].dtype))


def rollout_row(
    mixing: Float[Tensor, "batch layer pos pos"], positions: Int[Tensor, "batch"]
) -> Float[Tensor, "batch pos"]:
    """Row ``t`` of ``C^{L−1} ⋯ C^0`` (the authors' rollout without residual), per item."""
    idx = torch.arange(mixing.shape[0], device=mixing.device)
    row = mixing[idx, -1, positions.to(mixing.device)]
    for layer in range(mixing.shape[1] - 2, -1, -1):
        row = einops.einsum(row, mixing[:, layer], "b i, b i j -> b j")
    return row


@register(
    "value_zeroing",
    parametrization=True,
    label="Value Zeroing",
    target_free=True,
    needs_head=False,
    per_layer=True,
    options={
        "batch_size": Option(64, check=positive_int, help="block rows per forward"),
        "aggregation": Option(
            "rollout", choices=AGGREGATIONS, help="'rollout' (authors) or 'mean' (Inseq)"
        ),
    },
)
def value_zeroing(
    model: Any, batch: Batch, target: Target, *, batch_size: int, aggregation: str
) -> MethodOutput:
    """Value zeroing: per-layer context mixing by zeroing one value vector, rolled out."""
    arch = batch.arch
    first = embedded_input_hooks(arch)
    outputs = resid_hook_names(arch)[:-1]
    clean = run(model, batch, target, capture=[*first, *outputs], position_only_ok=True)
    x0 = clean.captured[first[0]]
    for name in first[1:]:
        x0 = x0 + clean.captured[name]
    layer_inputs = [x0] + [clean.captured[name] for name in outputs]
    positions = clean.resolved.positions
    if aggregation == "rollout":
        mixing = mixing_matrices(model, batch, layer_inputs, positions, batch_size)
        idx = torch.arange(batch.size, device=mixing.device)
        layer_scores = mixing[idx, :, positions.to(mixing.device)]  # rows C^l[t, :]
        scores = rollout_row(mixing, positions)
    else:
        layer_scores = target_rows(model, batch, layer_inputs, positions, batch_size)
        scores = layer_scores.mean(dim=1)
    meta = {"target_position_only": clean.position_only}
    return MethodOutput(scores, clean.resolved, layer_scores=layer_scores, meta=meta)
