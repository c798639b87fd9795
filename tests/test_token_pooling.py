"""Norm pooling of Gradient×Input and Integrated Gradients over ``d_model`` (``pooling="l1"``/
``"l2"``, the ℓ1 aggregation of the NormXLogit paper's faithfulness tables).

Oracles: plain autograd on the unhooked model (G×I, and IG with a fixed rule computed node by
node); for adaptive IG the per-dimension vectors taken at the final panels, whose signed sum over
``d`` must reproduce the signed (``pooling="sum"``) scores; batched == single; the per-item and
lockstep paths agree.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lens_attrib.backend import arch_of, embedding_hooks
from lens_attrib.inputs import to_batch
from lens_attrib.methods import integrated_gradients as ig
from lens_attrib.methods.integrated_gradients import quadrature
from lens_attrib.methods.registry import attribute
from lens_attrib.target import Target
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama
from tests.tl_versions import BRIDGE

F64 = torch.float64
PROMPTS = ["the dog sees the cat near the house", "a man likes books", "the keys to the cabinet"]
POOL = {
    "l1": lambda v: v.abs().sum(-1),
    "l2": lambda v: v.norm(dim=-1),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def _grad_x_input_vectors(model, text: str, names: list[str], scale: float = 1.0):
    """``Σ_k e^k ⊙ ∂f/∂e^k`` per token ``[pos, d]`` with plain autograd, the embeddings at
    ``names`` multiplied by ``scale`` (``f``: the logit of the prediction on the real input)."""
    tokens = to_batch(model, [text]).tokens
    with torch.no_grad():
        predicted = int(model(tokens)[0, -1].argmax())
    store = {}

    def keeper(name: str):
        def keep(x, hook):
            x = (scale * x).detach().requires_grad_(True)
            store[name] = x
            return x

        return keep

    with torch.enable_grad(), model.hooks(fwd_hooks=[(n, keeper(n)) for n in names]):
        f = model(tokens)[0, -1, predicted]
        grads = torch.autograd.grad(f, [store[n] for n in names])
    return store, grads


@pytest.mark.parametrize("pooling", ["l1", "l2"])
def test_grad_x_input_norms_equal_hand_written_autograd(pooling) -> None:
    model = tiny_gpt2(dtype=F64)
    names = embedding_hooks(arch_of(model), "full")
    assert len(names) == 2  # token and learned positions
    store, grads = _grad_x_input_vectors(model, PROMPTS[0], names)
    vectors = sum(store[n][0] * g[0] for n, g in zip(names, grads))
    got = attribute(model, PROMPTS[0], method="grad_x_input", pooling=pooling)
    assert _rel(got.scores[0], POOL[pooling](vectors)) < 1e-12
    signed = attribute(model, PROMPTS[0], method="grad_x_input")
    assert _rel(signed.scores[0], vectors.sum(-1)) < 1e-12
    assert bool((got.scores[0] >= signed.scores[0].abs() - 1e-12).all())  # a norm bounds |Σ|


def test_grad_x_input_l1_on_an_encoder_is_taken_at_the_token_embedding() -> None:
    model = tiny_bert(dtype=F64)
    text = "the cat sat on the mat"
    (name,) = embedding_hooks(arch_of(model), "partial")
    if BRIDGE:  # the library's 3.9 encoder names, mapped to the BERT bridge's hook points
        from lens_attrib.backend_bridge import encoder_hook_names

        name = encoder_hook_names(model)[name]
    tokens = to_batch(model, [text]).tokens
    store = {}

    def keep(x, hook):
        x = x.detach().requires_grad_(True)
        store["e"] = x
        return x

    with torch.enable_grad(), model.hooks(fwd_hooks=[(name, keep)]):
        logits = model(tokens)
        f = logits[0, -1, int(logits[0, -1].argmax())]
        (g,) = torch.autograd.grad(f, [store["e"]])
    got = attribute(model, text, Target(position=-1), method="grad_x_input", pooling="l1")
    assert _rel(got.scores[0], (store["e"] * g)[0].abs().sum(-1)) < 1e-12


@pytest.mark.parametrize("pooling", ["l1", "l2"])
def test_fixed_rule_ig_norms_equal_the_integral_node_by_node(pooling) -> None:
    """Zero baseline, token embedding only (GPT-2's default): ``v = e ⊙ Σ_s w_s ∇f(α_s e)``."""
    model = tiny_gpt2(dtype=F64)
    alphas, weights = quadrature(6, "gausslegendre")
    total = None
    names = embedding_hooks(arch_of(model), "partial")
    for a, w in zip(alphas, weights):
        _, grads = _grad_x_input_vectors(model, PROMPTS[1], names, scale=a)
        total = w * grads[0] if total is None else total + w * grads[0]
    assert total is not None
    store, _ = _grad_x_input_vectors(model, PROMPTS[1], names)
    vectors = (store[names[0]] * total)[0].detach()
    got = attribute(
        model, PROMPTS[1], method="integrated_gradients", n_steps=6, baseline="zero",
        keep_sink=False, pooling=pooling,
    )  # fmt: skip
    assert _rel(got.scores[0], POOL[pooling](vectors)) < 1e-12
    signed = attribute(
        model, PROMPTS[1], method="integrated_gradients", n_steps=6, baseline="zero",
        keep_sink=False,
    )  # fmt: skip
    assert _rel(signed.scores[0], vectors.sum(-1)) < 1e-12
    gap = got.meta["completeness_gap"]
    assert torch.equal(torch.as_tensor(gap), torch.as_tensor(signed.meta["completeness_gap"]))


def _adaptive(model, prompts, pooling: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attribute(
            model, prompts, method="integrated_gradients", tolerance=1e-6, pooling=pooling
        )


@pytest.mark.parametrize("path", ["lockstep, kept", "lockstep, final pass", "per item"])
def test_adaptive_ig_vectors_reproduce_the_signed_rule(path, monkeypatch) -> None:
    """The vectors integrated over the final panels sum over ``d`` to the adaptive signed
    scores, whether kept from the rounds (lockstep, the default), taken in one more pass over
    the final nodes (lockstep where they do not fit in memory), or per item (the oracle)."""
    monkeypatch.setattr(ig, "LOCKSTEP", path != "per item")
    if path == "lockstep, final pass":
        monkeypatch.setattr(ig, "vectors_fit", lambda paths, max_steps: False)
    model = tiny_llama(dtype=F64)
    taken: list[torch.Tensor] = []
    passes: list[int] = []
    real_pass, real_lockstep = ig.final_rule_vectors, ig.lockstep_adaptive

    def spy_pass(model, path, names, head, edges, rule, rows):
        passes.append(len(edges))
        total = real_pass(model, path, names, head, edges, rule, rows)
        vec = sum(d * t for d, t in zip(path.deltas, total))[0]
        taken.append(vec[int(path.prepended) :].detach())
        return total

    def spy_lockstep(*args, **kwargs):
        out = real_lockstep(*args, **kwargs)
        # tiny_llama prompts: no prepended sink, the vectors cover the item's tokens
        taken.extend(r.vectors.detach() for r in out[0] if r.vectors is not None)
        return out

    real_final = ig.final_vectors
    held: list[tuple[int, int]] = []

    def spy_final(kept, edges):
        held.append((len(kept), len(edges) - 1))
        return real_final(kept, edges)

    monkeypatch.setattr(ig, "final_rule_vectors", spy_pass)
    monkeypatch.setattr(ig, "lockstep_adaptive", spy_lockstep)
    monkeypatch.setattr(ig, "final_vectors", spy_final)
    pooled = _adaptive(model, PROMPTS, "l1")
    signed = _adaptive(model, PROMPTS, "sum")
    assert len(taken) == len(PROMPTS)
    assert bool(passes) == (path != "lockstep, kept")  # kept: no second pass
    # only the current panels' integrals are held (a bisected panel's is dropped)
    assert all(n_kept == n_panels for n_kept, n_panels in held)
    assert len(held) == (len(PROMPTS) if path == "lockstep, kept" else 0)
    assert not any(pooled.meta["prepended_sink"])
    assert pooled.meta["n_steps"] == signed.meta["n_steps"]
    assert pooled.meta["panels"] == signed.meta["panels"]
    for i, vec in enumerate(taken):
        assert _rel(vec.sum(-1), signed.item_scores(i)) < 1e-12
        assert _rel(pooled.item_scores(i), vec.abs().sum(-1)) < 1e-12


def test_kept_vectors_equal_the_final_pass_with_a_sink_padding_and_an_encoder(
    monkeypatch,
) -> None:
    """Lockstep with kept panel integrals == lockstep with a pass over the final nodes: on
    Llama token ids without a start token (a prepended sink, a left-padded batch, panels
    bisected), and on an encoder (right padding)."""
    llama, bert = tiny_llama(dtype=F64), tiny_bert(dtype=F64)
    batch = to_batch(llama, PROMPTS)
    ids = [t[m][1:].tolist() for t, m in zip(batch.tokens, batch.mask)]  # the start token dropped
    for model, inputs in ((llama, ids), (bert, PROMPTS)):
        kept = _adaptive(model, inputs, "l2")
        with monkeypatch.context() as m:
            m.setattr(ig, "vectors_fit", lambda paths, max_steps: False)
            final = _adaptive(model, inputs, "l2")
        assert kept.meta["panels"] == final.meta["panels"]
        assert _rel(kept.scores, final.scores) < 1e-12
        assert torch.equal(kept.meta["completeness_gap"], final.meta["completeness_gap"])
        if model is llama:
            assert all(kept.meta["prepended_sink"]) and max(kept.meta["panels"]) > 2
            assert not bool(kept.mask.all())


def test_adaptive_ig_norm_batched_equals_single() -> None:
    model = tiny_llama(dtype=F64)
    batched = _adaptive(model, PROMPTS, "l2")
    for i, prompt in enumerate(PROMPTS):
        alone = _adaptive(model, [prompt], "l2")
        assert _rel(batched.item_scores(i), alone.item_scores(0)) < 1e-12


def test_unknown_pooling_is_a_clear_error() -> None:
    model = tiny_gpt2(dtype=F64)
    with pytest.raises(Exception, match="pooling"):
        attribute(model, PROMPTS[0], method="grad_x_input", pooling="max")


@pytest.mark.parametrize("pooling", ["l1", "l2"])
def test_deeplift_norms_pool_the_vectors_whose_sum_is_the_signed_score(
    pooling, monkeypatch
) -> None:
    """DeepLIFT's vectors ``(e − b) ⊙ ∂̃f/∂e`` (the signed scores' summands, checked against
    Captum in ``tests/test_deeplift.py``) pooled by the norm; ``meta``'s sums stay signed."""
    from lens_attrib.methods import deeplift as module

    model = tiny_llama(dtype=F64)
    seen: list[torch.Tensor] = []
    real = module.grad_x_input_scores

    def spy(xs, grads, pooling="sum"):
        seen.append(sum(x * g for x, g in zip(xs, grads)).detach())
        return real(xs, grads, pooling)

    monkeypatch.setattr(module, "grad_x_input_scores", spy)
    signed = attribute(model, PROMPTS, method="deeplift")
    vectors = seen[-1]
    pooled = attribute(model, PROMPTS, method="deeplift", pooling=pooling)
    shift = vectors.shape[1] - signed.scores.shape[1]  # a prepended sink column
    mask = signed.mask.to(vectors.device)
    assert _rel(signed.scores, vectors.sum(-1)[:, shift:] * mask) < 1e-12
    assert _rel(pooled.scores, POOL[pooling](vectors)[:, shift:] * mask) < 1e-12
    for key in ("relevance_sum", "completeness_gap", "baseline_value"):
        assert torch.equal(pooled.meta[key], signed.meta[key]), key


@pytest.mark.parametrize("lockstep", [True, False])
@pytest.mark.parametrize("pooling", ["l1", "l2"])
def test_pooled_ig_keeps_the_signed_scores_of_its_pass(lockstep, pooling, monkeypatch) -> None:
    """``meta["signed_scores"]`` of a pooled call == the ``pooling="sum"`` call's scores (the
    same adaptive panels), padding included; :func:`signed_variant` gives that Attribution."""
    from lens_attrib.method_variants import signed_variant

    monkeypatch.setattr(ig, "LOCKSTEP", lockstep)
    model = tiny_llama(dtype=F64)
    pooled = _adaptive(model, PROMPTS, pooling)
    signed = _adaptive(model, PROMPTS, "sum")
    assert "signed_scores" not in signed.meta
    kept = pooled.meta["signed_scores"]
    assert kept.shape == signed.scores.shape
    assert _rel(kept, signed.scores) < 1e-12
    assert not bool(kept[~pooled.mask].any())  # zero at padding, as the scores
    derived = signed_variant(pooled)
    assert torch.equal(derived.scores, kept)
    assert derived.meta["options"]["pooling"] == "sum"
    assert "signed_scores" not in derived.meta
    assert pooled.meta["options"]["pooling"] == pooling  # the pooled one is left as it was
    for i in range(len(PROMPTS)):
        assert _rel(derived.item_scores(i), signed.item_scores(i)) < 1e-12
    for key in ("completeness_gap", "relevance_sum", "explained_value", "baseline_value"):
        assert torch.equal(derived.meta[key], signed.meta[key]), key


def test_pooled_ig_signed_scores_on_fixed_steps_and_a_generation() -> None:
    """The fixed-rule path and a generation's shared path keep the signed scores too; after the
    explained position of a causal model they are zero, as the scores."""
    model = tiny_gpt2(dtype=F64)
    target = Target(generate=3)
    common = {"method": "integrated_gradients", "n_steps": 6}
    pooled = attribute(model, PROMPTS[:2], target, pooling="l1", **common)
    signed = attribute(model, PROMPTS[:2], target, **common)
    assert _rel(pooled.meta["signed_scores"], signed.scores) < 1e-12
    fixed = attribute(model, PROMPTS, pooling="l2", **common)
    plain = attribute(model, PROMPTS, **common)
    assert _rel(fixed.meta["signed_scores"], plain.scores) < 1e-12


def test_signed_variant_of_an_attribution_without_signed_scores_is_an_error() -> None:
    from lens_attrib.method_variants import signed_variant

    model = tiny_gpt2(dtype=F64)
    plain = attribute(model, PROMPTS[0], method="integrated_gradients", n_steps=4)
    with pytest.raises(ValueError, match="pooling='sum'"):
        signed_variant(plain)


def test_word_aggregation_reduces_the_signed_scores_with_the_scores() -> None:
    from lens_attrib.aggregate import to_words

    model = tiny_gpt2(dtype=F64)
    pooled = attribute(model, PROMPTS, method="integrated_gradients", n_steps=4, pooling="l1")
    words = to_words(pooled, reduce="sum")
    signed_words = to_words(
        attribute(model, PROMPTS, method="integrated_gradients", n_steps=4), reduce="sum"
    )
    assert words.meta["signed_scores"].shape == words.scores.shape
    assert _rel(words.meta["signed_scores"], signed_words.scores) < 1e-12
