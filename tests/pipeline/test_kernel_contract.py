"""What the kernel (``pipeline/core``) may and may not know, beyond what ``lint-imports`` checks.

import-linter leaves annotations-only imports (``if TYPE_CHECKING:``) out of its graph, so two
kernel modules that name each other's types there would close a cycle no contract sees: the
check below builds the graph with them (grimp, import-linter's own graph library).
"""

from __future__ import annotations

import itertools

import grimp
import pytest

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
