"""The result of :func:`lens_attrib.verify`: one typed row per check, as text, HTML and a verdict.

A :class:`CheckRow` says what was checked (``check``, with the ``method`` it ran), its ``status``
(``"pass"``, ``"fail"`` or ``"n/a"`` — a check that does not apply to this model, with the
reason in ``detail``), the measured ``error`` and the ``tolerance`` it was held to (both in the
unit the row's ``detail`` names, relative unless stated), and the seconds it took.
:class:`VerifyReport` collects the rows: ``str(report)`` is a short plain-text table,
``report._repr_html_()`` an escaped HTML table for Jupyter, ``report.ok`` is True when no row
failed and ``report.raise_if_failed()`` raises :class:`VerificationError` naming the failed rows.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

Status = Literal["pass", "fail", "n/a"]


class VerificationError(AssertionError):
    """A :func:`lens_attrib.verify` check failed on this model (the message lists the rows)."""


@dataclass(frozen=True)
class CheckRow:
    """One check: what, on which method, pass/fail/n/a, measured error, tolerance, why."""

    check: str
    method: str | None
    status: Status
    error: float | None
    tolerance: float | None
    detail: str
    seconds: float = 0.0
    warnings: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        return self.status == "fail"


def _number(x: float | None) -> str:
    if x is None:
        return "—"
    if x == 0:
        return "0"
    return f"{x:.1e}"


_HEADERS = ("check", "method", "status", "error", "tolerance", "seconds", "detail")


@dataclass
class VerifyReport:
    """Every check's :class:`CheckRow`, with what the checks ran on."""

    model: str
    dtype: str
    target: str
    inputs: list[list[str]]
    rows: list[CheckRow] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when no check failed (``n/a`` rows do not count against it)."""
        return not any(row.failed for row in self.rows)

    @property
    def failed(self) -> list[CheckRow]:
        return [row for row in self.rows if row.failed]

    def row(self, check: str, method: str | None = None) -> CheckRow:
        """The row of ``check`` (and ``method`` where a check runs on several)."""
        found = [
            r for r in self.rows if r.check == check and (method is None or r.method == method)
        ]
        if not found:
            names = sorted({(r.check, r.method or "") for r in self.rows})
            raise KeyError(f"No row {check!r} (method {method!r}); rows: {names}.")
        return found[0]

    def raise_if_failed(self) -> None:
        """Raise :class:`VerificationError` listing every failed row; return when none failed."""
        if self.ok:
            return
        lines = [
            f"{r.check} ({r.method}): error {_number(r.error)} > tolerance "
            f"{_number(r.tolerance)}: {r.detail}"
            for r in self.failed
        ]
        raise VerificationError(
            f"verify: {len(lines)} check(s) failed on {self.model} ({self.dtype}):\n  "
            + "\n  ".join(lines)
        )

    def _cells(self) -> list[tuple[str, ...]]:
        return [
            (
                r.check,
                r.method or "",
                r.status.upper() if r.status != "n/a" else "n/a",
                _number(r.error),
                _number(r.tolerance),
                f"{r.seconds:.1f}",
                r.detail,
            )
            for r in self.rows
        ]

    def _title(self) -> str:
        verdict = "all checks pass" if self.ok else f"{len(self.failed)} FAILED"
        lengths = ", ".join(str(len(t)) for t in self.inputs)
        return (
            f"verify {self.model} ({self.dtype}): {verdict} — target: {self.target}; "
            f"{len(self.inputs)} inputs of {lengths} tokens; {self.seconds:.1f} s"
        )

    def __str__(self) -> str:
        cells = self._cells()
        widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(_HEADERS[:-1])]

        def line(values: Sequence[str]) -> str:
            padded = [v.ljust(w) for v, w in zip(values[:-1], widths)]
            return "  ".join([*padded, values[-1]]).rstrip()

        rule = "  ".join("-" * w for w in widths) + "  ------"
        out = [self._title(), line(_HEADERS), rule, *(line(c) for c in cells)]
        notes = [f"  {r.check} ({r.method}): {w}" for r in self.rows for w in r.warnings]
        if notes:
            out += ["warnings raised inside the checks:", *notes]
        return "\n".join(out)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        colour = {"pass": "#1a7f37", "fail": "#cf222e", "n/a": "#6e7781"}
        head = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in _HEADERS)
        body = []
        for row, cells in zip(self.rows, self._cells()):
            tds = []
            for i, cell in enumerate(cells):
                style = f" style='color:{colour[row.status]};font-weight:bold'" if i == 2 else ""
                tds.append(f"<td{style}>{html.escape(cell)}</td>")
            body.append("<tr>" + "".join(tds) + "</tr>")
        notes = "".join(
            f"<li>{html.escape(f'{r.check} ({r.method}): {w}')}</li>"
            for r in self.rows
            for w in r.warnings
        )
        extra = f"<p>Warnings raised inside the checks:</p><ul>{notes}</ul>" if notes else ""
        return (
            f"<div><p><b>{html.escape(self._title())}</b></p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
            f"{extra}</div>"
        )


__all__ = ["CheckRow", "Status", "VerificationError", "VerifyReport"]
