"""ALTI building blocks: transformed vectors, token-mixing matrices and their rollout.

Ferrando et al. 2022 ("Measuring the Mixing of Contextual Information in the Transformer") write
the output of an attention block at position ``i`` as a sum over source tokens ``j``:

    y_i = Σ_j T_i(x_j) + bias_i,
    T_i(x_j) = post_i( Σ_h α^h_ij · v^h_j W_O^h  +  δ_ij · x_j ),      bias_i = post_i(b_O) (+ β),

where ``v^h_j`` is head h's full value vector of token j (``hook_v``: for pre-norm decoders
``v_j = ṽ_j + θ_V`` with the first norm linearized with its actual scale,
``ṽ_j = (c(x_j)/σ_j ⊙ γ₁) W_V`` and ``θ_V = β₁ W_V + b_V``; ``c`` centres for LayerNorm and is the
identity for RMSNorm), and ``post_i`` is the identity for pre-norm decoders and the
post-attention LayerNorm linearized with the scale of row i for post-LN encoders
(``post_i(z) = c(z)/σ_i ⊙ γ``, whose β joins the bias). This is the convention of the official
code (mt-upc/logit-explanations, ``ModelWrapper.get_logit_contributions``): the "affine" term
``α^h_ij θ^h_V W_O^h`` belongs to source token j, and only ``b_O`` is left in the bias.
``affine="separate"`` (not the paper's) uses ``ṽ_j`` instead and moves ``Σ_h (Σ_j α^h_ij) θ^h_V
W_O^h`` (the ``A·θ`` term) into the bias; it makes the token terms independent of where a
checkpoint stores its value biases (``fold_value_biases`` moves ``b_V W_O`` into ``b_O``).

The contribution of token j to token i is

    c_ij = max(0, ‖y_i‖₁ − ‖T_i(x_j) − y_i + ε‖₁),  row-normalized: A_ij = c_ij / Σ_j c_ij,

with ``ε = l1_eps`` added to every coordinate (default 0; the official code measures the distance
with ``torch.nn.functional.pairwise_distance``, which adds ``ε = 1e-6``). In the official code the
causal model's future tokens ``j > i`` (``T_i(x_j) = 0``) then get ``max(0, ‖y_i‖₁ − ‖ε − y_i‖₁)``,
a tiny artifact of ε that is reproduced for ``l1_eps > 0`` (up to the explained position; later
positions get nothing) and is exactly 0 for ``l1_eps = 0``.
MLPs (position-wise) are non-mixing. Contributions of a layer's input positions are traced to the
input tokens with the product of the mixing matrices of the layers below (rollout).

Memory: the ``[rows, T, d_model]`` tensor of transformed vectors exists only for a chunk of query
rows at a time; causal models skip ``j > i``; centring is elementwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor, nn

from lens_attrib.backend import norm_params as backend_norm_params
from lens_attrib.backend import value_weights
from lens_attrib.methods.propagation import trace_rows
from lens_attrib.progress import advance

#: Default budget (elements; ~16 MB in float32, small enough to stay in cache) of one chunk
#: of transformed vectors ``[j, rows, d_model]``.
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class NormParams:
    """A norm layer as ``x ↦ c(x)/σ ⊙ weight + bias`` (``c`` centres when ``center``)."""

    center: bool
    weight: Tensor | None
    bias: Tensor | None
    active: bool = True


def norm_params(module: nn.Module) -> NormParams:
    """Read the affine parameters of a norm (LN, LNPre, RMS, RMSPre, identity; either backend)."""
    return NormParams(*backend_norm_params(module))


def center(x: Tensor) -> Tensor:
    """Subtract the mean over the last dimension (LayerNorm centring, elementwise)."""
    return x - x.mean(-1, keepdim=True)


def value_bias(
    attn: nn.Module, pre_norm: NormParams | None, n_v_heads: int
) -> Float[Tensor, "kv d_head"]:
    """``θ_V = β₁ W_V + b_V``: the part of every value vector that does not depend on the token."""
    w_v, b_v = value_weights(attn, n_v_heads)
    theta = b_v.clone()
    if pre_norm is not None and pre_norm.bias is not None:
        theta = theta + torch.einsum("d,kdh->kh", pre_norm.bias.to(w_v.dtype), w_v)
    return theta


def expand_kv(v: Float[Tensor, "... kv d_head"], n_heads: int) -> Float[Tensor, "... head d_head"]:
    """Map each query head h to its KV head ``h // (n_heads // n_kv_heads)`` (GQA)."""
    group = n_heads // v.shape[-2]
    return v if group == 1 else torch.repeat_interleave(v, group, dim=-2)


def head_outputs(
    v_lin: Float[Tensor, "pos kv d_head"], w_o: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, "head pos d_model"]:
    """``o^h_j = ṽ^{kv(h)}_j W_O^h`` for every head and source position (O(H·T·d))."""
    return torch.einsum("thk,hkd->htd", expand_kv(v_lin, w_o.shape[0]), w_o)


@dataclass(frozen=True)
class PostNorm:
    """A post-attention norm linearized row-wise: ``z ↦ c(z)/σ_i ⊙ weight``."""

    scale: Float[Tensor, "pos"]
    params: NormParams

    def apply(self, z: Tensor, rows: slice) -> Tensor:
        """Apply to ``z [j, rows, d]`` (in place where possible)."""
        if self.params.center:
            z = z - z.mean(-1, keepdim=True)
        z = z / self.scale[rows][None, :, None]
        if self.params.weight is not None:
            z = z * self.params.weight
        return z


def transformed_vectors(
    alpha: Float[Tensor, "head pos pos"],
    o: Float[Tensor, "head pos d_model"],
    x: Float[Tensor, "pos d_model"],
    rows: slice,
    *,
    n_src: int | None = None,
    post: PostNorm | None = None,
    minus: Float[Tensor, "pos d_model"] | None = None,
    o_by_src: Float[Tensor, "src head d_model"] | None = None,
) -> Float[Tensor, "src rows d_model"]:
    """``T_i(x_j)`` for query rows ``i ∈ rows`` and sources ``j < n_src``, laid out ``[j, i, d]``.

    ``Σ_h α^h_ij o^h_j`` is one batched matmul over sources ``j`` (inner dimension: heads); the
    residual ``x_i`` is added on the diagonal; ``post`` linearizes a post-LN with row scales.
    With ``minus`` (only without ``post``) the result is ``T_i(x_j) − minus_i``, fused into the
    matmul. ``o_by_src`` is ``o`` laid out ``[j, h, d]`` (pass it to avoid re-laying it out).
    """
    n_src = alpha.shape[-1] if n_src is None else n_src
    a = einops.rearrange(alpha[:, rows, :n_src], "h i j -> j i h")
    o_j = einops.rearrange(o, "h j d -> j h d") if o_by_src is None else o_by_src
    o_j = o_j[:n_src]
    if minus is not None and post is None:
        base = minus[rows].neg()[None].expand(n_src, -1, -1)
        t = torch.baddbmm(base, a, o_j)
    else:
        t = torch.bmm(a, o_j)
    idx = torch.arange(rows.start, rows.stop, device=x.device)
    t[idx, idx - rows.start] += x[rows]
    if post is not None:
        t = post.apply(t, rows)
        if minus is not None:
            t = t.sub_(minus[rows][None])
    return t


def attention_bias(
    alpha: Float[Tensor, "head pos pos"],
    theta: Float[Tensor, "kv d_head"] | None,
    w_o: Float[Tensor, "head d_head d_model"],
    b_o: Float[Tensor, "d_model"],
    post: PostNorm | None = None,
    post_bias: Tensor | None = None,
) -> Float[Tensor, "pos d_model"]:
    """``bias_i = b_O`` (official convention, ``theta=None``), or with ``affine="separate"``
    ``bias_i = b_O + Σ_h (Σ_j α^h_ij) θ^h W_O^h``; then post-norm'd, plus its β."""
    bias = b_o.expand(alpha.shape[-2], -1)
    if theta is not None:
        theta_o = torch.einsum("hk,hkd->hd", expand_kv(theta, w_o.shape[0]), w_o)
        bias = bias + torch.einsum("hi,hd->id", alpha.sum(-1), theta_o)
    if post is not None:
        bias = post.apply(bias[None], slice(0, bias.shape[0]))[0]
        if post_bias is not None:
            bias = bias + post_bias
    return bias


def auto_chunk(n_src: int, d_model: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, n_src * d_model))


def mixing_matrix(
    alpha: Float[Tensor, "head pos pos"],
    o: Float[Tensor, "head pos d_model"],
    x: Float[Tensor, "pos d_model"],
    y: Float[Tensor, "pos d_model"],
    *,
    causal: bool,
    n_rows: int | None = None,
    chunk_size: int | None = None,
    post: PostNorm | None = None,
    mask: Bool[Tensor, "pos"] | None = None,
    l1_eps: float = 0.0,
) -> Float[Tensor, "pos pos"]:
    """Row-normalized ALTI contributions ``A_ij`` of one item's layer (rows ≥ n_rows: identity).

    ``c_ij = max(0, ‖y_i‖₁ − ‖T_i(x_j) − y_i + ε‖₁)``, ``ε = l1_eps``. Rows are processed in
    chunks of ``chunk_size`` query positions; with ``causal`` the sources of a chunk stop at its
    last row, and the later sources ``i < j < n_rows`` (``T_i(x_j) = 0``) get ``max(0, ‖y_i‖₁ −
    ‖ε − y_i‖₁)``, which is 0 for ε = 0 (the official code's ε artifact otherwise); sources
    ``j ≥ n_rows`` get 0. Padding rows (``mask`` False) are identity rows and padding columns
    are zero.
    """
    n = x.shape[0]
    n_rows = n if n_rows is None else min(n, n_rows)
    out = torch.zeros(n, n, dtype=x.dtype, device=x.device)
    y_norm = y.abs().sum(-1)
    minus = y - l1_eps if l1_eps else y
    o_by_src = einops.rearrange(o, "h j d -> j h d").contiguous()
    step = chunk_size or auto_chunk(n_rows if causal else n, y.shape[-1])
    for start in range(0, n_rows, step):
        stop = min(n_rows, start + step)
        rows = slice(start, stop)
        n_src = stop if causal else n
        t = transformed_vectors(
            alpha, o, x, rows, n_src=n_src, post=post, minus=minus, o_by_src=o_by_src
        )
        dist = torch.linalg.vector_norm(t, ord=1, dim=-1)  # ‖T_i(x_j) − y_i + ε‖₁, [j, i]
        out[rows, :n_src] = torch.clamp(y_norm[rows][:, None] - dist.T, min=0.0)
        advance(0)  # refresh the open bar's clock (long items: seconds per chunk)
    if causal:
        later = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        later[n_rows:] = False
        later[:, n_rows:] = False  # positions after the explained one get nothing
        future = (
            torch.clamp(y_norm - minus.abs().sum(-1), min=0.0)
            if l1_eps
            else torch.zeros_like(y_norm)
        )
        out = torch.where(later, future[:, None], out)
    if mask is not None:
        out = out * mask[None, :].to(out.dtype)
    total = out.sum(-1, keepdim=True)
    out = torch.where(total > 0, out / total.clamp_min(torch.finfo(out.dtype).tiny), 0.0)
    eye = torch.eye(n, dtype=out.dtype, device=out.device)
    fill = torch.ones(n, dtype=torch.bool, device=out.device)
    fill[:n_rows] = total[:n_rows, 0] <= 0
    if mask is not None:
        fill |= ~mask
    return torch.where(fill[:, None], eye, out)


__all__ = [
    "CHUNK_ELEMENTS",
    "NormParams",
    "PostNorm",
    "attention_bias",
    "auto_chunk",
    "center",
    "expand_kv",
    "head_outputs",
    "mixing_matrix",
    "norm_params",
    "trace_rows",
    "transformed_vectors",
    "value_bias",
    "value_weights",
]
