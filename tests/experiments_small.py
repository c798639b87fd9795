"""Small runs of the experiments whose outputs are pinned in ``tests/fixtures/experiments_small``.

Each run calls an experiment's ``main([...])`` on a real offline model loaded in float64 (so that
the pinned numbers are the model's arithmetic, not float32 rounding), with the smallest settings
that still exercise every metric, mode and branch of the experiment. The classifier mode of
``experiments.faithfulness`` explains seeded random linear heads on MiniLM (float64) instead of
the trained built-in classifiers, whose training is neither quick nor pinned.

``python -m tests.experiments_small`` rewrites the fixtures (see the fixture folder's README);
``tests/test_experiments_regression.py`` reruns the same runs and compares.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "experiments_small"
USER_ITEMS = FIXTURES / "user_items.jsonl"
IDENTITY = (
    "task", "dataset", "paradigm", "item", "method", "mode", "specials", "metric", "layer",
    "n_attractors",
)  # fmt: skip
"""Fields that name a record (what it is about); every other field is a value."""
EXTRA_KEYS = ("counts", "linzen", "accuracy", "n_layers")


def load_models() -> dict[str, Any]:
    """SmolLM2-135M and MiniLM-L6 in float64."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lens_attrib import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "smollm2-135m": load_model("smollm2-135m", dtype=torch.float64),
            "minilm-l6": load_model("minilm-l6", dtype=torch.float64),
        }


@contextmanager
def experiment_models(models: dict[str, Any]) -> Iterator[None]:
    """Hand ``models`` to the experiments (``common.get_model``), restoring what was there."""
    from experiments import common

    saved = {k: common._MODELS.get(k) for k in [(name, "cpu") for name in models]}
    common._MODELS.update({(name, "cpu"): model for name, model in models.items()})
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                common._MODELS.pop(key, None)
            else:
                common._MODELS[key] = old


def faithfulness_on_random_heads(monkeypatch: Any) -> list[dict[str, Any]]:
    """Set ``experiments.faithfulness`` up to explain MiniLM in float64 with seeded random heads
    (:func:`random_classifier`), and return the list to which every ``attribute`` call it makes
    appends ``{"method": ..., **options}`` (``monkeypatch`` undoes all of it)."""
    from experiments import common, faithfulness
    from lens_attrib import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        minilm = load_model("minilm-l6", dtype=torch.float64)
    monkeypatch.setattr(faithfulness, "load_classifier", random_classifier)
    monkeypatch.setitem(common._MODELS, ("minilm-l6", "cpu"), minilm)
    calls: list[dict[str, Any]] = []
    real = faithfulness.attribute

    def spy(model: Any, inputs: Any, target: Any, *, method: str, **options: Any) -> Any:
        calls.append({"method": method, **options})
        return real(model, inputs, target, method=method, **options)

    monkeypatch.setattr(faithfulness, "attribute", spy)
    return calls


def journal_values(path: str | Path) -> dict[tuple, float]:
    """``(method, item, metric) -> value`` of every record in a gzipped journal."""
    import gzip

    out = {}
    with gzip.open(path, "rt") as f:
        for line in f:
            unit = json.loads(line)
            for r in unit.get("records", []):
                out[(r["method"], r["item"], r["metric"])] = r["value"]
    return out


def random_classifier(name: str, *, model: Any, **_: Any) -> Any:
    """A seeded random linear head on ``model`` in place of the built-in classifier ``name``
    (SST-2: two classes; STS-B: one regression output), read at ``[CLS]``."""
    from lens_attrib.classifiers import Classifier, ClassifierInfo, LinearHead

    regression = name.endswith("-stsb")
    d_model = int(model.cfg.d_model)
    head = LinearHead(d_model, 1 if regression else 2).to(torch.float64)
    gen = torch.Generator().manual_seed(7 if regression else 3)
    with torch.no_grad():
        head.linear.weight.copy_(torch.randn(head.linear.weight.shape, generator=gen) / 4)
        head.linear.bias.copy_(torch.randn(head.linear.bias.shape, generator=gen) / 4)
    labels = None if regression else ("negative", "positive")
    info = ClassifierInfo(name, labels, regression, 0, {"dev_score": float("nan")})
    return Classifier(model, head, info)


def _agreement(out: Path) -> dict[str, Any]:
    from experiments import agreement

    argv = ["--tasks", "ra,sva,blimp_darn,qa,linzen", "--data", str(USER_ITEMS),
            "--methods", "grad_x_input,random,alti_logit", "--n", "3", "--batch-size", "2",
            "--n-qa", "6", "--n-linzen", "6", "--n-boot", "200", "--ci",
            "--out", str(out)]  # fmt: skip
    agreement.main(argv)
    return _payload(out / "agreement.json")


def _blimp_alignment(out: Path) -> dict[str, Any]:
    from experiments import blimp_alignment

    argv = ["--paradigms", "dna,rpsv", "--n", "3", "--batch-size", "2", "--only-correct",
            "--methods", "normxlogit,logat_target,logat_foil,logat_plural,alti_logit,"
            "embed_norm,random", "--out", str(out)]  # fmt: skip
    blimp_alignment.main(argv)
    return _payload(out / "blimp_alignment.json")


def _faithfulness_zero_shot(out: Path) -> dict[str, Any]:
    from experiments import faithfulness

    argv = ["--mode", "zero-shot", "--datasets", "sst2", "--n", "2", "--batch-size", "1",
            "--methods", "grad_x_input,random", "--max-tokens", "6", "--pis", "0.3,0.7",
            "--n-draws", "2", "--fractions", "0.3,0.6", "--no-chat", "--out", str(out)]  # fmt: skip
    faithfulness.main(argv)
    return _payload(out / "faithfulness.json")


def _faithfulness_classifier(out: Path) -> dict[str, Any]:
    from experiments import faithfulness

    real = faithfulness.load_classifier
    faithfulness.load_classifier = random_classifier  # type: ignore[assignment]
    try:
        argv = ["--model", "minilm-l6", "--datasets", "sst2,stsb", "--n", "3",
                "--batch-size", "2", "--methods", "grad_x_input,normxlogit,random",
                "--max-tokens", "10", "--pis", "0.3,0.7", "--n-draws", "2",
                "--fractions", "0.3,0.6", "--steps", "4", "--out", str(out)]  # fmt: skip
        faithfulness.main(argv)
    finally:
        faithfulness.load_classifier = real  # type: ignore[assignment]
    return _payload(out / "faithfulness.json")


RUNS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "agreement": _agreement,
    "blimp_alignment": _blimp_alignment,
    "faithfulness_zero_shot": _faithfulness_zero_shot,
    "faithfulness_classifier": _faithfulness_classifier,
}


def _payload(path: Path) -> dict[str, Any]:
    """What an experiment wrote, less its config (paths and timings of this run)."""
    payload = json.loads(path.read_text(encoding="utf-8"))
    kept = {k: payload[k] for k in ("records", "summary", "table")}
    kept.update({k: payload[k] for k in EXTRA_KEYS if k in payload})
    return kept


def run(name: str, out: Path) -> dict[str, Any]:
    """One pinned run, with the threads and gradient mode the experiments set."""
    threads = torch.get_num_threads()
    try:
        return RUNS[name](out)
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- comparison
def _rows_by_identity(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    index: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        key = tuple((k, json.dumps(row[k])) for k in IDENTITY if k in row)
        assert key not in index, f"two rows named {key}"
        index[key] = row
    return index


def _is_number(value: Any) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool)


def _arrays(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[tuple[Any, ...], Any]]:
    """Values grouped into arrays: (array name = identity without ``item`` + field) -> row key
    -> value."""
    arrays: dict[tuple[Any, ...], dict[tuple[Any, ...], Any]] = {}
    for key, row in _rows_by_identity(rows).items():
        group = tuple(kv for kv in key if kv[0] != "item")
        for field, value in row.items():
            if field not in IDENTITY:
                arrays.setdefault((*group, ("field", field)), {})[key] = value
    return arrays


def compare(got: dict[str, Any], want: dict[str, Any], rtol: float = 1e-12) -> list[str]:
    """Differences between two payloads: the same rows and non-numeric values; each array of
    numbers (one field of the rows that share everything but ``item``) within ``rtol`` of its
    largest magnitude, NaN (``None``) where the pinned one has it."""
    problems: list[str] = []
    if set(got) != set(want):
        problems.append(f"sections {sorted(got)} != {sorted(want)}")
    for section in ("records", "summary", "linzen"):
        if section not in want:
            continue
        a, b = _arrays(got.get(section, [])), _arrays(want[section])
        if set(a) != set(b):
            extra, missing = set(a) - set(b), set(b) - set(a)
            problems.append(f"{section}: arrays differ; new {sorted(extra)[:3]}, "
                            f"missing {sorted(missing)[:3]}")  # fmt: skip
        cells = _cell_scales(want[section]) if section == "summary" else {}
        for name in sorted(set(a) & set(b)):
            floor = cells.get(name[:-1], 0.0) if name[-1][1] in CELL_STATS else 0.0
            problems += _compare_array(f"{section}{list(name)}", a[name], b[name], rtol, floor)
    for section in ("counts", "accuracy", "n_layers", "table"):
        if section in want:
            problems += _compare_tree(section, got.get(section), want[section], rtol)
    return problems


CELL_STATS = ("mean", "ci_low", "ci_high")


def _cell_scales(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], float]:
    """Per summary cell, the largest magnitude of its mean and CI bounds: a bound is a number in
    the units of the mean, so it is compared relative to the cell's scale, not to itself (a
    bootstrap bound of a 2-item Pearson drop is 0 up to rounding, e.g. 1.1e-16 or 2.2e-16)."""
    out: dict[tuple[Any, ...], float] = {}
    for key, row in _rows_by_identity(rows).items():
        stats = [abs(float(row[f])) for f in CELL_STATS if _is_number(row.get(f))]
        out[tuple(kv for kv in key if kv[0] != "item")] = max(stats, default=0.0)
    return out


def _compare_array(
    name: str, got: dict[Any, Any], want: dict[Any, Any], rtol: float, floor: float = 0.0
) -> list[str]:
    if set(got) != set(want):
        return [f"{name}: rows differ"]
    numbers = [v for v in want.values() if _is_number(v)]
    scale = max((abs(float(v)) for v in numbers), default=floor)
    scale = max(scale, floor)
    out = []
    for key, w in want.items():
        g = got[key]
        if _is_number(w) and _is_number(g):
            if abs(float(g) - float(w)) > rtol * scale:
                out.append(f"{name} {dict(key)}: {g!r} != {w!r} (scale {scale:.3g})")
        elif g != w:
            out.append(f"{name} {dict(key)}: {g!r} != {w!r}")
    return out


def _compare_tree(name: str, got: Any, want: Any, rtol: float) -> list[str]:
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return [f"{name}: keys {sorted(got)} != {sorted(want)}"]
        return [p for k in want for p in _compare_tree(f"{name}.{k}", got[k], want[k], rtol)]
    if _is_number(want) and _is_number(got):
        ok = math.isclose(float(got), float(want), rel_tol=rtol, abs_tol=0.0)
        return [] if ok else [f"{name}: {got!r} != {want!r}"]
    return [] if got == want else [f"{name}: {got!r} != {want!r}"]


def write_fixtures(names: list[str]) -> None:
    import tempfile
    import time

    models = load_models()
    with experiment_models(models), tempfile.TemporaryDirectory() as tmp:
        for name in names:
            started = time.perf_counter()
            payload = run(name, Path(tmp) / name)
            path = FIXTURES / f"{name}.json"
            path.write_text(json.dumps(payload, indent=0, sort_keys=True) + "\n", "utf-8")
            print(f"{name}: {time.perf_counter() - started:.1f} s -> {path}", flush=True)


if __name__ == "__main__":
    write_fixtures(sys.argv[1:] or list(RUNS))
