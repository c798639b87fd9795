"""Display text: visible and escaped tokens, axis labels, and what a result explains (target
labels, and target-freeness read from the method specs only)."""

from __future__ import annotations

import html
from dataclasses import replace

import pytest
import torch

from lens_attrib import METHODS, Target, attribute, display, plot, report
from lens_attrib.display import (
    TARGET_FREE_LABEL,
    escape_token,
    explained_label,
    grid_title,
    is_target_free,
    target_label,
    token_axis_labels,
    visible_token,
)
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2

PROMPTS = ["the keys to the cabinet", "the dog"]


@pytest.fixture(scope="module")
def gpt2():
    return tiny_gpt2()


def test_visible_and_escaped_tokens():
    assert visible_token(" were\n\t\r") == "␣were⏎⇥␍"
    assert escape_token(" <b>&") == "␣&lt;b&gt;&amp;"
    assert html.unescape(escape_token(' "x"')) == '␣"x"'
    assert token_axis_labels(["<s>", " the", " the"]) == ["0:&lt;s&gt;", "1:␣the", "2:␣the"]


def test_contrastive_and_plain_target_labels(gpt2):
    contrastive = attribute(gpt2, PROMPTS, Target(["is", "are"], foil="the"), method="gradient")
    assert target_label(contrastive, 0) == "'is' − 'the'"
    assert contrastive.explained_label(1) == "'are' − 'the'"
    assert contrastive.explained_label(-1) == contrastive.explained_label(1)
    plain = attribute(gpt2, PROMPTS, Target("is"), method="gradient")
    assert plain.explained_label() == explained_label(plain, 0) == "'is'"
    unlabelled = replace(plain, meta={k: v for k, v in plain.meta.items() if k != "target_tokens"})
    assert unlabelled.explained_label(1) == f"id {gpt2.tokenizer.convert_tokens_to_ids('is')}"
    with pytest.raises(IndexError, match="outside"):
        plain.explained_label(2)


def test_class_head_labels_name_the_class(gpt2):
    head = torch.nn.Linear(gpt2.cfg.d_model, 2)
    attr = attribute(
        gpt2, PROMPTS, Target(1, foil=0, head=head, labels=["neg", "pos"]), method="gradient"
    )
    assert attr.explained_label(0) == "'pos' − 'neg'"


def test_target_freeness_comes_from_the_specs_only(gpt2):
    assert not hasattr(report, "TARGET_FREE_METHODS")  # no second list beside the specs
    free = attribute(gpt2, PROMPTS, Target("is"), method="attention")
    assert METHODS["attention"].target_free and is_target_free(free)
    assert free.explained_label(0) == TARGET_FREE_LABEL
    # a result's flag is the spec's, whatever the method name says
    relabelled = replace(free, meta={**free.meta, "target_free": False})
    assert relabelled.explained_label(0) == "'is'"
    assert not is_target_free(replace(free, meta={}))  # hand-made, no flag: shows its target


def test_globenc_is_labelled_target_free_as_its_spec_says():
    # report.py's old hand-written list lacked globenc (every method: tests/test_contract.py)
    assert METHODS["globenc"].target_free
    attr = attribute(tiny_bert(), PROMPTS, method="globenc")
    assert attr.explained_label(0) == TARGET_FREE_LABEL
    assert "target-free" in report.attribution_rows(attr)[0].explains
    assert "target-free" in plot.token_heatmap(attr).layout.title.text


def test_grid_title_escapes_and_names_target_free_rows(gpt2):
    target = Target("is", foil="the")
    gxi = attribute(gpt2, PROMPTS, target, method="grad_x_input")
    free = attribute(gpt2, PROMPTS, target, method="rollout")
    title = grid_title([("gxi", gxi), ("rollout", free)], 0)
    assert title == html.escape(
        "Methods × tokens → 'is' − 'the'; target-free rows (the same for any target): rollout"
    )
    assert display.row_explains(free, 0) == html.escape("explains " + TARGET_FREE_LABEL)
