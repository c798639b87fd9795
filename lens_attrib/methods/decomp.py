"""GlobEnc (Modarressi et al. 2022) and DecompX (Modarressi et al. 2023) for post-LN encoders.

Both follow the authors' code (github.com/mohsenfayyaz/GlobEnc, ``src/modeling/modeling_bert.py``
with ``output_globenc``; github.com/mohsenfayyaz/DecompX, ``src/modeling_bert.py`` with a
``DecompXConfig``), which the tests compare against on committed fixtures
(``tests/fixtures/decompx_official``). Notation for one BERT layer with input ``x_j``:

    y_i = LN1(Σ_{h,j} α^h_ij v^h_j W_O^h + b_O + x_i),
    z_i = LN2(y_i + W_2 g(W_1 y_i + b_1) + b_2),

``v^h_j = x_j W_V^h + b_V^h`` (``hook_v``), ``LN(u)_i = (u_i − mean(u_i))/σ_i ⊙ γ + β`` with the
row's actual scale ``σ_i`` (``hook_scale``), so that a LayerNorm is linear in any split of ``u_i``.

**GlobEnc** (layer-wise attribution ``N_l`` with both LayerNorms, rolled out). Token ``j``'s part
of ``z_i`` without the FFN (which GlobEnc leaves out) and without biases:

    N_l[i, j] = ‖ LN2̃_i( LN1̃_i( Σ_h α^h_ij v^h_j W_O^h + δ_ij x_j ) ) ‖₂,    LÑ_i(u) = c(u)/σ_i ⊙ γ,

(the value bias b_V stays with its source token, as in the authors' code, whose transformed vectors
are those of ALTI: :func:`~lens_attrib.methods.alti_mixing.transformed_vectors`). With
``normalize=True`` (default) each row is divided by its sum, ``Ñ_l = N_l / N_l 1``, so that rows
sum to 1 like ALTI's and rollout's; ``normalize=False`` keeps the authors' raw norms (their
``output_globenc`` multiplies the raw matrices). Rollout: ``scores = e_t Ñ_{L−1} ⋯ Ñ_0``,
``layer_scores[l] = e_t Ñ_l ⋯ Ñ_0``. With ``rollout=False`` (the NormXLogit paper's per-layer
GlobEnc¬) ``layer_scores[l] = e_t Ñ_l`` and ``scores`` is the last layer's.

**DecompX** (decomposed vectors propagated through every component). Every row ``i`` of the
residual stream is kept as a sum over sources, ``x_i = Σ_s X[i, s]``, with ``s`` the input tokens
plus one bias slot ``⊥``. Layer 0 starts from ``X[i, s] = δ_is x⁰_i`` (the embedding output). Each
component maps the decomposition exactly (``Σ_s`` stays the real activation):

    attention  A[i, s] = Σ_{h,j} α^h_ij X[j, s] W_V^h W_O^h + X[i, s];  b_V W_O + b_O → ⊥
               (layer 0: ``v_j`` with its bias goes to token j, as in the authors' code)
    LN         L[i, s] = c(A[i, s])/σ_i ⊙ γ;  β → ⊥
    FFN        F[i, s] = (θ_i ⊙ (L[i, s] W_1)) W_2;  b_1 (inside, scaled by θ_i), b_2 → ⊥,
               θ_i = g(h_i)/h_i  (the activation's zero-origin slope at the real pre-activation
               h_i, the authors' "GeLU_ZO": exact for the sum since Σ_s θ ⊙ H_s = g(h))
    residual   X'[i, s] = LN2(L[i, s] + F[i, s])  (same LN rule)

``biases="absdot"`` (the authors' default) moves each bias, where it is added, onto the token
sources in proportion to ``|⟨vector_s, bias⟩|`` (``bias_decomp_type="absdot"``), so ``⊥`` stays 0;
``biases="separate"`` keeps them in ``⊥`` (``include_bias_token=True``), which goes to
``parts["bias"]``. The explained position's final decomposition ``X_L[t, s]`` then goes through the
target's head when it has one: a ``torch.nn.Linear`` (a class head) or an ``nn.Sequential`` of
linears and element-wise activations (BERT's pooler ``Linear → Tanh`` then the classifier, as in
the authors' ``include_classifier_w_pooler``; activations by their zero-origin slope, the
authors' ``tanh_approx_type="ZO"``); ``scores[s] = C[s, y] − C[s, y']``, and ``Σ_s scores[s] +
parts["bias"]`` is the explained logit (difference). Without a head (``Target(head=None)``)
``scores[s] = ‖X_L[t, s]‖₂``, as the NormXLogit paper does for STS-B.

The explained position ``t`` is the Target's (default: the last real token, ``[SEP]``, like
``alti`` and ``rollout``); BERT's pooler reads ``[CLS]``, so pass ``Target(..., position=0)`` to
explain a pooler head as the authors do. Departures from the authors' code: the zero-origin slope
is ``g(h)/h`` (theirs ``g(h)/(h + 10⁻¹²)``, also at the head's tanh) and the absdot shares are
``w_s / Σ w`` (theirs ``w_s / (Σ w + 10⁻¹²)``, which drops the rest of the bias; a bias no token
vector overlaps stays in ``⊥``), so that the decomposition sums to the real activations exactly
(the fixture agrees to float32 rounding). ``eps=1e-12`` reproduces the authors' two stabilisers
exactly (as ``l1_eps`` does for ALTI); the decomposition then misses the real activations by
about ``eps`` relative.

The decomposition needs ``O(T² · d)`` memory per item (``[pos, src, d_model]``) and
``O(T² · d · d_mlp)`` time per layer; the FFN runs in chunks of ``chunk_size`` rows. Items are
decomposed one at a time over their real tokens only (padding never enters). Hooks that change
activations the decomposition does not read (anything but attention patterns) are detected by
comparing ``Σ_s X[i, s]`` with the real layer output, and raise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_attrib.backend import hook_name
from lens_attrib.classifiers.linear import LinearHead
from lens_attrib.errors import ModelError
from lens_attrib.forward import Forward, no_grad_context, run
from lens_attrib.inputs import Batch
from lens_attrib.methods.alti_mixing import (
    NormParams,
    PostNorm,
    auto_chunk,
    head_outputs,
    norm_params,
    transformed_vectors,
)
from lens_attrib.methods.propagation import trace_rows
from lens_attrib.methods.registry import (
    MethodOutput,
    Option,
    is_bool,
    positive_int_or_none,
    prepare,
    register,
)
from lens_attrib.target import Target, TargetError

Biases = Literal["absdot", "separate"]
BIAS_MODES = ("absdot", "separate")

#: Elementwise activations a head may contain (decomposed by their zero-origin slope).
ELEMENTWISE = (nn.Tanh, nn.GELU, nn.ReLU, nn.Sigmoid, nn.SiLU, nn.LeakyReLU)


# --------------------------------------------------------------------------- recording
@dataclass
class EncoderActs:
    """Per-layer activations of one forward (after the user's hooks), in the work dtype."""

    dtype: torch.dtype
    model_dtype: torch.dtype
    acts: dict[tuple[int, str], Tensor] = field(default_factory=dict)

    def hooks(self, n_layers: int, mlp: bool) -> list[tuple[str, Callable[..., None]]]:
        names: list[tuple[str, str | None]] = [("resid_pre", None), ("pattern", None), ("v", None)]
        names += [("scale", "ln1"), ("scale", "ln2"), ("normalized_resid_post", None)]
        if mlp:
            names += [("pre", None), ("post", None)]
        out = []
        for layer in range(n_layers):
            for kind, sub in names:
                key = kind if sub is None else f"{sub}_{kind}"
                out.append((hook_name(kind, layer, sub), self._store(layer, key)))
        return out

    def _store(self, layer: int, key: str) -> Callable[..., None]:
        def hook(x: Tensor, hook: Any) -> None:
            self.acts[(layer, key)] = x.detach().to(self.dtype)

        return hook

    def item(self, layer: int, key: str, b: int, idx: Tensor) -> Tensor:
        """Item ``b``'s activation restricted to its real positions ``idx``."""
        x = self.acts[(layer, key)][b]
        if key == "pattern":
            return x[:, idx][:, :, idx]
        if key in ("ln1_scale", "ln2_scale"):
            return x[idx, 0]
        return x[idx]


def record(model: Any, batch: Batch, target: Target, *, mlp: bool) -> tuple[Forward, EncoderActs]:
    acts = EncoderActs(batch.arch.work_dtype, batch.arch.dtype)
    result = run(
        model,
        batch,
        target,
        fwd_hooks=acts.hooks(batch.arch.n_layers, mlp),
        position_only_ok=True,
    )
    return result, acts


def real_positions(batch: Batch, b: int) -> Tensor:
    return torch.nonzero(batch.mask[b]).flatten()


def local_index(idx: Tensor, position: Tensor) -> int:
    return int(torch.nonzero(idx == position).flatten()[0])


# --------------------------------------------------------------------------- GlobEnc
def globenc_matrix(
    model: Any, acts: EncoderActs, layer: int, b: int, idx: Tensor, chunk_size: int | None
) -> Float[Tensor, "pos pos"]:
    """``N_l[i, j]`` of one item over its real positions (module docstring)."""
    block = model.blocks[layer]
    dtype = acts.dtype
    ln1, ln2 = norm_params(block.ln1), norm_params(block.ln2)
    post1 = PostNorm(acts.item(layer, "ln1_scale", b, idx), _weights_only(ln1, dtype))
    post2 = PostNorm(acts.item(layer, "ln2_scale", b, idx), _weights_only(ln2, dtype))
    alpha = acts.item(layer, "pattern", b, idx)
    x = acts.item(layer, "resid_pre", b, idx)
    o = head_outputs(acts.item(layer, "v", b, idx), block.attn.W_O.to(dtype))
    n = x.shape[0]
    out = torch.empty(n, n, dtype=dtype, device=x.device)
    step = chunk_size or auto_chunk(n, x.shape[-1])
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        t = transformed_vectors(alpha, o, x, rows, post=post1)  # [j, i, d]
        t = post2.apply(t, rows)
        out[rows] = torch.linalg.vector_norm(t, dim=-1).T
    return out


def _weights_only(params: NormParams, dtype: torch.dtype) -> NormParams:
    weight = None if params.weight is None else params.weight.to(dtype)
    return NormParams(params.center, weight, None)


def row_normalize(mat: Tensor) -> Tensor:
    total = mat.sum(-1, keepdim=True)
    return torch.where(total > 0, mat / total.clamp_min(torch.finfo(mat.dtype).tiny), 0.0)


CHUNK_OPTION = Option(None, check=positive_int_or_none, help="query rows per chunk")


def _eps_check(value: Any) -> str | None:
    ok = isinstance(value, float | int) and not isinstance(value, bool) and 0 <= value < 1e-3
    return None if ok else "a small number >= 0 (1e-12: the authors' stabilisers)"


EPS_OPTION = Option(
    0.0,
    check=_eps_check,
    help="0: exact; 1e-12: the authors' g(h)/(h+eps) and w/(Σw+eps), reproduced exactly",
)


@register(
    "globenc",
    parametrization=True,
    label="GlobEnc",
    decoder=False,
    instead="alti",
    per_layer=True,
    target_free=True,
    needs_head=False,
    options={
        "rollout": Option(True, check=is_bool, help="roll out over layers (False: GlobEnc¬)"),
        "normalize": Option(True, check=is_bool, help="rows sum to 1 (False: raw norms)"),
        "chunk_size": CHUNK_OPTION,
    },
)
def globenc(
    model: Any,
    batch: Batch,
    target: Target,
    *,
    rollout: bool,
    normalize: bool,
    chunk_size: int | None,
) -> MethodOutput:
    """GlobEnc (Modarressi et al. 2022): norms of the decomposed encoder-layer output, rolled out.

    ``N_l[i, j] = ‖LN2̃_i(LN1̃_i(Σ_h α^h_ij v^h_j W_O^h + δ_ij x_j))‖₂`` (both LayerNorms linearized
    with the row's real scale, without β; the FFN is left out as in the paper), rows normalized
    to sum to 1 (``normalize=False``: the authors' raw norms), ``scores = e_t Ñ_{L−1} ⋯ Ñ_0`` and
    ``layer_scores[l] = e_t Ñ_l ⋯ Ñ_0``. ``rollout=False`` gives the per-layer GlobEnc¬ of the
    NormXLogit paper: ``layer_scores[l] = e_t Ñ_l`` (the target row of layer l alone), ``scores``
    the last layer's. ``chunk_size``: query rows per chunk of transformed vectors.
    """
    n_layers = batch.arch.n_layers
    result, acts = record(model, batch, target, mlp=False)
    positions = result.resolved.positions
    dtype = batch.arch.work_dtype
    device = batch.mask.device
    layer_scores = torch.zeros(batch.size, n_layers, batch.length, dtype=dtype, device=device)
    for b in range(batch.size):
        idx = real_positions(batch, b)
        mats = [globenc_matrix(model, acts, layer, b, idx, chunk_size) for layer in range(n_layers)]
        if normalize:
            mats = [row_normalize(m) for m in mats]
        rows = torch.zeros(1, n_layers, len(idx), dtype=dtype, device=device)
        rows[0, :, local_index(idx, positions[b])] = 1.0
        if rollout:
            traced = trace_rows(
                rows, [layer + 1 for layer in range(n_layers)], [m[None] for m in mats]
            )
        else:
            traced = torch.stack([rows[0, layer] @ mats[layer] for layer in range(n_layers)])[None]
        layer_scores[b][:, idx] = traced[0]
    return MethodOutput(
        layer_scores[:, -1],
        result.resolved,
        layer_scores=layer_scores,
        meta={"target_position_only": result.position_only},
    )


# --------------------------------------------------------------------------- DecompX
@dataclass(frozen=True)
class BiasRule:
    """Where a bias added to a decomposition ``[rows, S, d]`` goes (slot ``S−1`` is ⊥), and the
    authors' stabiliser ``eps`` (0: exact shares and slopes; 1e-12: the authors' code)."""

    mode: Biases
    eps: float = 0.0

    def add(self, vectors: Tensor, bias: Tensor | None) -> Tensor:
        """Add ``bias`` (``[d]`` or ``[rows, d]``) to ⊥, then apply the rule."""
        if bias is not None:
            vectors[:, -1] += bias
        return self.settle(vectors)

    def settle(self, vectors: Tensor) -> Tensor:
        """``absdot``: move ⊥ onto the token sources ∝ ``|⟨vector_s, ⊥⟩|`` (where any is > 0)."""
        if self.mode == "separate":
            return vectors
        bias = vectors[:, -1]
        weights = torch.einsum("isd,id->is", vectors[:, :-1], bias).abs()
        total = weights.sum(-1, keepdim=True)
        if self.eps > 0:  # the authors': w_s / (Σ w + eps); the rest of the bias is dropped
            vectors[:, :-1] += (weights / (total + self.eps))[..., None] * bias[:, None]
            vectors[:, -1] = 0.0
            return vectors
        moved = total > 0
        share = torch.where(moved, weights / total.clamp_min(torch.finfo(total.dtype).tiny), 0.0)
        vectors[:, :-1] += share[..., None] * bias[:, None]
        vectors[:, -1] = torch.where(moved, 0.0, bias)
        return vectors


def layer_norm_split(vectors: Tensor, scale: Tensor, params: NormParams, rule: BiasRule) -> Tensor:
    """``c(u_s)/σ_i ⊙ γ`` for every source; ``β`` to ⊥ (the authors' ``ln_decomposer``)."""
    out = vectors - vectors.mean(-1, keepdim=True) if params.center else vectors.clone()
    out = out / scale[:, None, None]
    if params.weight is not None:
        out = out * params.weight
    return rule.add(out, params.bias)


def zero_origin_slope(pre: Tensor, post: Tensor, eps: float = 0.0) -> Tensor:
    """``θ = g(h)/h`` (the authors' "ZO" slope); where ``h = 0`` the value is 0 either way.
    ``eps > 0``: ``g(h)/(h + eps)``, the authors' stabilised form."""
    if eps > 0:
        return post / (pre + eps)
    return torch.where(pre != 0, post / torch.where(pre != 0, pre, 1.0), 0.0)


@dataclass(frozen=True)
class LayerWeights:
    w_v: Tensor
    w_o: Tensor
    b_v: Tensor
    b_o: Tensor
    ln1: NormParams
    ln2: NormParams
    w_in: Tensor
    b_in: Tensor
    w_out: Tensor
    b_out: Tensor


def layer_weights(block: Any, dtype: torch.dtype) -> LayerWeights:
    def cast(p: NormParams) -> NormParams:
        return NormParams(
            p.center,
            None if p.weight is None else p.weight.to(dtype),
            None if p.bias is None else p.bias.to(dtype),
        )

    attn, mlp = block.attn, block.mlp
    if getattr(mlp, "W_in", None) is None or getattr(mlp, "W_gate", None) is not None:
        raise ModelError("decompx needs a plain two-layer MLP (W_in, act, W_out) in every block.")
    return LayerWeights(
        attn.W_V.to(dtype),
        attn.W_O.to(dtype),
        attn.b_V.to(dtype),
        attn.b_O.to(dtype),
        cast(norm_params(block.ln1)),
        cast(norm_params(block.ln2)),
        mlp.W_in.to(dtype),
        mlp.b_in.to(dtype),
        mlp.W_out.to(dtype),
        mlp.b_out.to(dtype),
    )


@dataclass
class ItemDecomposition:
    """DecompX of one item: per layer the decomposition of its computed rows ``[rows, S, d]``."""

    idx: Tensor
    rows: list[Tensor]
    layers: list[Tensor] = field(default_factory=list)


def decompose_item(
    model: Any,
    acts: EncoderActs,
    b: int,
    idx: Tensor,
    last_rows: Tensor | None,
    rule: BiasRule,
    chunk_size: int | None,
    keep: bool = False,
) -> ItemDecomposition:
    """Propagate the decomposition through every layer (module docstring).

    ``last_rows``: the local rows the last layer computes (all rows when ``None``); ``keep``:
    keep every layer's decomposition (tests). Raises where ``Σ_s`` misses the real output.
    """
    dtype = acts.dtype
    n_layers = len(model.blocks)
    x0 = acts.item(0, "resid_pre", b, idx)
    n, d = x0.shape
    vectors = torch.zeros(n, n + 1, d, dtype=dtype, device=x0.device)
    diag = torch.arange(n, device=x0.device)
    vectors[diag, diag] = x0
    out = ItemDecomposition(idx, [])
    for layer in range(n_layers):
        weights = layer_weights(model.blocks[layer], dtype)
        rows = diag if last_rows is None or layer < n_layers - 1 else last_rows
        vectors = decompose_layer(
            weights, acts, layer, b, idx, vectors, rows, rule, chunk_size, first=layer == 0
        )
        real = acts.item(layer, "normalized_resid_post", b, idx)[rows]
        check_sum(vectors, real, layer, acts.model_dtype)
        out.rows.append(rows)
        if keep:
            out.layers.append(vectors)
    if not keep:
        out.layers.append(vectors)
    return out


def decompose_layer(
    w: LayerWeights,
    acts: EncoderActs,
    layer: int,
    b: int,
    idx: Tensor,
    vectors: Float[Tensor, "pos src d_model"],
    rows: Tensor,
    rule: BiasRule,
    chunk_size: int | None,
    *,
    first: bool,
) -> Float[Tensor, "rows src d_model"]:
    """One BERT layer applied to a decomposition (attention, LN1, FFN, residual, LN2)."""
    n_src = vectors.shape[1]
    alpha = acts.item(layer, "pattern", b, idx)[:, rows]  # [h, rows, j]
    if first:  # v_j (with b_V) belongs to token j, as in the authors' code
        v = acts.item(layer, "v", b, idx)  # [j, h, k]
        mixed = torch.einsum("hij,jhk->ijhk", alpha, v)  # source j of row i
        attn = torch.einsum("ijhk,hkd->ijd", mixed, w.w_o)
        attn = torch.cat([attn, torch.zeros_like(attn[:, :1])], 1)
    else:
        v = torch.einsum("jsd,hdk->jshk", vectors, w.w_v)
        v[:, -1] += w.b_v
        attn = torch.einsum("hij,jshk->ishk", alpha, v).flatten(2) @ w.w_o.flatten(0, 1)
    attn = attn + vectors[rows]
    attn = rule.add(attn, w.b_o)
    ln1 = layer_norm_split(attn, acts.item(layer, "ln1_scale", b, idx)[rows], w.ln1, rule)
    theta = zero_origin_slope(
        acts.item(layer, "pre", b, idx), acts.item(layer, "post", b, idx), rule.eps
    )
    theta = theta[rows]
    ffn = torch.empty_like(ln1)
    step = chunk_size or max(1, auto_chunk(n_src, w.w_in.shape[1]))
    for start in range(0, len(rows), step):
        part = slice(start, min(len(rows), start + step))
        hidden = rule.add(ln1[part] @ w.w_in, w.b_in) * theta[part][:, None]
        ffn[part] = rule.add(hidden @ w.w_out, w.b_out)
    return layer_norm_split(ln1 + ffn, acts.item(layer, "ln2_scale", b, idx)[rows], w.ln2, rule)


#: Relative tolerance of the decomposition's sum against the real output, by model dtype (the
#: real output carries the model's rounding; a hook that changes activations misses by far more).
SUM_TOLERANCE = {torch.float64: 1e-6, torch.float32: 2e-3}


def check_sum(vectors: Tensor, real: Tensor, layer: int, model_dtype: torch.dtype) -> None:
    """Raise when the decomposition does not sum to the real layer output (a user hook)."""
    tol = SUM_TOLERANCE.get(model_dtype, 0.1)  # bf16 / fp16
    err = float((vectors.sum(1) - real).abs().max())
    if err > tol * (1.0 + float(real.abs().max())):
        raise ModelError(
            f"decompx: the decomposition of layer {layer} misses the real output by {err:.3g}: a "
            "hook changes activations DecompX does not follow (it follows attention patterns "
            "only). Remove the hook, or use a gradient method (grad_x_input, attnlrp)."
        )


def head_layers(head: Any) -> list[nn.Module]:
    """The head as a list of modules DecompX can decompose, or a TargetError naming the fix."""
    if isinstance(head, LinearHead) and head.norm is None:  # a trained encoder head: W x + c
        head = head.linear
    modules = list(head) if isinstance(head, nn.Sequential) else [head]
    for m in modules:
        ok = isinstance(m, (nn.Linear, nn.Identity, *ELEMENTWISE)) or (
            isinstance(m, nn.Dropout) and (not m.training or m.p == 0)
        )
        if not ok:
            raise TargetError(
                "decompx decomposes through a torch.nn.Linear head (or an encoder's trained "
                "LinearHead) or an nn.Sequential of "
                "Linear layers and element-wise activations (e.g. BERT's pooler Linear → Tanh, "
                f"then the classifier); got {type(m).__name__}. Pass such a head, leave "
                "Target(head=None) for ℓ2 norms of the final vectors, or use grad_x_input."
            )
    return modules


def through_head(
    vectors: Float[Tensor, "src d_model"],
    modules: list[nn.Module],
    rule: BiasRule,
    real: Float[Tensor, "d_model"] | None = None,
) -> Float[Tensor, "src n_out"]:
    """Push one row's decomposition through the head (linears exact, activations by ZO).

    ``real``: the row itself (the final residual at the explained position); each activation's
    slope is then taken at the real pre-activation, as the authors' code does (with ``eps=0`` it
    equals the decomposition's sum up to rounding)."""
    out = vectors[None]  # [1, S, d]: one "row" for the bias rule
    row = None if real is None else real.to(out.dtype)[None]
    for m in modules:
        if isinstance(m, nn.Linear):
            out = out @ m.weight.T.to(out.dtype)
            out = rule.add(out, None if m.bias is None else m.bias.to(out.dtype))
        elif isinstance(m, ELEMENTWISE):
            pre = out.sum(1) if row is None else row
            out = out * zero_origin_slope(pre, m(pre), rule.eps)[:, None]
        if row is not None:
            row = m(row)
    return out[0]


@register(
    "decompx",
    parametrization=True,
    label="DecompX",
    decoder=False,
    instead="alti_logit",
    needs_head=False,
    options={
        "biases": Option(
            "absdot",
            choices=BIAS_MODES,
            help="'absdot' (authors': biases onto tokens) or 'separate' (parts['bias'])",
        ),
        "chunk_size": CHUNK_OPTION,
        "eps": EPS_OPTION,
    },
)
def decompx(
    model: Any,
    batch: Batch,
    target: Target,
    *,
    biases: Biases,
    chunk_size: int | None,
    eps: float,
) -> MethodOutput:
    """DecompX (Modarressi et al. 2023): token decompositions propagated through every layer.

    ``x_i = Σ_s X[i, s]`` is carried through attention (``α X W_V W_O``), both residuals, both
    LayerNorms (``c(·)/σ_i ⊙ γ``) and the FFN (``(θ_i ⊙ X W_1) W_2``, ``θ = g(h)/h``), then through
    ``Target.head`` (a Linear, or Linear/activation Sequential such as pooler + classifier):
    ``scores[s] = C[s, y] − C[s, y']``; without a head ``scores[s] = ‖X_L[t, s]‖₂``. Options:
    ``biases`` ("absdot", the authors' default: each bias is spread over the tokens ∝
    ``|⟨vector, bias⟩|``; "separate": biases stay in one bias source reported in
    ``parts["bias"]``), ``chunk_size`` (rows per chunk of the FFN), ``eps`` (0: exact; ``1e-12``
    reproduces the authors' two stabilisers, ``g(h)/(h + eps)`` and ``w_s/(Σ w + eps)``). With a
    head and ``eps=0``, ``scores.sum(-1) + parts["bias"] == parts["logit"]`` (the explained value).
    """
    modules = head_layers(target.head) if target.head is not None else None
    rule = BiasRule(biases, eps)
    result, acts = record(model, batch, target, mlp=True)
    positions = result.resolved.positions
    dtype = batch.arch.work_dtype
    device = batch.mask.device
    scores = torch.zeros(batch.size, batch.length, dtype=dtype, device=device)
    bias = torch.zeros(batch.size, dtype=dtype, device=device)
    for b in range(batch.size):
        idx = real_positions(batch, b)
        t = torch.tensor([local_index(idx, positions[b])], device=device)
        final = decompose_item(model, acts, b, idx, t, rule, chunk_size).layers[-1][0]
        if modules is None:
            contrib = torch.linalg.vector_norm(final, dim=-1)
        else:
            real = result.resid[b, positions[b]]
            per_class = through_head(final, modules, rule, real)
            item = result.resolved.index(torch.tensor([b], device=positions.device))
            contrib = item.select_grid(per_class[None])[0]
        scores[b, idx] = contrib[:-1]
        bias[b] = contrib[-1]
    parts = {"bias": bias}
    meta: dict[str, Any] = {
        "target_position_only": result.position_only,
        "through": "ℓ2 norms" if modules is None else "→".join(type(m).__name__ for m in modules),
    }
    if result.value is not None and modules is not None:
        parts["logit"] = result.value.detach().to(dtype)
        meta["explained_value"] = result.value.detach().cpu()
    return MethodOutput(scores, result.resolved, parts=parts, meta=meta)


def decompx_layers(
    model: Any,
    inputs: Any,
    *,
    biases: Biases = "absdot",
    chunk_size: int | None = None,
    eps: float = 0.0,
) -> tuple[Batch, list[ItemDecomposition]]:
    """Every layer's DecompX decomposition of every real row of every item (for inspection).

    Returns the batch and one :class:`ItemDecomposition` per item whose ``layers[l]`` is
    ``[T_b, T_b + 1, d_model]`` (sources: the item's real tokens, then the bias slot).
    """
    Option("absdot", choices=BIAS_MODES).validate("decompx_layers", "biases", biases)
    CHUNK_OPTION.validate("decompx_layers", "chunk_size", chunk_size)
    EPS_OPTION.validate("decompx_layers", "eps", eps)
    batch, target = prepare(model, inputs, None)
    with no_grad_context(model):
        _, acts = record(model, batch, target, mlp=True)
        items = [
            decompose_item(
                model,
                acts,
                b,
                real_positions(batch, b),
                None,
                BiasRule(biases, eps),
                chunk_size,
                keep=True,
            )
            for b in range(batch.size)
        ]
    return batch, items


__all__ = ["decompx", "decompx_layers", "globenc", "globenc_matrix"]
