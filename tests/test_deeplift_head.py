"""DeepLIFT through a classifier head: the Rescale rule applies to the head's activation modules.

Oracle: Captum 0.9's ``DeepLift`` on a tiny random ``BertForSequenceClassification`` (pooler Tanh
+ classifier) in float64, two sentences and one sentence pair (``tests/fixtures/
deeplift_captum_bert_classifier``, see its README). The library loads the same folder with
``load_model`` and explains the same class through the model's own head.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lens_attrib import Target, attribute, load_model
from lens_attrib.backend import attached_head
from lens_attrib.tiny_models import tiny_tokenizer

F64 = torch.float64
FIXTURE = Path(__file__).parent / "fixtures" / "deeplift_captum_bert_classifier"
EXACT = 1e-10  # relative to the largest |score| of the item: float64 rounding
N_ITEMS = 3


@pytest.fixture(scope="module")
def captum() -> dict[str, np.ndarray]:
    with np.load(FIXTURE / "captum_deeplift_bert_classifier.npz") as f:
        return dict(f)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The fixture's folder with the tiny vocabulary's tokenizer (its special tokens [CLS]/[SEP]
    keep their embedding in the default baseline, as in the Captum run), once as saved (GELU)
    and once with ``hidden_act="relu"`` (same weights: the fixture's second run)."""
    out = {}
    for act in ("gelu", "relu"):
        folder = tmp_path_factory.mktemp(act) / "model"
        shutil.copytree(FIXTURE / "model", folder)
        config = json.loads((folder / "config.json").read_text())
        config["hidden_act"] = act
        (folder / "config.json").write_text(json.dumps(config))
        tiny_tokenizer(encoder=True).save_pretrained(folder)
        out[act] = load_model(str(folder), dtype=F64)
    return out


def padded(captum: dict[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
    rows = [captum[f"input_ids.{i}"] for i in range(N_ITEMS)]
    types = [captum[f"token_type_ids.{i}"] for i in range(N_ITEMS)]
    length = max(len(r) for r in rows)
    ids = torch.zeros(N_ITEMS, length, dtype=torch.long)
    tt = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for i, (r, t) in enumerate(zip(rows, types)):
        ids[i, : len(r)] = torch.from_numpy(r)
        tt[i, : len(r)] = torch.from_numpy(t)
        mask[i, : len(r)] = 1
    return ids, mask, tt


def explain(model, captum, activations, head=None):
    ids, mask, types = padded(captum)
    target = Target(label="positive") if head is None else Target(token=1, head=head, position=0)
    return attribute(
        model,
        ids,
        target,
        method="deeplift",
        attention_mask=mask,
        token_type_ids=types,
        activations=activations,
    )


def worst(attr, captum, act) -> float:
    """Largest |ours − Captum| over items, relative to the item's largest |Captum score|."""
    out = 0.0
    for i in range(N_ITEMS):
        ref = torch.from_numpy(captum[f"captum.{act}_scores.{i}"])
        ours = attr.scores[i, : len(ref)]
        out = max(out, float((ours - ref).abs().max()) / float(ref.abs().max()))
    return out


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_the_loaded_classifier_is_captums_model(models, captum, act):
    ids, mask, types = padded(captum)
    model = models[act]
    with torch.no_grad():
        resid = model.encoder_output(ids, types, mask)
        logits = attached_head(model)(resid[:, 0])
    for i in range(N_ITEMS):
        ref = torch.from_numpy(captum[f"captum.{act}_logits.{i}"])
        assert float((logits[i] - ref).abs().max()) <= EXACT * float(ref.abs().max())


@pytest.mark.parametrize(
    ("act", "activations"), [("gelu", "captum"), ("relu", "captum"), ("relu", "all")]
)
def test_equals_captum_deeplift_through_the_pooler(models, captum, act, activations):
    attr = explain(models[act], captum, activations)
    assert torch.equal(attr.target.token_ids, torch.ones(N_ITEMS, dtype=torch.long))
    assert worst(attr, captum, act) <= EXACT
    for i in range(N_ITEMS):
        ref = float(captum[f"captum.{act}_baseline_value.{i}"][0])
        assert abs(float(attr.meta["baseline_value"][i]) - ref) <= EXACT * abs(ref)


def test_a_head_without_modules_gets_the_plain_gradient(models, captum):
    """Negative control: hiding the Tanh in a plain function drops its Rescale rule, and the
    scores move far from Captum's (what the library computed before the head rule)."""
    head = attached_head(models["gelu"])
    attr = explain(models["gelu"], captum, "captum", head=lambda x: head(x))
    assert worst(attr, captum, "gelu") > 1e-3


def test_the_completeness_gap_is_captums_convergence_delta(models, captum):
    """``f(e) − f(b) − Σ R`` is minus Captum's ``Σ attributions − (f(x) − f(base))``."""
    for act, activations in (("gelu", "captum"), ("relu", "all")):
        gap = explain(models[act], captum, activations).meta["completeness_gap"]
        for i in range(N_ITEMS):
            delta = float(captum[f"captum.{act}_delta.{i}"][0])
            assert abs(float(gap[i]) + delta) <= EXACT * max(1.0, abs(delta))
