"""Inputs users really pass: tokenizer outputs and masks, numpy, wrong calls with clear errors.

Each row of the "bad input" table is a wrong call, the exception type it must raise and a phrase
its message must contain (what was wrong, and the fix).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from lens_attrib import (
    InputError,
    ModelError,
    OptionError,
    Target,
    TargetError,
    attribute,
)
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2

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


@pytest.mark.parametrize(
    ("name", "call", "error", "phrase"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS]
)
def test_bad_input_table(gpt2, bert, name, call, error, phrase):
    if error is None:  # accepted forms
        call(gpt2, bert)
        return
    with pytest.raises(error) as info:
        call(gpt2, bert)
    assert phrase in str(info.value), str(info.value)


def test_the_table_is_big_enough():
    assert sum(1 for c in BAD_CALLS if c[2] is not None) >= 25


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
