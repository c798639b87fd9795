"""Progress bars: the switch (function, context manager, environment), nesting, and that the long
methods and loops really move a bar."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import lens_attrib
from lens_attrib import Target, attribute, progress
from lens_attrib.progress import advance, open_bars, progress_bar, progress_enabled, show_progress
from lens_attrib.tiny_models import tiny_gpt2


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_gpt2()


@pytest.fixture(autouse=True)
def _no_choice(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every test starts from the default (no show_progress choice, no environment variable)."""
    monkeypatch.delenv(progress.ENV_VAR, raising=False)
    with show_progress(None):
        yield
    assert not list(open_bars()), "a bar was left open"


def test_default_is_off_inside_pytest_and_on_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not progress_enabled()
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    assert progress_enabled()


@pytest.mark.parametrize(
    ("value", "expected"), [("0", False), ("off", False), ("No", False), ("1", True), ("on", True)]
)
def test_the_environment_variable_switches(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: bool
) -> None:
    monkeypatch.setenv(progress.ENV_VAR, value)
    assert progress_enabled() is expected


def test_an_unknown_environment_value_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(progress.ENV_VAR, "maybe")
    with pytest.raises(ValueError, match="LENS_ATTRIB_PROGRESS='maybe' is not understood"):
        progress_enabled()


def test_show_progress_beats_the_environment_and_the_block_restores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(progress.ENV_VAR, "1")
    with lens_attrib.show_progress(False):
        assert not progress_enabled()
        with show_progress(True):
            assert progress_enabled()
        assert not progress_enabled()
    assert progress_enabled()
    show_progress(False)  # the plain call lasts until changed
    assert not progress_enabled()
    show_progress(None)
    assert progress_enabled()


def test_show_progress_refuses_a_non_bool() -> None:
    with pytest.raises(TypeError, match="True, False or None, got 'no'"):
        show_progress("no")  # type: ignore[arg-type]


def test_a_shown_bar_writes_after_its_delay_and_a_quick_one_does_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def written(delay: float, enabled: bool = True) -> str:
        monkeypatch.setattr(progress, "DELAY", delay)
        capsys.readouterr()
        with show_progress(enabled), progress_bar(desc="work", total=3, unit="step"):
            for _ in range(3):
                advance()
        return capsys.readouterr().err

    assert written(3600.0) == ""
    assert "work" in written(0.0)
    assert written(0.0, enabled=False) == ""


def test_a_disabled_bar_still_counts_and_advance_reaches_the_innermost() -> None:
    with progress_bar(desc="outer", total=2) as outer:
        assert outer.disable
        for _ in progress_bar(range(2), desc="inner"):
            advance(5)  # reaches the inner bar, not the outer one
        assert list(open_bars()) == [outer]
        advance()
        assert outer.n == 0  # a disabled tqdm does not count, but it takes the call
    assert not list(open_bars())


def test_a_broken_loop_closes_its_bar() -> None:
    for i in progress_bar(range(10), desc="loop"):
        if i == 3:
            break
    assert not list(open_bars())


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[float]]:
    """Record every bar's description and its count when it closes (bars shown, delay 0)."""
    seen: dict[str, list[float]] = {}
    original = progress._Bar.close

    def close(self: Any) -> None:
        if self in list(open_bars()):
            seen.setdefault(str(self.desc), []).append(self.n)
        original(self)

    monkeypatch.setattr(progress._Bar, "close", close)
    monkeypatch.setattr(progress, "DELAY", 0.0)
    return seen


@pytest.mark.parametrize(
    ("method", "options", "bar", "expected"),
    [
        ("integrated_gradients", {"n_steps": 8, "step_batch": 3}, "integrated_gradients", 16),
        ("value_zeroing", {"batch_size": 2}, "value_zeroing", None),
        ("alti", {}, "alti", None),
        ("alti_logit", {}, "alti", None),
        ("reagent", {"max_probe_steps": 3}, "reagent", None),
    ],
)
def test_long_methods_move_a_bar(
    monkeypatch: pytest.MonkeyPatch,
    model: Any,
    method: str,
    options: dict[str, Any],
    bar: str,
    expected: int | None,
) -> None:
    seen = _counting(monkeypatch)
    prompts = ["The keys to the cabinet", "A dog"]
    with show_progress(True), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reagent: too few probe rounds to stop, on purpose
        attr = attribute(model, prompts, Target(), method=method, **options)
    assert torch.isfinite(attr.scores).all()
    moved = sum(seen.get(bar, []))
    assert moved > 0, f"{method} never advanced its bar: {seen}"
    if expected is not None:  # IG with n_steps=8: 8 gradient points per item
        assert moved == expected
    if method in ("alti", "alti_logit"):  # one mixing matrix per item and mixing layer
        n_layers = model.cfg.n_layers
        assert moved == len(prompts) * (n_layers if method == "alti" else n_layers - 1)


class Boom(Exception):
    pass


def test_a_method_that_raises_leaves_no_bar_open(model: Any) -> None:
    """A user hook that fails in the middle of IG's integrand evaluations (its bar is open)."""
    calls = []

    def fail_later(x: torch.Tensor, hook: Any) -> None:
        calls.append(1)
        if len(calls) > 4:
            raise Boom("user hook failed")

    with show_progress(True), model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", fail_later)]):
        with pytest.raises(Boom):
            attribute(model, ["The keys"], Target(), method="integrated_gradients", n_steps=8,
                      step_batch=1)  # fmt: skip
    assert len(calls) > 4 and not list(open_bars())
