"""Adaptive Integrated Gradients in lockstep (issue 31): the items of a batch advance their
rounds together and each round's midpoint values ride in the forward of its nodes.

Oracles: the per-item implementation's outputs pinned before the change
(``tests/fixtures/ig_adaptive``), the per-item path run here (``LOCKSTEP = False``), each item
explained alone (batched == single); forwards are counted, not timed.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from lens_attrib.methods import integrated_gradients as ig
from tests.ig_adaptive_cases import CASES, FIXTURE, arrays, run_case


def _close(got: np.ndarray, want: np.ndarray, what: str, scale: float | None = None) -> None:
    assert got.shape == want.shape, what
    scale = scale or max(float(np.abs(want).max()), 1e-300)
    err = float(np.abs(got - want).max()) / scale
    assert err <= 1e-12, f"{what}: {err:.2e} of its largest magnitude"


def _run(case: str) -> dict[str, np.ndarray]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return arrays(case, run_case(case))


def _compare(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for key, value in want.items():
        if key.endswith(("/n_steps", "/panels")):
            assert got[key].tolist() == value.tolist(), key
        elif key.endswith("/completeness_gap"):  # f(x) − f(b) − Σ R: rounding of |f(x) − f(b)|
            case = key.split("/")[0]
            delta = want[f"{case}/explained_value"] - want[f"{case}/baseline_value"]
            _close(got[key], value, key, float(np.abs(delta).max()))
        else:
            _close(got[key], value, key)


@pytest.mark.parametrize("case", CASES)
def test_lockstep_equals_the_pinned_per_item_outputs(case) -> None:
    pinned = np.load(FIXTURE)
    want = {k: pinned[k] for k in pinned.files if k.startswith(f"{case}/")}
    assert want
    _compare(_run(case), want)


@pytest.mark.parametrize("case", ["llama_sink_capped", "gpt2_full"])
def test_lockstep_equals_the_per_item_path(case, monkeypatch) -> None:
    lockstep = _run(case)
    monkeypatch.setattr(ig, "LOCKSTEP", False)
    _compare(lockstep, _run(case))


def test_the_capped_case_holds_a_capped_item_beside_converging_ones() -> None:
    pinned = np.load(FIXTURE)
    steps = pinned["llama_sink_capped/n_steps"].tolist()
    gap = np.abs(pinned["llama_sink_capped/completeness_gap"])
    delta = np.abs(
        pinned["llama_sink_capped/explained_value"] - pinned["llama_sink_capped/baseline_value"]
    )
    assert steps[0] == 48 and gap[0] > 1e-6 * delta[0]  # capped at max_steps, not converged
    assert min(steps) == 16 and bool(np.all(gap[1:] <= 1e-6 * delta[1:]))


def test_batched_equals_single() -> None:
    from lens_attrib.methods.registry import attribute
    from lens_attrib.tiny_models import tiny_llama
    from tests.ig_adaptive_cases import F64, PROMPTS

    model = tiny_llama(dtype=F64)
    batched = attribute(model, PROMPTS, method="integrated_gradients", tolerance=1e-7)
    for i, prompt in enumerate(PROMPTS):
        alone = attribute(model, [prompt], method="integrated_gradients", tolerance=1e-7)
        assert batched.meta["n_steps"][i] == alone.meta["n_steps"][0]
        assert batched.meta["panels"][i] == alone.meta["panels"][0]
        _close(batched.item_scores(i).numpy(), alone.item_scores(0).numpy(), f"item {i}")


REAL_RESID_OF = ig.resid_of


def _count_forwards(monkeypatch) -> list[int]:
    rows: list[int] = []
    real = REAL_RESID_OF

    def counted(model, batch):
        rows.append(batch.size)
        return real(model, batch)

    monkeypatch.setattr(ig, "resid_of", counted)
    return rows


def test_lockstep_needs_fewer_sequential_forwards(monkeypatch) -> None:
    rounds: list[int] = []
    real_lockstep = ig.lockstep_adaptive

    def recorded(*args, **kwargs):
        out = real_lockstep(*args, **kwargs)
        rounds.append(out[2])
        return out

    monkeypatch.setattr(ig, "lockstep_adaptive", recorded)
    lockstep = _count_forwards(monkeypatch)
    _run("llama_mixed")
    monkeypatch.setattr(ig, "LOCKSTEP", False)
    per_item = _count_forwards(monkeypatch)
    _run("llama_mixed")
    pinned = np.load(FIXTURE)
    steps = pinned["llama_mixed/n_steps"].tolist()
    # every item alone: f(x), f(b), then per round one value forward and one of its nodes
    per_item_rounds = [1 + (n - 16) // 16 for n in steps]  # here each round splits one panel
    assert len(per_item) == 2 * len(steps) + 2 * sum(per_item_rounds)
    # lockstep: the rounds of the slowest item, each one forward per planned bucket
    assert rounds == [max(per_item_rounds)]
    assert len(lockstep) - 2 * len(steps) <= rounds[0] * len(steps)
    assert len(lockstep) < len(per_item)
    assert sum(lockstep) == sum(per_item)  # the same rows, in fewer forwards
