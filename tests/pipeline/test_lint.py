"""The TensorRT-compatibility lint on graphs of every quant recipe of the tiny Llama (built here
through the real passes), and on copies broken on purpose: a contrib op, a scale computed at
run time, INT4 blocks along the wrong axis or of a size TensorRT lacks, a non-zero zero point."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from pipeline.core.artifacts import Artifact
from pipeline.core.cache import Cache
from pipeline.core.lint import Finding, LintError, lint, support_table, table_disagreements
from pipeline.core.manager import PassManager
from pipeline.core.plugins import build_passes
from tests.pipeline.recipe import compose_recipe

CALIBRATION = ["quant.calibration.num_samples=4"]
INT4_QDQ = [
    "quant=int4_awq",
    "quant.lowering=qdq",
    "quant.group_size=64",
    "quant.symmetric=true",
    *CALIBRATION,
]
RECIPES = {
    "fp32": [],
    "int8": ["quant=int8", *CALIBRATION],
    "fp8": ["quant=fp8", *CALIBRATION],
    "int4-qdq": INT4_QDQ,
    "int4-matmulnbits": ["quant=int4_awq", *CALIBRATION],
    "int4-qdq-group32": ["quant=int4_awq", "quant.lowering=qdq", "quant.symmetric=true", *CALIBRATION],
    "fusion-ort": ["fusion=ort"],
    "fusion-tensorrt": ["fusion=tensorrt"],
    "int8-fusion-tensorrt": ["quant=int8", "fusion=tensorrt", *CALIBRATION],
}


@pytest.fixture(scope="module")
def graphs(tiny_source: Artifact, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache = Cache(tmp_path_factory.mktemp("lint-cache"))
    return {
        name: PassManager(build_passes(compose_recipe(overrides)), cache).run(tiny_source)[0].path
        for name, overrides in RECIPES.items()
    }


def _rules(findings: list[Finding]) -> set[tuple[str, str]]:
    return {(f.rule, f.op) for f in findings if f.severity == "error"}


@pytest.mark.parametrize(
    "recipe", ["fp32", "int8", "fp8", "int4-qdq", "fusion-tensorrt", "int8-fusion-tensorrt"]
)
def test_graphs_for_tensorrt_pass(graphs: dict[str, Path], recipe: str) -> None:
    assert lint(graphs[recipe]) == []


def test_ort_contrib_ops_are_named_node_by_node(graphs: dict[str, Path]) -> None:
    findings = lint(graphs["int4-matmulnbits"])
    assert _rules(findings) == {("contrib-op", "com.microsoft.MatMulNBits")}
    assert len(findings) == 15  # 7 linear layers x 2 decoder layers + lm_head
    assert any("q_proj" in f.node for f in findings)
    fused = _rules(lint(graphs["fusion-ort"]))
    assert ("contrib-op", "com.microsoft.GroupQueryAttention") in fused
    assert ("unsupported-op", "SimplifiedLayerNormalization") in fused  # ORT registers it in the ONNX domain


def test_int4_blocks_of_32_are_refused(graphs: dict[str, Path]) -> None:
    findings = lint(graphs["int4-qdq-group32"])
    assert findings and all(f.rule == "qdq-int4" and "block_size=32" in f.message for f in findings)


def _edited(folder: Path, out: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    """A copy of the graph folder with ``edit(model)`` applied (onnx-ir)."""
    import onnx_ir as ir

    from pipeline.core.graph_io import load_graph

    out.mkdir()
    for path in folder.iterdir():
        if not path.name.startswith("model.onnx"):
            shutil.copy(path, out / path.name)
    model = load_graph(folder)  # the folder's data may be hard-linked (tiny_engine links tiny_graph)
    edit(model)
    ir.save(model, out / "model.onnx", external_data="model.onnx.data")
    return out


def _first(model, op: str, int4: bool = False):  # type: ignore[no-untyped-def]
    import onnx_ir as ir

    for node in model.graph.all_nodes():
        if node.op_type == op and (not int4 or node.inputs[0].dtype == ir.DataType.INT4):
            return node
    raise AssertionError(f"no {op}")


def test_a_scale_computed_at_run_time_is_named(graphs: dict[str, Path], tmp_path: Path) -> None:
    import onnx_ir as ir

    def edit(model) -> None:  # type: ignore[no-untyped-def]
        node = _first(model, "QuantizeLinear")
        scale = ir.node("Abs", inputs=[node.inputs[1]], name="computed_scale")
        model.graph.insert_before(node, scale)
        node.replace_input_with(1, scale.outputs[0])
        scale.outputs[0].dtype = ir.DataType.FLOAT

    findings = lint(_edited(graphs["int8"], tmp_path / "g", edit))
    assert [(f.rule, f.op) for f in findings] == [("qdq-scale", "QuantizeLinear")]
    assert "build-time constant" in findings[0].message and findings[0].node


def test_int4_blocks_along_the_output_axis_are_refused(graphs: dict[str, Path], tmp_path: Path) -> None:
    def edit(model) -> None:  # type: ignore[no-untyped-def]
        node = _first(model, "DequantizeLinear", int4=True)
        node.attributes["axis"] = __import__("onnx_ir").AttrInt64("axis", 1)

    findings = lint(_edited(graphs["int4-qdq"], tmp_path / "g", edit))
    assert len(findings) == 1 and findings[0].rule == "qdq-int4"
    assert "expected" in findings[0].message and findings[0].op == "DequantizeLinear" and findings[0].node


def test_a_non_zero_zero_point_is_refused(graphs: dict[str, Path], tmp_path: Path) -> None:
    import onnx_ir as ir

    def edit(model) -> None:  # type: ignore[no-untyped-def]
        node = _first(model, "QuantizeLinear")
        zero = (
            np.ones(node.inputs[2].const_value.numpy().shape, dtype=np.int8) if len(node.inputs) > 2 else None
        )
        if zero is None:
            zero = np.ones((), dtype=np.int8)
        value = ir.Value(name="nonzero_zero_point", const_value=ir.tensor(zero))
        model.graph.register_initializer(value)
        node.resize_inputs(3)
        node.replace_input_with(2, value)

    findings = lint(_edited(graphs["int8"], tmp_path / "g", edit))
    assert ("qdq-zero-point", "QuantizeLinear") in _rules(findings)


def test_the_command_line(graphs: dict[str, Path], tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pipeline.lint", *args], capture_output=True, text=True)

    clean = run(str(graphs["int8"]))
    assert clean.returncode == 0 and "0 error(s)" in clean.stdout
    dirty = run(str(graphs["int4-matmulnbits"]))
    assert dirty.returncode == 1 and dirty.stdout.count("error contrib-op") == 15
    missing = run(str(tmp_path / "nowhere"))
    assert (
        missing.returncode == 2
        and missing.stderr.startswith("error: ")
        and len(missing.stderr.splitlines()) == 1
    )
    with pytest.raises(LintError, match="holds no ONNX graph"):
        lint(tmp_path)


def test_the_support_table_is_compared_with_a_parser() -> None:
    """On a GPU machine the build pass hands TensorRT's ``OnnxParser.supports_operator`` to
    table_disagreements; here a parser is described by the ops it imports. Agreement gives two
    empty lists; an op the table marks supported but the parser lacks, and ops the parser imports
    that the table marks unsupported or does not list, are named."""
    rows = support_table()["ops"]
    supported = {op for op, row in rows.items() if row["supported"]}
    assert table_disagreements(supported.__contains__) == {"table_only": [], "parser_only": []}
    unsupported = sorted(op for op, row in rows.items() if not row["supported"])[0]
    standard = {schema.name for schema in onnx.defs.get_all_schemas_with_history() if schema.domain == ""}
    unlisted = sorted(standard - set(rows))[0]  # ONNX has ops newer than the 10.15 table (Swish, ...)
    parser = (supported - {"MatMul"}) | {unsupported, unlisted, "NotAnOnnxOp"}
    found = table_disagreements(parser.__contains__)
    assert found == {"table_only": ["MatMul"], "parser_only": sorted([unsupported, unlisted])}
