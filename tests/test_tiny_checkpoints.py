"""The tiny models are one function on both TransformerLens majors.

On TransformerLens 3.9 the tiny builders build HookedTransformer/HookedEncoder objects; on 4.x
they load Hugging Face checkpoints of the same parameters on the TransformerBridge
(:mod:`lens_attrib.tiny_checkpoints`). Checked here:

- 3.9: the parameter list the checkpoints are drawn from is HookedTransformer's (names, shapes,
  order), and the checkpoint loaded by ``load_model(folder, backend="hooked")`` (plus the tiny
  model's unembedding bias and float32 rotary tables) computes the HookedTransformer tiny model's
  float64 logits to ≤ 1e-12 of their largest magnitude: the inverse weight mapping is right;
- 4.x: the bridge tiny models' float64 logits equal the committed 3.9 logits
  (``tests/fixtures/tiny/logits.npz``, ``python -m tests.tiny_reference``) to ≤ 1e-12;
- either: a setting transformers cannot express is an error naming it.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch

from lens_attrib.errors import ModelError
from lens_attrib.models import load_model, transformer_lens_major
from lens_attrib.tiny_checkpoints import (
    hooked_parameter_shapes,
    load_tiny,
    tiny_config,
    tiny_folder,
)
from tests import tiny_reference as ref

REL = 1e-12
F64 = torch.float64
BRIDGE = transformer_lens_major() >= 4
needs_hooked = pytest.mark.skipif(BRIDGE, reason="TransformerLens 3.9 not installed")
needs_bridge = pytest.mark.skipif(not BRIDGE, reason="TransformerLens ≥ 4 not installed")


def relative_gap(now: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(now - reference).max() / np.abs(reference).max())


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(ref.PATH) as data:
        return {k: data[k] for k in data.files}


@needs_hooked
@pytest.mark.parametrize("case", sorted(ref.CASES))
def test_parameter_list_is_hooked_transformers(case: str) -> None:
    kind, seed, overrides = ref.CASES[case]
    model = ref.build(case)
    expected = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert hooked_parameter_shapes(kind, tiny_config(kind, seed, overrides)) == expected


@needs_hooked
@pytest.mark.parametrize("case", sorted(ref.CASES))
def test_checkpoint_on_hooked_backend_equals_the_tiny_model(case: str) -> None:
    kind, seed, overrides = ref.CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_tiny(kind, seed, F64, overrides, backend="hooked")
    tiny = ref.build(case)
    assert relative_gap(ref.logits(loaded, case), ref.logits(tiny, case)) <= REL


@needs_hooked
def test_bert_checkpoint_alone_is_the_tiny_bert() -> None:
    """BERT needs no extra: the plain folder loads to the tiny BERT (its head has a bias)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_model(str(tiny_folder("bert", 0)), dtype=F64, backend="hooked")
    assert relative_gap(ref.logits(loaded, "bert"), ref.logits(ref.build("bert"), "bert")) <= REL


@needs_hooked
def test_reference_file_describes_the_hooked_tiny_models(reference: dict[str, Any]) -> None:
    for case in ref.CASES:
        assert relative_gap(ref.logits(ref.build(case), case), reference[f"{case}/logits"]) <= REL


@needs_bridge
@pytest.mark.parametrize("case", sorted(ref.CASES))
def test_bridge_tiny_model_equals_the_hooked_reference(
    case: str, reference: dict[str, Any]
) -> None:
    model = ref.build(case)
    assert type(model).__name__ == "TransformerBridge"
    assert relative_gap(ref.logits(model, case), reference[f"{case}/logits"]) <= REL


@needs_bridge
def test_bridge_tiny_float32_is_the_float64_model_rounded(reference: dict[str, Any]) -> None:
    """float32 weights are the float64 model's (both are the float32 draws): logits agree to
    float32 rounding."""
    now = ref.logits(ref.build("llama", dtype=torch.float32), "llama")
    assert relative_gap(now, reference["llama/logits"]) < 1e-5


@pytest.mark.parametrize(
    ("kind", "overrides", "named"),
    [
        ("gpt2", {"normalization_type": None}, "normalization_type"),
        ("gpt2", {"positional_embedding_type": "rotary"}, "positional_embedding_type"),
        ("pythia", {"parallel_attn_mlp": False}, "parallel_attn_mlp"),
        ("llama", {"rotary_dim": 4}, "rotary_dim"),
        ("gpt2", {"d_head": 4}, "d_model = n_heads"),
        ("bert", {"act_fn": "relu"}, "act_fn"),
        ("gpt2", {"act_fn": "solu_ln"}, "act_fn"),
    ],
)
def test_settings_transformers_cannot_express_are_refused(
    kind: str, overrides: dict[str, Any], named: str
) -> None:
    with pytest.raises(ModelError, match=named):
        tiny_folder(kind, 0, **overrides)


def test_default_settings_passed_explicitly_are_accepted() -> None:
    cfg = tiny_config("gpt2", 0, {"normalization_type": "LN", "n_layers": 2})
    assert cfg["n_layers"] == 2 and cfg["normalization_type"] == "LN"
