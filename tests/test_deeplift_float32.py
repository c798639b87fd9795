"""Float32 DeepLIFT departs from float64 DeepLIFT by float32 rounding, as Gradient×Input does.

The Rescale multiplier ``(φ(h) − φ(h₀))/(h − h₀)`` cancels where ``h`` is close to ``h₀``; taken
in float32 its error is ``≈ 2⁻²⁴ |φ(h)| / |φ(h) − φ(h₀)|``. That made float32 DeepLIFT on the
real models 7–90× further from float64 than Gradient×Input, and let the device's last bits of
``φ`` decide multipliers.
The multipliers are now taken in float64 (``lens_attrib.precision.widened``).

The model tests compare a model's float32 and float64 copies (the same weights) on the same
inputs, and bound DeepLIFT's departure by Gradient×Input's on those inputs (the rounding one
float32 forward and backward pass accumulates there, on this machine) with a factor 5 of room:
the float32 secant exceeded the bound 3.3× (SmolLM2) and 11× (MiniLM).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lens_attrib import Target, attribute, load_model
from lens_attrib.hooks.rules import hooked_secant, rescale_multiplier
from lens_attrib.tiny_models import tiny_gpt2
from tests.test_deeplift import PROMPTS, frozen_attention, unembed_head, word_ids
from tests.tl_versions import hooked_only

F32, F64 = torch.float32, torch.float64
ROOM = 5.0
LONGER = [
    "The keys to the cabinet",
    "The author that the guards like",
    "Paris is the capital of",
    "After the meeting the manager who hired the new accountants said that she",
    "The pictures of the old castle near the river",
]
SENTENCES = [
    "a gripping , funny and moving film that never loses its nerve",
    "the plot is thin , the jokes fall flat and the actors look bored throughout",
]


def close_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-activations ``h`` and references ``h₀`` 1e-6 … 1e-1 apart (in float32)."""
    torch.manual_seed(0)
    h = torch.randn(4000, dtype=F64) * 3
    gaps = torch.logspace(-6, -1, 4000, dtype=F64) * torch.sign(torch.randn(4000, dtype=F64))
    return h.to(F32), (h + gaps).to(F32)


@pytest.mark.parametrize("act", [torch.nn.functional.gelu, torch.nn.functional.silu, torch.tanh])
def test_the_multiplier_is_the_float64_secant_of_the_float32_values(act):
    h, h0 = close_pairs()
    exact = (act(h.double()) - act(h0.double())) / (h.double() - h0.double())
    m = rescale_multiplier(act, h, h0)
    assert m.dtype == F32
    assert float(((m.double() - exact) / exact.abs().clamp_min(1e-3)).abs().max()) < 1e-6
    plain = (act(h) - act(h0)) / (h - h0)  # the float32 secant: cancellation
    assert float(((plain.double() - exact) / exact.abs().clamp_min(1e-3)).abs().max()) > 1e-2


def test_the_hooked_secant_keeps_the_users_edit_and_is_exact_without_one():
    h, h0 = close_pairs()
    act = torch.nn.functional.gelu
    m, applies = hooked_secant(act, h, h0, act(h), act(h0))
    assert bool(applies.all()) and m.dtype == F32
    torch.testing.assert_close(m, rescale_multiplier(act, h, h0), rtol=0, atol=0)
    # a user's edit of the activation is part of φ; its float32 values are what is known of it,
    # so on pairs ≥ 1e-2 apart the multiplier is float32's φ (~1e-6 absolute error) over Δh
    far = (h - h0).abs() > 1e-2 * (1 + h.abs())
    h, h0, m = h[far], h0[far], m[far]
    assert h.numel() > 100
    halved, _ = hooked_secant(act, h, h0, 0.5 * act(h), 0.5 * act(h0))
    torch.testing.assert_close(halved, 0.5 * m, rtol=1e-4, atol=1e-4)
    shifted, _ = hooked_secant(act, h, h0, act(h) + 1.0, act(h0) + 1.0)
    torch.testing.assert_close(shifted, m, rtol=1e-4, atol=1e-4)
    m64, _ = hooked_secant(act, h.double(), h0.double(), act(h.double()), act(h0.double()))
    assert m64.dtype == F64  # float64 inputs: divided as read
    unnamed, _ = hooked_secant(None, h, h0, act(h), act(h0))  # no φ known: divided as read
    torch.testing.assert_close(unnamed, (act(h) - act(h0)) / (h - h0), rtol=0, atol=0)


@hooked_only("needs normalization_type=None, which no transformers checkpoint expresses")
def test_a_user_hook_on_the_activation_is_part_of_phi_in_float32():
    """Float32 twin of test_deeplift's float64 test: with constant attention and no norms the
    Rescale rule sums to ``f(x) − f(x₀)`` exactly, here to float32 rounding, with the user's
    halving of ``mlp.hook_post`` inside ``φ``."""
    model = frozen_attention(tiny_gpt2).to(F32)
    target = Target(word_ids(model, ["are", "is", "sees"]), head=unembed_head(model))
    model.blocks[0].mlp.hook_post.add_hook(lambda x, hook: x * 0.5)
    try:
        attr = attribute(model, PROMPTS, target, method="deeplift")
    finally:
        model.reset_hooks()
    delta = attr.meta["explained_value"] - attr.meta["baseline_value"]
    torch.testing.assert_close(
        attr.scores.sum(-1), delta, atol=1e-5 * float(delta.abs().max()), rtol=0
    )


def largest_departure(a32, a64) -> float:
    """``max |s32 − s64| / max |s64|`` over the items (each item's scale its own)."""
    return max(
        float((s32.to("cpu", F64) - s64.cpu()).abs().max() / s64.abs().max())
        for s32, s64 in zip(a32.scores, a64.scores)
    )


def departures(m32, m64, texts, target32=None, target64=None) -> dict[str, float]:
    out = {}
    for method in ("grad_x_input", "deeplift"):
        a32 = attribute(m32, texts, target32 or Target(), method=method)
        a64 = attribute(m64, texts, target64 or Target(), method=method)
        out[method] = largest_departure(a32, a64)
    return out


def test_smollm2_float32_departs_by_rounding(smollm2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m64 = load_model("smollm2-135m", dtype=F64)
    got = departures(smollm2, m64, LONGER)
    assert got["deeplift"] < ROOM * got["grad_x_input"], got


def classifier_head(dtype: torch.dtype) -> nn.Module:
    """A random pooler-and-classifier head on the first position (its Tanh gets Rescale too)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(384, 384), nn.Tanh(), nn.Linear(384, 2)).to(dtype)


def test_minilm_with_a_classifier_head_float32_departs_by_rounding(minilm):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m64 = load_model("minilm-l6", dtype=F64)
    t32 = Target(token=1, head=classifier_head(F32), position=0)
    t64 = Target(token=1, head=classifier_head(F64), position=0)
    got = departures(minilm, m64, SENTENCES, t32, t64)
    assert got["deeplift"] < ROOM * got["grad_x_input"], got
