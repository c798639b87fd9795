"""ALTI and ALTI-Logit: exact decomposition, reconstruction, independent reference mixing
matrices (both affine conventions, with and without the L1 ε), chunking, batching, GQA,
encoders, custom heads, SmolLM2. Equality with the official code: test_alti_official.py."""

from __future__ import annotations

import warnings

import einops
import pytest
import torch
from torch import nn

from lens_attrib.backend import norm_params as affine_of
from lens_attrib.backend import output_weights, value_weights
from lens_attrib.hooks.guard import model_guard
from lens_attrib.methods import attribute
from lens_attrib.methods.alti import alti, alti_logit, alti_mixing_matrices
from lens_attrib.methods.alti_mixing import (
    PostNorm,
    attention_bias,
    head_outputs,
    norm_params,
    transformed_vectors,
    value_bias,
)
from lens_attrib.target import Target, TargetError
from lens_attrib.tiny_models import TINY_DECODERS, tiny_bert, tiny_llama

PROMPTS = ["the dog sees the cat", "a man likes the keys of the cabinet near the table"]
DECODERS = sorted(TINY_DECODERS)


@pytest.fixture(scope="module")
def models64():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {k: f(dtype=torch.float64) for k, f in TINY_DECODERS.items()}


@pytest.fixture(scope="module")
def bert64():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_bert(dtype=torch.float64)


def total_of(a) -> torch.Tensor:
    p = a.parts
    return a.scores.sum(-1) + p["mlp"].sum(-1) + p["attn_bias"].sum(-1) + p["embedding"] + p["bias"]


# ---------------------------------------------------------------- exact decomposition
@pytest.mark.parametrize("arch", DECODERS)
@pytest.mark.parametrize("foil", [None, "dogs"])
def test_decomposition_is_exact(models64, arch, foil):
    model = models64[arch]
    target = Target(foil=foil)
    a = alti_logit(model, PROMPTS, target, chunk_size=4)
    assert torch.allclose(total_of(a), a.parts["logit"], atol=1e-8, rtol=0)
    # the explained value is the model's own logit (difference)
    with torch.no_grad():
        logits = model(a.token_ids, attention_mask=a.mask.long())
    rows = logits[torch.arange(2), a.target.positions]
    expected = rows[torch.arange(2), a.target.token_ids]
    if foil is not None:
        expected = expected - rows[torch.arange(2), a.target.foil_ids]
    assert torch.allclose(a.parts["logit"], expected, atol=1e-10)
    # layer scores add up to scores; heads add up to the untraced layer contributions
    assert torch.allclose(a.layer_scores.sum(1), a.scores, atol=1e-12)
    assert torch.allclose(a.head_token_scores.sum(-1), a.head_scores, atol=1e-12)
    assert torch.allclose(a.head_scores.sum((1, 2)), a.scores.sum(-1), atol=1e-10)
    assert (a.scores[~a.mask] == 0).all() and (a.head_token_scores[..., ~a.mask[0]][0] == 0).all()


@pytest.mark.parametrize("l1_eps", [0.0, 1e-3])
def test_decomposition_at_other_position(models64, l1_eps):
    a = alti_logit(models64["gpt2"], PROMPTS, Target(position=2), l1_eps=l1_eps)
    r = alti(models64["gpt2"], PROMPTS, Target(position=2), l1_eps=l1_eps)
    assert torch.allclose(total_of(a), a.parts["logit"], atol=1e-8, rtol=0)
    # causal: tokens after the target get nothing (also from the ε artifact)
    for b in range(2):
        t = int(a.target.positions[b])
        assert (a.scores[b, t + 1 :] == 0).all() and (r.layer_scores[b, :, t + 1 :] == 0).all()
        assert (r.layer_scores[b, :, : t + 1] > 0).any()


def test_bad_options_raise(models64):
    model = models64["gpt2"]
    with pytest.raises(ValueError, match="affine"):
        alti_logit(model, PROMPTS, affine="bias")
    with pytest.raises(ValueError, match="l1_eps"):
        alti(model, PROMPTS, l1_eps=-1e-6)


def reference_u(model, a) -> torch.Tensor:
    """Final norm folded into the head direction, from the model's own norm scale."""
    _, cache = model.run_with_cache(a.token_ids, attention_mask=a.mask.long())
    idx = torch.arange(a.token_ids.shape[0])
    resid = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][idx, a.target.positions]
    d = model.unembed.W_U[:, a.target.token_ids].T
    ln = model.ln_final
    center, w, _, _ = affine_of(ln)
    if center:
        resid_c = resid - resid.mean(-1, keepdim=True)
        scale = (resid_c.pow(2).mean(-1) + norm_eps(ln)).sqrt()
        u = d * w
        u = (u - u.mean(-1, keepdim=True)) / scale[:, None]
    else:
        scale = (resid.pow(2).mean(-1) + norm_eps(ln)).sqrt()
        u = d * w / scale[:, None]
    return u, cache


def norm_eps(ln) -> float:
    """The norm's ε (TransformerLens 3.9: ``ln.eps``; the bridge: its Hugging Face module's)."""
    if hasattr(ln, "original_component"):
        hf = ln.original_component
        return float(getattr(hf, "variance_epsilon", None) or hf.eps)
    return float(ln.eps)


@pytest.mark.parametrize("affine", ["source", "separate"])
@pytest.mark.parametrize("arch", DECODERS)
def test_head_mlp_and_embedding_parts_match_cache(models64, arch, affine):
    """Per-head contributions = z_h W_O^h · u (official) or that minus its value-bias share
    (``affine="separate"``); with ``attn_bias`` they give attn_out · u; MLP part = mlp_out · u."""
    model = models64[arch]
    a = alti_logit(model, PROMPTS, affine=affine)
    assert torch.allclose(total_of(a), a.parts["logit"], atol=1e-8, rtol=0)
    u, cache = reference_u(model, a)
    idx, pos = torch.arange(2), a.target.positions
    emb = cache["blocks.0.hook_resid_pre"][idx, pos]
    assert torch.allclose(a.parts["embedding"], (emb * u).sum(-1), atol=1e-10)
    for layer in range(model.cfg.n_layers):
        attn = model.blocks[layer].attn
        w_v, b_v = value_weights(attn, model.cfg.n_heads)
        w_o, b_o = output_weights(attn)
        z = cache[f"blocks.{layer}.attn.hook_z"][idx, pos]  # [b, head, d_head]
        per_head = torch.einsum("bhk,hkd,bd->bh", z, w_o, u)
        theta = b_v.clone()
        ln1_bias = affine_of(model.blocks[layer].ln1)[2]
        if ln1_bias is not None:
            theta = theta + torch.einsum("d,hdk->hk", ln1_bias, w_v)
        bias_share = torch.einsum("hk,hkd,bd->bh", theta, w_o, u)  # Σ_j α = 1
        expected = per_head if affine == "source" else per_head - bias_share
        assert torch.allclose(a.head_scores[:, layer], expected, atol=1e-10)
        if affine == "source":
            assert torch.allclose(a.parts["attn_bias"][:, layer], u @ b_o, atol=1e-10)
        attn_out = cache[f"blocks.{layer}.hook_attn_out"][idx, pos]
        assert torch.allclose(
            a.head_scores[:, layer].sum(-1) + a.parts["attn_bias"][:, layer],
            (attn_out * u).sum(-1),
            atol=1e-10,
        )
        mlp = cache[f"blocks.{layer}.hook_mlp_out"][idx, pos]
        assert torch.allclose(a.parts["mlp"][:, layer], (mlp * u).sum(-1), atol=1e-10)


# ---------------------------------------------------------------- reference mixing
def reference_decoder_layer(model, cache, layer, b, affine="source"):
    """Naive ALTI transformed vectors from weights and the linearized ln1 (no cached values).

    ``affine="source"`` (official): ``T_i(x_j)`` includes ``Σ_h α^h_ij θ^h W_O^h`` and the bias is
    ``b_O``; "separate": the linear part only, the ``A·θ`` term in the bias."""
    block = model.blocks[layer]
    x = cache[f"blocks.{layer}.hook_resid_pre"][b]
    scale = cache[f"blocks.{layer}.ln1.hook_scale"][b]
    alpha = cache[f"blocks.{layer}.attn.hook_pattern"][b]
    center, ln_w, ln_b, _ = affine_of(block.ln1)
    w_v, b_v = value_weights(block.attn, model.cfg.n_heads)
    w_o, b_o = output_weights(block.attn)
    lin = x - x.mean(-1, keepdim=True) if center else x
    lin = lin / scale * ln_w
    w_ov = torch.einsum("hdk,hke->hde", w_v, w_o)
    n = x.shape[0]
    t = torch.zeros(n, n, x.shape[-1], dtype=x.dtype)
    for i in range(n):
        for j in range(n):
            t[i, j] = torch.einsum("h,d,hde->e", alpha[:, i, j], lin[j], w_ov)
        t[i, i] += x[i]
    theta = b_v.clone()
    if ln_b is not None:
        theta = theta + torch.einsum("d,hdk->hk", ln_b, w_v)
    theta_o = torch.einsum("hk,hke->he", theta, w_o)
    affine_term = torch.einsum("hij,he->ije", alpha, theta_o)
    if affine == "source":
        t = t + affine_term
        bias = b_o.expand(n, -1)
    else:
        bias = b_o + affine_term.sum(1)
    if model.cfg.parallel_attn_mlp:
        y = x + cache[f"blocks.{layer}.hook_attn_out"][b]
    else:
        y = cache[f"blocks.{layer}.hook_resid_mid"][b]
    return t, bias, y


def reference_mixing(t, y, eps=0.0):
    """``c_ij = max(0, ‖y_i‖₁ − ‖t_ij − y_i + ε‖₁)`` over every pair (i, j), row-normalized."""
    y_norm = y.abs().sum(-1)
    c = torch.clamp(y_norm[:, None] - (t - y[:, None] + eps).abs().sum(-1), min=0)
    return c / c.sum(-1, keepdim=True)


@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("affine", ["source", "separate"])
@pytest.mark.parametrize("arch", DECODERS)
def test_reconstruction_and_reference_mixing(models64, arch, affine, eps):
    model = models64[arch]
    text = PROMPTS[1]
    batch, _, mats = alti_mixing_matrices(model, text, chunk_size=3, affine=affine, l1_eps=eps)
    _, cache = model.run_with_cache(batch.tokens)
    for layer in range(model.cfg.n_layers):
        t, bias, y = reference_decoder_layer(model, cache, layer, 0, affine)
        assert torch.allclose(t.sum(1) + bias, y, atol=1e-10)  # reconstruction (reference)
        # the library's own transformed vectors rebuild resid_mid too
        block = model.blocks[layer]
        v = cache[f"blocks.{layer}.attn.hook_v"][0]
        theta = value_bias(block.attn, norm_params(block.ln1), v.shape[-2])
        w_o, b_o = output_weights(block.attn)
        if affine == "separate":
            o = head_outputs(v - theta, w_o)
        else:
            o, theta = head_outputs(v, w_o), None
        alpha = cache[f"blocks.{layer}.attn.hook_pattern"][0]
        x = cache[f"blocks.{layer}.hook_resid_pre"][0]
        n = x.shape[0]
        lib_t = transformed_vectors(alpha, o, x, slice(0, n))  # [j, i, d]
        lib_bias = attention_bias(alpha, theta, w_o, b_o)
        assert torch.allclose(lib_t.sum(0) + lib_bias, y, atol=1e-10)
        assert torch.allclose(lib_t.transpose(0, 1), t, atol=1e-10)
        # the reference scores every pair, so later tokens get the ε artifact (zero for ε = 0)
        assert torch.allclose(mats[layer][0], reference_mixing(t, y, eps), atol=1e-10)


@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("affine", ["source", "separate"])
def test_encoder_reconstruction_and_reference_mixing(bert64, affine, eps):
    model = bert64
    batch, _, mats = alti_mixing_matrices(
        model, PROMPTS[0], chunk_size=2, affine=affine, l1_eps=eps
    )
    _, cache = model.run_with_cache(batch.tokens)
    for layer in range(model.cfg.n_layers):
        block = model.blocks[layer]
        x = cache[f"blocks.{layer}.hook_resid_pre"][0]
        alpha = cache[f"blocks.{layer}.attn.hook_pattern"][0]
        scale = cache[f"blocks.{layer}.ln1.hook_scale"][0]
        y = cache[f"blocks.{layer}.ln1.hook_normalized"][0] * block.ln1.w + block.ln1.b
        w_ov = torch.einsum("hdk,hke->hde", block.attn.W_V, block.attn.W_O)
        z = torch.einsum("hij,jd,hde->ije", alpha, x, w_ov) + torch.diag_embed(x.T).permute(1, 2, 0)
        affine_term = torch.einsum("hij,hk,hke->ije", alpha, block.attn.b_V, block.attn.W_O)
        pre_bias = block.attn.b_O.expand_as(x)
        if affine == "source":
            z = z + affine_term
        else:
            pre_bias = pre_bias + affine_term.sum(1)
        t = (z - z.mean(-1, keepdim=True)) / scale[:, None] * block.ln1.w
        bias = (pre_bias - pre_bias.mean(-1, keepdim=True)) / scale * block.ln1.w + block.ln1.b
        assert torch.allclose(t.sum(1) + bias, y, atol=1e-10)
        lib_bias = attention_bias(
            alpha,
            block.attn.b_V if affine == "separate" else None,
            block.attn.W_O,
            block.attn.b_O,
            PostNorm(scale[:, 0], norm_params(block.ln1)),
            block.ln1.b,
        )
        assert torch.allclose(lib_bias, bias, atol=1e-10)
        assert torch.allclose(mats[layer][0], reference_mixing(t, y, eps), atol=1e-10)


# ---------------------------------------------------------------- chunking, batching, GQA
@pytest.mark.parametrize("arch", DECODERS)
def test_chunked_equals_unchunked(models64, arch):
    model = models64[arch]
    full = alti_logit(model, PROMPTS, chunk_size=10_000, trace_heads=True)
    for chunk in (1, 3):
        a = alti_logit(model, PROMPTS, chunk_size=chunk, trace_heads=True)
        assert torch.allclose(a.scores, full.scores, atol=1e-12)
        assert torch.allclose(a.head_token_scores, full.head_token_scores, atol=1e-12)
    for eps in (0.0, 1e-3):
        r1 = alti(model, PROMPTS, chunk_size=1, l1_eps=eps)
        r2 = alti(model, PROMPTS, l1_eps=eps)
        assert torch.allclose(r1.layer_scores, r2.layer_scores, atol=1e-12)


def ungrouped_copy(grouped):
    """The same Llama with every query head owning its own (copied) key/value head."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_llama(dtype=torch.float64, n_key_value_heads=None)
    group = grouped.cfg.n_heads // grouped.cfg.n_key_value_heads
    if hasattr(grouped, "original_model"):  # the bridge: the Hugging Face modules' weights
        target = dict(model.original_model.named_parameters())
        with torch.no_grad():
            for name, p in grouped.original_model.named_parameters():
                if p.shape != target[name].shape:  # k_proj / v_proj: [(kv_head d_head), d_model]
                    heads = einops.rearrange(p, "(n h) m -> n h m", n=grouped.cfg.n_key_value_heads)
                    p = einops.rearrange(heads.repeat_interleave(group, dim=0), "n h m -> (n h) m")
                target[name].copy_(p)
        return model
    state = {}
    for name, p in grouped.state_dict().items():
        if name.split(".")[-1] in ("_W_K", "_W_V", "_b_K", "_b_V"):
            name = name.replace("._", ".")
            p = torch.repeat_interleave(p, group, dim=0)
        state[name] = p
    model.load_state_dict(state, strict=False)
    missing = set(model.state_dict()) - set(state)
    assert all("mask" in k or "IGNORE" in k or "rotary" in k for k in missing), missing
    return model


def test_gqa_matches_ungrouped_copy(models64):
    grouped = models64["llama"]
    ungrouped = ungrouped_copy(grouped)
    with torch.no_grad():
        toks = grouped.to_tokens(PROMPTS[1])
        assert torch.allclose(grouped(toks), ungrouped(toks), atol=1e-10)
    a = alti_logit(grouped, PROMPTS, trace_heads=True)
    b = alti_logit(ungrouped, PROMPTS, trace_heads=True)
    assert torch.allclose(a.scores, b.scores, atol=1e-10)
    assert torch.allclose(a.head_token_scores, b.head_token_scores, atol=1e-10)
    assert torch.allclose(
        alti(grouped, PROMPTS).scores, alti(ungrouped, PROMPTS).scores, atol=1e-10
    )


# ---------------------------------------------------------------- ALTI rollout, encoders, heads
@pytest.mark.parametrize("arch", DECODERS)
def test_alti_rows_are_distributions(models64, arch):
    r = alti(models64[arch], PROMPTS)
    assert torch.allclose(r.layer_scores.sum(-1), torch.ones(2, 3, dtype=torch.float64))
    assert (r.scores >= 0).all() and (r.scores[~r.mask] == 0).all()
    assert torch.equal(r.scores, r.layer_scores[:, -1])


def test_encoder_alti_rows_are_distributions(bert64):
    r = attribute(bert64, PROMPTS, method="alti")
    assert r.scores.shape == r.mask.shape
    assert torch.allclose(r.scores.sum(-1), torch.ones(2, dtype=torch.float64))


def test_minilm_alti(minilm):
    r = alti(minilm, ["the keys to the cabinet are on the table", "a dog"])
    assert torch.allclose(r.scores.sum(-1), torch.ones(2), atol=1e-5)
    assert r.meta["target_position_only"]


def test_linear_head_and_nonlinear_head_error(models64):
    model = models64["gpt2"]
    head = nn.Linear(model.cfg.d_model, 3, dtype=torch.float64)
    a = alti_logit(model, PROMPTS, Target(head=head, token=1, foil=2))
    assert torch.allclose(total_of(a), a.parts["logit"], atol=1e-8)
    with pytest.raises(TargetError, match="linear head"):
        alti_logit(model, PROMPTS, Target(head=lambda x: x[:, :3]))


def test_float32_decomposition_sums_to_the_logit(models64):
    a64 = alti_logit(models64["pythia"], PROMPTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model32 = TINY_DECODERS["pythia"](dtype=torch.float32)
    with torch.no_grad(), model_guard(model32):
        a32 = alti_logit(model32, PROMPTS)
    assert torch.allclose(total_of(a32).double(), a64.parts["logit"], atol=1e-4)


def test_smollm2_decomposition_sums_to_logit(smollm2):
    a = alti_logit(smollm2, "The capital of France is", chunk_size=2)
    logit = a.parts["logit"]
    assert torch.allclose(total_of(a), logit, rtol=1e-3, atol=1e-3 * float(logit.abs().max()))
    assert a.head_scores.shape == (1, 30, 9)
    assert a.meta["target_tokens"] == [" Paris"]
