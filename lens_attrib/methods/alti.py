"""ALTI (Ferrando et al. 2022) and ALTI-Logit (Ferrando et al. 2023), read from one hooked forward.

Both follow the official code (github.com/mt-upc/logit-explanations, ``src/contributions.py``,
``compute_alti`` in ``src/utils_contributions.py``, ``track2input_tokens`` in
``extract_explanations.py``), which the tests compare against on committed fixtures.

**ALTI-Logit** (decoders). The final residual at the target position ``t`` is the sum of the
embedding ``x⁰_t``, every attention block's output and every MLP block's output. The final norm is
linearized with its actual scale ``σ_t`` and folded with the head direction into one vector

    u = c(γ_f ⊙ (W_U[:, y] − W_U[:, y'])) / σ_t        (``c`` centres for LayerNorm only),

so that a block output ``o`` contributes ``o · u`` to the explained logit (difference). Attention
outputs are decomposed onto source tokens through the cached pattern and full value vectors:

    Δ^l_h(j) = α^{l,h}_tj · v^{l,h}_j W_O^{l,h} · u,   v_j = ṽ_j + θ_V   (θ_V = β₁W_V + b_V),

i.e. the affine term ``α_tj θ_V W_O`` belongs to source j (the official "aff_x_j"), leaving
``b_O·u`` (attention bias), ``mlp_l[t]·u`` (MLP), ``x⁰_t·u`` (embedding) and
``β_f·d + b_U[y] − b_U[y']`` (bias). Then

    logit = Σ_l Σ_{h,j} Δ^l_h(j) + Σ_l mlp_l + Σ_l attn_bias_l + embedding + bias     (exactly).

Layer l's token contributions live on the positions of its input residual; they are traced to the
input tokens through the ALTI mixing matrices of the layers below (see ``alti_mixing``):
``layer_scores[l] = Δ^l · A_{l−1} ⋯ A_0``, ``scores = Σ_l layer_scores[l]`` (the official
"logit_aff_x_j_alti" summed over layers; like the official evaluation, the embedding of the
target position stays in ``parts["embedding"]`` and is not added to ``scores``).

**ALTI** (encoders and decoders): ``scores = e_t A_{L−1} ⋯ A_0`` (rollout of the mixing matrices),
``layer_scores[l] = e_t A_l ⋯ A_0``.

Departures from the official code: ``l1_eps`` defaults to 0 where the official L1 distance adds
1e-6 to every coordinate (``l1_eps=1e-6`` reproduces it, future-token artifact included, to
~1e-13; the default moves each contribution ``c_ij`` by up to ``d_model·1e-6``, up to 2e-5 of the
largest value on small random GPT-2s); ``y_i`` is the forward's own attention-block output
rather than its reconstruction (equal up to rounding). The encoder path follows the same
convention as the official BERT code (mt-upc/transformer-contributions: value vectors with
``b_V`` go to their source token). ``affine="separate"`` is a non-default variant (not the
papers'): the affine term goes to ``parts["attn_bias"]`` and the ALTI mixing matrices use ``ṽ``.
Under the official convention the token terms depend on where a checkpoint keeps its value biases
(load models with ``fold_value_biases=False``, as ``load_model`` does); under "separate" they
do not.

A custom ``Target.head`` is supported by ALTI-Logit only when it is a ``torch.nn.Linear`` on the
final residual (its weight gives the direction, its bias a bias term); anything else raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import einops
import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_attrib.backend import final_norm, has_hooks, hook_name, output_weights, unembedding
from lens_attrib.errors import ModelError
from lens_attrib.forward import (
    Forward,
    group_rows,
    no_grad_context,
    run,
    run_shared,
    step_groups,
    target_rows,
)
from lens_attrib.inputs import Batch
from lens_attrib.methods.alti_mixing import (
    PostNorm,
    center,
    expand_kv,
    head_outputs,
    mixing_matrix,
    norm_params,
    trace_rows,
    value_bias,
)
from lens_attrib.methods.propagation import rollout_target_rows
from lens_attrib.methods.registry import (
    MethodOutput,
    Option,
    is_bool,
    positive_int_or_none,
    prepare,
    register,
)
from lens_attrib.progress import advance, progress_bar
from lens_attrib.target import ResolvedTarget, Target, TargetError

#: Where the affine term ``α_ij θ_V W_O`` of the attention output goes (see the module docstring).
Affine = Literal["source", "separate"]
AFFINE_MODES = ("source", "separate")


@dataclass
class AltiCache:
    """What the hooks keep: per-layer value vectors, target rows and mixing matrices."""

    model: Any
    batch: Batch
    positions: Tensor
    mixing_layers: set[int]
    chunk_size: int | None
    dtype: torch.dtype
    affine: Affine = "source"
    l1_eps: float = 0.0
    v: dict[int, Tensor] = field(default_factory=dict)
    alpha_t: dict[int, Tensor] = field(default_factory=dict)
    mlp_t: dict[int, Tensor] = field(default_factory=dict)
    mats: dict[int, Tensor] = field(default_factory=dict)
    embed_t: Tensor | None = None
    final_scale: Tensor | None = None
    z_hooked: set[int] = field(default_factory=set)
    rows: Tensor | None = None
    """Shared forward (generation steps): the recorded sequence each batch row reads; ``v`` and
    ``mats`` then have one row per sequence (use :meth:`row_values` / :meth:`row_mats`)."""
    _tmp: dict[str, Tensor] = field(default_factory=dict)

    def at_targets(self, x: Tensor) -> Tensor:
        """``x[seq_b, t_b]`` for every batch row ``b`` (``x`` ``[seq, pos, ...]``)."""
        if self.rows is None:
            return target_rows(x, self.positions)
        return x[self.rows.to(x.device), self.positions.to(x.device)]

    def pattern_rows(self, pattern: Tensor) -> Tensor:
        """The target query row of every batch row: ``[batch, head, key]``."""
        seq = torch.arange(pattern.shape[0]) if self.rows is None else self.rows
        return pattern[seq.to(pattern.device), :, self.positions.to(pattern.device)]

    def mixing_rows(self) -> list[int]:
        """Rows of each recorded sequence's mixing matrices: its last explained position + 1."""
        if self.rows is None:
            return [int(p) + 1 for p in self.positions]
        last = torch.full((int(self.rows.max()) + 1,), -1, dtype=torch.long)
        last = last.scatter_reduce(0, self.rows.cpu(), self.positions.cpu(), reduce="amax")
        return [int(p) + 1 for p in last]

    def row_values(self, layer: int, pre_norm: bool) -> Tensor:
        """:meth:`source_values` of every batch row."""
        v = self.source_values(layer, pre_norm)
        return v if self.rows is None else v[self.rows.to(v.device)]

    def row_mats(self, layer: int) -> Tensor:
        """Layer ``layer``'s mixing matrices of every batch row."""
        mats = self.mats[layer]
        return mats if self.rows is None else mats[self.rows.to(mats.device)]

    @property
    def encoder(self) -> bool:
        return self.batch.arch.encoder

    def source_values(self, layer: int, pre_norm: bool) -> Tensor:
        """Value vectors attributed to their source token: ``v`` (official), or ``v − θ_V``."""
        v = self.v[layer]
        if self.affine == "source":
            return v
        block = self.model.blocks[layer]
        ln = norm_params(block.ln1) if pre_norm else None
        return v - value_bias(block.attn, ln, v.shape[-2]).to(self.dtype)

    def hooks(self) -> list[tuple[str, Callable[..., None]]]:
        hooks: list[tuple[str, Callable[..., None]]] = []
        for layer in range(self.batch.arch.n_layers):
            hooks += [
                (hook_name("resid_pre", layer), self._store(layer, "x")),
                (hook_name("v", layer), self._store(layer, "v")),
                (hook_name("pattern", layer), self._store(layer, "pattern")),
            ]
            if layer in self.z_hooked:
                hooks.append((hook_name("z", layer), self._store(layer, "z")))
            if self.encoder:
                hooks += [
                    (hook_name("scale", layer, "ln1"), self._store(layer, "scale")),
                    (hook_name("normalized", layer, "ln1"), self._store(layer, "normalized")),
                ]
            else:
                hooks += [
                    (hook_name("attn_out", layer), self._store(layer, "attn_out")),
                    (hook_name("mlp_out", layer), self._store(layer, "mlp_out")),
                ]
        if not self.encoder:
            hooks.append((hook_name("scale"), self._store(-1, "final_scale")))
        return hooks

    def _store(self, layer: int, what: str) -> Callable[..., None]:
        def hook(x: Tensor, hook: Any) -> None:
            self.receive(layer, what, x.detach().to(self.dtype))

        return hook

    def receive(self, layer: int, what: str, x: Tensor) -> None:
        mixing = layer in self.mixing_layers
        if what == "final_scale":
            self.final_scale = x.reshape(x.shape[0], -1)[:, -1]
        elif what == "x":
            if layer == 0:
                self.embed_t = self.at_targets(x)
            if mixing:
                self._tmp["x"] = x
        elif what == "v":
            self.v[layer] = x
        elif what == "pattern":
            self.alpha_t[layer] = self.pattern_rows(x)
            if mixing:
                self._tmp["pattern"] = x
            if layer in self.z_hooked:
                self._tmp["full_pattern"] = x
        elif what == "z":
            self.follow_head_scaling(layer, x)
        elif what == "mlp_out":
            self.mlp_t[layer] = self.at_targets(x)
        elif what == "scale":
            self._tmp["scale"] = x[..., 0]
        elif what == "attn_out" and mixing:
            self.mats[layer] = self.decoder_mixing(layer, self._tmp["x"] + x)
            self._tmp.clear()
        elif what == "normalized" and mixing:
            self.mats[layer] = self.encoder_mixing(layer, x)
            self._tmp.clear()

    def follow_head_scaling(self, layer: int, z: Tensor) -> None:
        """Follow a user hook on ``hook_z`` that scales head outputs (e.g. a head ablation).

        With ``ẑ_ih = Σ_j α_hij v_j`` the head output the pattern and values give, the hooked
        ``z_ih`` must be ``c_ih ẑ_ih``; then ``α_hij`` is replaced by ``c_ih α_hij`` everywhere
        (target row and mixing matrices), which is exact. Anything else raises.
        """
        pattern = self._tmp.pop("full_pattern")
        v = expand_kv(self.v[layer], z.shape[-2])
        z_hat = torch.einsum("bhij,bjhd->bihd", pattern, v)
        norm2 = (z_hat * z_hat).sum(-1)
        scale = torch.where(norm2 > 0, (z * z_hat).sum(-1) / norm2.clamp_min(1e-300), 1.0)
        residual = (z - scale[..., None] * z_hat).norm(dim=-1)
        tol = (1e-9 if self.dtype == torch.float64 else 1e-4) * (z_hat.norm(dim=-1) + 1e-30)
        if bool((residual > tol).any()):
            raise ModelError(
                f"A hook on {hook_name('z', layer)} changes head outputs in a way ALTI cannot "
                "decompose onto source tokens: it can follow hooks that scale each head's output "
                "(ablations such as zeroing a head). Remove the hook, or use a gradient method "
                "(grad_x_input, attnlrp), which follow any hook."
            )
        scaled = pattern * einops.rearrange(scale, "b i h -> b h i")[..., None]
        self.alpha_t[layer] = self.pattern_rows(scaled)
        if "pattern" in self._tmp:
            self._tmp["pattern"] = scaled

    def decoder_mixing(self, layer: int, y: Tensor) -> Tensor:
        block = self.model.blocks[layer]
        x, pattern, v = self._tmp["x"], self._tmp["pattern"], self.source_values(layer, True)
        w_o = block.attn.W_O.to(self.dtype)
        mats = []
        n_rows = self.mixing_rows()
        for b in range(x.shape[0]):
            o = head_outputs(v[b], w_o)
            mats.append(
                mixing_matrix(
                    pattern[b],
                    o,
                    x[b],
                    y[b],
                    causal=True,
                    n_rows=n_rows[b],
                    chunk_size=self.chunk_size,
                    mask=self.batch.mask[b],
                    l1_eps=self.l1_eps,
                )
            )
            advance()
        return torch.stack(mats)

    def encoder_mixing(self, layer: int, normalized: Tensor) -> Tensor:
        block = self.model.blocks[layer]
        ln = norm_params(block.ln1)
        x, pattern, v, scale = (
            self._tmp["x"],
            self._tmp["pattern"],
            self.source_values(layer, False),
            self._tmp["scale"],
        )
        weight = None if ln.weight is None else ln.weight.to(self.dtype)
        y = normalized * (1.0 if weight is None else weight)
        if ln.bias is not None:
            y = y + ln.bias.to(self.dtype)
        w_o = block.attn.W_O.to(self.dtype)
        params = type(ln)(ln.center, weight, None)
        mats = []
        for b in range(x.shape[0]):
            o = head_outputs(v[b], w_o)
            post = PostNorm(scale[b], params)
            mats.append(
                mixing_matrix(
                    pattern[b],
                    o,
                    x[b],
                    y[b],
                    causal=False,
                    chunk_size=self.chunk_size,
                    post=post,
                    mask=self.batch.mask[b],
                    l1_eps=self.l1_eps,
                )
            )
            advance()
        return torch.stack(mats)


def run_alti_forward(
    model: Any,
    batch: Batch,
    target: Target,
    mixing_layers: set[int],
    chunk_size: int | None,
    *,
    affine: Affine = "source",
    l1_eps: float = 0.0,
) -> tuple[Forward, AltiCache]:
    """One forward recording exactly what ALTI / ALTI-Logit need (after the user's hooks).

    A generation step batch (every step of a prompt a row with the same sequence) runs once per
    sequence (:func:`lens_attrib.forward.run_shared`) and its mixing matrices are computed once,
    with rows up to the sequence's last explained position: row ``i`` of a causal mixing matrix
    depends only on positions ``≤ i`` (its later sources get exactly 0 for ``l1_eps = 0``), and
    step ``s`` reads rows ``≤ P − 1 + s`` only, so every step equals its prefix explained alone.
    With ``l1_eps > 0`` the later sources get ``ε``-terms that depend on the explained position
    (the official code's artifact), so each step row keeps its own forward and matrices.
    """
    groups = step_groups(batch) if l1_eps == 0 else None
    cache = AltiCache(
        model,
        batch,
        target.positions(batch),
        mixing_layers,
        chunk_size,
        batch.arch.work_dtype,
        affine,
        l1_eps,
    )
    points = model.hook_dict  # read once: a TransformerBridge rebuilds it on every access
    cache.z_hooked = {
        layer for layer in range(batch.arch.n_layers) if has_hooks(points[hook_name("z", layer)])
    }
    sequences = batch.size if groups is None else len(groups)
    matrices = len(mixing_layers) * sequences
    with progress_bar(desc="alti", total=matrices, unit="matrix"):  # advanced per item and layer
        if groups is None:
            result = run(model, batch, target, fwd_hooks=cache.hooks(), position_only_ok=True)
        else:
            cache.rows = group_rows(groups, batch.size, batch.tokens.device)
            result = run_shared(model, batch, target, groups, fwd_hooks=cache.hooks())
    return result, cache


def logit_direction(
    model: Any, target: Target, resolved: ResolvedTarget, final_scale: Tensor | None, dtype: Any
) -> tuple[Float[Tensor, "batch d_model"], Float[Tensor, "batch"]]:
    """``u`` (final norm folded into the head direction) and the constant bias term."""
    head = target.head
    # a trained class head h(x) = linear(ln_final(x)) (lens_attrib.classifiers.LinearHead) has the
    # default head's structure: its linear map takes the place of the unembedding below
    normed = (
        head is not None
        and isinstance(getattr(head, "linear", None), nn.Linear)
        and getattr(head, "norm", None) is final_norm(model)
    )
    if head is not None and not normed:
        if not isinstance(head, nn.Linear):
            raise TargetError(
                "alti_logit needs a linear head on the final residual: pass Target(head=...) as "
                "a torch.nn.Linear (its weight gives the direction), a lens_attrib.classifiers."
                "LinearHead, or use the default head (ln_final + unembed). Got "
                f"{type(head).__name__}."
            )
        weight = head.weight.T.to(dtype)
        u = resolved.direction(weight)
        const = torch.zeros(u.shape[0], dtype=dtype, device=u.device)
        if head.bias is not None:
            const = resolved.select(head.bias.to(dtype)[None].expand(u.shape[0], -1))
        return u, const
    if normed:
        linear = head.linear  # type: ignore[union-attr]
        w_u, b_u = linear.weight.T, linear.bias
    else:
        w_u, b_u = unembedding(model)
    d = resolved.direction(w_u.to(dtype))
    const = resolved.select(b_u.to(dtype)[None].expand(d.shape[0], -1))
    ln = norm_params(final_norm(model))
    if ln.bias is not None:
        const = const + d @ ln.bias.to(dtype)
    u = d if ln.weight is None else d * ln.weight.to(dtype)
    if ln.center:
        u = center(u)
    if ln.active:
        if final_scale is None:
            raise RuntimeError("ln_final.hook_scale did not fire: cannot linearize the final norm.")
        u = u / final_scale[:, None]
    return u, const


CHUNK_OPTION = Option(
    None, check=positive_int_or_none, help="query rows per chunk (default: a memory budget)"
)
AFFINE_OPTION = Option(
    "source",
    choices=AFFINE_MODES,
    help="'source' (official: α·θ_V·W_O goes to its source token) or 'separate' (attn_bias)",
)


def _nonnegative_finite(value: Any) -> str | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1e300
    return None if ok else "a finite number >= 0 (the official code uses 1e-6)"


L1_EPS_OPTION = Option(
    0.0, check=_nonnegative_finite, help="ε inside the L1 distances (official code: 1e-6)"
)


@register(
    "alti_logit",
    parametrization=True,
    label="ALTI-Logit",
    encoder=False,
    per_layer=True,
    head_relevances=True,
    instead="alti",
    options={
        "chunk_size": CHUNK_OPTION,
        "trace_heads": Option(False, check=is_bool, help="trace head scores to input tokens"),
        "affine": AFFINE_OPTION,
        "l1_eps": L1_EPS_OPTION,
    },
)
def alti_logit(
    model: Any,
    batch: Batch,
    target: Target,
    *,
    chunk_size: int | None,
    trace_heads: bool,
    affine: Affine,
    l1_eps: float,
) -> MethodOutput:
    """ALTI-Logit (Ferrando et al. 2023): logit contributions traced to input tokens.

    Options: ``chunk_size`` (query rows per chunk of the mixing computation; default: a memory
    budget of 2^22 elements), ``trace_heads`` (trace ``head_token_scores`` to input tokens through
    the mixing matrices below; default: they are on the layer's own input positions, the
    official "aff_x_j_h"), ``affine`` ("source", official: ``α_tj θ_V W_O`` is part of token j's
    terms; "separate": it goes to ``parts["attn_bias"]``, not the paper's convention),
    ``l1_eps`` (ε added inside the L1 distances of the mixing matrices; the official code uses
    1e-6, the default 0 measures the plain distance).

    Returns ``scores`` ``[batch, pos]``, ``layer_scores`` ``[batch, layer, pos]``, ``head_scores``
    ``[batch, layer, head]`` and ``head_token_scores`` ``[batch, layer, head, pos]``, and in
    ``parts``: ``mlp`` ``[batch, layer]``, ``attn_bias`` ``[batch, layer]``, ``embedding``
    ``[batch]`` (embedding of the target position), ``bias`` ``[batch]`` (unembedding bias and
    final-norm β), ``hooks`` ``[batch]`` (what the user's hooks add to the residual stream,
    e.g. a steering vector; 0 up to rounding without hooks), ``logit`` ``[batch]`` (the
    explained value). ``attn_bias`` is ``b_O·u`` (plus the affine term with
    ``affine="separate"``). ``scores.sum(-1) + mlp.sum(-1) +
    attn_bias.sum(-1) + embedding + bias + hooks == logit``.
    """
    n_layers = batch.arch.n_layers
    dtype = batch.arch.work_dtype
    result, cache = run_alti_forward(
        model, batch, target, set(range(n_layers - 1)), chunk_size, affine=affine, l1_eps=l1_eps
    )
    assert result.value is not None
    u, const = logit_direction(model, target, result.resolved, cache.final_scale, dtype)
    n_heads = batch.arch.n_heads
    head_tok = []
    attn_bias = []
    mlp = []
    for layer in range(n_layers):
        block = model.blocks[layer]
        v = cache.row_values(layer, True)
        w = torch.einsum("hkd,bd->bhk", block.attn.W_O.to(dtype), u)
        vt = torch.einsum("bthk,bhk->bht", expand_kv(v, n_heads), w)
        alpha = cache.alpha_t[layer]
        head_tok.append(alpha * vt)
        bias = u @ output_weights(block.attn)[1].to(dtype)
        if affine == "separate":
            theta = value_bias(block.attn, norm_params(block.ln1), v.shape[-2]).to(dtype)
            theta_u = torch.einsum("hk,bhk->bh", expand_kv(theta, n_heads), w)
            bias = bias + torch.einsum("bh,bh->b", alpha.sum(-1), theta_u)
        attn_bias.append(bias)
        mlp.append((cache.mlp_t[layer] * u).sum(-1))
    head_token = torch.stack(head_tok, 1)  # [batch, layer, head, pos]
    mats = [cache.row_mats(k) for k in range(n_layers - 1)]
    layer_scores = trace_rows(head_token.sum(2), list(range(n_layers)), mats)
    if trace_heads:
        flat = head_token.flatten(1, 2)
        depths = [layer for layer in range(n_layers) for _ in range(n_heads)]
        head_token = trace_rows(flat, depths, mats).unflatten(1, (n_layers, n_heads))
    assert cache.embed_t is not None
    parts = {
        "mlp": torch.stack(mlp, 1),
        "attn_bias": torch.stack(attn_bias, 1),
        "embedding": (cache.embed_t * u).sum(-1),
        "bias": const,
        "logit": result.value.to(dtype),
    }
    # What the user's hooks add to the residual stream (steering, patching of block outputs):
    # the final residual minus the blocks' decomposed outputs; ~1e-16 without such hooks.
    final_t = target_rows(result.resid.to(dtype), result.resolved.positions)
    decomposed = (
        parts["embedding"]
        + parts["mlp"].sum(-1)
        + parts["attn_bias"].sum(-1)
        + torch.stack(head_tok, 1).sum((1, 2, 3))
    )
    parts["hooks"] = (final_t * u).sum(-1) - decomposed
    return MethodOutput(
        layer_scores.sum(1),
        result.resolved,
        layer_scores=layer_scores * batch.mask[:, None].to(dtype),
        head_scores=head_token.sum(-1),
        head_token_scores=head_token,
        parts=parts,
        meta={"explained_value": result.value.detach().cpu()},
    )


def alti_mixing_matrices(
    model: Any,
    inputs: Any,
    target: Target | None = None,
    *,
    chunk_size: int | None = None,
    affine: Affine = "source",
    l1_eps: float = 0.0,
) -> tuple[Batch, Forward, list[Tensor]]:
    """Every layer's ALTI mixing matrix ``[batch, pos, pos]`` (decoders: rows ≤ target)."""
    for name, option, value in (
        ("chunk_size", CHUNK_OPTION, chunk_size),
        ("affine", AFFINE_OPTION, affine),
        ("l1_eps", L1_EPS_OPTION, l1_eps),
    ):
        option.validate("alti_mixing_matrices", name, value)
    batch, target = prepare(model, inputs, target)
    with no_grad_context(model):
        result, cache = run_alti_forward(
            model,
            batch,
            target,
            set(range(batch.arch.n_layers)),
            chunk_size,
            affine=affine,
            l1_eps=l1_eps,
        )
    return batch, result, [cache.row_mats(k) for k in range(batch.arch.n_layers)]


@register(
    "alti",
    parametrization=True,
    label="ALTI",
    per_layer=True,
    target_free=True,
    needs_head=False,
    options={
        "chunk_size": CHUNK_OPTION,
        "affine": AFFINE_OPTION,
        "l1_eps": L1_EPS_OPTION,
        "rollout": Option(True, check=is_bool, help="roll out over layers (False: ALTI¬)"),
    },
)
def alti(
    model: Any,
    batch: Batch,
    target: Target,
    *,
    chunk_size: int | None,
    affine: Affine,
    l1_eps: float,
    rollout: bool,
) -> MethodOutput:
    """ALTI (Ferrando et al. 2022): rollout of token-mixing matrices, the target row.

    ``scores[b] = (A_{L−1} ⋯ A_0)[t_b]``; ``layer_scores[b, l] = (A_l ⋯ A_0)[t_b]`` (contributions
    of the input tokens to the representation of the target position after layer l). Rows sum
    to 1 over real tokens. Options ``chunk_size``, ``affine`` and ``l1_eps`` as in
    ``alti_logit``; ``rollout=False`` gives the per-layer ALTI¬ of the NormXLogit paper (Mohebbi
    et al.'s layer-wise setting): ``layer_scores[b, l] = A_l[t_b]`` (layer l's own mixing row,
    no rollout) and ``scores`` the last layer's.
    """
    n_layers = batch.arch.n_layers
    result, cache = run_alti_forward(
        model, batch, target, set(range(n_layers)), chunk_size, affine=affine, l1_eps=l1_eps
    )
    mats = [cache.row_mats(k) for k in range(n_layers)]
    positions = result.resolved.positions
    if rollout:
        layer_scores = rollout_target_rows(mats, positions)
    else:
        layer_scores = torch.stack([target_rows(m, positions) for m in mats], 1)
    return MethodOutput(
        layer_scores[:, -1],
        result.resolved,
        layer_scores=layer_scores,
        meta={"target_position_only": result.position_only},
    )
