"""Attributions kept on disk between runs (``experiments.attribution_cache``).

Oracles: the Attribution loaded from an entry against the call it replaces, for every method on
a decoder and an encoder (every tensor bit-identical, every other field equal); a faithfulness
run that loads every unit against the same run computing them (records equal), with the calls
counted; entries keyed by everything that decides the call.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

from experiments.attribution_cache import AttributionCache, code_key
from lens_attrib import METHODS
from lens_attrib.backend import arch_of
from lens_attrib.methods.registry import attribute
from lens_attrib.tiny_models import tiny_bert, tiny_llama

F64 = torch.float64
PROMPTS = ["the dog sees the cat near the house", "a man likes books"]


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(dtype=F64)


@pytest.fixture(scope="module")
def bert():
    return tiny_bert(dtype=F64)


def _equal(a, b, where: str = "") -> None:
    """``a`` and ``b`` equal field by field, tensors bit for bit with their dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a.cpu(), b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dataclass_fields__"):
        for name in a.__dataclass_fields__:
            _equal(getattr(a, name), getattr(b, name), f"{where}.{name}")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, where


def _methods(model) -> list[str]:
    encoder = arch_of(model).encoder
    return sorted(m for m, spec in METHODS.items() if spec.applies_to(encoder=encoder))


@pytest.mark.parametrize("which", ["llama", "bert"])
def test_a_loaded_entry_is_the_call_it_replaces_for_every_method(which, request, tmp_path):
    model = request.getfixturevalue(which)
    cache = AttributionCache(tmp_path, model, f"tiny {which}")
    options = {"integrated_gradients": {"max_steps": 32}, "random": {"seed": 3}}
    methods = _methods(model)
    assert len(methods) >= 15
    computed = {}
    for method in methods:
        opts = options.get(method, {})

        def explain(method=method, opts=opts):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return attribute(model, PROMPTS, method=method, **opts)

        computed[method] = cache.get(method, opts, PROMPTS, "next token", explain)
    assert cache.misses == len(methods) and cache.hits == 0, cache.describe()
    assert not cache.unsaved and not list(tmp_path.glob("*.partial"))

    def fail():
        raise AssertionError("an entry exists: nothing is computed")

    for method in methods:
        loaded = cache.get(method, options.get(method, {}), PROMPTS, "next token", fail)
        _equal(computed[method], loaded, method)
    assert cache.hits == len(methods)


def test_every_part_of_the_call_keys_the_entry(llama, tmp_path):
    cache = AttributionCache(tmp_path, llama, "weights A")
    base = cache.path("integrated_gradients", {"max_steps": 32}, PROMPTS, "next token")
    assert base == cache.path("integrated_gradients", {"max_steps": 32}, PROMPTS, "next token")
    others = {
        cache.path("grad_x_input", {"max_steps": 32}, PROMPTS, "next token"),
        cache.path("integrated_gradients", {"max_steps": 64}, PROMPTS, "next token"),
        cache.path("integrated_gradients", {"max_steps": 32, "pooling": "l2"}, PROMPTS, "x"),
        cache.path("integrated_gradients", {"max_steps": 32}, PROMPTS[::-1], "next token"),
        cache.path("integrated_gradients", {"max_steps": 32}, PROMPTS, "token=[5, 7]"),
        AttributionCache(tmp_path, llama, "weights B").path(
            "integrated_gradients", {"max_steps": 32}, PROMPTS, "next token"
        ),
        AttributionCache(tmp_path, tiny_llama(dtype=torch.float32), "weights A").path(
            "integrated_gradients", {"max_steps": 32}, PROMPTS, "next token"
        ),
    }
    assert base not in others and len(others) == 7


def test_a_changed_line_of_the_library_changes_the_code_key(tmp_path):
    root = Path(__file__).resolve().parents[1] / "lens_attrib"
    copy = tmp_path / "lens_attrib"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert code_key(copy) == code_key(root)
    target = copy / "methods" / "gradient.py"
    target.write_text(target.read_text() + "\n# changed\n")
    tmp_copy = tmp_path / "again"
    shutil.copytree(copy, tmp_copy)
    assert code_key(tmp_copy) != code_key(root)


def test_a_model_off_the_cpu_is_refused(tmp_path):
    model = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="CPU runs"):
        AttributionCache(tmp_path, model, "meta weights")


def test_an_attribution_the_file_cannot_hold_is_returned_and_not_kept(llama, tmp_path):
    cache = AttributionCache(tmp_path, llama, "tiny llama")

    def explain():
        attr = attribute(llama, PROMPTS, method="grad_x_input")
        attr.meta["callback"] = print  # not storable: the file format refuses functions
        return attr

    with pytest.warns(RuntimeWarning, match="computed but not kept"):
        attr = cache.get("grad_x_input", {}, PROMPTS, "next token", explain)
    assert attr.meta["callback"] is print
    assert cache.unsaved == {"grad_x_input"} and "not kept: grad_x_input" in cache.describe()
    assert not list(tmp_path.iterdir())  # no entry, no partial file


def test_a_companion_run_loads_every_attribution_and_writes_the_same_records(
    tmp_path, monkeypatch, capsys
):
    """MiniLM in float64 with a seeded random head (``tests/experiments_small.py``): an AOPC
    run fills the cache; an insertion/deletion run over the same items then calls
    ``attribute`` for nothing and writes the records of the same run without the cache. IG
    with its ℓ² variant exercises the shared pooled call (``experiments.pooling_share``)."""
    from experiments import faithfulness
    from tests.experiments_small import faithfulness_on_random_heads, journal_values

    calls = faithfulness_on_random_heads(monkeypatch)
    methods = "grad_x_input,integrated_gradients,integrated_gradients[pooling=l2],random"
    cache = tmp_path / "cache"

    def run(name: str, groups: str, *extra: str):
        journal = tmp_path / name / "records.jsonl.gz"
        faithfulness.main(
            [
                *("--model", "minilm-l6", "--datasets", "sst2", "--n", "2"),
                *("--methods", methods, "--fractions", "0.5", "--steps", "4"),
                *("--metric-groups", groups, "--out", str(tmp_path / name)),
                *("--journal", str(journal), "--ig-max-steps", "64", *extra),
            ]
        )
        return journal_values(journal)

    def methods_called() -> list[str]:
        return sorted(c["method"] for c in calls)

    single = sorted(["grad_x_input", "integrated_gradients", "random"])
    run("aopc", "aopc", "--attribution-cache", str(cache))
    assert methods_called() == single  # IG's two units share one pooled call
    assert "0 Attributions loaded, 3 computed" in capsys.readouterr().out
    calls.clear()
    cached = run("curves-cached", "curves", "--attribution-cache", str(cache))
    assert calls == []  # every Attribution loaded
    assert "3 Attributions loaded, 0 computed" in capsys.readouterr().out
    fresh = run("curves", "curves")
    assert methods_called() == single
    assert cached.keys() == fresh.keys() and len(cached) > 0
    assert {m for m, _, _ in cached} == set(methods.split(","))
    for key, value in fresh.items():  # deletion_flip is NaN where the prediction never flips
        assert cached[key] == value or (value != value and cached[key] != cached[key]), key


def test_a_damaged_entry_is_computed_again_and_rewritten(llama, tmp_path):
    cache = AttributionCache(tmp_path, llama, "tiny llama")

    def explain():
        return attribute(llama, PROMPTS, method="grad_x_input")

    first = cache.get("grad_x_input", {}, PROMPTS, "next token", explain)
    path = cache.path("grad_x_input", {}, PROMPTS, "next token")
    path.write_bytes(path.read_bytes()[:100])  # cut short, as by a full disk
    with pytest.warns(RuntimeWarning, match="could not be read"):
        again = cache.get("grad_x_input", {}, PROMPTS, "next token", explain)
    assert torch.equal(first.scores, again.scores)  # computed again (meta["seconds"] differs)
    assert (cache.hits, cache.misses) == (0, 2)
    _equal(again, cache.get("grad_x_input", {}, PROMPTS, "next token", explain))  # rewritten
    assert cache.hits == 1
