"""Integrated Gradients converges and attributes every real token (issue 14).

Oracles: Gauss–Legendre exactness on polynomials, completeness (Σ R = f(x) − f(b)) within the
requested tolerance, batched == unbatched, and the explained value with a prepended sink equal to
an independent forward of ``BOS + prompt``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lens_attrib.methods.baselines import sink_token_id
from lens_attrib.methods.integrated_gradients import quadrature
from lens_attrib.methods.path_quadrature import adaptive_quadrature
from lens_attrib.methods.registry import attribute
from lens_attrib.target import Target
from lens_attrib.tiny_models import tiny_gpt2, tiny_llama

F64 = torch.float64
PROMPTS = ["the dog sees the cat near the house", "a man likes books", "the keys to the cabinet"]


def _ids_without_bos(model, text):
    return torch.tensor([model.tokenizer(text, add_special_tokens=False)["input_ids"]])


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_gauss_legendre_is_exact_up_to_degree_2n_minus_1(n) -> None:
    alphas, weights = quadrature(n, "gausslegendre")
    assert all(0 < a < 1 for a in alphas)
    for degree in range(2 * n):  # ∫₀¹ α^k dα = 1/(k + 1)
        approx = sum(w * a**degree for a, w in zip(alphas, weights))
        assert approx == pytest.approx(1 / (degree + 1), rel=1e-12, abs=1e-14)
    # and not beyond: the error on α^(2n) is (n!)^4 / ((2n + 1) ((2n)!)^2) (Gauss's remainder)
    too_high = sum(w * a ** (2 * n) for a, w in zip(alphas, weights))
    expected = math.factorial(n) ** 4 / ((2 * n + 1) * math.factorial(2 * n) ** 2)
    assert 1 / (2 * n + 1) - too_high == pytest.approx(expected, rel=1e-6, abs=1e-15)


def _steep_path(sharpness: float):
    """Two 'tokens' whose integrands are logistic steps at α = 0.3 and 0.71 (closed-form f)."""
    centres = torch.tensor([0.3, 0.71], dtype=F64)
    heights = torch.tensor([2.0, -0.5], dtype=F64)

    def f_parts(alphas):
        return heights * torch.sigmoid(sharpness * (alphas[:, None] - centres))

    def node_scores(alphas):
        s = torch.sigmoid(sharpness * (alphas[:, None] - centres))
        return heights * sharpness * s * (1 - s)

    return f_parts, node_scores


@pytest.mark.parametrize("sharpness", [5.0, 300.0, 3000.0])
def test_adaptive_panels_integrate_steep_steps_to_the_tolerance(sharpness) -> None:
    f_parts, node_scores = _steep_path(sharpness)
    exact = (f_parts(torch.ones(1, dtype=F64)) - f_parts(torch.zeros(1, dtype=F64)))[0]
    a0, w0 = quadrature(8, "gausslegendre")
    calls = []

    def values(alphas):
        calls.append(len(alphas))
        return f_parts(alphas).sum(-1)

    result = adaptive_quadrature(
        node_scores,
        values,
        float(f_parts(torch.zeros(1, dtype=F64)).sum()),
        float(f_parts(torch.ones(1, dtype=F64)).sum()),
        alphas=torch.tensor(a0, dtype=F64),
        weights=torch.tensor(w0, dtype=F64),
        tolerance=1e-3,
        max_points=4096,
    )
    delta = float(exact.sum())
    assert abs(result.gap) <= 1e-3 * abs(delta)
    assert result.gap == pytest.approx(delta - float(result.scores.sum()), abs=1e-12)
    # per token, not only in sum: each step is integrated to the same order
    assert torch.allclose(result.scores, exact, rtol=0, atol=2e-3 * abs(delta))
    assert result.n_points <= 4096 and result.n_points % 8 == 0
    assert result.edges[0] == 0.0 and result.edges[-1] == 1.0
    assert all(lo < hi for lo, hi in zip(result.edges, result.edges[1:]))
    if sharpness == 5.0:  # smooth: the first two panels already converge
        assert result.n_points == 16 and sum(calls) == 1
    else:  # the panels around the steps get bisected, the rest stays coarse
        widths = [hi - lo for lo, hi in zip(result.edges, result.edges[1:])]
        assert min(widths) < 0.05 and max(widths) >= 0.25


def test_adaptive_panels_stop_at_the_evaluation_cap() -> None:
    f_parts, node_scores = _steep_path(3000.0)
    a0, w0 = quadrature(8, "gausslegendre")
    result = adaptive_quadrature(
        node_scores,
        lambda a: f_parts(a).sum(-1),
        float(f_parts(torch.zeros(1, dtype=F64)).sum()),
        float(f_parts(torch.ones(1, dtype=F64)).sum()),
        alphas=torch.tensor(a0, dtype=F64),
        weights=torch.tensor(w0, dtype=F64),
        tolerance=1e-12,
        max_points=64,
    )
    assert result.n_points <= 64
    assert abs(result.gap) > 0


@pytest.mark.parametrize("builder", [tiny_gpt2, tiny_llama])
def test_auto_steps_reach_one_percent(builder) -> None:
    model = builder(dtype=F64)
    a = attribute(model, PROMPTS, Target(foil="cat"), method="integrated_gradients")
    delta = a.meta["explained_value"] - a.meta["baseline_value"]
    gap = delta - a.scores.sum(-1)
    assert torch.allclose(gap, a.meta["completeness_gap"])
    assert torch.all(gap.abs() <= 0.01 * delta.abs())
    assert all(16 <= n <= 1024 for n in a.meta["n_steps"])
    assert all(p >= 2 for p in a.meta["panels"])


def test_unconverged_items_are_named_in_a_warning() -> None:
    model = tiny_llama(dtype=F64)
    with pytest.warns(UserWarning, match=r"did not converge.*item 0: gap"):
        attribute(model, PROMPTS[:1], method="integrated_gradients", tolerance=1e-12, max_steps=2)


def test_bos_less_prompt_attributes_every_real_token() -> None:
    model = tiny_llama(dtype=F64)
    ids = _ids_without_bos(model, PROMPTS[1])
    a = attribute(model, ids, method="integrated_gradients")  # default keep_sink="special"
    assert a.meta["options"]["keep_sink"] == "special"
    assert a.meta["prepended_sink"] == [True]
    assert a.scores.shape == ids.shape and len(a.tokens[0]) == ids.shape[1]
    assert torch.all(a.scores[0] != 0)  # the first real token included
    delta = a.meta["explained_value"] - a.meta["baseline_value"]
    assert torch.all((delta - a.scores.sum(-1)).abs() <= 0.01 * delta.abs())
    with_sink = torch.cat([torch.tensor([[sink_token_id(model)]]), ids], 1)
    with torch.no_grad():
        logits = model(with_sink)[0, -1]
        logits_in = model(ids)[0, -1]
    y = int(a.target.token_ids[0])
    assert float(a.meta["explained_value"][0]) == pytest.approx(float(logits[y]), rel=1e-10)
    assert float(a.meta["input_value"][0]) == pytest.approx(float(logits_in[y]), rel=1e-10)
    old = attribute(model, ids, method="integrated_gradients", keep_sink=True)
    assert old.meta["prepended_sink"] == [False] and old.scores[0, 0] == 0
    with_bos = attribute(model, PROMPTS[1], method="integrated_gradients", keep_sink="special")
    assert with_bos.meta["prepended_sink"] == [False] and with_bos.scores[0, 0] == 0


def test_batched_equals_unbatched_with_padding_and_a_prepended_sink() -> None:
    model = tiny_llama(dtype=F64)
    rows = [model.tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]
    length = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (length - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rows])
    batched = attribute(
        model, ids, attention_mask=mask, method="integrated_gradients", keep_sink="special"
    )
    for i, row in enumerate(rows):
        alone = attribute(
            model, torch.tensor([row]), method="integrated_gradients", keep_sink="special"
        )
        assert batched.meta["n_steps"][i] == alone.meta["n_steps"][0]
        diff = (batched.item_scores(i) - alone.item_scores(0)).abs().max()
        assert float(diff) <= 1e-10 * float(alone.item_scores(0).abs().max())


def test_smollm2_first_token_of_a_bos_less_anaphora_prompt(smollm2) -> None:
    torch.set_num_threads(1)
    target = Target(" herself", foil=" himself")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = attribute(
            smollm2,
            "Tamara thinks about",
            target,
            method="integrated_gradients",
            start_token=False,  # a BOS-less prompt (the default puts <|endoftext|> in front)
        )
    assert a.meta["prepended_sink"] == [True]
    assert a.tokens[0][0] == "Tam" and a.scores[0, 0] != 0
    delta = a.meta["explained_value"] - a.meta["baseline_value"]
    assert torch.all(a.meta["completeness_gap"].abs() <= 0.01 * delta.abs())


def test_step_batch_follows_the_free_memory(monkeypatch) -> None:
    from lens_attrib.backend import arch_of, backward_bytes_per_row
    from lens_attrib.methods import integrated_gradients as ig_module

    model = tiny_llama(dtype=F64)
    arch = arch_of(model)
    per_row = backward_bytes_per_row(arch, 5)
    assert backward_bytes_per_row(arch, 10) > 2 * per_row  # attention grows with length²
    monkeypatch.setattr(ig_module, "available_memory", lambda device: 10 * per_row)
    assert ig_module.rows_per_forward(arch, 5, 64, None, torch.device("cpu")) == 2  # ¼ of 10
    assert ig_module.rows_per_forward(arch, 5, 64, 7, torch.device("cpu")) == 7  # step_batch wins
    ids = _ids_without_bos(model, "a man likes")
    length = ids.shape[1] + 1  # with the prepended sink
    monkeypatch.setattr(
        ig_module, "available_memory", lambda device: 12 * backward_bytes_per_row(arch, length)
    )
    small = attribute(model, ids, method="integrated_gradients", n_steps=8)
    assert small.meta["step_batch"] == [3]
    monkeypatch.undo()
    large = attribute(model, ids, method="integrated_gradients", n_steps=8)
    assert large.meta["step_batch"] == [8]
    assert torch.allclose(small.scores, large.scores, rtol=1e-12, atol=1e-14)
