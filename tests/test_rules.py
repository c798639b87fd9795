"""The rule primitives of ``hooks/rules.py`` on their defining identities (float64).

Oracles: each rule's relevance identity (Gradient×Input read at the rule's inputs), forward values
unchanged bit for bit, and the Rescale multiplier's exact difference ``Δa = m · Δh``.
"""

from __future__ import annotations

import torch

from lens_attrib.hooks.rules import (
    identity_rule,
    linearized,
    rescale_multiplier,
    safe_ratio,
    scale_grad,
    uniform_rule,
)

F64 = torch.float64


def _leaf(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64).requires_grad_(True)


def test_identity_rule_passes_the_relevance_through_the_activation():
    h = _leaf(5, 7, seed=0)
    a = torch.nn.functional.gelu(h)
    out = identity_rule(h, a, eps=0.0)
    assert torch.equal(out, a)  # forward unchanged
    (g,) = torch.autograd.grad(out.sum(), h)  # upstream gradient 1: R_a = a
    torch.testing.assert_close(h.detach() * g, a.detach(), rtol=1e-12, atol=1e-15)


def test_uniform_rule_gives_each_factor_half_of_the_product():
    a, b = _leaf(4, 6, seed=1), _leaf(4, 6, seed=2)
    c = a * b
    m_a, m_b = uniform_rule(a, b)
    assert not m_a.requires_grad and not m_b.requires_grad
    out = linearized(c, (a, m_a), (b, m_b))
    assert torch.equal(out, c)
    g_a, g_b = torch.autograd.grad(out.sum(), [a, b])
    half = c.detach() / 2
    torch.testing.assert_close(a.detach() * g_a, half, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(b.detach() * g_b, half, rtol=1e-12, atol=1e-15)


def test_rescale_multiplier_carries_differences_exactly():
    h, h0 = _leaf(3, 8, seed=3).detach(), _leaf(3, 8, seed=4).detach()
    h0[0, 0] = h[0, 0]  # |Δh| = 0 < eps: the derivative instead of the secant
    act = torch.nn.functional.silu
    m = rescale_multiplier(act, h, h0, eps=1e-10)
    exact = (h - h0).abs() >= 1e-10
    torch.testing.assert_close(
        (m * (h - h0))[exact], (act(h) - act(h0))[exact], rtol=1e-12, atol=1e-15
    )
    x = h[0, 0].clone().requires_grad_(True)
    (slope,) = torch.autograd.grad(act(x), x)
    assert torch.equal(m[0, 0], slope)


def test_scale_grad_and_safe_ratio():
    x = _leaf(2, 3, seed=5)
    (g,) = torch.autograd.grad(scale_grad(x, 0.25).sum(), x)
    assert torch.equal(g, torch.full_like(g, 0.25))
    num, den = torch.tensor([1.0, 2.0], dtype=F64), torch.tensor([0.0, 4.0], dtype=F64)
    assert torch.equal(safe_ratio(num, den), torch.tensor([0.0, 0.5], dtype=F64))
