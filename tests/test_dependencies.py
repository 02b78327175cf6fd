"""Every package the tests import is declared: in the project's dependencies or its ``dev`` extra
(or pulled in by one of them). A fresh virtual environment installs only what pyproject.toml
declares, so an undeclared import there fails collection, and an undeclared ``importorskip`` would
silently skip: this test fails on either, even on a machine where the package was installed by
hand.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"pipeline", "passes", "evals", "calibration", "tests", "benchmarks"}
# Optional peers a test skips without: each belongs to an extra that CI does not install, since
# it needs a GPU (tensorrt) or a 20-minute compile (llama_cpp, the `bench` extra).
OPTIONAL = {"tensorrt", "tensorrt_bindings", "llama_cpp"}


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions() -> set[str]:
    """The project's dependencies and ``dev`` extra, with everything they require, transitively
    (as installed here), canonicalized."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["dev"]
    pending = [_requirement_name(requirement) for requirement in requirements]
    seen: set[str] = set()
    while pending:
        name = _canonical(pending.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for requirement in requires:
            if "extra" in requirement.partition(";")[2]:  # an extra's own: not installed by the name
                continue
            pending.append(_requirement_name(requirement))
    return seen


def imported_top_level_modules(path: Path) -> set[str]:
    """Top-level modules a test file imports, ``pytest.importorskip("x")`` included."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            modules.add(node.args[0].value.split(".")[0])
    return modules


def test_every_package_a_test_imports_is_declared_in_pyproject():
    declared = declared_distributions()
    providers = metadata.packages_distributions()
    undeclared: dict[str, str] = {}
    for path in sorted(ROOT.joinpath("tests").rglob("*.py")):
        for module in imported_top_level_modules(path):
            if module in sys.stdlib_module_names or module in FIRST_PARTY or module in OPTIONAL:
                continue
            distributions = {_canonical(d) for d in providers.get(module, [])}
            if not distributions & declared:
                undeclared.setdefault(module, str(path.relative_to(ROOT)))
    assert not undeclared, (
        "imported by the tests but declared neither in [project] dependencies nor in the dev extra "
        f"of pyproject.toml (a fresh environment lacks them): {undeclared}"
    )


def test_the_check_sees_an_undeclared_package(tmp_path):
    """The check above can fail: a module no declared distribution provides is found."""
    sample = tmp_path / "test_sample.py"
    sample.write_text("import pytest\npytest.importorskip('not_a_declared_module')\nimport numpy\n")
    modules = imported_top_level_modules(sample)
    assert modules == {"pytest", "not_a_declared_module", "numpy"}
    providers = metadata.packages_distributions()
    declared = declared_distributions()
    assert {_canonical(d) for d in providers["numpy"]} & declared
    assert not {_canonical(d) for d in providers.get("not_a_declared_module", [])} & declared
