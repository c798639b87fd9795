"""Gradient baselines: saliency, Gradient×Input (with per-head relevances), Integrated Gradients.

Oracles: a hand-written autograd computation, IG completeness (Σ R = f(x) − f(baseline)), and
the model left unchanged after an exception mid-backward (batched == unbatched and the model
guard on normal calls: tests/test_contract.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lens_attrib.hooks.guard import model_state_fingerprint
from lens_attrib.inputs import to_batch
from lens_attrib.methods.baselines import default_baseline
from lens_attrib.methods.integrated_gradients import quadrature
from lens_attrib.methods.registry import attribute
from lens_attrib.target import Target
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama, tiny_pythia

F64 = torch.float64
PROMPTS = ["the dog sees the cat near the house", "a man likes books", "the keys to the cabinet"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def _by_hand(model, text, foil=None):
    """Gradient×Input and z ⊙ ∂f/∂z with plain autograd on the unhooked model's graph."""
    tokens = to_batch(model, [text]).tokens
    store = {}

    def keeper(name):
        # the name is bound here, not read from hook.name (a bridge reports its own names)
        def keep(x, hook):
            if "embed" in name:  # leaves; z stays in the graph (non-leaf)
                x = x.detach().requires_grad_(True)
            store[name] = x
            return x

        return keep

    names = ["hook_embed", "hook_pos_embed"] + [
        f"blocks.{i}.attn.hook_z" for i in range(model.cfg.n_layers)
    ]
    with torch.enable_grad(), model.hooks(fwd_hooks=[(n, keeper(n)) for n in names]):
        logits = model(tokens)[0, -1]
        y = int(logits.argmax())
        f = logits[y] - (logits[model.tokenizer.convert_tokens_to_ids(foil)] if foil else 0)
        grads = torch.autograd.grad(f, [store[n] for n in names])
    tok = (store["hook_embed"] * grads[0]).sum(-1) + (store["hook_pos_embed"] * grads[1]).sum(-1)
    heads = torch.stack([(store[n] * g).sum(-1)[0].T for n, g in zip(names[2:], grads[2:])])
    return tok[0].detach(), heads.detach(), grads[0][0].detach(), grads[2:]


@pytest.mark.parametrize("foil", [None, "cat"])
def test_grad_x_input_equals_hand_written_autograd(foil) -> None:
    model = tiny_gpt2(dtype=F64)
    tok, heads, _, _ = _by_hand(model, PROMPTS[0], foil)
    a = attribute(model, PROMPTS[0], Target(foil=foil), method="grad_x_input", heads=True)
    assert _rel(a.scores[0], tok) < 1e-12
    assert a.head_token_scores is not None
    assert _rel(a.head_token_scores[0], heads) < 1e-12


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_gradient_heads_are_gradient_norms(norm) -> None:
    model = tiny_gpt2(dtype=F64)
    _, _, g_embed, g_z = _by_hand(model, PROMPTS[0])
    a = attribute(model, PROMPTS[0], method="gradient", norm=norm, heads=True)
    expected = g_embed.abs().sum(-1) if norm == "l1" else g_embed.norm(dim=-1)
    assert _rel(a.scores[0], expected) < 1e-12
    dims = a.parts["head_dim_relevance"][0]  # [layer, head, pos, d_head] = |∂f/∂z|
    g = torch.stack([gz[0].permute(1, 0, 2) for gz in g_z]).abs()
    assert _rel(dims, g) < 1e-12
    assert a.head_scores is not None and a.head_token_scores is not None
    if norm == "l2":
        assert torch.allclose(a.head_token_scores[0], g.norm(dim=-1))
        assert torch.allclose(a.head_scores[0], g.flatten(-2).norm(dim=-1))
    else:
        assert torch.allclose(a.head_scores[0], g.sum((-1, -2)))


# ------------------------------------------------------------------- integrated gradients
def test_quadrature_weights() -> None:
    for rule in ("trapezoid", "riemann", "riemann_left", "riemann_right"):
        alphas, weights = quadrature(10, rule)
        assert sum(weights) == pytest.approx(1.0)
        # exact for linear integrands: ∫ α dα = 1/2
        assert sum(a * w for a, w in zip(alphas, weights)) == pytest.approx(
            0.5 if rule in ("trapezoid", "riemann") else (0.45 if rule == "riemann_left" else 0.55)
        )
    with pytest.raises(ValueError):
        quadrature(10, "simpson")


@pytest.mark.parametrize("rule", ["trapezoid", "riemann"])
@pytest.mark.parametrize("foil", [None, "cat"])
def test_ig_completeness_tiny_gpt2_zero_baseline(rule, foil) -> None:
    model = tiny_gpt2(dtype=F64)
    assert default_baseline(model) == "zero"
    a = attribute(model, PROMPTS, Target(foil=foil), method="integrated_gradients", rule=rule)
    assert a.meta["options"]["baseline"] == "zero"
    delta = a.meta["explained_value"] - a.meta["baseline_value"]
    gap = delta - a.scores.sum(-1)
    assert torch.allclose(gap, a.meta["completeness_gap"])
    assert torch.all(gap.abs() <= 0.01 * delta.abs())


def test_ig_completeness_bert_and_pythia() -> None:
    bert = tiny_bert(dtype=F64)
    a = attribute(
        bert,
        ["the dog [MASK] the cat"],
        Target(token="sees", position=2),
        method="integrated_gradients",
    )
    delta = a.meta["explained_value"] - a.meta["baseline_value"]
    assert torch.all(a.meta["completeness_gap"].abs() <= 0.01 * delta.abs())
    pythia = tiny_pythia(dtype=F64)  # rotary: a zero token embedding is a zero input
    assert default_baseline(pythia) == "pad"
    b = attribute(pythia, PROMPTS, method="integrated_gradients")
    delta = b.meta["explained_value"] - b.meta["baseline_value"]
    assert torch.all(b.meta["completeness_gap"].abs() <= 0.01 * delta.abs())


def test_ig_chunked_equals_unchunked_and_baseline_at_input_gives_zero() -> None:
    model = tiny_llama(dtype=F64)
    batched = attribute(model, PROMPTS, method="integrated_gradients", n_steps=8)
    chunked = attribute(model, PROMPTS, method="integrated_gradients", n_steps=8, step_batch=3)
    assert _rel(chunked.scores, batched.scores) < 1e-12
    x = model.embed(to_batch(model, PROMPTS[0]).tokens).detach()
    same = attribute(model, PROMPTS[0], method="integrated_gradients", n_steps=4, baseline=x)
    assert same.scores.abs().max() == 0


def test_model_unchanged_after_an_exception_mid_backward() -> None:
    model = tiny_gpt2()

    def boom(grad):
        raise RuntimeError("boom in backward")

    def raising(x, hook):  # a user hook whose tensor raises during the backward pass
        if x.requires_grad:
            x.register_hook(boom)
        return x

    model.blocks[1].attn.hook_z.add_hook(raising)
    before = model_state_fingerprint(model)
    for method in ("integrated_gradients", "grad_x_input", "lrp"):
        with pytest.raises(RuntimeError, match="boom"):
            attribute(model, PROMPTS, method=method, n_steps=4) if method.startswith(
                "integrated"
            ) else attribute(model, PROMPTS, method=method)
        assert model_state_fingerprint(model) == before
    model.reset_hooks()


def test_ig_completeness_smollm2(smollm2) -> None:
    # Default baseline on this RMSNorm/rotary model: pad token, attention sink kept (see docs).
    assert default_baseline(smollm2) == "pad"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = attribute(smollm2, "The capital of France is", method="integrated_gradients")
    delta = a.meta["explained_value"] - a.meta["baseline_value"]
    assert torch.all(a.meta["completeness_gap"].abs() <= 0.01 * delta.abs())
