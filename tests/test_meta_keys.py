"""Every ``Attribution.meta`` key is documented in :mod:`lens_attrib.meta_keys`, by its writers.

Every registered method runs on a tiny decoder and a tiny encoder (where it applies; cheapest
options), also with ``heads=True`` where it takes it, under ``Target(generate=N)`` and
``Target(continuation=...)``, and aggregated to words. Oracles: each emitted key is in
``META_KEYS`` and names the method among its writers; each key documented as always written is
written by every writer that ran; per-head relevances appear exactly where the spec says so.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from lens_attrib import METHODS, Attribution, Target, attribute
from lens_attrib.aggregate import to_words
from lens_attrib.meta_keys import AGGREGATE, EVERY_METHOD, META_KEYS
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2

CHEAPEST: dict[str, dict[str, Any]] = {"integrated_gradients": {"n_steps": 2}}
"""Options that keep a method fast here (only the keys are checked, not the values)."""

PROMPTS = ["the dog is", "a cat"]


def _call(
    model: Any, name: str, target: Target | None = None, prompts: Any = PROMPTS, **options: Any
) -> Attribution:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny random models: space and chance warnings
        return attribute(
            model, prompts, target, method=name, **{**CHEAPEST.get(name, {}), **options}
        )


@pytest.fixture(scope="module")
def runs() -> list[tuple[str, str, Attribution]]:
    """(writer, how it ran, Attribution) for every method and the special paths."""
    decoder, encoder = tiny_gpt2(), tiny_bert()
    out: list[tuple[str, str, Attribution]] = []
    for name, spec in METHODS.items():
        for arch, model, applies in (
            ("gpt2", decoder, spec.decoder),
            ("bert", encoder, spec.encoder),
        ):
            if not applies:
                continue
            out.append((name, arch, _call(model, name)))
            if "heads" in spec.options:
                out.append((name, f"{arch} heads=True", _call(model, name, heads=True)))
    for name in ("grad_x_input", "grad_ellm"):
        out.append(
            (name, "generate=2", _call(decoder, name, Target(generate=2), prompts=PROMPTS[0]))
        )
    continued = _call(decoder, "grad_x_input", Target(continuation=["is a", "was"]))
    out.append(("grad_x_input", "continuation", continued))
    sampled = Target(generate=2, sample=True, seed=0)
    out.append(("grad_x_input", "sampled", _call(decoder, "grad_x_input", sampled, PROMPTS[0])))
    contrast = Target(continuation=["is a", "was"], contrast=["was a", "is"])
    out.append(("grad_x_input", "contrast", _call(decoder, "grad_x_input", contrast)))
    words = to_words(out[0][2], text=PROMPTS, tokenizer=decoder.tokenizer)
    out.append((AGGREGATE, f"to_words({out[0][0]})", words))
    return out


def test_every_emitted_meta_key_is_documented_with_its_writer(runs):
    problems = []
    for writer, how, attr in runs:
        for key in sorted(attr.meta):
            doc = META_KEYS.get(key)
            if doc is None:
                problems.append(f"{writer} ({how}) writes undocumented meta[{key!r}]")
            elif writer not in doc.written_by and EVERY_METHOD not in doc.written_by:
                if writer != AGGREGATE:  # an aggregated Attribution keeps its method's keys
                    problems.append(f"{writer} ({how}) writes meta[{key!r}], not listed as writer")
    assert not problems, "lens_attrib/meta_keys.py is out of date:\n" + "\n".join(problems)


def test_keys_documented_as_always_written_are_written_by_each_writer(runs):
    missing = []
    for key, doc in META_KEYS.items():
        if doc.when:
            continue
        for writer, how, attr in runs:
            wrote = writer in doc.written_by or (
                EVERY_METHOD in doc.written_by and writer != AGGREGATE
            )
            if wrote and key not in attr.meta:
                missing.append(f"meta[{key!r}] missing from {writer} ({how})")
    assert not missing, "\n".join(missing)


def test_documented_writers_exist():
    for key, doc in META_KEYS.items():
        assert doc.meaning and "\n" not in doc.meaning, key
        unknown = set(doc.written_by) - set(METHODS) - {EVERY_METHOD, AGGREGATE}
        assert not unknown, f"meta[{key!r}] names unregistered writers {unknown}"


def test_the_sum_rule_gap_has_one_name(runs):
    gap_writers = {w for w, _, a in runs if "completeness_gap" in a.meta and w != AGGREGATE}
    assert gap_writers == {"integrated_gradients", "deeplift", "lrp", "attnlrp"}
    assert not [k for k in META_KEYS if k.endswith("_gap") and k != "completeness_gap"]


def test_head_relevances_appear_exactly_where_the_spec_says(runs):
    for writer, how, attr in runs:
        if writer == AGGREGATE or "generate" in how or "continuation" in how:
            continue
        spec = METHODS[writer]
        expected = spec.head_relevances and ("heads" not in spec.options or "heads=True" in how)
        assert (attr.head_scores is not None) == expected, f"{writer} ({how})"
