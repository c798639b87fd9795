"""Test-only oracle: LRP / AttnLRP with explicit rules, layer by layer, in plain torch.

Independent of the hook implementation: the forward pass is re-written from the model's weights
(GPT-2 shape: LayerNorm, learned positions, GELU MLP; Llama shape: RMSNorm, rotary, GQA, gated
SiLU MLP), single sequence, no autograd, no TransformerLens hooks. Relevance then flows from the
explained logit back to the embeddings with the explicit rules:

- linear maps ``z = x W + b``: ε-rule with ε = 0, ``R_x = x ⊙ ((R_z / z) Wᵀ)`` (the bias
  absorbs its share); residual sums ``y = a + b``: ``R_a = a/y ⊙ R_y``.
- LayerNorm with detached σ: the linear map ``(x − μ)·w/σ + b`` (ε-rule);
  RMSNorm ``x·w/σ``: identity ``R_x = R_y``.
- elementwise activations: identity rule ``R_h = R_a``.
- attention ``z = A v``: CP-LRP (A constant, ε-rule into v) or AttnLRP uniform rule (each term's
  relevance ``A_ij v_jd / z_id · R_id`` split half to ``A_ij`` and half to ``v_jd``);
  ``s = q·k/√d``: uniform rule (half to q, half to k); softmax (AttnLRP):
  ``R_s = s ⊙ (R_A − A · Σ_j R_A)`` with ``s`` the scores (zero at masked entries).
- gated MLP ``φ(g)·u``: CP-LRP all to ``u``; AttnLRP half to ``u``, half (identity through φ)
  to ``g``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tests.tl_versions import BRIDGE, rotary_facts


def div(num: Tensor, den: Tensor) -> Tensor:
    """num/den with 0 where den == 0 (ε = 0 with the usual 0/0 := 0 convention)."""
    zero = den == 0
    return torch.where(zero, torch.zeros_like(num), num / torch.where(zero, 1.0, den))


def eps_linear(x: Tensor, w: Tensor, z: Tensor, r: Tensor) -> Tensor:
    """ε-rule (ε = 0) for ``z = x @ w (+ b)``: ``R_x = x ⊙ ((R_z / z) @ wᵀ)``."""
    return x * (div(r, z) @ w.T)


def split_sum(parts: list[Tensor], total: Tensor, r: Tensor) -> list[Tensor]:
    """ε-rule for ``total = Σ parts``."""
    u = div(r, total)
    return [p * u for p in parts]


@dataclass
class Norm:
    x: Tensor
    y: Tensor
    w: Tensor
    sigma: Tensor
    kind: str

    def relevance(self, r: Tensor) -> Tensor:
        if self.kind == "RMS":
            return r.clone()  # y_i = x_i · w_i / σ elementwise: identity
        u = div(r, self.y) * self.w
        return self.x * (u - u.mean(-1, keepdim=True)) / self.sigma


def norm_forward(x: Tensor, module: Any, kind: str, eps: float) -> Norm:
    if kind == "RMS":
        sigma = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        return Norm(x, x / sigma * module.w, module.w, sigma, kind)
    c = x - x.mean(-1, keepdim=True)
    sigma = (c.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return Norm(x, c / sigma * module.w + module.b, module.w, sigma, kind)


def gelu_new(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def bias(b: Tensor | None) -> Tensor | float:
    """A bias, or 0 where the model has none (a bridge of a bias-free Llama: ``None``)."""
    return 0.0 if b is None else b


def key_value_weights(at: Any, grouped: bool) -> tuple[Tensor, Tensor, Any, Any]:
    """``W_K, W_V, b_K, b_V`` with one slice per key/value head: TransformerLens 3.9 expands
    grouped-query weights to every query head (its unexpanded ones: ``_W_K`` …); a bridge's
    ``W_K`` are the unexpanded ones already."""
    if grouped and hasattr(at, "_W_K") and not BRIDGE:
        return at._W_K, at._W_V, bias(at._b_K), bias(at._b_V)
    return at.W_K, at.W_V, bias(at.b_K), bias(at.b_V)


def rotary_tables(
    n_pos: int, rotary_dim: int, base: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos/sin of the HF/NeoX rotary angles, computed in float32 like the model's own buffers."""
    half = rotary_dim // 2
    freq = base ** (torch.arange(half, dtype=torch.float32) / half)
    ang = torch.arange(n_pos, dtype=torch.float32)[:, None] / freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, rd: int) -> Tensor:
    """HF/NeoX rotary on the first ``rd`` dims of ``x [pos, head, d]``."""
    h = rd // 2
    a, b, rest = x[..., :h], x[..., h:rd], x[..., rd:]
    c, s = cos[:, None, :h], sin[:, None, :h]
    return torch.cat([a * c - b * s, b * c + a * s, rest], dim=-1)


def rotate_relevance(x: Tensor, y: Tensor, r: Tensor, cos: Tensor, sin: Tensor, rd: int) -> Tensor:
    """ε-rule through the rotation ``y = rot(x)`` (2×2 linear map per pair of dims)."""
    h = rd // 2
    u = div(r, y)
    ua, ub = u[..., :h], u[..., h:rd]
    c, s = cos[:, None, :h], sin[:, None, :h]
    ra = x[..., :h] * (c * ua + s * ub)
    rb = x[..., h:rd] * (-s * ua + c * ub)
    return torch.cat([ra, rb, x[..., rd:] * u[..., rd:]], dim=-1)


@torch.no_grad()
def reference_relevance(
    model: Any, tokens: Tensor, target: int, variant: str = "attnlrp"
) -> dict[str, Tensor]:
    """Relevances of one sequence ``tokens [pos]`` for the logit of ``target`` at the last position.

    Returns ``logit`` (the explained value), ``tokens`` (token-embedding relevance per position),
    ``pos`` (positional-embedding relevance per position, zeros for rotary models), ``heads``
    (``[layer, head, pos]`` relevance of every head output ``z``) and ``logits`` (last row, to check
    the forward pass against the model).
    """
    assert variant in ("lrp", "attnlrp")
    cfg = model.cfg
    n_heads, d_head = cfg.n_heads, cfg.d_head
    n_kv = cfg.n_key_value_heads or n_heads
    group = n_heads // n_kv
    kind = "RMS" if str(cfg.normalization_type).startswith("RMS") else "LN"
    rotary = cfg.positional_embedding_type == "rotary"
    gated = bool(cfg.gated_mlp)
    t_len = tokens.shape[0]
    dtype = model.W_E.dtype
    tok = model.W_E[tokens]
    pos = torch.zeros_like(tok) if rotary else model.W_pos[:t_len]
    cos, sin = (None, None)
    if rotary:
        cos, sin = rotary_tables(t_len, *rotary_facts(model), dtype)
    causal = torch.ones(t_len, t_len, dtype=torch.bool).tril()
    scale = math.sqrt(d_head) if cfg.use_attn_scale else 1.0

    def act(x: Tensor) -> Tensor:
        if cfg.act_fn == "gelu_new":
            return gelu_new(x)
        if cfg.act_fn == "silu":
            return torch.nn.functional.silu(x)
        if cfg.act_fn == "gelu":
            return torch.nn.functional.gelu(x)
        raise NotImplementedError(cfg.act_fn)

    # ------------------------------------------------------------------ forward
    resid = tok + pos
    layers: list[dict[str, Any]] = []
    for block in model.blocks:
        at, mlp = block.attn, block.mlp
        st: dict[str, Any] = {"resid_pre": resid}
        n1 = norm_forward(resid, block.ln1, kind, cfg.eps)
        x = n1.y
        w_k, w_v, b_k, b_v = key_value_weights(at, n_kv != n_heads)
        q = torch.einsum("pm,hmd->phd", x, at.W_Q) + bias(at.b_Q)
        k = torch.einsum("pm,hmd->phd", x, w_k) + b_k
        v = torch.einsum("pm,hmd->phd", x, w_v) + b_v
        qr, kr = (
            (
                rotate(q, cos, sin, rotary_facts(model)[0]),
                rotate(k, cos, sin, rotary_facts(model)[0]),
            )
            if rotary
            else (q, k)
        )
        kq = kr.repeat_interleave(group, dim=1)
        vq = v.repeat_interleave(group, dim=1)
        terms_qk = torch.einsum("ihd,jhd->hijd", qr, kq) / scale
        s = terms_qk.sum(-1)
        s_masked = s.masked_fill(~causal, -torch.inf)
        a = torch.softmax(s_masked, dim=-1)
        terms_av = torch.einsum("hij,jhd->hijd", a, vq)
        z = terms_av.sum(2).permute(1, 0, 2)  # [pos, head, d]
        head_out = torch.einsum("phd,hdm->phm", z, at.W_O)
        attn_out = head_out.sum(1) + bias(at.b_O)
        mid = resid + attn_out
        n2 = norm_forward(mid, block.ln2, kind, cfg.eps)
        if gated:
            gate = n2.y @ mlp.W_gate
            up = n2.y @ mlp.W_in
            prod = act(gate) * up
            post = prod + bias(mlp.b_in)
            st.update(gate=gate, up=up, prod=prod)
        else:
            pre = n2.y @ mlp.W_in + bias(mlp.b_in)
            post = act(pre)
            st.update(pre=pre)
        mlp_out = post @ mlp.W_out + bias(mlp.b_out)
        resid_post = mid + mlp_out
        st.update(
            n1=n1,
            q=q,
            k=k,
            v=v,
            qr=qr,
            kr=kr,
            terms_qk=terms_qk,
            s=s,
            a=a,
            terms_av=terms_av,
            z=z,
            attn_out=attn_out,
            mid=mid,
            n2=n2,
            post=post,
            mlp_out=mlp_out,
            resid_post=resid_post,
        )
        layers.append(st)
        resid = resid_post
    nf = norm_forward(resid, model.ln_final, kind, cfg.eps)
    logits = nf.y[-1] @ model.W_U + bias(model.b_U)
    logit = logits[target]

    # ----------------------------------------------------------------- backward
    r_y = torch.zeros_like(nf.y)
    r_y[-1] = eps_linear(nf.y[-1], model.W_U[:, target : target + 1], logit[None], logit[None])
    r_resid = nf.relevance(r_y)
    heads = torch.zeros(len(layers), n_heads, t_len, dtype=dtype)
    for layer in reversed(range(len(layers))):
        st = layers[layer]
        blk = model.blocks[layer]
        at, mlp = blk.attn, blk.mlp
        r_mid, r_mlp_out = split_sum([st["mid"], st["mlp_out"]], st["resid_post"], r_resid)
        r_post = eps_linear(st["post"], mlp.W_out, st["mlp_out"], r_mlp_out)
        if gated:
            (r_prod,) = split_sum([st["prod"]], st["post"], r_post)  # b_in absorbs its share
            if variant == "lrp":
                r_up, r_gate = r_prod, torch.zeros_like(r_prod)
            else:
                r_up, r_gate = 0.5 * r_prod, 0.5 * r_prod  # identity through φ for the gate
            r_x2 = eps_linear(st["n2"].y, mlp.W_in, st["up"], r_up)
            r_x2 = r_x2 + eps_linear(st["n2"].y, mlp.W_gate, st["gate"], r_gate)
        else:
            r_pre = r_post  # identity rule
            r_x2 = eps_linear(st["n2"].y, mlp.W_in, st["pre"], r_pre)
        r_mid = r_mid + st["n2"].relevance(r_x2)
        r_in, r_attn = split_sum([st["resid_pre"], st["attn_out"]], st["mid"], r_mid)
        u = div(r_attn, st["attn_out"])  # ε-rule through W_O (b_O absorbs its share)
        r_z = st["z"] * torch.einsum("pm,hdm->phd", u, at.W_O)
        heads[layer] = r_z.sum(-1).T
        # z = A v: term (h, i, j, d) relevance
        r_terms = st["terms_av"] * div(r_z.permute(1, 0, 2), st["terms_av"].sum(2))[:, :, None, :]
        share = 1.0 if variant == "lrp" else 0.5
        r_vq = share * r_terms.sum(1).permute(1, 0, 2)  # [pos_j, head, d]
        n_kv = st["v"].shape[1]
        r_v = r_vq.reshape(t_len, n_kv, group, d_head).sum(2)
        r_kr = torch.zeros_like(st["kr"])
        r_qr = torch.zeros_like(st["qr"])
        if variant == "attnlrp":
            r_a = 0.5 * r_terms.sum(-1)  # [head, i, j]
            s = st["s"].masked_fill(~causal, 0.0)
            r_s = s * (r_a - st["a"] * r_a.sum(-1, keepdim=True))
            r_s = r_s.masked_fill(~causal, 0.0)
            r_tqk = st["terms_qk"] * div(r_s, st["terms_qk"].sum(-1))[..., None]
            r_qr = 0.5 * r_tqk.sum(2).permute(1, 0, 2)
            r_kq = 0.5 * r_tqk.sum(1).permute(1, 0, 2)
            r_kr = r_kq.reshape(t_len, n_kv, group, d_head).sum(2)
        if rotary:
            rd = rotary_facts(model)[0]
            r_q = rotate_relevance(st["q"], st["qr"], r_qr, cos, sin, rd)
            r_k = rotate_relevance(st["k"], st["kr"], r_kr, cos, sin, rd)
        else:
            r_q, r_k = r_qr, r_kr
        w_k, w_v, _, _ = key_value_weights(at, n_kv != n_heads)
        x1 = st["n1"].y
        r_x1 = torch.zeros_like(x1)
        for h in range(n_heads):
            r_x1 += eps_linear(x1, at.W_Q[h], st["q"][:, h], r_q[:, h])
        for h in range(n_kv):
            r_x1 += eps_linear(x1, w_k[h], st["k"][:, h], r_k[:, h])
            r_x1 += eps_linear(x1, w_v[h], st["v"][:, h], r_v[:, h])
        r_resid = r_in + st["n1"].relevance(r_x1)
    r_tok, r_pos = split_sum([tok, pos], tok + pos, r_resid)
    return {
        "logit": logit,
        "logits": logits,
        "tokens": r_tok.sum(-1),
        "pos": r_pos.sum(-1),
        "heads": heads,
    }
