"""Fine-tuned encoder classifiers as users have them: ``*ForSequenceClassification`` folders.

A tiny random BERT / RoBERTa classifier (and regression head) is saved with transformers'
``save_pretrained``, with and without tokenizer files, and loaded with ``load_model(folder)``.
Oracle: transformers' own float64 forward of the same folder (logits ≤ 1e-10) on single
sentences and on sentence pairs (segment ids), and every encoder method runs through the head
the model came with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lens_attrib import METHODS, InputError, ModelError, Target, attribute, load_model
from lens_attrib.backend import attached_head, has_lm_head
from lens_attrib.classifiers.checkpoint_head import ClassifierHead
from lens_attrib.hooks.guard import model_state_fingerprint
from lens_attrib.tiny_models import tiny_tokenizer

F64 = torch.float64
EXACT = 1e-10
LABELS = {0: "negative", 1: "positive"}
# in-vocabulary words only: RoBERTa numbers positions by ids != pad id, and [UNK] (1) is its pad
TEXTS = ["the keys to the cabinet are", "a dog is near the cat"]
PAIRS = [("the keys to the cabinet are", "a dog is near the cat"), ("the keys are", "the dog is")]


def _randomize(hf_model: Any, seed: int) -> None:
    """transformers initialises biases to 0 and norm gains to 1: make every parameter count."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if p.ndim == 1:
                base = 1.0 if "LayerNorm.weight" in name or "layer_norm.weight" in name else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))


def _config(family: str, act: str, vocab: int, **extra: Any) -> Any:
    from transformers import BertConfig, RobertaConfig

    common = {
        "vocab_size": vocab,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "hidden_act": act,
        **extra,
    }
    if family == "bert":
        return BertConfig(max_position_embeddings=64, **common)
    # RoBERTa: positions from pad_token_id + 1 = 2, one segment
    return RobertaConfig(max_position_embeddings=66, pad_token_id=1, type_vocab_size=1, **common)


def save_classifier(
    folder: Path,
    family: str = "bert",
    act: str = "gelu",
    *,
    kind: str = "ForSequenceClassification",
    regression: bool = False,
    tokenizer: bool = True,
    seed: int = 0,
) -> Path:
    """A tiny random transformers checkpoint saved to ``folder``."""
    import transformers

    tok = tiny_tokenizer(encoder=True)
    extra: dict[str, Any] = {}
    if kind == "ForSequenceClassification":
        extra = (
            {"num_labels": 1, "problem_type": "regression"}
            if regression
            else {"id2label": LABELS, "label2id": {v: k for k, v in LABELS.items()}}
        )
    cls = getattr(transformers, f"{'Bert' if family == 'bert' else 'Roberta'}{kind}")
    torch.manual_seed(seed)
    hf_model = cls(_config(family, act, len(tok), **extra)).eval()
    _randomize(hf_model, seed + 1)
    hf_model.save_pretrained(folder)
    if tokenizer:
        tok.save_pretrained(folder)
    return folder


def reference(folder: Path, kind: str = "ForSequenceClassification") -> Any:
    import transformers

    model = getattr(transformers, f"AutoModel{kind}".replace("AutoModelModel", "AutoModel"))
    return model.from_pretrained(folder, dtype=F64).eval().requires_grad_(False)


def hf_inputs(model: Any, ids: torch.Tensor, mask: torch.Tensor, pad: int) -> torch.Tensor:
    return ids.masked_fill(~mask.bool(), pad)


def our_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor, types: Any = None) -> Any:
    with torch.no_grad():
        resid = model.encoder_output(ids, types, mask.long())
        return attached_head(model)(resid[:, 0])


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    out = {}
    for family in ("bert", "roberta"):
        for act in ("gelu", "relu"):
            out[f"{family}-{act}"] = save_classifier(root / f"{family}-{act}", family, act)
    out["bert-gelu_new"] = save_classifier(root / "bert-gelu_new", "bert", "gelu_new")
    out["bert-silu"] = save_classifier(root / "bert-silu", "bert", "silu")
    out["bert-notok"] = save_classifier(root / "bert-notok", tokenizer=False)
    out["bert-stsb"] = save_classifier(root / "bert-stsb", regression=True)
    out["roberta-stsb"] = save_classifier(root / "roberta-stsb", "roberta", regression=True)
    for family in ("bert", "roberta"):
        for kind in ("Model", "ForMaskedLM"):
            out[f"{family}-{kind}"] = save_classifier(root / f"{family}-{kind}", family, kind=kind)
    return out


@pytest.mark.parametrize(
    "name",
    [
        "bert-gelu",
        "bert-relu",
        "bert-gelu_new",
        "bert-silu",
        "roberta-gelu",
        "roberta-relu",
        "bert-stsb",
        "roberta-stsb",
    ],
)
def test_logits_equal_transformers_on_sentences_and_pairs(saved, name):
    model = load_model(str(saved[name]), dtype=F64)
    hf = reference(saved[name])
    head = attached_head(model)
    assert isinstance(head, ClassifierHead) and not has_lm_head(model)
    assert head.regression == name.endswith("stsb")
    if not head.regression:
        assert head.labels == ["negative", "positive"]
    pad = int(hf.config.pad_token_id or 0)
    enc = model.tokenizer(TEXTS, padding=True, return_tensors="pt")
    ours = our_logits(model, enc.input_ids, enc.attention_mask)
    ref = hf(
        input_ids=hf_inputs(model, enc.input_ids, enc.attention_mask, pad),
        attention_mask=enc.attention_mask,
    ).logits
    assert torch.allclose(ours, ref, rtol=0, atol=EXACT * float(ref.abs().max()))
    # pairs: BERT with its segment ids; RoBERTa has one segment ([SEP] [SEP] between the texts)
    ids, mask, types = (
        model.tokenizer(
            [a for a, _ in PAIRS],
            [b for _, b in PAIRS],
            padding=True,
            return_tensors="pt",
            return_token_type_ids=True,
        )[k]
        for k in ("input_ids", "attention_mask", "token_type_ids")
    )
    seg = types if name.startswith("bert") else None
    ours = our_logits(model, ids, mask, seg)
    ref = hf(
        input_ids=hf_inputs(model, ids, mask, pad), attention_mask=mask, token_type_ids=seg
    ).logits
    assert torch.allclose(ours, ref, rtol=0, atol=EXACT * float(ref.abs().max()))
    if seg is not None:  # the segments matter: segment 0 everywhere differs
        flat = our_logits(model, ids, mask)
        assert not torch.allclose(flat, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "name", ["bert-Model", "bert-ForMaskedLM", "roberta-Model", "roberta-ForMaskedLM"]
)
def test_encoder_and_masked_lm_folders_equal_transformers(saved, name):
    kind = name.split("-")[1]
    model = load_model(str(saved[name]), dtype=F64)
    hf = reference(saved[name], kind)
    assert attached_head(model) is None and has_lm_head(model) == (kind == "ForMaskedLM")
    enc = model.tokenizer(TEXTS, padding=True, return_tensors="pt")
    pad = int(hf.config.pad_token_id or 0)
    ids = hf_inputs(model, enc.input_ids, enc.attention_mask, pad)
    with torch.no_grad():
        if kind == "Model":
            ours = model.encoder_output(enc.input_ids, None, enc.attention_mask)
            ref = hf(input_ids=ids, attention_mask=enc.attention_mask).last_hidden_state
        else:
            ours = model(enc.input_ids, one_zero_attention_mask=enc.attention_mask)
            ref = hf(input_ids=ids, attention_mask=enc.attention_mask).logits
    real = enc.attention_mask.bool()
    assert float((ours - ref)[real].abs().max()) <= EXACT * float(ref.abs().max())


def test_roberta_position_offset_and_one_segment(saved):
    model = load_model(str(saved["roberta-gelu"]), dtype=F64)
    hf = reference(saved["roberta-gelu"])
    table = hf.roberta.embeddings.position_embeddings.weight
    assert torch.equal(model.embed.pos_embed.W_pos, table[2:])
    assert model.cfg.n_ctx == 64
    assert model.embed.token_type_embed.W_token_type.shape[0] == 1
    with pytest.raises(InputError, match="1 segment"):
        attribute(model, PAIRS[0], Target(label="positive"), method="grad_x_input")


def test_folder_without_tokenizer(saved):
    model = load_model(str(saved["bert-notok"]), dtype=F64)
    assert model.tokenizer is None
    with pytest.raises(InputError, match="no tokenizer"):
        attribute(model, "the cat", Target(label="positive"))
    with pytest.raises(InputError, match="no tokenizer"):
        attribute(model, PAIRS[0], Target(label="positive"))
    ids = torch.tensor([[2, 5, 44, 3, 6, 51, 3]])
    types = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    attr = attribute(model, ids, Target(label="positive"), token_type_ids=types)
    hf = reference(saved["bert-notok"])
    logits = hf(input_ids=ids, token_type_ids=types).logits
    assert torch.equal(attr.target.token_ids, torch.tensor([1]))
    assert attr.tokens[0][0] == "<2>"
    # grad × input over the full embedding with a zero baseline sums to nothing checkable here,
    # so check the explained value through the value-zeroing-free path: the Target's evaluation
    from lens_attrib.classifiers.checkpoint_head import with_model_head
    from lens_attrib.forward import no_grad_context, run
    from lens_attrib.inputs import to_batch

    with no_grad_context(model):
        fwd = run(
            model,
            to_batch(model, ids, token_type_ids=types),
            with_model_head(model, Target(label="positive")),
        )
    assert abs(float(fwd.value[0]) - float(logits[0, 1])) <= EXACT * float(logits.abs().max())


def test_unsupported_families_and_activations(tmp_path):
    from transformers import BertConfig, DebertaV2Config, DebertaV2Model

    cfg = DebertaV2Config(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
    )
    DebertaV2Model(cfg).save_pretrained(tmp_path / "deberta")
    with pytest.raises(ModelError, match="relative-position"):
        load_model(str(tmp_path / "deberta"))
    bad = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_act="mish",
        architectures=["BertModel"],
    )
    from transformers import BertModel

    BertModel(bad).save_pretrained(tmp_path / "mish")
    with pytest.raises(ModelError, match="mish"):
        load_model(str(tmp_path / "mish"))


ENCODER_METHODS = sorted(n for n, s in METHODS.items() if s.encoder)
QUICK = {
    "integrated_gradients": {"n_steps": 8},
    "reagent": {"num_probes": 2, "max_probe_steps": 2, "stopping_condition_top_k": 1},
}


@pytest.mark.parametrize("method", ENCODER_METHODS)
def test_every_encoder_method_runs_through_the_models_own_head(saved, method):
    model = load_model(str(saved["bert-gelu"]), dtype=F64)
    before = model_state_fingerprint(model)
    attr = attribute(
        model, PAIRS[0], Target(label="positive"), method=method, **QUICK.get(method, {})
    )
    assert model_state_fingerprint(model) == before
    assert torch.isfinite(attr.scores).all()
    if not METHODS[method].target_free:
        assert int(attr.target.positions[0]) == 0  # read at [CLS]
        assert int(attr.target.token_ids[0]) == 1  # "positive"
    assert attr.token_types is not None and int(attr.token_types.max()) == 1


def test_default_target_is_the_prediction_of_the_models_head(saved):
    model = load_model(str(saved["bert-gelu"]), dtype=F64)
    hf = reference(saved["bert-gelu"])
    enc = model.tokenizer(*PAIRS[0], return_tensors="pt", return_token_type_ids=True)
    logits = hf(**enc).logits[0]
    attr = attribute(model, PAIRS[0], method="grad_x_input")
    assert int(attr.target.token_ids[0]) == int(logits.argmax())
    assert attr.meta["target_tokens"] is None or attr.meta["target_tokens"][0] in LABELS.values()
    with pytest.raises(Exception, match="labels"):
        attribute(model, PAIRS[0], Target(label="neutral"), method="grad_x_input")


def _hf_head_on_every_row(hf: Any, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' own head (pooler dense + tanh + classifier, or RoBERTa's classifier)
    applied to every position's representation, not only [CLS]: ``[batch, pos, n_out]``."""
    if hasattr(hf, "bert"):
        return hf.classifier(torch.tanh(hf.bert.pooler.dense(hidden)))
    head = hf.classifier
    return head.out_proj(torch.tanh(head.dense(hidden)))


@pytest.mark.parametrize("name", ["bert-stsb", "roberta-stsb", "bert-gelu"])
def test_logat_and_normxlogit_through_the_loaded_head(saved, name):
    """LogAt (eq. 2/3 of the NormXLogit paper) through the model's own head at every layer:
    classification ``HoT(x_i^l)[ŷ]``; regression ``|HoT(x_i^l) − HoT([CLS]^l)|``; NormXLogit
    multiplies by ‖x⁰_i‖ (the embedding output). Oracle: transformers' hidden states."""
    model = load_model(str(saved[name]), dtype=F64)
    hf = reference(saved[name])
    pair = name.startswith("bert")
    inputs = PAIRS[0] if pair else TEXTS[0]
    regression = name.endswith("stsb")
    logat = attribute(model, inputs, method="logat")
    normx = attribute(model, inputs, method="normxlogit")
    enc = model.tokenizer(
        *([*inputs] if pair else [inputs]), return_tensors="pt", return_token_type_ids=pair
    )
    out = hf(**enc, output_hidden_states=True)
    per_layer = torch.stack(
        [_hf_head_on_every_row(hf, h[0]) for h in out.hidden_states[1:]]
    )  # [layer, pos, n_out]
    if regression:
        assert logat.target.regression
        expected = (per_layer[..., 0] - per_layer[:, :1, 0]).abs()
    else:
        label = int(out.logits[0].argmax())
        assert int(logat.target.token_ids[0]) == label
        expected = per_layer[..., label]
    assert int(logat.target.positions[0]) == 0  # read at [CLS]
    tol = EXACT * float(expected.abs().max())
    assert float((logat.layer_scores[0] - expected).abs().max()) <= tol
    assert torch.equal(logat.scores[0], logat.layer_scores[0, -1])
    norms = out.hidden_states[0][0].norm(dim=-1)
    expected_x = expected * norms
    assert float((normx.layer_scores[0] - expected_x).abs().max()) <= EXACT * float(
        expected_x.abs().max()
    )
    if regression:  # [CLS] is the prediction itself: distance 0 at every layer
        assert bool((logat.layer_scores[0, :, 0] == 0).all())
