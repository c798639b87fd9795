"""No global warning filters: the library and the scripts silence only TransformerLens'
HookedTransformer/HookedEncoder deprecation notice, and only where they construct a model."""

from __future__ import annotations

import argparse
import ast
import warnings
from pathlib import Path

import pytest

from lens_attrib.models import quiet_deprecation

ROOT = Path(__file__).resolve().parents[1]
FILTER_CALLS = {"filterwarnings", "simplefilter", "resetwarnings"}


def _is_catch_warnings(item: ast.withitem) -> bool:
    call = item.context_expr
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "catch_warnings"
    )


def global_filters(source: str) -> list[int]:
    """Lines of ``warnings.filterwarnings/simplefilter/resetwarnings`` calls that are not inside a
    ``with warnings.catch_warnings():`` block (so they change the process-wide filters)."""
    found: list[int] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.With | ast.AsyncWith):
            guarded = guarded or any(_is_catch_warnings(i) for i in node.items)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in FILTER_CALLS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "warnings"
            and not guarded
        ):
            found.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(ast.parse(source), False)
    return found


def test_the_scan_finds_a_planted_global_filter() -> None:
    planted = (
        "import warnings\n"
        "def setup():\n"
        "    with warnings.catch_warnings():\n"
        "        warnings.simplefilter('ignore')\n"
        "    warnings.filterwarnings('ignore', category=DeprecationWarning)\n"
    )
    assert global_filters(planted) == [5]


@pytest.mark.parametrize("folder", ["lens_attrib", "hooks", "experiments", "benchmarks"])
def test_no_code_sets_a_global_warning_filter(folder: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (lines := global_filters(path.read_text(encoding="utf-8")))
    }
    assert not offenders, f"global warning filters (wrap them in catch_warnings): {offenders}"


def test_quiet_deprecation_silences_only_the_hooked_transformer_notice() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_deprecation():
            notice = "HookedTransformer is deprecated and will be removed in 4.0. Use ..."
            warnings.warn(notice, DeprecationWarning, stacklevel=1)  # TransformerLens 3.9's
            warnings.warn("some other API is deprecated", DeprecationWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["some other API is deprecated"]


def test_experiment_setup_leaves_the_warning_filters_alone() -> None:
    from experiments import common
    from lens_attrib.tiny_models import tiny_gpt2

    common._MODELS[("tiny-for-warnings", "cpu")] = tiny_gpt2()
    try:
        before = list(warnings.filters)
        args = argparse.Namespace(model="tiny-for-warnings", device="cpu", threads=0)
        assert common.setup(args) is common._MODELS[("tiny-for-warnings", "cpu")]
        assert list(warnings.filters) == before
    finally:
        del common._MODELS[("tiny-for-warnings", "cpu")]
