"""What the kernel (``pipeline/core``) may and may not know, beyond what ``lint-imports`` checks.

import-linter leaves annotations-only imports (``if TYPE_CHECKING:``) out of its graph, so two
kernel modules that name each other's types there would close a cycle no contract sees: the
check below builds the graph with them (grimp, import-linter's own graph library).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import itertools
import pkgutil
from pathlib import Path

import grimp
import pytest

from pipeline.core.base import Pass, Recipe

PACKAGES = ("pipeline", "passes", "calibration", "evals")


def cycles_among_siblings(graph: grimp.ImportGraph, package: str) -> list[tuple[str, str]]:
    """Pairs of children of ``package`` that import each other, directly or through others."""
    children = sorted(graph.find_children(package))
    return [
        (a, b)
        for a, b in itertools.combinations(children, 2)
        if graph.chain_exists(a, b, as_packages=True) and graph.chain_exists(b, a, as_packages=True)
    ]


@pytest.mark.parametrize("root", PACKAGES)
def test_no_import_cycle_even_through_annotations_only_imports(root):
    graph = grimp.build_graph(root, exclude_type_checking_imports=False)
    packages = sorted(module for module in graph.modules if graph.find_children(module))
    cycles = {package: cycles_among_siblings(graph, package) for package in packages}
    cycles = {package: pairs for package, pairs in cycles.items() if pairs}
    assert not cycles, f"modules that import each other (annotations-only imports included): {cycles}"


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    """The check above can fail: two modules that import each other under TYPE_CHECKING."""
    package = tmp_path / "cyclic_sample"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, other in (("a", "b"), ("b", "a")):
        (package / f"{name}.py").write_text(
            f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyclic_sample.{other} import X\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyclic_sample", exclude_type_checking_imports=False, cache_dir=None)
    assert cycles_among_siblings(graph, "cyclic_sample") == [("cyclic_sample.a", "cyclic_sample.b")]


# --------------------------------------------------------------------------------------------
# The kernel reads no pass's knob. A pass tells the kernel what it needs through the contract's
# methods (``workload``, ``ranks``, ``estimate_memory``, ``check_model``, ...); a knob read in
# pipeline/core would tie the kernel to one pass's config layout again.

KERNEL = Path(__file__).resolve().parents[2] / "pipeline" / "core"


def pass_knobs() -> tuple[frozenset[str], frozenset[str]]:
    """Every field name of every pass's and recipe's config under passes/, and the dotted paths
    of the nested ones ("calibration.num_processes")."""
    import passes

    for module in pkgutil.walk_packages(passes.__path__, "passes."):
        importlib.import_module(module.name)
    names: set[str] = set()
    paths: set[str] = set()

    def walk(config: type, prefix: str) -> None:
        for field in dataclasses.fields(config):
            names.add(field.name)
            if prefix:
                paths.add(prefix + field.name)
            nested = field.default_factory if field.default_factory is not dataclasses.MISSING else None
            value = nested() if nested is not None else None
            if dataclasses.is_dataclass(value):
                walk(type(value), f"{prefix}{field.name}.")

    def subclasses(cls: type) -> list[type]:
        return [cls, *(sub for child in cls.__subclasses__() for sub in subclasses(child))]

    for cls in subclasses(Pass) + subclasses(Recipe):
        config = getattr(cls, "Config", None)
        if cls.__module__.startswith("passes.") and dataclasses.is_dataclass(config):
            walk(config, "")
    names.discard("_target_")
    return frozenset(names), frozenset(paths)


def knob_reads(source: str, names: frozenset[str], paths: frozenset[str]) -> list[str]:
    """Where ``source`` reads a pass's knob: ``getattr(x, "knob")``, ``x.config.knob``, or a
    string naming a nested knob (``"calibration.num_processes"``, ``f"{group}.micro_batch_size"``)."""
    found = []
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in names
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            if node.value.attr == "config" and node.attr in names:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
            named = [path for path in paths if path in text]
            named += [name for name in names if text.startswith(f".{name}")]
            if named:
                found.append(f"line {node.lineno}: {text!r} names {sorted(named)[0]}")
    return found


@pytest.fixture(scope="module")
def knobs() -> tuple[frozenset[str], frozenset[str]]:
    return pass_knobs()


@pytest.mark.parametrize("module", sorted(KERNEL.rglob("*.py")), ids=lambda path: path.name)
def test_the_kernel_reads_no_knob_of_a_pass(module: Path, knobs) -> None:
    reads = knob_reads(module.read_text(), *knobs)
    assert not reads, f"pipeline/core/{module.name} reads a pass's knob: " + "; ".join(reads)


def test_the_knob_check_sees_each_form_it_forbids(knobs) -> None:
    names, paths = knobs
    assert {"micro_batch_size", "num_processes", "calibration"} <= names
    assert "calibration.num_processes" in paths
    source = (
        'getattr(step.config, "calibration", None)\n'
        "step.config.micro_batch_size\n"
        'knob = "calibration.num_processes"\n'
        'hint = f"{group}.micro_batch_size"\n'
        'fine = getattr(exc, "__notes__", [])\n'
    )
    assert [read.split(":")[0] for read in knob_reads(source, names, paths)] == [
        "line 1",
        "line 2",
        "line 3",
        "line 4",
    ]
