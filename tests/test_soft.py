"""Soft-NC/NS and π-Soft: α bisection, limits, an independent deterministic reference, fixed
routing exactness, seeds, batching."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lens_attrib import attribute
from lens_attrib.attribution import Attribution
from lens_attrib.evaluation.soft import hellinger, keep_scores, kl, soft_metrics, solve_alpha
from lens_attrib.hooks.routing import cache_patterns, fixed_routing_hooks
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore:π unreachable:RuntimeWarning")

PROMPTS = ["the keys to the cabinet", "the dog near the cats is", "a man sees"]
FAST = {"n_draws": 2, "pis": (0.25, 0.5, 0.75)}


@pytest.fixture(scope="module")
def llama():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_llama(dtype=torch.float64)


@pytest.fixture(scope="module")
def attr(llama):
    return attribute(llama, PROMPTS, method="grad_x_input")


def _with_scores(attr: Attribution, fill: float) -> Attribution:
    from dataclasses import replace

    return replace(attr, scores=torch.where(attr.mask, fill, 0.0).to(torch.float64))


def test_keep_scores_clip_and_scale():
    s = keep_scores(torch.tensor([-1.0, 0.5, 2.0, 0.0]))
    assert s.tolist() == [0.0, 0.25, 1.0, 0.0]
    assert keep_scores(torch.tensor([-1.0, -2.0])).tolist() == [0.0, 0.0]


def test_alpha_bisection_accuracy():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        s = torch.rand(12, generator=gen, dtype=torch.float64) * 0.98 + 0.01
        s[0] = 1.0
        pis = [0.15, 0.3, 0.5, 0.7, 0.85]
        alpha, reached = solve_alpha(s, pis)
        for a, p in zip(alpha, pis):
            assert abs(float(s.pow(a).mean()) - p) <= 1e-4
        assert torch.all(alpha[1:] < alpha[:-1])  # larger π, smaller α
        assert torch.allclose(reached, torch.tensor(pis, dtype=torch.float64), atol=1e-4)


def test_alpha_unreachable_warns():
    s = torch.tensor([1.0, 0.5, 0.0, 0.0], dtype=torch.float64)  # reachable (0.25, 0.5)
    with pytest.warns(RuntimeWarning, match="unreachable"):
        _, reached = solve_alpha(s, [0.1, 0.4, 0.9])
    assert float(reached[1]) == pytest.approx(0.4, abs=1e-4)
    assert float(reached[0]) == pytest.approx(0.25, abs=1e-4)
    assert float(reached[2]) == pytest.approx(0.5, abs=1e-4)


def test_distances():
    p = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    q = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
    assert float(hellinger(p, p)) == 0.0
    assert float(hellinger(p, q)) == pytest.approx(math.sqrt(0.5), abs=1e-12)
    r = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    assert float(kl(p, r)) == pytest.approx(0.5 * math.log(2), abs=1e-12)


@pytest.mark.parametrize("distance", ["hellinger", "reagent"])
@pytest.mark.parametrize("routing", ["dynamic", "fixed"])
@pytest.mark.parametrize("per_element", [False, True])
def test_limits(llama, attr, distance, routing, per_element):
    opts = {**FAST, "distance": distance, "routing": routing, "per_element": per_element}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # constant scores: every π but mean(s) is unreachable
        ones = soft_metrics(llama, _with_scores(attr, 1.0), **opts)
        zeros = soft_metrics(llama, _with_scores(attr, 0.0), **opts)
    one, zero = torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    # s ≡ 1: NS keeps every token -> 1; s ≡ 0: NC keeps every token -> exactly 0
    assert torch.allclose(ones.soft_ns, one, atol=1e-9)
    assert torch.equal(zeros.soft_nc, zero)
    if distance == "hellinger":
        # s ≡ 1: NC removes every token (= the zero baseline) -> 1; s ≡ 0: NS removes all -> 0
        assert torch.allclose(ones.soft_nc, one, atol=1e-9)
        assert torch.allclose(zeros.soft_ns, zero, atol=1e-9)
    else:
        # ReAGent mixes distances (Σ(√p−√q)²/√2 and H over KL): its limits are not 1 / 0
        assert not torch.allclose(ones.soft_nc, one, atol=1e-3)
        assert torch.all(ones.soft_nc == ones.soft_nc[None].mean(0))  # deterministic
    assert ones.expected_retained_ns.tolist() == [5.0, 6.0, 3.0]  # BOS excluded
    assert zeros.expected_retained_nc.tolist() == [5.0, 6.0, 3.0]


def test_binary_scores_match_deterministic_hand_computation(llama, attr):
    """With s ∈ {0, 1} the Bernoulli masks are deterministic: compare with plain hooks."""
    from dataclasses import replace

    scores = torch.zeros_like(attr.scores)
    b = 0
    real = torch.nonzero(attr.mask[b]).flatten()
    chosen = [int(real[2]), int(real[4])]
    scores[b, chosen] = torch.tensor([0.7, 0.3], dtype=torch.float64)  # s = [1, 3/7]
    scores[b, chosen[1]] = 0.7  # both s = 1
    one = replace(attr, scores=scores)[b]
    res = soft_metrics(llama, one, **FAST)
    ids = one.token_ids[0]
    bos = llama.tokenizer.bos_token_id

    def probs(keep: torch.Tensor) -> torch.Tensor:
        """The item's real tokens only (its left padding dropped: how an unmasked pad token is
        treated is the backend's business, TransformerLens 3.9 infers a mask, a bridge not)."""

        def hook(x, hook):
            return x * keep[real][None, :, None]

        with torch.no_grad(), llama.hooks(fwd_hooks=[("hook_embed", hook)]):
            logits = llama(ids[real][None])
        return torch.softmax(logits[0, -1], -1)

    n = ids.shape[0]
    is_bos = (ids == bos).double()
    p = probs(torch.ones(n, dtype=torch.float64))
    p0 = probs(is_bos)
    s = torch.zeros(n, dtype=torch.float64)
    s[chosen] = 1.0
    h0 = float(hellinger(p, p0))
    nc = float(hellinger(p, probs(torch.clamp(1 - s + is_bos, max=1.0)))) / h0
    ns = max(0.0, 1 - float(hellinger(p, probs(torch.clamp(s + is_bos, max=1.0)))) / h0)
    assert float(res.soft_nc[0]) == pytest.approx(nc, abs=1e-9)
    assert float(res.soft_ns[0]) == pytest.approx(ns, abs=1e-9)


def test_fixed_routing_reproduces_clean_logits_exactly(llama):
    tokens = llama.to_tokens(["the keys to the cabinet"])
    with torch.no_grad():
        patterns = cache_patterns(llama, tokens)
        # the clean run observes the same patterns (a do-nothing hook): a bridge's attention
        # takes its eager kernel where a pattern is observed, the fused one where not
        observe = [(name, lambda x, hook: None) for name in patterns]
        with llama.hooks(fwd_hooks=observe):
            clean = llama(tokens)
        with llama.hooks(fwd_hooks=fixed_routing_hooks(patterns)):
            replayed = llama(tokens)
        # broadcast over several draws of one item
        rep = tokens.expand(4, -1)
        with llama.hooks(fwd_hooks=fixed_routing_hooks(patterns, torch.zeros(4, dtype=torch.long))):
            replayed4 = llama(rep)
        with llama.hooks(fwd_hooks=fixed_routing_hooks(patterns)):
            other = llama(llama.to_tokens(["a dog near the cats"]))
        dynamic = llama(llama.to_tokens(["a dog near the cats"]))
    assert torch.equal(replayed, clean)
    assert torch.allclose(replayed4, clean.expand(4, -1, -1), atol=1e-12)
    assert not torch.allclose(other, dynamic, atol=1e-6)  # routing really is fixed


def test_seeded_runs_repeat_and_seeds_matter(llama, attr):
    a = soft_metrics(llama, attr, seed=3, **FAST)
    b = soft_metrics(llama, attr, seed=3, **FAST)
    c = soft_metrics(llama, attr, seed=4, **FAST)
    for k, v in a.as_dict().items():
        assert torch.equal(v, b.as_dict()[k]), k
    assert not torch.equal(a.pi_nc_curve, c.pi_nc_curve)


@pytest.mark.parametrize("routing", ["dynamic", "fixed"])
def test_batched_equals_unbatched(llama, attr, routing):
    full = soft_metrics(llama, attr, routing=routing, max_batch=64, **FAST)
    for b in range(len(PROMPTS)):
        one = soft_metrics(llama, attr[b], routing=routing, max_batch=5, **FAST)
        for k, v in one.as_dict().items():
            assert torch.allclose(v, full.as_dict()[k][b : b + 1], atol=1e-10), k
        assert torch.allclose(one.pi_ns_curve, full.pi_ns_curve[b : b + 1], atol=1e-10)


def test_pi_curve_and_expected_retained(llama, attr):
    res = soft_metrics(llama, attr, **FAST)
    pis = torch.tensor(FAST["pis"], dtype=torch.float64)
    auc = torch.trapezoid(res.pi_ns_curve, pis, dim=-1)
    assert torch.allclose(res.pi_soft_ns, auc, atol=1e-12)
    for b in range(3):
        real = attr.mask[b]
        s = keep_scores(attr.scores[b][real][1:])  # BOS excluded
        assert float(res.expected_retained_ns[b]) == pytest.approx(float(s.sum()), abs=1e-12)


def test_gpt2_learned_positions_runs():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_gpt2(dtype=torch.float64)
    a = attribute(model, PROMPTS[:2], method="gradient")
    res = soft_metrics(model, a, routing="fixed", **FAST)
    assert torch.isfinite(res.soft_nc).all() and torch.isfinite(res.pi_soft_ns).all()


def test_encoder_limits_with_fixed_routing():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert = tiny_bert(dtype=torch.float64)
    a = attribute(bert, ["the keys to the cabinet", "a dog"], method="gradient")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ones = soft_metrics(bert, _with_scores(a, 1.0), routing="fixed", **FAST)
        zeros = soft_metrics(bert, _with_scores(a, 0.0), routing="fixed", **FAST)
    assert torch.allclose(ones.soft_nc, torch.ones(2, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(ones.soft_ns, torch.ones(2, dtype=torch.float64), atol=1e-9)
    assert torch.equal(zeros.soft_nc, torch.zeros(2, dtype=torch.float64))
    assert ones.expected_retained_ns.tolist() == [5.0, 2.0]  # [CLS] and [SEP] excluded
