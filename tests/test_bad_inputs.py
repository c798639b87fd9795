"""Inputs users really pass: tokenizer outputs and masks, numpy, wrong calls with clear errors.

Each row of the "bad input" table is a wrong call, the exception (or warning) type it must raise
and a phrase its message must contain (what was wrong, and the fix). After every row the tiny
models are exactly as they were (guard fingerprint and every weight). Further tests below: NaN
weights and activations for every method, missing leading spaces and trailing spaces with
SmolLM2's tokenizer (the bug needs a tokenizer with spaced and unspaced forms), model folders,
the runner's command line.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from model_state import assert_unchanged
from model_state import model_state as _state

from lens_attrib import (
    METHODS,
    InputError,
    InputWarning,
    ModelError,
    NonFiniteError,
    OptionError,
    Target,
    TargetError,
    attribute,
    load_classifier,
    load_model,
)
from lens_attrib.data.user import load_items, parse_item
from lens_attrib.evaluation import (
    aopc,
    average_precision,
    dot_product,
    evaluate,
    insertion_deletion,
    mrr,
    per_token_accuracy,
    plausibility,
    pointing_game,
    relevance_mass_accuracy,
    soft_metrics,
    token_accuracy,
)
from lens_attrib.evaluation.plausibility import is_degenerate
from lens_attrib.hooks.guard import model_state_fingerprint
from lens_attrib.methods.registry import prepare
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama
from tests.tl_versions import hooked_only

F64 = torch.float64


@pytest.fixture(scope="module")
def gpt2():
    return tiny_gpt2(dtype=F64)


@pytest.fixture(scope="module")
def bert():
    return tiny_bert(dtype=F64)


def _head(n_out: int = 3):
    torch.manual_seed(0)
    return torch.nn.Linear(32, n_out).double()


BAD_CALLS = [
    # (id, call(model, bert), exception, phrase)
    ("string target", lambda m, b: attribute(m, "the dog", " are"), TargetError, "Target("),
    ("method as target", lambda m, b: attribute(m, "the dog", "attnlrp"), TargetError, "method="),
    ("np.int64 target", lambda m, b: attribute(m, "the dog", Target(np.int64(5))), None, None),
    ("position='last'", lambda m, b: Target(position="last"), TargetError, "None already"),
    ("float position", lambda m, b: Target(position=1.5), TargetError, "position must be"),
    ("None inside a token list", lambda m, b: Target(["are", None]), TargetError, "strings or ids"),
    ("dict token", lambda m, b: Target({"a": 1}), TargetError, "must be a string"),
    ("negative generate", lambda m, b: Target(generate=-1), TargetError, "generate must"),
    ("non-callable head", lambda m, b: Target(head=3), TargetError, "callable"),
    ("mixed prompt list", lambda m, b: attribute(m, [["the keys", None]]), InputError, "not a mix"),
    ("float ids", lambda m, b: attribute(m, torch.tensor([[1.5, 2.0]])), InputError, "integer"),
    ("float id lists", lambda m, b: attribute(m, [[1.5, 2.0]]), InputError, "integer"),
    ("negative ids", lambda m, b: attribute(m, [[5, -1, 6]]), InputError, "outside the vocab"),
    ("ids past vocab", lambda m, b: attribute(m, [[5, 100000]]), InputError, "outside the vocab"),
    ("empty prompt", lambda m, b: attribute(m, ""), InputError, "empty"),
    ("empty list", lambda m, b: attribute(m, []), InputError, "No inputs"),
    ("an int as input", lambda m, b: attribute(m, 42), InputError, "No inputs"),
    ("too long", lambda m, b: attribute(m, "the " * 80), InputError, "n_ctx"),
    (
        "3-d ids",
        lambda m, b: attribute(m, torch.ones(1, 2, 3, dtype=torch.long)),
        InputError,
        "[pos]",
    ),
    ("mask shape", lambda m, b: attribute(m, [[5, 6]], attention_mask=[[1]]), InputError, "shape"),
    (
        "mask values",
        lambda m, b: attribute(m, [[5, 6]], attention_mask=[[1, 2]]),
        InputError,
        "0/1",
    ),
    ("dict without ids", lambda m, b: attribute(m, {"ids": [[1]]}), InputError, "input_ids"),
    (
        "multi-token target",
        lambda m, b: attribute(m, "the dog", Target("the dog")),
        TargetError,
        "2 tokens",
    ),
    (
        "position outside",
        lambda m, b: attribute(m, "the dog", Target(position=7)),
        InputError,
        "outside item",
    ),
    (
        "too many positions",
        lambda m, b: attribute(m, ["the dog", "a cat"], Target(position=[0, 1, 1])),
        TargetError,
        "3 target positions",
    ),
    (
        "too many tokens",
        lambda m, b: attribute(m, ["the dog"], Target(["is", "are"])),
        TargetError,
        "2 tokens for a batch",
    ),
    (
        "token id past head",
        lambda m, b: attribute(m, "the dog", Target(10**6)),
        TargetError,
        "outside the head",
    ),
    ("unknown method", lambda m, b: attribute(m, "the dog", method="lrp2"), KeyError, "Registered"),
    (
        "unknown option value",
        lambda m, b: attribute(m, "the dog", method="lrp", embeddings="bogus"),
        OptionError,
        "'partial'",
    ),
    (
        "heads on a method without",
        lambda m, b: attribute(m, "the dog", method="rollout", heads=True),
        OptionError,
        "methods that have them",
    ),
    (
        "unknown option",
        lambda m, b: attribute(m, "the dog", method="lrp", steps=3),
        OptionError,
        "its options",
    ),
    (
        "bad option type",
        lambda m, b: attribute(m, "the dog", method="integrated_gradients", n_steps=0),
        OptionError,
        "positive integer",
    ),
    (
        "decoder-only method",
        lambda m, b: attribute(b, "the dog", method="alti_logit"),
        ModelError,
        "'alti'",
    ),
    (
        "string label on a class head",
        lambda m, b: attribute(m, "the dog", Target("is", head=_head())),
        TargetError,
        "class index",
    ),
    (
        "1-d head output",
        lambda m, b: attribute(m, "the dog", Target(0, head=lambda x: x.sum(-1))),
        TargetError,
        "[n, n_out]",
    ),
    (
        "regression head with 3 outputs",
        lambda m, b: attribute(m, "the dog", Target(head=_head(), regression=True)),
        TargetError,
        "one output",
    ),
    (
        "generate on an encoder",
        lambda m, b: attribute(b, "the dog", Target(generate=2)),
        TargetError,
        "decoder",
    ),
]


def _attr(m, n: int = 1):
    prompts = ["the keys to the cabinet", "the dog", "a cat"][:n]
    return attribute(m, prompts, method="grad_x_input")


def _with_nan_scores(m):
    attr = _attr(m, 2)
    attr.scores[0, -2] = float("nan")
    return attr


def _item(**fields):
    row = {"prompt": "the keys to the cabinet", "target": " are", "evidence_words": [1]}
    row.update(fields)
    return row


def _items_file(rows, name: str = "items.jsonl") -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="bad_inputs_")) / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


DATASET = [parse_item(_item(foil=" is"))]
NAN = float("nan")

BAD_CALLS += [
    # --- not a model / the wrong model
    ("model None", lambda m, b: attribute(None, "the dog"), ModelError, "model is None"),
    ("model name", lambda m, b: attribute("smollm2-135m", "the dog"), ModelError, "load_model("),
    ("a tokenizer", lambda m, b: attribute(m.tokenizer, "the dog"), ModelError, "a tokenizer"),
    (
        "a torch module",
        lambda m, b: attribute(torch.nn.Linear(2, 2), "the dog"),
        ModelError,
        "HookedTransformer",
    ),
    (
        "spec called with None",
        lambda m, b: METHODS["grad_x_input"](None, "the dog"),
        ModelError,
        "model is None",
    ),
    (
        "decoder-only method name",
        lambda m, b: attribute(m, "the dog", method="decompx"),
        ModelError,
        "'alti_logit'",
    ),
    # --- options: Target fields, heads, spelling, values
    ("token=", lambda m, b: attribute(m, "the dog", token=" are"), OptionError, "Target(token="),
    ("foil=", lambda m, b: attribute(m, "the dog", foil="is"), OptionError, "Target(foil="),
    ("position=", lambda m, b: attribute(m, "the dog", position=1), OptionError, "third argument"),
    (
        "heads=True on alti_logit",
        lambda m, b: attribute(m, "the dog", method="alti_logit", heads=True),
        OptionError,
        "always returns per-head relevances",
    ),
    (
        "heads on attention names only methods that take it",
        lambda m, b: attribute(m, "the dog", method="attention", heads=True),
        OptionError,
        "['attnlrp', 'grad_x_input', 'gradient', 'lrp'] (with heads=True)",
    ),
    (
        "misspelled option",
        lambda m, b: attribute(m, "the dog", method="integrated_gradients", nsteps=8),
        OptionError,
        "Did you mean 'n_steps'",
    ),
    (
        "misspelled method",
        lambda m, b: attribute(m, "the dog", method="grad_x_imput"),
        KeyError,
        "Did you mean 'grad_x_input'",
    ),
    (
        "method with dashes and capitals",
        lambda m, b: attribute(m, "the dog", method="Grad-X-Input"),
        KeyError,
        "Did you mean 'grad_x_input'",
    ),
    (
        "method None",
        lambda m, b: attribute(m, "the dog", None, None),
        KeyError,
        "Unknown method None",
    ),
    (
        "Target as the method",
        lambda m, b: attribute(m, "the dog", None, Target("is")),
        KeyError,
        "fourth argument",
    ),
    (
        "negative IG steps",
        lambda m, b: attribute(m, "the dog", method="integrated_gradients", n_steps=-2),
        OptionError,
        "positive integer",
    ),
    (
        "IG max_steps 0",
        lambda m, b: attribute(m, "the dog", method="integrated_gradients", max_steps=0),
        OptionError,
        "positive integer",
    ),
    (
        "IG step_batch 0",
        lambda m, b: attribute(m, "the dog", method="integrated_gradients", step_batch=0),
        OptionError,
        "positive integer",
    ),
    (
        "IG negative tolerance",
        lambda m, b: attribute(m, "the dog", method="integrated_gradients", tolerance=-1.0),
        OptionError,
        "(0, 1)",
    ),
    (
        "IG unknown baseline",
        lambda m, b: attribute(m, "the dog", method="integrated_gradients", baseline="zeros"),
        OptionError,
        "'zero'",
    ),
    (
        "heads='yes'",
        lambda m, b: attribute(m, "the dog", method="grad_x_input", heads="yes"),
        OptionError,
        "True or False",
    ),
    (
        "alti chunk_size 0",
        lambda m, b: attribute(m, "the dog", method="alti_logit", chunk_size=0),
        OptionError,
        "positive integer",
    ),
    (
        "reagent keep_top_n 0",
        lambda m, b: attribute(m, "the dog is", method="reagent", keep_top_n=0),
        OptionError,
        "positive integer",
    ),
    (
        "reagent num_probes 0",
        lambda m, b: attribute(m, "the dog is", method="reagent", num_probes=0),
        OptionError,
        "positive integer",
    ),
    (
        "reagent replacing_ratio 2",
        lambda m, b: attribute(m, "the dog is", method="reagent", replacing_ratio=2.0),
        OptionError,
        "(0, 1)",
    ),
    (
        "value_zeroing batch 0",
        lambda m, b: attribute(m, "the dog", method="value_zeroing", batch_size=0),
        OptionError,
        "positive integer",
    ),
    (
        "grad_ellm n_layers 0",
        lambda m, b: attribute(m, "the dog", method="grad_ellm", n_layers=0),
        OptionError,
        "positive integer",
    ),
    (
        "grad_ellm layer outside",
        lambda m, b: attribute(m, "the dog", method="grad_ellm", layers=[9]),
        ValueError,
        "[-3, 3)",
    ),
    (
        "attention layer outside",
        lambda m, b: attribute(m, "the dog", method="attention", layer=99),
        ValueError,
        "[-3, 2]",
    ),
    (
        "random seed float",
        lambda m, b: attribute(m, "the dog", method="random", seed=1.5),
        OptionError,
        "an integer",
    ),
    (
        "deeplift negative eps",
        lambda m, b: attribute(m, "the dog", method="deeplift", eps=-1.0),
        OptionError,
        "[0, 1)",
    ),
    (
        "lrp negative identity_eps",
        lambda m, b: attribute(m, "the dog", method="lrp", identity_eps=-1.0),
        OptionError,
        ">= 0",
    ),
    # --- inputs
    ("one empty prompt of two", lambda m, b: attribute(m, ["the dog", ""]), InputError, "Input 1"),
    ("whitespace prompt", lambda m, b: attribute(m, "   "), InputError, "empty"),
    ("list of word lists", lambda m, b: attribute(m, [["the", "dog"]]), InputError, "not a mix"),
    (
        "zero-length ids",
        lambda m, b: attribute(m, torch.zeros(1, 0, dtype=torch.long)),
        InputError,
        "empty",
    ),
    (
        "all-masked ids",
        lambda m, b: attribute(m, torch.tensor([[5, 6]]), attention_mask=torch.tensor([[0, 0]])),
        InputError,
        "empty",
    ),
    ("float numpy ids", lambda m, b: attribute(m, np.array([[1.0, 2.0]])), InputError, "integer"),
    (
        "mask shorter than a BatchEncoding's ids",
        lambda m, b: attribute(m, {"input_ids": [[5, 6]], "attention_mask": [[1]]}),
        InputError,
        "shape",
    ),
    (
        "1-d mask for 2 items",
        lambda m, b: attribute(
            m, torch.tensor([[5, 6], [7, 8]]), attention_mask=torch.tensor([1, 1])
        ),
        InputError,
        "one mask entry per token",
    ),
    (
        "float mask",
        lambda m, b: attribute(m, [[5, 6]], attention_mask=[[0.5, 1.0]]),
        InputError,
        "integer",
    ),
    (
        "ids past vocab on bert",
        lambda m, b: attribute(b, [[2, 9999, 3]]),
        InputError,
        "outside the vocab",
    ),
    ("too long for bert", lambda m, b: attribute(b, "the " * 80), InputError, "n_ctx"),
    # --- targets
    ("float id tensor", lambda m, b: Target(torch.tensor([1.5])), TargetError, "integers"),
    ("float id array foil", lambda m, b: Target(foil=np.array([2.0])), TargetError, "integers"),
    (
        "labels as one string",
        lambda m, b: Target(1, labels="neg,pos"),
        TargetError,
        "list of class",
    ),
    ("regression='yes'", lambda m, b: Target(regression="yes"), TargetError, "True or False"),
    ("bool token", lambda m, b: Target(True), TargetError, "must be a string"),
    ("float generate", lambda m, b: Target(generate=1.5), TargetError, "generate must"),
    (
        "empty target string",
        lambda m, b: attribute(m, "the dog", Target("")),
        TargetError,
        "0 tokens",
    ),
    (
        "negative token id",
        lambda m, b: attribute(m, "the dog", Target(-1)),
        TargetError,
        "outside the head",
    ),
    (
        "too many foils",
        lambda m, b: attribute(m, ["the dog"], Target(" is", foil=["is", "are"])),
        TargetError,
        "2 foils for a batch of 1",
    ),
    (
        "position list outside",
        lambda m, b: attribute(m, ["the dog", "a cat"], Target(position=[0, 9])),
        InputError,
        "outside item 1",
    ),
    (
        "negative position outside",
        lambda m, b: attribute(m, "the dog", Target(position=-4)),
        InputError,
        "valid: -3..2",
    ),
    (
        "token with generate",
        lambda m, b: attribute(m, "the dog", Target("is", generate=2)),
        TargetError,
        "cannot be combined",
    ),
    (
        "foil equals token",
        lambda m, b: attribute(m, "the dog", Target(5, foil=5)),
        RuntimeWarning,
        "foil equals the token",
    ),
    # --- plausibility metrics: NaN, 2-D, whole batches
    ("PG NaN", lambda m, b: pointing_game(torch.tensor([NAN, 0.5, 0.2]), [1]), ValueError, "NaN"),
    ("MRR all NaN", lambda m, b: mrr(torch.full((4,), NAN), [1]), ValueError, "NaN"),
    ("PG 2-D", lambda m, b: pointing_game(torch.rand(2, 4), [1]), ValueError, "1-D"),
    ("PG [1, n]", lambda m, b: pointing_game(torch.rand(1, 4), [1]), ValueError, "shape (1, 4)"),
    (
        "token accuracy inf",
        lambda m, b: token_accuracy([1.0, float("inf")], [0]),
        ValueError,
        "NaN/inf",
    ),
    ("AP 2-D", lambda m, b: average_precision(np.ones((2, 3)), [0]), ValueError, "1-D"),
    ("RMA NaN", lambda m, b: relevance_mass_accuracy([NAN, 1.0], [0]), ValueError, "NaN"),
    ("dot NaN", lambda m, b: dot_product([NAN, 1.0], [0]), ValueError, "NaN"),
    ("PTA NaN", lambda m, b: per_token_accuracy([NAN, 1.0], [0]), ValueError, "NaN"),
    ("PTA 2-D", lambda m, b: per_token_accuracy(np.ones((2, 3)), [0]), ValueError, "1-D"),
    ("degenerate NaN", lambda m, b: is_degenerate(torch.tensor([NAN, NAN])), ValueError, "NaN"),
    ("scores as text", lambda m, b: pointing_game("0.1 0.2", [0]), TypeError, "1-D tensor"),
    (
        "PG of an Attribution",
        lambda m, b: pointing_game(_attr(m), [1]),
        TypeError,
        "whole Attribution",
    ),
    ("bool scores", lambda m, b: mrr(torch.tensor([True, False]), [0]), TypeError, "numbers"),
    (
        "flat evidence for a batch",
        lambda m, b: plausibility(_attr(m, 2), [1, 2]),
        TypeError,
        "one list per item",
    ),
    (
        "evidence count",
        lambda m, b: plausibility(_attr(m, 2), [[1]]),
        ValueError,
        "1 evidence lists for 2 items",
    ),
    (
        "plausibility of NaN scores",
        lambda m, b: plausibility(_with_nan_scores(m), [[1], [1]]),
        ValueError,
        "NaN/inf",
    ),
    (
        "unknown plausibility metric",
        lambda m, b: plausibility(_attr(m), [[1]], metrics=["pg"]),
        KeyError,
        "pointing_game",
    ),
    # --- faithfulness and soft metrics
    ("aopc no fractions", lambda m, b: aopc(m, _attr(m), fractions=[]), ValueError, "empty"),
    (
        "aopc fraction 1.5",
        lambda m, b: aopc(m, _attr(m), fractions=[0.1, 1.5]),
        ValueError,
        "[0, 1]",
    ),
    ("aopc max_batch 0", lambda m, b: aopc(m, _attr(m), max_batch=0), ValueError, "max_batch"),
    ("aopc label", lambda m, b: aopc(m, _attr(m), label="gold"), ValueError, "'prediction'"),
    ("aopc of a string", lambda m, b: aopc(m, "the dog"), TypeError, "takes an Attribution"),
    ("aopc NaN", lambda m, b: aopc(m, _with_nan_scores(m)), ValueError, "NaN/inf"),
    ("curves steps 0", lambda m, b: insertion_deletion(m, _attr(m), steps=0), ValueError, "steps"),
    ("curves NaN", lambda m, b: insertion_deletion(m, _with_nan_scores(m)), ValueError, "NaN/inf"),
    ("soft n_draws 0", lambda m, b: soft_metrics(m, _attr(m), n_draws=0), ValueError, "n_draws"),
    ("soft pi 0", lambda m, b: soft_metrics(m, _attr(m), pis=[0.0, 0.5]), ValueError, "(0, 1)"),
    (
        "soft max_batch -1",
        lambda m, b: soft_metrics(m, _attr(m), max_batch=-1),
        ValueError,
        "max_batch",
    ),
    ("soft NaN", lambda m, b: soft_metrics(m, _with_nan_scores(m)), ValueError, "NaN/inf"),
    # --- evaluate()
    (
        "evaluate empty",
        lambda m, b: evaluate(m, [], ["random"], ["pointing_game"]),
        ValueError,
        "empty",
    ),
    (
        "evaluate methods as a string",
        lambda m, b: evaluate(m, DATASET, "random", ["pointing_game"]),
        TypeError,
        "['random']",
    ),
    (
        "evaluate batch_size 0",
        lambda m, b: evaluate(m, DATASET, ["random"], ["pointing_game"], batch_size=0),
        ValueError,
        "batch_size",
    ),
    (
        "evaluate misspelled method",
        lambda m, b: evaluate(m, DATASET, ["grad_x_imput"], ["pointing_game"]),
        KeyError,
        "Did you mean 'grad_x_input'",
    ),
    (
        "evaluate target",
        lambda m, b: evaluate(m, DATASET, ["random"], ["pointing_game"], target="foil"),
        ValueError,
        "'gold' or 'prediction'",
    ),
    # --- Attribution
    (
        "plot item 5",
        lambda m, b: _attr(m).plot(item=5),
        IndexError,
        "outside this Attribution of 1",
    ),
    ("plot item '0'", lambda m, b: _attr(m).plot(item="0"), TypeError, "item index"),
    (
        "plot layers without layer scores",
        lambda m, b: _attr(m).plot(layers=True),
        ValueError,
        "use a per-layer method ('alti_logit', 'alti', 'rollout'",
    ),
    ("item_scores 3", lambda m, b: _attr(m, 2).item_scores(3), IndexError, "0..1"),
    ("to_html item 7", lambda m, b: _attr(m).to_html(item=7), IndexError, "outside"),
    ("numpy item -3", lambda m, b: _attr(m, 2).numpy(item=-3), IndexError, "outside"),
    ("top item 9", lambda m, b: _attr(m).top(3, item=9), IndexError, "outside"),
    # --- the user's JSONL
    (
        "label 'positive'",
        lambda m, b: load_items(_items_file([_item(label="positive")])),
        ValueError,
        "integer class index",
    ),
    ("label True", lambda m, b: parse_item(_item(label=True)), ValueError, "integer class index"),
    (
        "JSONL target without space",
        lambda m, b: load_items(_items_file([_item(target="are"), _item()])),
        InputWarning,
        "1 of 2 items",
    ),
    (
        "JSONL target and foil without space: one item, two problems",
        lambda m, b: load_items(_items_file([_item(target="are", foil="is"), _item()])),
        InputWarning,
        "space problem (2 in all)",
    ),
    (
        "JSONL prompt ending in a space",
        lambda m, b: load_items(_items_file([_item(prompt="the keys to the cabinet ")])),
        InputWarning,
        "ends in a space",
    ),
    (
        "item foil without space",
        lambda m, b: parse_item(_item(foil="is")),
        InputWarning,
        "the foil 'is' has no leading space",
    ),
    ("n=0 items", lambda m, b: load_items(_items_file([_item()]), n=0), ValueError, ">= 1"),
    (
        "no item file",
        lambda m, b: load_items("/nonexistent/items.jsonl"),
        FileNotFoundError,
        "no item",
    ),
    ("item without target", lambda m, b: parse_item({"prompt": "the dog"}), ValueError, "'target'"),
    # --- load_model and load_classifier: arguments checked before anything loads or trains
    ("load None", lambda m, b: load_model(None), ModelError, "needs a model name"),
    ("load a model", lambda m, b: load_model(m), ModelError, "already loaded"),
    (
        "load a missing path",
        lambda m, b: load_model("/nonexistent/ckpt"),
        ModelError,
        "does not exist",
    ),
    (
        "load a missing ./path",
        lambda m, b: load_model("./no-such-ckpt"),
        ModelError,
        "does not exist",
    ),
    ("load a file", lambda m, b: load_model(__file__), ModelError, "is a file"),
    ("load int8", lambda m, b: load_model("smollm2-135m", dtype=torch.int8), ModelError, "dtype"),
    (
        "classifier n_train -3",
        lambda m, b: load_classifier("minilm-l6-sst2", model=b, n_train=-3),
        ValueError,
        "n_train=-3",
    ),
    (
        "classifier n_train 0",
        lambda m, b: load_classifier("minilm-l6-sst2", model=b, n_train=0),
        ValueError,
        ">= 1",
    ),
    (
        "classifier n_dev 2.5",
        lambda m, b: load_classifier("minilm-l6-sst2", model=b, n_dev=2.5),
        ValueError,
        "n_dev=2.5",
    ),
    ("unknown classifier", lambda m, b: load_classifier("sst2"), KeyError, "built-in"),
]


@pytest.mark.parametrize(
    ("name", "call", "error", "phrase"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS]
)
def test_bad_input_table(gpt2, bert, name, call, error, phrase):
    before = {"gpt2": _state(gpt2), "bert": _state(bert)}
    if error is None:  # accepted forms
        call(gpt2, bert)
    elif issubclass(error, Warning):
        with pytest.warns(error) as record:
            call(gpt2, bert)
        messages = [str(w.message) for w in record if issubclass(w.category, error)]
        assert any(phrase in msg for msg in messages), messages
    else:
        with pytest.raises(error) as info:
            call(gpt2, bert)
        assert phrase in str(info.value), str(info.value)
    assert_unchanged(gpt2, before["gpt2"])
    assert_unchanged(bert, before["bert"])


def test_the_table_is_big_enough():
    assert sum(1 for c in BAD_CALLS if c[2] is not None) >= 100


def test_foil_equal_to_token_warns(gpt2):
    with pytest.warns(RuntimeWarning, match="foil equals the token"):
        attribute(gpt2, "the dog", Target("is", foil="is"))


def test_padded_token_ids_with_their_mask_equal_the_strings(gpt2):
    """Left- or right-padded ids with their attention_mask: pads are never scored or explained."""
    tok = gpt2.tokenizer
    prompts = ["the keys to the cabinet", "the dog"]
    ref = attribute(gpt2, prompts, method="grad_x_input")
    ids = [[tok.bos_token_id, *tok(p, add_special_tokens=False)["input_ids"]] for p in prompts]
    width = max(len(i) for i in ids)
    for side in ("left", "right"):
        padded, mask = [], []
        for row in ids:
            pad = [tok.pad_token_id] * (width - len(row))
            padded.append(pad + row if side == "left" else row + pad)
            mask.append(
                [0] * len(pad) + [1] * len(row)
                if side == "left"
                else [1] * len(row) + [0] * len(pad)
            )
        for inputs in (
            {"input_ids": torch.tensor(padded), "attention_mask": torch.tensor(mask)},
            np.array(padded),
        ):
            kwargs = {"attention_mask": np.array(mask)} if isinstance(inputs, np.ndarray) else {}
            attr = attribute(gpt2, inputs, method="grad_x_input", **kwargs)
            assert attr.tokens == ref.tokens
            torch.testing.assert_close(attr.scores, ref.scores)
            assert torch.equal(attr.target.token_ids, ref.target.token_ids)


@pytest.mark.parametrize("method", ["normxlogit", "logat", "embed_norm", "random", "grad_x_input"])
def test_positions_after_the_target_score_zero(gpt2, method):
    attr = attribute(gpt2, "the keys to the cabinet", Target("is", position=2), method=method)
    first = int(torch.nonzero(attr.mask[0]).min())
    after = attr.scores[0, first + 3 :]
    assert after.numel() == 3 and bool((after == 0).all())  # <bos> the keys | to the cabinet
    if attr.layer_scores is not None:
        assert bool((attr.layer_scores[0, :, first + 3 :] == 0).all())
    assert all(pos <= 2 for pos, _, _ in attr.top(10))
    assert attr.n_context(0) == 3


def test_generation_steps_never_score_later_tokens(gpt2):
    attr = attribute(gpt2, "the keys to the", Target(generate=3), method="normxlogit")
    prompt = attr.meta["prompt_length"]
    for step in range(len(attr)):
        assert bool((attr.scores[step, prompt + step :] == 0).all())


def test_indexing_slices_per_item_meta(gpt2):
    attr = attribute(gpt2, ["the dog", "the keys to the"], Target(["is", "are"]), method="lrp")
    second = attr[1]
    assert second.meta["target_tokens"] == ["are"]
    assert second.meta["explained_value"].shape == (1,)
    assert float(second.meta["explained_value"][0]) == float(attr.meta["explained_value"][1])
    assert second.meta["options"] == attr.meta["options"]


def test_class_heads_get_class_labels(gpt2):
    head = _head()
    attr = attribute(gpt2, "the dog", Target(2, foil=0, head=head), method="grad_x_input")
    assert attr.meta["target_tokens"] == ["class 2"] and attr.meta["foil_tokens"] == ["class 0"]
    named = attribute(gpt2, "the dog", Target(2, head=head, labels=["neg", "neu", "pos"]))
    assert named.meta["target_tokens"] == ["pos"]


def test_per_layer_methods_keep_real_layer_numbers(gpt2):
    attr = attribute(gpt2, "the dog is", method="grad_ellm", layers=[0, 2])
    assert attr.meta["layers"] == [0, 2]
    assert attr.layer_scores is not None and attr.layer_scores.shape[1] == 2


@pytest.mark.parametrize("k", [0, -1, 1.5])
def test_top_validates_k(gpt2, k):
    attr = attribute(gpt2, "the dog", method="random")
    with pytest.raises(ValueError, match="positive number"):
        attr.top(k)


def test_one_position_is_used_for_every_item_like_one_token(gpt2):
    attr = attribute(gpt2, ["the dog is", "a cat"], Target("is", position=[1]), method="random")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert attr.target.positions.tolist() == [
            int(torch.nonzero(attr.mask[b]).min()) + 1 for b in range(2)
        ]


def test_out_of_memory_names_the_need_and_the_alternatives(gpt2, monkeypatch):
    from lens_attrib import METHODS

    spec = METHODS["attnlrp"]

    def explode(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setitem(METHODS, "attnlrp", type(spec)(**{**spec.__dict__, "core": explode}))
    with pytest.raises(MemoryError) as info:
        attribute(gpt2, "the keys to the cabinet", method="attnlrp")
    message = str(info.value)
    assert "attnlrp ran out of memory" in message and "1 item(s) × 6 tokens" in message
    assert "embed_norm" in message and "chunk_size" in message


# --------------------------------------------------------------------------- NaN weights
DECODER_METHODS = sorted(n for n, s in METHODS.items() if s.decoder)
ENCODER_METHODS = sorted(n for n, s in METHODS.items() if s.encoder)


@hooked_only("sets NaN via HookedTransformer views; expects 3.9 parameter names")
@pytest.mark.parametrize("method", DECODER_METHODS)
def test_a_nan_query_weight_is_named_by_every_method(method):
    """TransformerLens zeroes NaN pattern rows (a dead head, finite outputs): every method must
    refuse, name the parameter, and not call it an overflow."""
    model = tiny_gpt2(dtype=F64)
    with torch.no_grad():
        model.blocks[1].attn.W_Q[2, 0, 0] = float("nan")
    before = _state(model)
    with pytest.raises(NonFiniteError) as info:
        attribute(model, "the keys to the cabinet", Target("are"), method=method)
    message = str(info.value)
    assert "blocks.1.attn.W_Q: 1 NaN, first at index (2, 0, 0)" in message, message
    assert "retry in float64" not in message
    assert_unchanged(model, before)


@hooked_only("sets NaN via HookedTransformer views; expects 3.9 parameter names")
@pytest.mark.parametrize("method", ENCODER_METHODS)
def test_a_nan_key_weight_of_an_encoder_is_named(method):
    model = tiny_bert(dtype=F64)
    with torch.no_grad():
        model.blocks[0].attn.W_K[1, 3, 2] = float("inf")
    before = _state(model)
    with pytest.raises(NonFiniteError, match=r"blocks\.0\.attn\.W_K: 1 inf"):
        attribute(model, "the keys to the cabinet", method=method)
    assert_unchanged(model, before)


@pytest.mark.parametrize(
    ("where", "name"),
    [
        (lambda m: m.blocks[0].attn._W_K[1, 0], "blocks.0.attn._W_K"),  # grouped-query keys
        (lambda m: m.blocks[1].mlp.W_in[3], "blocks.1.mlp.W_in"),
        (lambda m: m.blocks[2].attn._W_V[0, 5], "blocks.2.attn._W_V"),
        (lambda m: m.embed.W_E[0], "embed.W_E"),
        (lambda m: m.blocks[0].ln1.w, "blocks.0.ln1.w"),
        (lambda m: m.ln_final.w, "ln_final.w"),
    ],
    ids=["W_K", "W_in", "W_V", "W_E", "ln1", "ln_final"],
)
@hooked_only("sets NaN via HookedTransformer views; expects 3.9 parameter names")
@pytest.mark.parametrize("method", ["alti_logit", "normxlogit", "attention", "grad_x_input"])
def test_nan_weights_anywhere_are_named(where, name, method):
    """NaN in a grouped-query key, an MLP, a value, an embedding row, a norm: named, never an
    overflow and never finite scores."""
    model = tiny_llama(dtype=F64)
    if name == "embed.W_E":
        ids = model.tokenizer("the keys", add_special_tokens=False)["input_ids"]
        where = lambda m: m.embed.W_E[ids[1]]  # noqa: E731  (a token of the prompt)
    with torch.no_grad():
        where(model).fill_(float("nan"))
    before = _state(model)
    with pytest.raises(NonFiniteError) as info:
        attribute(model, "the keys to the cabinet", Target("are"), method=method)
    assert name in str(info.value) and "retry in float64" not in str(info.value)
    assert_unchanged(model, before)


@hooked_only("sets NaN via HookedTransformer views; expects 3.9 parameter names")
def test_a_nan_unembedding_column_of_the_target_is_named():
    model = tiny_gpt2(dtype=F64)
    token = model.tokenizer("are", add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():
        model.unembed.W_U[:, token] = float("nan")
    for method in ("logat", "grad_x_input"):
        with pytest.raises(NonFiniteError, match=r"unembed\.W_U: 32 NaN"):
            attribute(model, "the keys to the cabinet", Target("are"), method=method)


def test_a_hook_that_writes_nan_is_named_as_an_activation():
    model = tiny_gpt2(dtype=F64)

    def poison(x, hook):
        x = x.clone()
        x[:, 2] = float("nan")
        return x

    model.add_hook("blocks.1.hook_resid_mid", poison)
    before = _state(model)
    try:
        for method in ("normxlogit", "attention", "integrated_gradients"):
            with pytest.raises(NonFiniteError, match="although every weight is finite"):
                attribute(model, "the keys to the cabinet", method=method)
            assert_unchanged(model, before)  # the user's hook is still there
    finally:
        model.reset_hooks()


@hooked_only("the per-call scan's parameters are listed by 3.9 names")
def test_the_weight_scan_reads_a_small_share_of_the_weights(smollm2):
    """Every call sums only the attention-score parameters (a forward reads all of them once):
    about a tenth of SmolLM2's stored parameters; the rotary tables only after a change."""
    from lens_attrib.finite import _unchecked, check_score_weights, score_path_tensors

    check_score_weights(smollm2)  # finite: no error; the tables are now known clean
    per_call = _unchecked(smollm2, score_path_tensors(smollm2))
    stored = {p.data_ptr(): p.numel() for p in smollm2.parameters()}  # tied weights once
    share = sum(t.numel() for _, t in per_call) / sum(stored.values())
    assert 0.05 < share < 0.11
    assert {n.rsplit(".", 1)[-1] for n, _ in per_call} == {"W_Q", "b_Q", "_W_K", "_b_K", "w"}


@hooked_only("writes into 3.9's rotary table buffers (the bridge computes them)")
def test_a_nan_written_into_a_rotary_table_is_found_after_a_clean_call():
    model = tiny_llama(dtype=F64)
    attribute(model, "the keys to the cabinet", method="normxlogit")  # tables found clean
    model.blocks[1].attn.rotary_sin[3, 2] = float("nan")  # in place: the version changes
    with pytest.raises(NonFiniteError, match="rotary_sin"):
        attribute(model, "the keys to the cabinet", method="normxlogit")


def test_minilm_placeholder_heads_are_not_reported(minilm):
    """MiniLM ships no MLM head; the loader fills it with NaN on purpose: not an error."""
    attr = attribute(minilm, "the keys to the cabinet", method="alti")
    assert torch.isfinite(attr.scores).all()


# --------------------------------------------------------------------------- leading spaces
PROMPT = "The keys to the cabinet"


def _warnings_of(call) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in record if issubclass(w.category, InputWarning)]


def test_a_target_without_its_leading_space_warns_with_both_ids(smollm2):
    tok = smollm2.tokenizer
    plain = tok("are", add_special_tokens=False)["input_ids"][0]
    spaced = tok(" are", add_special_tokens=False)["input_ids"][0]
    assert plain != spaced
    before = model_state_fingerprint(smollm2)
    messages = _warnings_of(lambda: attribute(smollm2, PROMPT, Target("are"), method="random"))
    assert len(messages) == 1, messages
    assert f"'are' (id {plain})" in messages[0] and f"' are' (id {spaced})" in messages[0]
    assert "Target(' are')" in messages[0]
    foil = _warnings_of(
        lambda: attribute(smollm2, PROMPT, Target(" are", foil="is"), method="random")
    )
    assert len(foil) == 1 and "The foil 'is'" in foil[0]
    per_item = _warnings_of(
        lambda: attribute(smollm2, [PROMPT, "The dog"], Target([" are", "is"]), method="random")
    )
    assert len(per_item) == 1 and "(item 1)" in per_item[0]
    assert model_state_fingerprint(smollm2) == before


def test_a_prompt_ending_in_a_space_warns_with_the_fix(smollm2):
    # prepare() is the wrapper's first step (inputs and target, no forward): fast on SmolLM2
    messages = _warnings_of(lambda: prepare(smollm2, ["The dog", PROMPT + " "], Target(" are")))
    assert len(messages) == 1, messages
    assert "Prompt 1" in messages[0] and f"Remove the trailing space: {PROMPT!r}" in messages[0]
    ids = smollm2.tokenizer(PROMPT + " ")["input_ids"]
    from_ids = _warnings_of(lambda: prepare(smollm2, [ids], None))
    assert len(from_ids) == 1 and "ends in a space" in from_ids[0]


@pytest.mark.parametrize(
    ("prompt", "target"),
    [
        (PROMPT, Target(" are")),  # right
        (PROMPT, Target(",")),  # punctuation has no space
        ('He said "', Target("hello")),  # after an opening quote: no space
        (PROMPT + "\n", Target("The")),  # a new line starts without a space
        (PROMPT, Target(522)),  # an id is explicit
        (PROMPT, Target()),  # the prediction
    ],
    ids=["spaced", "comma", "quote", "newline", "id", "prediction"],
)
def test_no_space_warning_where_none_applies(smollm2, prompt, target):
    assert _warnings_of(lambda: prepare(smollm2, prompt, target)) == []


def test_no_space_warning_for_encoders_or_word_level_tokenizers(gpt2, bert):
    # the tiny tokenizers split on whitespace: 'are' and ' are' are one token
    assert _warnings_of(lambda: attribute(gpt2, "the keys to the cabinet ", Target("are"))) == []
    assert _warnings_of(lambda: attribute(bert, "the keys to the cabinet", Target("are"))) == []


# --------------------------------------------------------------------------- folders, runner
def test_a_folder_without_tokenizer_files_loads_and_refuses_text_clearly(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    cfg.bos_token_id = cfg.eos_token_id = 0
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    model = load_model(str(tmp_path))
    assert model.tokenizer is None
    attr = attribute(model, [[1, 2, 3]], method="grad_x_input")  # ids work
    assert attr.scores.shape == (1, 3)
    with pytest.raises(InputError, match=r"has no tokenizer.*'The keys'.*model\.tokenizer = "):
        attribute(model, "The keys")


@hooked_only("close names come from 3.9's official list; the bridge loads folders")
def test_an_unknown_model_name_is_short_and_suggests(tmp_path):
    with pytest.raises(ModelError) as info:
        load_model("gpt3-xl")
    message = str(info.value)
    assert "Close names: ['gpt2-xl'" in message and len(message) < 600, message


@pytest.mark.parametrize(
    ("argv", "phrase"),
    [
        (["--n-items", "0"], "expected a positive integer, got '0'"),
        (["--n", "-3"], "expected a positive integer, got '-3'"),
        (["--n-draws", "0"], "expected a positive integer, got '0'"),
        (["--batch-size", "0"], "expected a positive integer, got '0'"),
        (["--methods", "grad_x_imput"], "unknown method(s) ['grad_x_imput']"),
    ],
)
def test_runner_refuses_counts_below_one(argv, phrase, capsys):
    from lens_attrib.evaluation.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--model", "tiny-gpt2", *argv])
    assert info.value.code == 2
    assert phrase in capsys.readouterr().err


# --------------------------------------------------------------------------- saying nothing
@pytest.mark.parametrize(
    "metric",
    [
        pointing_game,
        mrr,
        token_accuracy,
        per_token_accuracy,
        average_precision,
        relevance_mass_accuracy,
        dot_product,
    ],
)
def test_all_equal_scores_earn_chance_never_more_than_a_real_ranking(metric):
    """Tie-aware metrics give constant scores the chance value (|E|/n for the pointing game)
    and never beat a ranking that puts the evidence first."""
    flat, ranked = torch.full((5,), 0.3), torch.tensor([0.1, 0.9, 0.2, 0.0, 0.05])
    assert metric(flat, [1]) < metric(ranked, [1])
    if metric is pointing_game:
        assert metric(flat, [1]) == pytest.approx(1 / 5)
    if metric is mrr:  # expected reciprocal rank of a uniformly random position
        assert metric(flat, [1]) == pytest.approx(sum(1 / r for r in range(1, 6)) / 5)
