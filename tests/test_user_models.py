"""The user's model as it is: processed weights are detected, encoder inputs are not degenerate."""

from __future__ import annotations

import warnings

import pytest
import torch

from lens_attrib import Target, attribute
from lens_attrib.backend import arch_of, processing_signatures
from lens_attrib.methods.registry import _WARNED_PROCESSED
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama
from tests.tl_versions import process_weights

F64 = torch.float64


@pytest.mark.parametrize("builder", [tiny_gpt2, tiny_llama, tiny_bert])
def test_unprocessed_models_show_no_processing(builder):
    model = builder(dtype=F64)
    assert processing_signatures(model, arch_of(model)) == []


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        ({"fold_ln": True, "center_writing_weights": False, "center_unembed": False}, "fold_ln"),
        (
            {"fold_ln": False, "center_writing_weights": False, "center_unembed": True},
            "center_unembed",
        ),
        (
            {"fold_ln": False, "center_writing_weights": True, "center_unembed": False},
            "center_writing_weights",
        ),
    ],
)
def test_processing_is_detected_and_warned_once(kwargs, phrase):
    model = tiny_gpt2(dtype=F64)
    process_weights(model, **kwargs)  # TransformerLens also folds value biases here
    found = processing_signatures(model, arch_of(model))
    assert any(phrase in f for f in found)
    assert any("fold_value_biases" in f for f in found)
    with pytest.warns(UserWarning, match=phrase):
        attribute(model, "the dog", method="normxlogit")
    assert model in _WARNED_PROCESSED
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attribute(model, "the dog", method="alti_logit")  # once per model
        attribute(tiny_gpt2(dtype=F64), "the dog", method="grad_x_input")


def test_methods_that_do_not_read_the_parametrisation_do_not_warn():
    # folding and centring the writing weights leave every logit as it was: no warning
    folded = tiny_gpt2(dtype=F64)
    process_weights(folded, fold_ln=True, center_writing_weights=True, center_unembed=False)
    # center_unembed moves raw logits, not logit differences: a contrastive target is unaffected
    centred = tiny_gpt2(dtype=F64)
    process_weights(centred)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attribute(folded, "the dog", method="grad_x_input")
        attribute(centred, "the dog", Target(token="dog", foil="the"), method="grad_x_input")


def test_encoder_grad_x_input_is_not_degenerate_by_default(minilm):
    head = torch.nn.Linear(384, 2)
    torch.manual_seed(0)
    from lens_attrib import Target

    target = Target(1, foil=0, head=head, position=0)
    attr = attribute(minilm, ["a gripping, beautiful film"], target, method="grad_x_input")
    assert attr.meta["options"]["embeddings"] == "partial"
    value = float(attr.meta["explained_value"].abs()[0])
    assert float(attr.scores.abs().max()) > 1e-3 * value
    with pytest.warns(RuntimeWarning, match="scale-invariant"):
        full = attribute(
            minilm, ["a gripping, beautiful film"], target, method="grad_x_input", embeddings="full"
        )
    assert float(full.scores.abs().max()) < 1e-5 * value  # the degenerate reading, ~0


@pytest.mark.parametrize("method", ["alti_logit", "alti", "rollout", "attnlrp"])
def test_low_precision_models_say_when_a_method_upcasts(method):
    model = tiny_gpt2(dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attr = attribute(model, "the keys to the cabinet", method=method)
    assert attr.meta["model_dtype"] == "torch.bfloat16"
    assert torch.isfinite(attr.scores).all()
    if attr.scores.dtype != torch.bfloat16:
        assert attr.meta["upcast_to"] == str(attr.scores.dtype)
    else:
        assert "upcast_to" not in attr.meta
