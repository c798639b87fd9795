"""Method variants (``name[option=value,…]``) in the experiments' ``--methods``: parsing and
its errors, the options a variant is called with, its journal key, and a faithfulness run holding
a method beside its variant (each computed with its own options, its own rows and IG gap line).
"""

from __future__ import annotations

import argparse
from functools import partial
from types import SimpleNamespace

import pytest

from experiments import common
from experiments.method_settings import experiment_options, gap_lines, unit_suffix
from lens_attrib.cli import variant_list
from lens_attrib.method_variants import (
    base_method,
    split_method_list,
    split_variant,
    variant_label,
)


def test_split_and_label_round_trip() -> None:
    assert split_variant("grad_x_input") == ("grad_x_input", {})
    name, options = split_variant(" integrated_gradients[ pooling=l1, max_steps=64,tolerance=0.5] ")
    assert name == "integrated_gradients"
    assert options == {"pooling": "l1", "max_steps": 64, "tolerance": 0.5}
    label = variant_label(name, options)
    assert label == "integrated_gradients[max_steps=64,pooling=l1,tolerance=0.5]"
    assert split_variant(label) == (name, options)
    assert split_variant("random[seed=none]")[1] == {"seed": None}
    assert split_variant("gradient[heads=true]")[1] == {"heads": True}
    assert base_method(label) == "integrated_gradients"


def test_commas_inside_brackets_stay_with_their_method() -> None:
    assert split_method_list("a, b[x=1,y=2] ,c") == ["a", "b[x=1,y=2]", "c"]
    for bad in ("a[x=1", "a]x", "a[x=1]]"):
        with pytest.raises(ValueError):
            split_method_list(bad)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("grad_x_input[pooling]", "option=value"),
        ("grad_x_input[]", "empty brackets"),
        ("grad_x_input[pooling=l1,pooling=l2]", "twice"),
        ("grad_x_input[pooling=max]", "pooling='max' is not allowed"),
        ("grad_x_input[poling=l1]", "no option 'poling'"),
        ("grad_x_inputt", "unknown method"),
        ("grad_x_input,grad_x_input[pooling=sum],grad_x_input[pooling=sum]", "given twice"),
        ("2x[a=1]", "expected a method name"),
    ],
)
def test_variant_list_errors_name_the_problem(text, says) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says.replace("[", r"\[")):
        variant_list(text)


def test_variant_list_returns_canonical_labels() -> None:
    got = variant_list("grad_x_input, grad_x_input[ pooling = l1 ],gradient[norm=l1]")
    assert got == ["grad_x_input", "grad_x_input[pooling=l1]", "gradient[norm=l1]"]


def test_a_variant_is_called_with_its_options_and_keyed_by_its_label(minilm) -> None:
    args = SimpleNamespace(vz_aggregation="auto", ig_max_steps=256)
    plain = experiment_options("integrated_gradients", 0, minilm, args)
    variant = experiment_options("integrated_gradients[pooling=l1]", 0, minilm, args)
    assert plain == {"max_steps": 256}
    assert variant == {"max_steps": 256, "pooling": "l1"}
    assert unit_suffix("integrated_gradients", plain) == "[max_steps=256]"
    assert unit_suffix("integrated_gradients[pooling=l1]", variant) == "[max_steps=256]"
    own = experiment_options("integrated_gradients[max_steps=64]", 0, minilm, args)
    assert own == {"max_steps": 64}  # the variant's own value wins over the table setting
    assert unit_suffix("integrated_gradients[max_steps=64]", own) == ""
    seeded = experiment_options("random[seed=7]", 3, minilm, args)
    assert seeded == {"seed": 7}


def test_gap_lines_are_per_variant_when_a_run_has_several() -> None:
    records = [
        {"dataset": "d", "method": m, "metric": "completeness_gap", "value": v}
        for m, v in (("integrated_gradients", 0.001), ("integrated_gradients[pooling=l1]", 0.02))
    ]
    lines = gap_lines(records, {"dataset": "d"}, None, None)
    assert len(lines) == 2
    assert "(integrated_gradients)" in lines[0] and "0/1 items" in lines[0]
    assert "(integrated_gradients[pooling=l1])" in lines[1] and "1/1 items" in lines[1]
    alone = gap_lines(records[:1], {"dataset": "d"}, None, None)
    assert len(alone) == 1 and "integrated_gradients" not in alone[0]


def test_faithfulness_runs_a_method_beside_its_variant(
    tmp_path, minilm, monkeypatch, capsys
) -> None:
    from experiments import faithfulness
    from lens_attrib import classifiers

    monkeypatch.setattr(
        faithfulness, "load_classifier", partial(classifiers.load_classifier, cache_dir=tmp_path)
    )
    called: list[tuple[str, dict]] = []
    real = faithfulness.attribute

    def spy(model, inputs, target, *, method, **options):
        called.append((method, dict(options)))
        return real(model, inputs, target, method=method, **options)

    monkeypatch.setattr(faithfulness, "attribute", spy)
    common._MODELS[("minilm-l6", "cpu")] = minilm
    methods = "grad_x_input,grad_x_input[pooling=l1],integrated_gradients[pooling=l1]"
    try:
        out = faithfulness.main(
            [
                *("--model", "minilm-l6", "--datasets", "sst2", "--n", "3", "--train-n", "24"),
                *("--dev-n", "8", "--methods", methods, "--fractions", "0.5"),
                *("--metric-groups", "aopc", "--out", str(tmp_path / "out")),
            ]
        )
    finally:
        common._MODELS.pop(("minilm-l6", "cpu"), None)
    assert ("grad_x_input", {}) in called
    assert ("grad_x_input", {"pooling": "l1"}) in called
    assert ("integrated_gradients", {"pooling": "l1"}) in called
    rows = {(r["method"], r["metric"]): r["mean"] for r in out["summary"]}
    for label in methods.split(",")[:2]:
        assert (label, "comprehensiveness") in rows
    text = capsys.readouterr().out
    assert "\ngrad_x_input[pooling=l1] " in text
    assert "|f(x)−f(b)|: median" in text  # one IG label: one gap line, not named
