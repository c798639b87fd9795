"""The package's structure: no import cycle, architecture facts asked in one place, one spec
per method, and the registry doing the shared work."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from lens_attrib import METHODS, OptionError, attribute
from lens_attrib.cli import method_list, shard
from lens_attrib.tiny_models import tiny_gpt2

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"lens_attrib": ROOT / "lens_attrib", "lens_attrib.hooks": ROOT / "hooks"}


def _modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every lens_attrib module ``path`` imports (also inside functions, not TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skip |= {id(n) for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name in known:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(path, known) - {name} for name, path in modules.items()}
    # a submodule's import of its own package's __init__ is how Python runs it anyway
    return {k: {v for v in vs if not k.startswith(v + ".")} for k, vs in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "lens_attrib.attribution" in graph and "lens_attrib.methods.registry" in graph
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_check_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_sibling_modules_do_not_lean_on_each_other():
    graph = import_graph()
    assert "lens_attrib.methods.alti_mixing" not in graph["lens_attrib.methods.attention"]
    assert "lens_attrib.pruning" not in graph["lens_attrib.plot"]
    assert not {"lens_attrib.attribution", "lens_attrib.methods"} & graph["lens_attrib.plot"]


SHARED_MACHINERY = {
    "lens_attrib.methods",  # the package: imports every module so that they register
    "lens_attrib.methods.registry",  # MethodSpec, Option, the wrapper
    "lens_attrib.methods.backprop",  # gradients at hooks, Gradient×Input pooling, shared options
    "lens_attrib.methods.baselines",  # baselines of the path methods (IG, DeepLIFT)
    "lens_attrib.methods.path_quadrature",  # adaptive quadrature (IG numerics)
    "lens_attrib.methods.prefix_chunks",  # generation steps in chunks through the KV cache
    "lens_attrib.methods.propagation",  # row tracing down token-mixing matrices
    "lens_attrib.methods.alti_mixing",  # ALTI's transformed vectors and mixing (ALTI, GlobEnc)
    "lens_attrib.methods.generation",  # Target(generate=N / continuation=...) as step batches
    "lens_attrib.methods.seeding",  # per-item seeds (random, ReAGent)
}
"""Modules of ``lens_attrib/methods/`` that register no method: the machinery method modules
share. Every other module there is a *method module* (it registers at least one method), and
method modules import shared machinery, never each other."""


def method_modules() -> set[str]:
    """The modules of the library that define a registered method's core (methods a test
    registers for a while live in its test module and are not the library's)."""
    return {
        s.core.__module__ for s in METHODS.values() if s.core.__module__.startswith("lens_attrib.")
    }


def test_every_methods_module_is_a_method_module_or_shared_machinery():
    in_package = {m for m in _modules() if m.startswith("lens_attrib.methods")}
    methods = method_modules()
    assert methods <= in_package
    assert not methods & SHARED_MACHINERY, (
        f"shared machinery registers methods: {methods & SHARED_MACHINERY}"
    )
    unclassified = in_package - methods - SHARED_MACHINERY
    assert not unclassified, (
        f"{unclassified}: register a method there, or add it to SHARED_MACHINERY (with a reason)"
    )
    assert not SHARED_MACHINERY - in_package, f"gone: {SHARED_MACHINERY - in_package}"


def method_module_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """For every method module, the other method modules it imports (should be none)."""
    methods = method_modules()
    return {m: bad for m in sorted(methods) if (bad := graph[m] & (methods - {m}))}


def test_no_method_module_imports_another_method_module():
    graph = import_graph()
    assert not method_module_imports(graph), (
        f"method modules importing method modules: {method_module_imports(graph)}; move what they "
        "share into a shared module (SHARED_MACHINERY)"
    )


def test_the_method_import_check_finds_a_planted_import():
    graph = {m: set() for m in method_modules()}
    graph["lens_attrib.methods.deeplift"] = {
        "lens_attrib.methods.integrated_gradients",
        "lens_attrib.methods.baselines",
    }
    assert method_module_imports(graph) == {
        "lens_attrib.methods.deeplift": {"lens_attrib.methods.integrated_gradients"}
    }


def test_the_rule_patches_compose_rules_and_do_not_import_each_other():
    graph = import_graph()
    lrp, deeplift = "lens_attrib.hooks.lrp", "lens_attrib.hooks.deeplift"
    assert lrp not in graph[deeplift] and deeplift not in graph[lrp]
    assert "lens_attrib.hooks.rules" in graph[lrp] & graph[deeplift]


def _top_level_imports(path: Path) -> set[str]:
    """The top-level package of every import in ``path`` (also inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_the_library_never_imports_the_scripts_above_it():
    """Imports go downwards: experiments and benchmarks use the library, never the reverse
    (provenance, tasks and metrics live in ``lens_attrib.evaluation``)."""
    upward = {"experiments", "benchmarks", "tests", "notebooks"}
    offenders = {
        str(path.relative_to(ROOT)): sorted(_top_level_imports(path) & upward)
        for path in _modules().values()
        if _top_level_imports(path) & upward
    }
    assert not offenders, f"library modules importing scripts: {offenders}"
    evaluation = [p for p in _modules().values() if "evaluation" in p.parts]
    assert len(evaluation) >= 10
    assert all("experiments" not in _top_level_imports(p) for p in evaluation)


def test_experiments_score_through_the_one_metric_door():
    """The experiments compute no metric themselves: no metric function is imported there;
    every number comes from ``lens_attrib.evaluation.metrics.score``."""
    metric_functions = {"plausibility", "degenerate", "aopc", "insertion_deletion",
                        "soft_metrics", "pointing_game", "mrr", "average_precision",
                        "dot_product", "relevance_mass_accuracy", "token_accuracy",
                        "per_token_accuracy"}  # fmt: skip
    for name in ("agreement", "faithfulness", "blimp_alignment", "demo"):
        tree = ast.parse((ROOT / "experiments" / f"{name}.py").read_text())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lens_attrib")
            for alias in node.names
        }
        assert not imported & metric_functions, f"{name} imports {imported & metric_functions}"
        assert "score" in imported, f"{name} does not call lens_attrib.evaluation.metrics.score"


def test_architecture_is_asked_only_in_the_backend():
    pattern = re.compile(r"\bis_encoder\(")
    users = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "lens_attrib").rglob("*.py")
        if pattern.search(path.read_text())
    }
    backends = {"lens_attrib/backend_hooked.py", "lens_attrib/backend_bridge.py"}
    assert users == {"lens_attrib/backend.py"} | backends


def test_every_method_is_one_spec_and_the_wrapper_does_the_skeleton():
    forbidden = ("model_guard(", "to_batch(", "Attribution(", "time.perf_counter(")
    for name, spec in METHODS.items():
        source = Path(spec.core.__code__.co_filename).read_text()
        for word in forbidden:
            assert word not in source, f"{name}'s module repeats the wrapper's {word}"
        assert spec.label and spec.summary, name


def test_option_errors_name_the_allowed_values():
    model = tiny_gpt2()
    with pytest.raises(OptionError, match=r"'full', 'partial'"):
        attribute(model, "the dog", method="grad_x_input", embeddings="bogus")
    with pytest.raises(OptionError, match=r"methods that have them: .*attnlrp"):
        attribute(model, "the dog", method="normxlogit", heads=True)
    with pytest.raises(OptionError, match="its options"):
        attribute(model, "the dog", method="gradient", n_steps=3)


def test_the_heads_error_lists_the_methods_the_specs_give_head_relevances():
    model = tiny_gpt2()
    have = {n for n, s in METHODS.items() if s.head_relevances}
    takes = {n for n in have if "heads" in METHODS[n].options}
    assert takes and have - takes  # both kinds exist, so both lists are checked
    for name in sorted(n for n, s in METHODS.items() if "heads" not in s.options):
        if not METHODS[name].decoder:
            continue
        with pytest.raises(OptionError) as info:
            attribute(model, "the dog", method=name, heads=True)
        message = str(info.value)
        if name in have:
            assert message.startswith(f"{name} always returns per-head relevances"), message
            continue
        listed = re.search(
            r"have them: \[(.*)\] \(with heads=True\) and \[(.*)\] \(always", message
        )
        assert listed, message
        with_option, always = (set(re.findall(r"'(\w+)'", g)) for g in listed.groups())
        assert with_option == takes and always == have - takes, message
        assert name not in with_option | always


def test_the_layers_plot_error_lists_the_methods_the_specs_mark_per_layer():
    from lens_attrib.attribution import PER_LAYER_METHODS

    assert set(PER_LAYER_METHODS) == {n for n, s in METHODS.items() if s.per_layer}
    attr = attribute(tiny_gpt2(), "the dog", method="gradient")
    with pytest.raises(ValueError, match="per-layer method") as info:
        attr.plot(layers=True)
    assert set(re.findall(r"'(\w+)'", str(info.value).split("per-layer method")[1])) == set(
        PER_LAYER_METHODS
    )


def test_cli_types_check_before_anything_loads():
    import argparse

    assert method_list("attnlrp, lrp") == ["attnlrp", "lrp"]
    with pytest.raises(argparse.ArgumentTypeError, match="choose from"):
        method_list("attnlrp,bogus")
    assert shard("1/4") == (1, 4)
    for bad in ("0-2", "4/4", "x/2"):
        with pytest.raises(argparse.ArgumentTypeError, match="i/n"):
            shard(bad)


def test_the_architecture_page_lists_every_module():
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    listed = set(re.findall(r"`((?:lens_attrib|hooks)/[\w/]+\.py)`", page))
    on_disk = {
        str(path.relative_to(ROOT))
        for folder in PACKAGE_DIRS.values()
        for path in folder.rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert not on_disk - listed, f"modules missing from docs/ARCHITECTURE.md: {on_disk - listed}"
    assert not listed - on_disk, (
        f"docs/ARCHITECTURE.md lists modules that do not exist: {listed - on_disk}"
    )


def test_names_moved_out_of_gradient_still_import_with_a_warning():
    import importlib

    gradient = importlib.import_module("lens_attrib.methods.gradient")
    for name, where in gradient.MOVED.items():
        home = importlib.import_module(f"lens_attrib.methods.{where}")
        with pytest.warns(DeprecationWarning, match=f"moved to lens_attrib.methods.{where}"):
            assert getattr(gradient, name) is getattr(home, name)
    with pytest.raises(AttributeError, match="no attribute 'bogus'"):
        gradient.bogus  # noqa: B018
