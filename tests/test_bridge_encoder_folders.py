"""RoBERTa and sequence-classifier encoder folders, on the installed backend (issue 27).

The folders users save (``RobertaForMaskedLM``, ``RobertaModel``,
``RobertaForSequenceClassification``, ``BertForSequenceClassification``) are rebuilt from seeds
in ``tmp_path`` (:mod:`tests.encoder_folders_reference`) and loaded with ``load_model(folder,
float64)``. Oracles: transformers' own float64 forward (logits and hidden states ≤ 1e-10 of the
largest magnitude), every encoder method equal to TransformerLens 3.9's (the committed
``encoder_folders.npz``, made by the hooked backend: under 3.9 these cases prove the file still
describes the code, under 4.x that the bridge equals it), conservation (LRP without biases,
DecompX with its bias part), batched == single, and the model guard. A classifier's head is the
checkpoint's own (:func:`lens_attrib.backend.attached_head`) on both backends.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lens_attrib import InputError, ModelError, Target, attribute, load_model
from lens_attrib.backend import arch_of, attached_head, final_residual, lm_head
from lens_attrib.forward import no_grad_context
from lens_attrib.hooks.guard import model_state_fingerprint
from lens_attrib.inputs import to_batch
from lens_attrib.models import default_backend, transformer_lens_major
from tests import backend_reference as ref
from tests import encoder_folders_reference as efr

F64 = torch.float64
TOLERANCE = 1e-10
pytestmark = pytest.mark.filterwarnings("ignore:reagent. no probe:RuntimeWarning")
needs_bridge = pytest.mark.skipif(
    transformer_lens_major() < 4, reason="TransformerLens ≥ 4 not installed"
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return efr.write_folders(tmp_path_factory.mktemp("encoder_folders"))


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return efr.load_reference()


@pytest.fixture(scope="module")
def loaded(folders: dict[str, Path]) -> dict[str, Any]:
    return {name: load_model(str(path), dtype=F64) for name, path in folders.items()}


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = TOLERANCE) -> None:
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    assert err <= tol * scale, f"{err:.2e} > {tol:.0e} · {scale:.2e}"


def test_rebuilt_folders_hold_the_references_weights(folders, reference):
    for name, path in folders.items():
        np.testing.assert_allclose(
            efr.digest(path), reference[f"{name}/{efr.DIGEST_KEY}"], rtol=1e-12, atol=0
        )


def _case_id(case: tuple[Any, ...]) -> str:
    return "/".join(map(str, case[:-1])) + "/" + "-".join(f"{k}={v}" for k, v in case[-1].items())


@pytest.mark.parametrize(
    "case", [*efr.CASES, *[("ablated", *c) for c in efr.ABLATION_CASES]], ids=_case_id
)
def test_every_method_equals_the_hooked_reference(case, loaded, reference):
    ablated = case[0] == "ablated"
    folder, method, options = case[1:] if ablated else case
    model = loaded[folder]
    assert arch_of(model).backend == default_backend()
    if ablated:
        model.add_hook(ref.ABLATED_HOOK, ref.ablate_head)
    try:
        got = efr.case_arrays(model, folder, method, options, "ablated/" if ablated else "")
    finally:
        if ablated:
            model.reset_hooks()
    key = ("ablated/" if ablated else "") + ref.key_of(folder, method, options)
    assert set(got) == {k for k in reference if k.startswith(key + "/")}
    for name, value in got.items():
        _close(torch.as_tensor(value), torch.as_tensor(reference[name]))


@pytest.mark.parametrize("folder", efr.EVAL_FOLDERS)
def test_evaluation_equals_the_hooked_reference(folder, loaded, reference):
    """AOPC, insertion/deletion and Soft-NC/NS through the folder's head (MLM or the
    checkpoint's class head), as the 3.9 backend computes them."""
    got = efr.evaluation_arrays(loaded[folder], folder)
    assert set(got) == {k for k in reference if k.startswith(f"eval/{folder}/")}
    for name, value in got.items():
        _close(torch.as_tensor(value), torch.as_tensor(reference[name]))


# --------------------------------------------------------------------------- transformers
def _hf(folder: Path) -> Any:
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    kind = config.architectures[0].removeprefix("Bert").removeprefix("Roberta")
    auto = getattr(transformers, "AutoModel" if kind == "Model" else f"AutoModel{kind}")
    return auto.from_pretrained(folder, dtype=F64).eval().requires_grad_(False)


@pytest.mark.parametrize("name", efr.FOLDERS)
@pytest.mark.parametrize("unknown", [False, True], ids=["plain", "unk"])
def test_outputs_equal_transformers(name, unknown, folders, loaded):
    """Logits (MLM: every real position; classifiers: the checkpoint's head at ``[CLS]``) and
    RoBERTa's hidden states equal transformers' float64 forward on a right-padded batch
    (BERT: sentence pairs with segment ids). ``unk``: a row holding ``[UNK]``, whose id is
    RoBERTa's padding id; transformers then numbers the later positions one lower, the hooked
    backend (and so the bridge) ``pad + 1 + i``: compared with transformers given those
    position ids."""
    model, hf = loaded[name], _hf(folders[name])
    texts = efr.inputs(name)
    if not unknown:
        texts = [("the keys are", "a dog")] if name == "bert_cls" else ["the dog likes the cat"]
        texts = [*texts, *efr.inputs(name)[1:]]
    batch = to_batch(model, texts)
    assert bool((batch.tokens[batch.mask] == 1).any()) == (unknown and name != "bert_cls")
    a = batch.arch
    with no_grad_context(model):
        resid = final_residual(model, a, batch.tokens, batch.mask, batch.padded, batch.token_types)
        ours = (
            attached_head(model)(resid[:, 0])
            if a.class_head
            else lm_head(model, a)(resid[batch.mask])
            if a.lm_head
            else resid[batch.mask]
        )
    kwargs: dict[str, Any] = {"attention_mask": batch.mask.long()}
    if batch.token_types is not None:
        kwargs["token_type_ids"] = batch.token_types
    if name.startswith("roberta"):
        start = hf.config.pad_token_id + 1
        kwargs["position_ids"] = torch.arange(start, start + batch.length).expand(batch.size, -1)
        kwargs["token_type_ids"] = torch.zeros_like(batch.tokens)
    out = hf(batch.tokens, **kwargs)
    theirs = (
        out.logits
        if a.class_head
        else out.logits[batch.mask]
        if a.lm_head
        else out.last_hidden_state[batch.mask]
    )
    assert (a.class_head, a.lm_head) == (name.endswith("cls"), name == "roberta_mlm")
    _close(ours, theirs)
    if unknown or not name.startswith("roberta"):
        return
    plain = hf(batch.tokens, attention_mask=batch.mask.long())  # transformers' own numbering
    _close(ours, plain.logits if a.class_head else theirs)


def test_the_class_head_is_the_checkpoints(folders, loaded):
    for name in ("roberta_cls", "bert_cls"):
        hf, head = _hf(folders[name]), attached_head(loaded[name])
        dense, out = (
            (hf.bert.pooler.dense, hf.classifier)
            if name == "bert_cls"
            else (hf.classifier.dense, hf.classifier.out_proj)
        )
        assert head is not None and list(head.labels) == ["negative", "positive"]
        assert torch.equal(head.dense.weight, dense.weight) and torch.equal(head.out.bias, out.bias)


# --------------------------------------------------------------------------- conservation
def _without_biases(folder: Path) -> Any:
    model = load_model(str(folder), dtype=F64)
    bias = re.compile(r"(^|\.)(b|b_[A-Za-z]+|bias)$")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if bias.search(name):
                param.zero_()
    return model


@pytest.mark.parametrize("name", ["roberta_mlm"])
def test_lrp_conserves_without_biases(name, folders):
    """With every bias zero (encoder and MLM head) LRP's relevances sum to the explained value
    (as on BERT, tests/test_lrp.py; a class head's tanh has no conservative rule, on either
    backend: DecompX's conservation below covers the classifiers)."""
    model = _without_biases(folders[name])
    attr = attribute(model, efr.inputs(name), efr.target(name), method="lrp")
    value = attr.meta["explained_value"]
    _close(attr.scores.sum(-1), value, 1e-10)
    plain = attribute(model, efr.inputs(name), efr.target(name), method="grad_x_input")
    assert float((plain.scores.sum(-1) - value).abs().max()) > 1e-6 * float(value.abs().max())


@pytest.mark.parametrize("name", ["roberta_cls", "bert_cls"])
def test_decompx_sums_to_the_explained_value(name, loaded):
    attr = attribute(loaded[name], efr.inputs(name), efr.target(name), method="decompx",
                     biases="separate")  # fmt: skip
    total = attr.scores.sum(-1) + attr.parts["bias"]
    _close(total, attr.parts["logit"], 1e-10)
    if "explained_value" in attr.meta:
        _close(attr.parts["logit"], torch.as_tensor(attr.meta["explained_value"], dtype=F64))


# --------------------------------------------------------------------------- batching, guard
@pytest.mark.parametrize("method", ["grad_x_input", "attnlrp", "alti", "decompx", "value_zeroing"])
@pytest.mark.parametrize("name", ["roberta_cls", "bert_cls"])
def test_batched_equals_single(name, method, loaded):
    model, texts = loaded[name], efr.inputs(name)
    both = attribute(model, texts, efr.target(name), method=method)
    for b, text in enumerate(texts):
        alone = attribute(model, [text], efr.target(name), method=method)
        n = alone.scores.shape[-1]
        assert bool(both.mask[b, :n].all()) and not bool(both.mask[b, n:].any())
        _close(both.scores[b, :n], alone.scores[0], 1e-10)


@pytest.mark.parametrize("name", efr.FOLDERS)
def test_the_model_is_unchanged_after_a_call_also_on_error(name, loaded):
    model = loaded[name]
    before = model_state_fingerprint(model)
    method = "alti" if name == "roberta_model" else "attnlrp"
    attribute(model, efr.inputs(name), efr.target(name), method=method)
    assert model_state_fingerprint(model) == before

    def boom(x: torch.Tensor, hook: Any) -> None:
        raise RuntimeError("user hook failed")

    model.add_hook("blocks.0.hook_resid_post", boom)
    before = model_state_fingerprint(model)  # the user's hook is part of the state
    try:
        with pytest.raises(RuntimeError, match="user hook failed"):
            attribute(model, efr.inputs(name), efr.target(name), method="grad_x_input")
        assert model_state_fingerprint(model) == before
    finally:
        model.reset_hooks()
    after = attribute(model, efr.inputs(name), efr.target(name), method=method)
    again = attribute(model, efr.inputs(name), efr.target(name), method=method)
    assert torch.equal(after.scores, again.scores)


# --------------------------------------------------------------------------- refusals
def test_roberta_has_one_segment(loaded):
    with pytest.raises(InputError, match="1 segment"):
        attribute(loaded["roberta_cls"], [("the keys are", "a dog")], method="grad_x_input")


@needs_bridge
def test_other_encoder_families_name_the_hooked_backend(tmp_path):
    from transformers import XLMRobertaConfig, XLMRobertaModel

    config = XLMRobertaConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=40,
    )  # fmt: skip
    XLMRobertaModel(config).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="backend='hooked'"):
        load_model(str(tmp_path), backend="bridge")


def test_a_headless_folder_has_no_token_logits(loaded):
    from lens_attrib import TargetError

    with pytest.raises(TargetError, match="no masked-LM head"):
        attribute(loaded["roberta_model"], efr.ROBERTA_PROMPTS, Target(token="sees", position=3),
                  method="lrp")  # fmt: skip
