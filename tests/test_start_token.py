"""One start-token policy for every entry point (issue 26, item 4).

The same item gives the same scores through ``attribute``, ``evaluate`` on a user JSONL, the
agreement experiment's own code path and a data-loader item, on a float64 tiny decoder built like
SmolLM2 (a tokenizer BOS that the config does not prepend, ``<|endoftext|>`` as a special token)
and on SmolLM2 itself; ``meta`` and the runner's records say which start token was used; the
per-call and per-model overrides work; token ids are never changed; encoders are unaffected.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lens_attrib import Target, attribute
from lens_attrib.data import TaskItem, item_evidence_positions, load_items, word_spans
from lens_attrib.errors import InputError
from lens_attrib.evaluation import runner
from lens_attrib.evaluation.faithfulness import special_ids_of
from lens_attrib.evaluation.items import item_evidence
from lens_attrib.evaluation.journal import ManifestMismatch
from lens_attrib.inputs import (
    DOCUMENT_SEPARATOR,
    set_start_token,
    start_token_of,
    start_token_setting,
    to_batch,
)
from lens_attrib.scoring import contrastive_scores
from lens_attrib.tiny_models import tiny_bert, tiny_llama, tiny_tokenizer
from tests.tl_versions import BRIDGE

F64 = torch.float64
PROMPT = "the keys to the cabinet"
EVIDENCE_WORD = 1  # "keys"
REL = 1e-12  # float64: the same computation through another door, relative to max |score|


def smol_like(dtype: torch.dtype = F64) -> Any:
    """A tiny Llama whose tokenizer has a BOS the config does not prepend and ``<|endoftext|>``
    as an extra special token: the start-token situation of SmolLM2."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [DOCUMENT_SEPARATOR]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_llama(dtype=dtype, default_prepend_bos=False, d_vocab=len(tokenizer))
    if BRIDGE:  # the bridge's tokenizer setter re-loads a tokenizer by name: keep this one
        from lens_attrib.backend_bridge import use_tokenizer

        use_tokenizer(model, tokenizer)
    else:
        model.tokenizer = tokenizer
    return model


@pytest.fixture(scope="module")
def model() -> Any:
    return smol_like()


def close(a: torch.Tensor, b: torch.Tensor, rel: float = REL) -> bool:
    scale = float(b.abs().max())
    return a.shape == b.shape and float((a - b).abs().max()) <= rel * scale


def right_item(model: Any, prompt: str = PROMPT) -> TaskItem:
    """The item with target/foil ordered so that the (random) model gets it right: the
    experiments only explain items the model predicts correctly."""
    item = make_item(prompt, "are", "is", (EVIDENCE_WORD,))
    if not bool(contrastive_scores(model, [item]).correct[0]):
        item = make_item(prompt, "is", "are", (EVIDENCE_WORD,))
    return item


def make_item(prompt: str, target: str | None, foil: str | None, words: tuple[int, ...]) -> Any:
    return TaskItem(prompt, target, foil, words, task="t", meta={})


def write_jsonl(path: Path, item: TaskItem, spans: bool = False) -> Path:
    row: dict[str, Any] = {"prompt": item.prompt, "target": item.target, "foil": item.foil}
    if spans:
        row["evidence_spans"] = [list(word_spans(item.prompt)[w]) for w in item.evidence_words]
    else:
        row["evidence_words"] = list(item.evidence_words)
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------------ the policy
def test_default_policy_per_model(model, smollm2) -> None:
    eot = model.tokenizer.convert_tokens_to_ids(DOCUMENT_SEPARATOR)
    assert (start_token_of(model).id, start_token_of(model).text) == (eot, DOCUMENT_SEPARATOR)
    tiny = tiny_llama(dtype=F64)  # cfg.default_prepend_bos=True: the tokenizer's BOS
    assert start_token_of(tiny).text == "<bos>"
    bare = tiny_llama(dtype=F64, default_prepend_bos=False)  # no BOS prepended, no separator
    assert start_token_of(bare).id is None
    assert start_token_of(tiny_bert()).id is None  # encoders: [CLS] … [SEP] only
    smol = start_token_of(smollm2)
    assert smol.text == "<|endoftext|>" and smol.id == 0
    assert smollm2.tokenizer.bos_token == "<|im_start|>"  # a chat marker, not the start token


def test_text_gets_the_start_token_and_ids_are_used_as_given(model) -> None:
    eot = start_token_of(model).id
    words = model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    text = to_batch(model, PROMPT)
    assert text.tokens[0].tolist() == [eot, *words]
    assert bool(text.special[0, 0])  # special: never perturbed, never evidence
    assert eot in special_ids_of(model, None)
    ids = to_batch(model, torch.tensor([words]))
    assert ids.tokens[0].tolist() == words  # token ids: never changed
    with_start = to_batch(model, [[eot, *words]])
    assert with_start.tokens[0].tolist() == [eot, *words]
    # written into the text, it is not doubled; another leading special token gets nothing more
    assert to_batch(model, DOCUMENT_SEPARATOR + PROMPT).tokens[0].tolist() == [eot, *words]
    bos = model.tokenizer.bos_token_id
    assert to_batch(model, "<bos>" + PROMPT).tokens[0].tolist() == [bos, *words]


def test_positions_count_the_start_token(model) -> None:
    attr = attribute(model, PROMPT, Target(position=2), method="grad_x_input")
    assert attr.tokens[0][2] == "keys"  # real token 0 is <|endoftext|>
    assert int(attr.target.positions[0]) == 2
    assert item_evidence_positions(model, right_item(model)) == [2]
    assert item_evidence_positions(model, right_item(model), start_token=False) == [1]


# ------------------------------------------------------------------------ every door
@pytest.mark.parametrize("method", ["alti_logit", "grad_x_input"])
def test_same_scores_through_every_door(model, tmp_path, monkeypatch, method) -> None:
    """attribute == evaluate(user JSONL) == agreement's code path == loaded item == ids."""
    from experiments import agreement

    item = right_item(model)
    target = Target(token=[item.target], foil=[item.foil])
    direct = attribute(model, [item.prompt], target, method=method)
    assert direct.meta["start_token"] == [DOCUMENT_SEPARATOR]
    assert DOCUMENT_SEPARATOR in direct.meta["start_token_policy"]
    evidence = item_evidence_positions(model, item)

    # the data loader: the same item from a user JSONL, evidence as words and as spans
    for spans in (False, True):
        path = write_jsonl(tmp_path / f"items_{spans}.jsonl", item, spans=spans)
        (loaded,) = load_items(path)
        assert item_evidence_positions(model, loaded) == evidence
        assert item_evidence(model, loaded, None) == evidence

    # evaluate() on that JSONL: capture the Attribution it computes
    seen: list[Any] = []
    real = runner.attribute

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(runner, "attribute", spy)
    (loaded,) = load_items(tmp_path / "items_False.jsonl")
    result = runner.evaluate(
        model, [loaded], [method], ["pointing_game"], contrastive=True, progress=False
    )
    monkeypatch.undo()
    assert len(seen) == 1 and close(seen[0].scores, direct.scores)
    assert torch.equal(seen[0].token_ids, direct.token_ids)
    assert result.config["start_token"].startswith(repr(DOCUMENT_SEPARATOR))
    assert {r["start_token"] for r in result.records} == {DOCUMENT_SEPARATOR}
    (pg,) = [r["value"] for r in result.records if r["metric"] == "pointing_game"]
    best = int(direct.item_scores(0)[1:].argmax()) + 1  # the start token is special: out
    assert pg == float(best in evidence)

    # the agreement experiment's own path: prepare (correct items, evidence), then one unit
    data = agreement.prepare_items(model, [item], n=1)
    assert data.prompts == [item.prompt] and data.evidence == [evidence]
    kept: dict[str, Any] = {}
    agreement.unit_records(
        model, "t", data.prompts, data.evidence, target, method, "contrastive", 0, 0, kept
    )
    assert close(kept[method].scores, direct.scores)
    assert torch.equal(kept[method].token_ids, direct.token_ids)

    # token ids that start with the start token, and the old experiments' prefixed text
    ids = direct.token_ids[0][direct.mask[0]].tolist()
    for inputs in ([ids], [DOCUMENT_SEPARATOR + item.prompt]):
        again = attribute(model, inputs, target, method=method)
        assert close(again.scores, direct.scores)
        assert again.meta["start_token"] == [DOCUMENT_SEPARATOR]


def test_evaluate_override_reaches_every_part(model) -> None:
    item = right_item(model)
    target = Target(token=[item.target], foil=[item.foil])
    bare = attribute(model, [item.prompt], target, method="alti_logit", start_token=False)
    assert bare.meta["start_token"] == [None] and bare.tokens[0][0] == "the"
    assert bare.meta["start_token_policy"].startswith("none (start_token=False")
    result = runner.evaluate(
        model,
        [item],
        ["alti_logit"],
        ["pointing_game"],
        contrastive=True,
        progress=False,
        start_token=False,
    )
    assert result.config["start_token"].startswith("none")
    assert {r["start_token"] for r in result.records} == {None}
    (pg,) = [r["value"] for r in result.records if r["metric"] == "pointing_game"]
    best = int(bare.item_scores(0).argmax())
    assert pg == float(best in item_evidence_positions(model, item, start_token=False))


def test_evaluate_journal_refuses_another_start_token(model, tmp_path) -> None:
    item = right_item(model)
    out = tmp_path / "run.json"
    args = ([item], ["grad_x_input"], ["pointing_game"])
    runner.evaluate(model, *args, progress=False, out=out)
    with pytest.raises(ManifestMismatch, match="start_token"):
        runner.evaluate(model, *args, progress=False, out=out, start_token=False)


# ------------------------------------------------------------------------------ SmolLM2
def test_smollm2_same_scores_through_every_door(smollm2, monkeypatch) -> None:
    """Float32, one agreement item: the scores of attribute, evaluate and the agreement path
    are the same computation (same ids, same batch) and agree to float32 rounding."""
    from experiments import agreement

    torch.set_num_threads(1)
    item = make_item("The keys to the cabinet", " are", " is", (1,))
    target = Target(token=[item.target], foil=[item.foil])
    direct = attribute(smollm2, [item.prompt], target, method="alti_logit")
    assert direct.tokens[0][:2] == ["<|endoftext|>", "The"]
    assert direct.meta["start_token"] == ["<|endoftext|>"]
    evidence = item_evidence_positions(smollm2, item)
    assert evidence == [2]  # <|endoftext|> The keys

    seen: list[Any] = []
    real = runner.attribute
    monkeypatch.setattr(runner, "attribute", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    result = runner.evaluate(
        smollm2, [item], ["alti_logit"], ["pointing_game", "mrr"], contrastive=True, progress=False
    )
    monkeypatch.undo()
    data = agreement.prepare_items(smollm2, [item], n=1)
    assert data.evidence == [evidence] and data.prompts == [item.prompt]
    kept: dict[str, Any] = {}
    records = agreement.unit_records(
        smollm2, "t", data.prompts, data.evidence, target, "alti_logit", "c", 0, 0, kept
    )
    # the same metric values: <|endoftext|> (also SmolLM2's UNK) is special in both, not content
    ours = {r["metric"]: r["value"] for r in result.records if r["method"] == "alti_logit"}
    theirs = {r["metric"]: r["value"] for r in records if r["specials"] == "out"}
    assert ours == {m: theirs[m] for m in ours}
    for other in (seen[0], kept["alti_logit"]):
        assert torch.equal(other.token_ids, direct.token_ids)
        assert close(other.scores, direct.scores, rel=1e-6)
    # the written-in start token of the earlier experiments gives the very same input
    old = attribute(smollm2, ["<|endoftext|>" + item.prompt], target, method="alti_logit")
    assert torch.equal(old.token_ids, direct.token_ids)
    assert close(old.scores, direct.scores, rel=1e-6)
    # a chat-template prompt already starts with a special token: nothing is added
    chat = to_batch(smollm2, "<|im_start|>user\nhi")
    assert chat.str_tokens[0][0] == "<|im_start|>"


def test_the_start_token_is_never_perturbed(smollm2) -> None:
    """SmolLM2's UNK token is ``<|endoftext|>``, its start token: it stays special for the
    perturbation metrics (an ordinary UNK word would not)."""
    from lens_attrib.evaluation.faithfulness import item_views

    assert smollm2.tokenizer.unk_token_id == 0 == start_token_of(smollm2).id
    special = special_ids_of(smollm2, None)
    assert 0 in special
    attr = attribute(smollm2, "The keys to the", method="attention")
    (view,) = item_views(attr, special)
    assert 0 in view.kept and 0 not in view.ranked
    bert = tiny_bert()
    assert bert.tokenizer.unk_token_id not in special_ids_of(bert, None)  # [UNK] is a word


# ---------------------------------------------------------------------------- overrides
def test_per_call_overrides(model, smollm2) -> None:
    words = model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    bos = model.tokenizer.bos_token_id
    assert to_batch(model, PROMPT, start_token=False).tokens[0].tolist() == words
    assert to_batch(model, PROMPT, start_token="<bos>").tokens[0].tolist() == [bos, *words]
    assert to_batch(model, PROMPT, start_token=bos).tokens[0].tolist() == [bos, *words]
    assert to_batch(model, PROMPT, prepend_bos=True).tokens[0].tolist() == [bos, *words]
    assert to_batch(model, PROMPT, prepend_bos=False).tokens[0].tolist() == words
    default = to_batch(smollm2, "The keys").tokens
    assert torch.equal(to_batch(smollm2, "The keys", start_token=0).tokens, default)  # id 0
    with pytest.raises(InputError, match="already tokenized"):
        to_batch(smollm2, to_batch(smollm2, "The keys"), start_token=0)
    a = attribute(smollm2, "The keys", method="attention", start_token="<|im_start|>")
    assert a.tokens[0][0] == "<|im_start|>" and a.meta["start_token"] == ["<|im_start|>"]
    assert "(this call)" in a.meta["start_token_policy"]


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        ({"start_token": "keys"}, "not one special token"),
        ({"start_token": True}, "does not say which token"),
        ({"start_token": 5}, "not the id of a special token"),
        ({"start_token": "<bos>", "prepend_bos": True}, "both given"),
    ],
)
def test_bad_start_tokens_are_refused(model, kwargs, phrase) -> None:
    with pytest.raises(InputError, match=phrase):
        attribute(model, PROMPT, method="grad_x_input", **kwargs)


def test_token_ids_with_a_requested_start_token_are_refused(model) -> None:
    ids = torch.tensor([model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]])
    with pytest.raises(InputError, match="used exactly as given"):
        to_batch(model, ids, start_token="<bos>")
    assert to_batch(model, ids, start_token=False).tokens.tolist() == ids.tolist()


def test_model_setting_and_its_scope(model) -> None:
    words = model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    bos = model.tokenizer.bos_token_id
    with start_token_setting(model, False) as start:
        assert start.id is None and start.rule == "set_start_token"
        assert to_batch(model, PROMPT).tokens[0].tolist() == words
        item = right_item(model)
        assert item_evidence_positions(model, item) == [1]
        # a per-call choice still wins over the model's
        assert to_batch(model, PROMPT, start_token="<bos>").tokens[0].tolist() == [bos, *words]
    assert start_token_of(model).text == DOCUMENT_SEPARATOR  # restored
    with pytest.raises(RuntimeError), start_token_setting(model, "<bos>"):
        assert start_token_of(model).id == bos
        raise RuntimeError("restored on an exception too")
    assert start_token_of(model).text == DOCUMENT_SEPARATOR
    set_start_token(model, "<bos>")
    try:
        assert to_batch(model, PROMPT).tokens[0].tolist() == [bos, *words]
    finally:
        set_start_token(model, None)
    assert start_token_of(model).text == DOCUMENT_SEPARATOR


def test_agreement_no_bos_flag_means_no_start_token(model) -> None:
    from experiments import agreement

    args = agreement.parse_args(["--no-bos"])
    assert args.start_token is False
    assert agreement.parse_args(["--start-token", "<bos>"]).start_token == "<bos>"
    assert agreement.parse_args([]).start_token is None


# ---------------------------------------------------------------------------- encoders
def test_encoders_are_unaffected() -> None:
    bert = tiny_bert(dtype=F64)
    batch = to_batch(bert, "the keys")
    assert batch.str_tokens[0] == ["[CLS]", "the", "keys", "[SEP]"]
    attr = attribute(bert, "the keys", method="grad_x_input", target=Target(position=0))
    assert attr.meta["start_token"] == [None]
    assert attr.meta["start_token_policy"].startswith("none (encoder")
    item = make_item("the keys", None, None, (1,))
    assert item_evidence_positions(bert, item) == [2]  # [CLS] the keys
    with pytest.raises(InputError, match="encoder"):
        to_batch(bert, "the keys", start_token="[CLS]")
    with pytest.raises(InputError, match="encoder"):
        set_start_token(bert, "[CLS]")


# ------------------------------------------------------------------- IG / DeepLIFT sink
@pytest.mark.parametrize("method", ["integrated_gradients", "deeplift"])
def test_sink_is_the_start_token(model, method) -> None:
    """Text already begins with the start token (no sink added); ids without it get the same
    token prepended as sink, so the content scores are the same."""
    opts = {"integrated_gradients": {"n_steps": 16}, "deeplift": {}}[method]
    opts["keep_sink"] = "special"
    text = attribute(model, PROMPT, method=method, **opts)
    words = model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ids = attribute(model, torch.tensor([words]), method=method, **opts)
    assert text.meta["prepended_sink"] == [False] and ids.meta["prepended_sink"] == [True]
    assert float(text.scores[0, 0]) == 0.0  # the start token is kept fixed: no relevance
    assert close(ids.scores[0], text.scores[0, 1:])


# ------------------------------------------------------------------------- classifiers
def test_classifier_cache_key_and_metadata_record_the_start_token(model, tmp_path) -> None:
    from lens_attrib.classifiers import data_hash, train_or_load

    texts = [f"the {w} is {s}" for w in ("movie", "film", "book") for s in ("good", "bad")] * 3
    labels = torch.tensor([int("good" in t) for t in texts])
    args = (texts[:12], labels[:12], texts[12:], labels[12:])
    _, meta = train_or_load(model, tmp_path / "a", *args, n_out=2, weight_decays=(1e-3,))
    assert meta["start_token"] == DOCUMENT_SEPARATOR
    with start_token_setting(model, False):
        _, bare = train_or_load(model, tmp_path / "a", *args, n_out=2, weight_decays=(1e-3,))
    assert bare["start_token"] is None and bare["data_hash"] != meta["data_hash"]
    name = str(model.cfg.model_name)
    assert data_hash(name, texts, labels) != data_hash(name, texts, labels, DOCUMENT_SEPARATOR)


# ------------------------------------------------------------------------------- speed
def test_speed_inputs_start_with_the_start_token(model) -> None:
    from experiments import speed

    tokens = speed.token_inputs(model, 12, batch=2)
    assert tokens.shape == (2, 12)
    assert tokens[:, 0].tolist() == [start_token_of(model).id] * 2
