"""Attribution.save / load (safetensors + JSON, no pickle), collections, to_pandas, plot_heads."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import warnings
from functools import cache

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lens_attrib import (
    METHODS,
    Attribution,
    Target,
    attribute,
    load_attributions,
    save_attributions,
)
from lens_attrib.attribution_io import FORMAT_VERSION, HEADER_KEY, AttributionFileError
from lens_attrib.errors import TargetError
from lens_attrib.target import DetachedHead
from lens_attrib.tiny_models import tiny_bert, tiny_llama

PROMPTS = ["the cat sat on the mat", "a dog ran"]


@cache
def _model(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_llama(dtype=dtype) if kind == "decoder" else tiny_bert(dtype=dtype)


def _options(name: str) -> dict[str, bool | int]:
    """Ask for every optional output the method has (per-head scores, head → token tracing);
    a fixed small quadrature for path methods (speed only: the stored values are what is tested)."""
    opts = METHODS[name].options
    chosen: dict[str, bool | int] = {k: True for k in ("heads", "trace_heads") if k in opts}
    if "n_steps" in opts:
        chosen["n_steps"] = 8
    return chosen


def _run(name: str, dtype: torch.dtype, target: Target | None = None) -> Attribution:
    kind = "decoder" if METHODS[name].decoder else "encoder"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attribute(_model(kind, dtype), PROMPTS if target is None or not target.generate
                         else PROMPTS[0], target, method=name, **_options(name))  # fmt: skip


def assert_identical(a: object, b: object, where: str = "attribution") -> None:
    """Equal types and values; tensors bit-identical (bytes, dtype, shape, device)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), where
        assert torch.equal(
            a.contiguous().view(torch.uint8) if a.numel() else a,
            b.contiguous().view(torch.uint8) if b.numel() else b,
        ), where
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), where
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        # fields outside equality are not data (ResolvedTarget.head, a module): not saved
        for f in (f for f in dataclasses.fields(a) if f.compare):
            assert_identical(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert isinstance(b, dict)
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple)
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _roundtrip(attr: Attribution, tmp_path, name: str = "a.safetensors") -> Attribution:
    path = attr.save(tmp_path / name)
    return Attribution.load(path)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_round_trips_bit_exactly(name, tmp_path):
    spec = METHODS[name]
    for dtype in (torch.float32, torch.float64):
        attr = _run(name, dtype)
        loaded = _roundtrip(attr, tmp_path, f"{name}-{dtype}.safetensors")
        assert_identical(attr, loaded)
        assert loaded.scores.dtype == attr.scores.dtype
        if spec.per_layer:
            assert loaded.layer_scores is not None
        if "heads" in spec.options or "trace_heads" in spec.options:
            assert loaded.head_scores is not None
    if spec.decoder:  # generation: one row per generated step, generated ids/tokens in meta
        gen = _run(name, torch.float64, Target(generate=2))
        assert "generated_ids" in gen.meta
        assert_identical(gen, _roundtrip(gen, tmp_path, f"{name}-gen.safetensors"))


@pytest.mark.parametrize("name", ["grad_x_input", "attnlrp", "alti_logit", "integrated_gradients"])
def test_class_head_round_trips_with_its_resolved_target(name, tmp_path):
    model = _model("decoder", torch.float64)
    torch.manual_seed(0)
    head = torch.nn.Linear(model.cfg.d_model, 3, dtype=torch.float64)
    target = Target(head=head, labels=["neg", "neu", "pos"], token=[2, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attr = attribute(model, PROMPTS, target, method=name)
    loaded = _roundtrip(attr, tmp_path)
    assert_identical(attr, loaded)
    # the head callable is not part of an Attribution: the resolved class ids and labels are
    assert loaded.target.token_ids.tolist() == [2, 0]
    assert loaded.meta["target_tokens"] == ["pos", "neg"]
    assert attr.target.head is head and isinstance(loaded.target.head, DetachedHead)
    assert loaded.with_head(head).target.head is head


def test_a_loaded_attribution_is_scored_only_with_its_head_given_back(tmp_path):
    """The file cannot hold a head; a metric on the model's own output would score another
    quantity, so the loaded target refuses to be read until ``with_head`` (float64: the scores
    with the head given back equal the original's)."""
    from lens_attrib.evaluation import score

    model = _model("decoder", torch.float64)
    torch.manual_seed(0)
    head = torch.nn.Linear(model.cfg.d_model, 2, dtype=torch.float64)
    target = Target(head=head, labels=["neg", "pos"], token=[1, 0])
    attr = attribute(model, PROMPTS, target, method="grad_x_input")
    loaded = _roundtrip(attr, tmp_path)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = ["comprehensiveness", "soft_nc"]
    with pytest.raises(TargetError, match=r"with_head\(head\)"):
        score(model, loaded, metrics)
    with pytest.raises(TargetError, match=r"clf\.head"):
        loaded.target.head(torch.zeros(1, model.cfg.d_model, dtype=torch.float64))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any(hp.fwd_hooks or hp.bwd_hooks for hp in model.hook_dict.values())

    def values(a: Attribution) -> list[tuple]:
        return [(r.metric, r.item, r.point, r.value) for r in score(model, a, metrics)]

    assert values(loaded.with_head(head)) == values(attr)
    plain = attribute(model, PROMPTS, method="grad_x_input")  # no head: loads with None
    assert _roundtrip(plain, tmp_path, "plain.safetensors").target.head is None


def test_meta_values_of_every_storable_kind_round_trip(tmp_path):
    attr = _run("grad_x_input", torch.float32)
    view = torch.arange(12.0).reshape(3, 4)
    attr.meta.update(
        {
            "np_float32": np.float32(0.1),
            "np_int": np.int64(7),
            "np_bool": np.bool_(True),
            "array": np.arange(6, dtype=np.int16).reshape(2, 3),
            "tuple": (1, "two", 3.5, None),
            "int_keys": {1: "a", (2, 3): [4.0]},
            "$dollar": {"$tensor": "not a reference"},
            "floats": [math.inf, -math.inf, math.nan, -0.0, 1e-310],
            "bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
            "views": [view[0], view[:, 1], view.T],  # share one storage
            "empty": torch.zeros(0, 3),
        }
    )
    loaded = _roundtrip(attr, tmp_path)
    assert loaded.meta["np_float32"] == float(np.float32(0.1))  # widened exactly, plain float
    assert type(loaded.meta["np_float32"]) is float and type(loaded.meta["np_int"]) is int
    assert loaded.meta["np_bool"] is True
    for key in ("array", "tuple", "int_keys", "$dollar", "floats", "bf16", "views", "empty"):
        assert_identical(attr.meta[key], loaded.meta[key], key)
    assert math.copysign(1.0, loaded.meta["floats"][3]) == -1.0


def test_unstorable_values_are_refused_without_pickling(tmp_path):
    attr = _run("grad_x_input", torch.float32)
    path = tmp_path / "x.safetensors"
    attr.meta["callback"] = {"fn": lambda x: x}
    with pytest.raises(AttributionFileError, match=r"meta/callback/fn: a builtins.function"):
        attr.save(path)
    assert not path.exists()
    del attr.meta["callback"]
    attr.meta["model_obj"] = torch.nn.Linear(2, 2)
    with pytest.raises(AttributionFileError, match="never pickles"):
        attr.save(path)
    attr.meta["model_obj"] = torch.zeros(2, dtype=torch.complex64)
    with pytest.raises(AttributionFileError, match="complex64"):
        attr.save(path)


def test_loading_uses_no_pickle_and_no_model(tmp_path, monkeypatch):
    attr = _run("attnlrp", torch.float64)
    path = attr.save(tmp_path / "a.safetensors")

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    assert_identical(attr, Attribution.load(path))


def _write_raw(path, header: dict, tensors: dict | None = None) -> None:
    save_file(
        tensors or {"x": torch.zeros(1)}, str(path), metadata={HEADER_KEY: json.dumps(header)}
    )


def test_newer_or_foreign_files_are_clear_errors(tmp_path):
    attr = _run("grad_x_input", torch.float32)
    path = attr.save(tmp_path / "a.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()[HEADER_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert header["format_version"] == FORMAT_VERSION
    header["format_version"] = FORMAT_VERSION + 1
    _write_raw(tmp_path / "newer.safetensors", header, tensors)
    with pytest.raises(AttributionFileError, match=rf"version {FORMAT_VERSION + 1}.*Upgrade"):
        Attribution.load(tmp_path / "newer.safetensors")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(AttributionFileError, match="without lens_attrib's header"):
        Attribution.load(tmp_path / "plain.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(AttributionFileError, match="not a safetensors file"):
        Attribution.load(tmp_path / "junk.safetensors")
    with pytest.raises(AttributionFileError, match="load_attributions"):
        save_attributions([attr], tmp_path / "c.safetensors")
        Attribution.load(tmp_path / "c.safetensors")
    with pytest.raises(AttributionFileError, match=r"Attribution.load"):
        load_attributions(path)


def test_collections_round_trip_as_list_and_dict(tmp_path):
    sweep = {name: _run(name, torch.float32) for name in ("grad_x_input", "logat", "alti_logit")}
    path = save_attributions(sweep, tmp_path / "sweep.safetensors")
    loaded = load_attributions(path)
    assert isinstance(loaded, dict) and list(loaded) == list(sweep)
    for key in sweep:
        assert_identical(sweep[key], loaded[key], key)
    as_list = load_attributions(save_attributions(list(sweep.values()), tmp_path / "l.safetensors"))
    assert isinstance(as_list, list)
    assert_identical(list(sweep.values()), as_list)
    with pytest.raises(AttributionFileError, match="string keys"):
        save_attributions({1: sweep["logat"]}, tmp_path / "bad.safetensors")
    with pytest.raises(AttributionFileError, match="not an Attribution"):
        save_attributions([sweep["logat"], "x"], tmp_path / "bad.safetensors")


# ------------------------------------------------------------------------------------ to_pandas
def test_to_pandas_scores_rows_are_the_real_tokens():
    attr = _run("grad_x_input", torch.float64)
    df = attr.to_pandas()
    assert list(df.columns) == ["item", "position", "token", "token_id", "target", "score"]
    assert len(df) == int(attr.mask.sum())  # left padding of the shorter prompt excluded
    for b in range(len(attr)):
        rows = df[df["item"] == b]
        assert rows["token"].tolist() == attr.tokens[b]
        assert rows["position"].tolist() == list(range(len(attr.tokens[b])))
        assert np.array_equal(rows["score"].to_numpy(), attr.numpy(b))
        assert rows["token_id"].tolist() == attr.token_ids[b][attr.mask[b]].tolist()
        assert set(rows["target"]) == {attr.meta["target_tokens"][b]}


def test_to_pandas_layers_heads_and_generation_steps():
    attr = _run("logat", torch.float64)
    df = attr.to_pandas("layer_scores")
    n_layers = attr.layer_scores.shape[1]
    assert len(df) == int(attr.mask.sum()) * n_layers
    assert sorted(set(df["layer"])) == attr.meta["layers"]
    one = df[(df["item"] == 1) & (df["layer"] == attr.meta["layers"][-1])]
    real = attr.layer_scores[1, -1][attr.mask[1]].numpy()
    assert np.array_equal(one["score"].to_numpy(), real)

    lrp = _run("attnlrp", torch.float64)
    heads = lrp.to_pandas("head_scores")
    assert len(heads) == lrp.head_scores.numel()
    row = heads[(heads["item"] == 1) & (heads["layer"] == 2) & (heads["head"] == 3)]
    assert float(row["score"].iloc[0]) == float(lrp.head_scores[1, 2, 3])
    assert (
        len(lrp.to_pandas("head_token_scores")) == int(lrp.mask.sum()) * lrp.head_scores[0].numel()
    )
    with pytest.raises(ValueError, match="has no layer_scores"):
        lrp.to_pandas("layer_scores")
    with pytest.raises(ValueError, match="takes one of"):
        lrp.to_pandas("tokens")

    gen = _run("grad_x_input", torch.float64, Target(generate=2))
    steps = gen.to_pandas()
    assert {"item", "step"} <= set(steps.columns) and set(steps["item"]) == {0}
    assert sorted(set(steps["step"])) == list(range(len(gen)))
    assert steps[steps["step"] == 1]["target"].iloc[0] == gen.meta["generated_tokens"][1]


# ------------------------------------------------------------------------------------ plot_heads
def test_plot_heads_shows_head_scores_of_the_item():
    attr = _run("attnlrp", torch.float64)
    fig = attr.plot_heads(item=1)
    z = np.asarray(fig.data[0].z)
    assert np.array_equal(z, attr.head_scores[1].numpy())
    assert len(fig.data[0].y) == attr.head_scores.shape[1]
    assert len(fig.data[0].x) == attr.head_scores.shape[2]
    with pytest.raises(ValueError, match="has no head_scores"):
        _run("logat", torch.float64).plot_heads()
    with pytest.raises(IndexError, match="item 5"):
        attr.plot_heads(item=5)
