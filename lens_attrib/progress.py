"""Progress bars for long calls, and the one switch that turns them off.

Every loop that can run for more than about ten seconds — Integrated Gradients' integrand
evaluations, ALTI's mixing matrices, ReAGent's probe rounds, value zeroing's perturbed forwards,
evaluation sweeps, fine-tuning, classifier features — shows a ``tqdm.auto`` bar (a widget in
Jupyter, a text line in a terminal). A bar appears only once its call has run for
:data:`DELAY` seconds, so quick calls print nothing.

The switch, strongest first:

- ``lens_attrib.show_progress(False)`` turns bars off for the rest of the session;
  ``with lens_attrib.show_progress(False): ...`` only inside the block (``True`` turns them
  on, ``None`` goes back to the environment / default);
- the environment variable ``LENS_ATTRIB_PROGRESS``: ``0`` / ``off`` / ``false`` / ``no`` (off),
  ``1`` / ``on`` / ``true`` / ``yes`` (on);
- default: on, except while pytest runs a test (``PYTEST_CURRENT_TEST`` is set), so test output
  stays clean.

Code deep inside a method moves the innermost open bar with :func:`advance` (``advance(0)`` only
refreshes its clock), so the functions that do the work need no bar argument.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

if importlib.util.find_spec("ipywidgets") is not None:  # a widget in Jupyter
    from tqdm.auto import tqdm
else:  # text bars (tqdm.auto would warn "IProgress not found" in every notebook)
    from tqdm.std import tqdm

ENV_VAR = "LENS_ATTRIB_PROGRESS"
DELAY = 3.0
"""Seconds a call runs before its bar appears."""
LOG_INTERVAL = 10.0
"""Seconds between refreshes when stderr is not a terminal (log files get a line per refresh)."""

_OFF = {"0", "off", "false", "no"}
_ON = {"1", "on", "true", "yes"}
_choice: list[bool | None] = [None]
_open: list[Any] = []


def progress_enabled() -> bool:
    """Whether bars are shown now: :func:`show_progress`, else ``LENS_ATTRIB_PROGRESS``, else on
    outside pytest."""
    if _choice[0] is not None:
        return _choice[0]
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    if value:
        raise ValueError(
            f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not understood: use 0/off/false/no or "
            "1/on/true/yes (or unset it for the default: on, off inside pytest)."
        )
    return "PYTEST_CURRENT_TEST" not in os.environ


class show_progress:  # lower case: used like a function, lens_attrib.show_progress(False)
    """Turn progress bars on (``True``) or off (``False``), or back to the environment / default
    (``None``). Takes effect at once; used as a context manager, the previous choice comes back
    when the block ends."""

    def __init__(self, enabled: bool | None = True) -> None:
        if enabled is not None and not isinstance(enabled, bool):
            raise TypeError(
                f"show_progress takes True, False or None, got {enabled!r} "
                f"({type(enabled).__name__})."
            )
        self.previous = _choice[0]
        _choice[0] = enabled

    def __enter__(self) -> show_progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        _choice[0] = self.previous


class _Bar(tqdm):  # type: ignore[misc, valid-type]
    """A tqdm.auto bar that :func:`advance` can reach while it is open."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _open.append(self)

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from super().__iter__()
        finally:  # a disabled tqdm does not close itself after iterating
            self.close()

    def close(self) -> None:
        if self in _open:
            _open.remove(self)
        super().close()

    def tick(self, n: float) -> None:
        """``update(n)``; for ``n == 0`` a refresh of the clock once the bar may show."""
        if n or self.disable:
            self.update(n)
            return
        now = time.time()  # tqdm's own clock (its _time)
        last = float(getattr(self, "last_print_t", 0.0))
        if now - self.start_t >= self.delay and now - last >= self.mininterval:
            self.refresh()
            self.last_print_t = now


def progress_bar(
    iterable: Iterable[Any] | None = None,
    *,
    desc: str,
    total: float | None = None,
    unit: str = "it",
    enabled: bool = True,
) -> Any:
    """A tqdm.auto bar (iterate over it, or use it as a context manager and ``update``): shown
    after :data:`DELAY` seconds when :func:`progress_enabled` and ``enabled``, removed when done."""
    show = enabled and progress_enabled()
    interactive = bool(getattr(sys.stderr, "isatty", lambda: False)())
    return _Bar(
        iterable,
        desc=desc,
        total=total,
        unit=unit,
        disable=not show,
        delay=DELAY,
        leave=False,
        mininterval=0.1 if interactive else LOG_INTERVAL,
        dynamic_ncols=True,
    )


def advance(n: float = 1) -> None:
    """Move the innermost open bar by ``n`` (``0``: refresh its clock only); no bar, no effect."""
    if _open:
        _open[-1].tick(n)


@contextmanager
def bars_closed_after() -> Iterator[None]:
    """Close every bar opened inside the block when it ends (also when it raises)."""
    depth = len(_open)
    try:
        yield
    finally:
        while len(_open) > depth:
            _open[-1].close()


def open_bars() -> Iterator[Any]:
    """The bars open now, outermost first (for tests)."""
    return iter(list(_open))


__all__ = [
    "DELAY",
    "ENV_VAR",
    "advance",
    "bars_closed_after",
    "open_bars",
    "progress_bar",
    "progress_enabled",
    "show_progress",
]
