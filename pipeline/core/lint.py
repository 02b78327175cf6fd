"""TensorRT-compatibility lint of an ONNX graph, on CPU, without TensorRT.

TensorRT 11 builds strongly typed networks only: the precision of every layer comes from the
graph (explicit QuantizeLinear/DequantizeLinear, typed tensors), and its ONNX parser takes ONNX
standard ops only. This lint reads a graph (or the graph of an engine folder) with onnx-ir and
reports, node by node:

- ``contrib-op``: an op outside the ONNX standard domain (ONNX Runtime's ``com.microsoft``
  kernels such as MatMulNBits or GroupQueryAttention): the parser has no importer for it;
- ``unsupported-op``: a standard op the parser's support matrix marks unsupported or lacks;
- ``opset``: a default-domain opset outside the range the parser imports;
- ``dtype``: a tensor of a data type TensorRT does not have;
- ``qdq-*``: Q/DQ placement against TensorRT's explicit-quantization rules: scales (and zero
  points) constant; zero points zero (symmetric quantization only); FP8 only as E4M3; per-tensor
  scales on activations, per-tensor or per-channel on weights; INT4 only as a block-quantized
  2-D weight initializer dequantized along its input axis.

The support matrix is data (``pipeline/core/data/onnx_tensorrt_ops.json``): onnx-tensorrt's
``docs/operators.md`` table for TensorRT 10.15, parsed row by row, with its commit. TensorRT 11's
table is not published where we could read it, so an op that 11 added is reported as
``unsupported-op`` until the file is updated. Where TensorRT itself runs (a GPU machine), the
build pass compares the table with the parser's own ``OnnxParser.supports_operator``
(:func:`table_disagreements`) and records every disagreement in the engine's ``tensorrt`` record:
that list is what to update the file from.

Run as ``python -m pipeline.lint <graph or engine folder | model.onnx>``: one line per finding,
exit status 1 when there is any.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.artifacts import read_metadata
from pipeline.core.engine import ENGINE_FILE, read_engine_spec
from pipeline.core.errors import EngineError, PipelineError, first_line
from pipeline.core.files import UnsafeFileError, confined

SUPPORT_TABLE = Path(__file__).resolve().parent / "data" / "onnx_tensorrt_ops.json"
STANDARD_DOMAINS = ("", "ai.onnx")
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
QUANTIZED_TYPES = ("INT8", "INT4", "FLOAT8E4M3FN")  # the ones our recipes emit; FP4 is not among them
FLOAT_TYPE_IDS = (1, 10, 16)  # FLOAT, FLOAT16, BFLOAT16
INT4_BLOCK_SIZES = (64, 128)  # TensorRT guide, "Quantized Types": "supported block sizes are {64, 128}"


class LintError(PipelineError):
    """The graph cannot be read: not a lint finding but a bad input."""


@dataclass(frozen=True)
class Finding:
    rule: str
    node: str
    op: str
    message: str
    severity: str = "error"  # "warning": a convention, not a parser error

    def __str__(self) -> str:
        return f"{self.severity} {self.rule}: {self.op} '{self.node}': {self.message}"


@cache
def support_table() -> dict[str, Any]:
    return json.loads(SUPPORT_TABLE.read_text())


def table_disagreements(supports_operator: Callable[[str], bool]) -> dict[str, list[str]]:
    """Where the support table and a TensorRT parser disagree. ``supports_operator``: the
    parser's ``OnnxParser.supports_operator``. ``table_only``: ops the table marks supported that
    the parser has no importer for; ``parser_only``: ONNX standard ops the parser imports that
    the table marks unsupported or does not list (for TensorRT 11, what it added since 10.15)."""
    import onnx

    rows = support_table()["ops"]
    schemas = onnx.defs.get_all_schemas_with_history()
    standard = {schema.name for schema in schemas if schema.domain in STANDARD_DOMAINS}
    table_only = sorted(op for op, row in rows.items() if row["supported"] and not supports_operator(op))
    parser_only = sorted(
        op for op in standard | set(rows) if not rows.get(op, {}).get("supported") and supports_operator(op)
    )
    return {"table_only": table_only, "parser_only": parser_only}


def model_file(path: Path) -> Path:
    """The ONNX file of a graph or engine folder (or the file itself)."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise LintError(f"{path} does not exist: give a graph or engine folder, or a .onnx file")
    if os.path.lexists(path / ENGINE_FILE):  # typed, and its graph confined to the folder
        try:
            return read_engine_spec(path, graphs=False).model_path
        except EngineError as exc:
            raise LintError(str(exc)) from None
    name = read_metadata(path).get("model_file")
    if isinstance(name, str) and name:
        try:
            named = confined(path / name, path)
        except UnsafeFileError as exc:
            raise LintError(str(exc)) from None
        if named.is_file():
            return named
    if (path / "model.onnx").is_file():
        return path / "model.onnx"
    raise LintError(f"{path} holds no ONNX graph (no model.onnx): give a graph or engine folder")


def lint(path: Path) -> list[Finding]:
    """Every TensorRT-compatibility finding of the graph at ``path``."""
    from pipeline.core.graph_io import load_graph

    file = model_file(path)
    try:
        model = load_graph(file.parent, file.name)  # hard-linked data files (cache, engine) allowed
    except Exception as exc:  # onnx raises DecodeError, ValidationError, OSError ...
        raise LintError(f"cannot read {file} as ONNX ({first_line(exc)})") from None
    table = support_table()
    findings = list(_opset(model, table))
    for node in model.graph.all_nodes():
        findings.extend(_op(node, table))
        if node.domain not in STANDARD_DOMAINS:
            continue
        if node.op_type in QDQ_OPS:
            findings.extend(_qdq(node))
        elif node.op_type == "Attention":
            findings.extend(_attention(node))
    findings.extend(_dtypes(model, table))
    findings.extend(_quantized_flow(model))
    return findings


def _opset(model: Any, table: dict[str, Any]) -> Iterator[Finding]:
    version = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
    low, high = table["opset_min"], table["opset_max"]
    if not low <= version <= high:
        yield Finding(
            "opset",
            "<model>",
            "-",
            f"default-domain opset {version} is outside {low}..{high}, the range "
            f"TensorRT {table['tensorrt_version']}'s ONNX parser imports",
        )


def _op(node: Any, table: dict[str, Any]) -> Iterator[Finding]:
    name = node.name or "<unnamed>"
    if node.domain not in STANDARD_DOMAINS:
        yield Finding(
            "contrib-op",
            name,
            f"{node.domain}.{node.op_type}",
            "not an ONNX standard op; TensorRT's parser has no importer for it (for target=tensorrt "
            "use fusion=tensorrt and quant.lowering=qdq)",
        )
        return
    row = table["ops"].get(node.op_type)
    if row is None or not row["supported"]:
        status = "marks it unsupported" if row else "does not list it"
        yield Finding("unsupported-op", name, node.op_type, f"the parser's support matrix {status}")


def _dtypes(model: Any, table: dict[str, Any]) -> Iterator[Finding]:
    allowed, names = set(table["data_types"]), table["onnx_type_names"]
    seen: set[str] = set()
    values = [*model.graph.inputs, *model.graph.outputs, *model.graph.initializers.values()]
    values += [out for node in model.graph.all_nodes() for out in node.outputs]
    for value in values:
        dtype = value.dtype
        if dtype is None or value.name in seen:
            continue
        seen.add(value.name)
        if names.get(_type_name(dtype)) not in allowed:
            producer = value.producer()
            yield Finding(
                "dtype",
                producer.name if producer is not None else value.name,
                producer.op_type if producer is not None else "tensor",
                f"tensor '{value.name}' is {_type_name(dtype)}, a type TensorRT does not have",
            )


def _type_name(dtype: Any) -> str:
    """The ONNX name of an ir.DataType (FLOAT, FLOAT16, INT8, FLOAT8E4M3FN ...)."""
    return str(dtype.name)


def _is_constant(value: Any) -> bool:
    """An initializer or a Constant node's output (without reading its data)."""
    producer = value.producer()
    return value.const_value is not None or (producer is not None and producer.op_type == "Constant")


def _constant(value: Any) -> np.ndarray | None:
    """The value's data if it is an initializer or a Constant node's output, else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return producer.attributes["value"].as_tensor().numpy()
    return None


def _qdq(node: Any) -> Iterator[Finding]:
    name, op = node.name or "<unnamed>", node.op_type
    inputs = list(node.inputs) + [None] * (3 - len(node.inputs))
    data, scale_value, zero_value = inputs[:3]
    scale = _constant(scale_value)
    if scale is None:
        yield Finding(
            "qdq-scale", name, op, "the scale is computed at run time; TensorRT needs a build-time constant"
        )
        return
    if np.any(scale.astype(np.float32) <= 0):
        yield Finding("qdq-scale", name, op, "a scale <= 0: TensorRT needs positive scales")
    quantized = _quantized_type(node)
    if quantized not in QUANTIZED_TYPES:
        yield Finding(
            "qdq-type",
            name,
            op,
            f"{quantized}: TensorRT quantizes to INT8, INT4 or FP8 E4M3 (FLOAT8E4M3FN) only",
        )
    if zero_value is not None:
        zero = _constant(zero_value)
        if zero is None:
            yield Finding(
                "qdq-zero-point", name, op, "the zero point is computed at run time; it must be constant 0"
            )
        elif np.any(zero.astype(np.float32) != 0):
            yield Finding(
                "qdq-zero-point", name, op, "a non-zero zero point: TensorRT quantizes symmetrically only"
            )
    output_dtype = node.attributes.get("output_dtype")
    if op == "DequantizeLinear" and output_dtype is not None and output_dtype.as_int() not in FLOAT_TYPE_IDS:
        yield Finding("qdq-type", name, op, "output_dtype must be FLOAT, FLOAT16 or BFLOAT16")
    block_size = node.attributes.get("block_size")
    block = block_size.as_int() if block_size is not None else 0
    axis_attr = node.attributes.get("axis")
    axis = axis_attr.as_int() if axis_attr is not None else 1
    is_weight = op == "DequantizeLinear" and _is_constant(data)
    if quantized == "INT4":
        yield from _int4(node, data, scale, block, axis, is_weight)
    elif block:
        yield Finding(
            "qdq-block", name, op, f"block_size={block} on {quantized}: here only INT4 weights are blocked"
        )
    elif scale.size > 1 and not is_weight:
        yield Finding(
            "qdq-axis",
            name,
            op,
            f"a per-channel scale ({scale.size} values) on an activation: TensorRT's convention (and "
            "NVIDIA ModelOpt's) is per-tensor activations",
            severity="warning",
        )
    elif scale.size > 1:
        shape = data.shape
        if scale.ndim != 1 or shape is None or scale.size != shape[axis]:
            yield Finding(
                "qdq-axis",
                name,
                op,
                f"per-channel scale of shape {list(scale.shape)} does not match axis {axis} of the weight "
                f"{list(shape) if shape is not None else '?'}",
            )


def _quantized_type(node: Any) -> str | None:
    """The low-precision type a Q/DQ node converts to or from (None when the graph does not say)."""
    import onnx_ir as ir

    if node.op_type == "DequantizeLinear":
        data = node.inputs[0]
        if data.dtype is not None:
            return _type_name(data.dtype)
        producer = data.producer()
        return _quantized_type(producer) if producer is not None and producer.op_type in QDQ_OPS else None
    if node.outputs[0].dtype is not None:
        return _type_name(node.outputs[0].dtype)
    if len(node.inputs) > 2 and node.inputs[2] is not None and node.inputs[2].dtype is not None:
        return _type_name(node.inputs[2].dtype)
    output_dtype = node.attributes.get("output_dtype")
    return (
        ir.DataType(output_dtype.as_int()).name if output_dtype is not None else "UINT8"
    )  # the spec's default


def _int4(
    node: Any, data: Any, scale: np.ndarray, block: int, axis: int, is_weight: bool
) -> Iterator[Finding]:
    """INT4: weight-only, blocks of 64 or 128 along one of the last two dimensions, even size."""
    name, op = node.name or "<unnamed>", node.op_type
    if not is_weight:
        yield Finding("qdq-int4", name, op, "INT4 on an activation: TensorRT quantizes weights only to INT4")
        return
    shape = list(data.shape) if data.shape is not None else None
    if shape is None or len(shape) != 2:
        yield Finding("qdq-int4", name, op, f"an INT4 weight of shape {shape}: TensorRT blocks 2-D weights")
        return
    if block not in INT4_BLOCK_SIZES:
        yield Finding(
            "qdq-int4",
            name,
            op,
            f"block_size={block}: TensorRT's INT4 blocks are {' or '.join(map(str, INT4_BLOCK_SIZES))} "
            "(quant.group_size)",
        )
    if axis not in (0, 1, -1, -2):
        yield Finding("qdq-int4", name, op, f"blocks along axis {axis}: it must be one of the last two")
    elif block > 0:
        expected = list(shape)
        expected[axis] = -(-shape[axis] // block)
        if list(scale.shape) != expected:
            yield Finding(
                "qdq-int4",
                name,
                op,
                f"scale of shape {list(scale.shape)}, expected {expected} for blocks of {block}",
            )
    if (shape[0] * shape[1]) % 2:
        yield Finding("qdq-int4", name, op, "an odd number of INT4 elements: TensorRT needs an even count")


def _attention(node: Any) -> Iterator[Finding]:
    """ONNX Attention (opset 23): the parser takes no KV-cache inputs or outputs."""
    inputs, outputs = list(node.inputs), list(node.outputs)
    cache_in = [i for i in (4, 5) if i < len(inputs) and inputs[i] is not None]
    cache_out = [i for i in (1, 2) if i < len(outputs) and outputs[i] is not None and outputs[i].uses()]
    if cache_in or cache_out:
        yield Finding(
            "op-restriction",
            node.name or "<unnamed>",
            node.op_type,
            "past_key/past_value inputs and present_key/present_value outputs are unsupported by the "
            f"parser (TensorRT {support_table()['tensorrt_version']}): the KV cache must be updated "
            "outside Attention (TensorScatter)",
        )


def _quantized_flow(model: Any) -> Iterator[Finding]:
    """Quantized tensors (INT8, INT4, FP8) may only flow into DequantizeLinear."""
    for node in model.graph.all_nodes():
        if node.op_type in QDQ_OPS:
            continue
        for value in node.inputs:
            if value is not None and value.dtype is not None and _type_name(value.dtype) in QUANTIZED_TYPES:
                yield Finding(
                    "qdq-flow",
                    node.name or "<unnamed>",
                    node.op_type,
                    f"takes {_type_name(value.dtype)} tensor '{value.name}': TensorRT's quantized types only "
                    "go through DequantizeLinear",
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.lint", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("path", type=Path, help="graph or engine folder, or a .onnx file")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = parser.parse_args(argv)
    try:
        findings = lint(args.path)
    except LintError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = support_table()
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        for finding in findings:
            print(finding)
        errors = sum(f.severity == "error" for f in findings)
        verdict = f"{errors} error(s), {len(findings) - errors} warning(s)"
        print(
            f"{model_file(args.path)}: {verdict} against TensorRT {table['tensorrt_version']}'s ONNX parser"
        )
    return 1 if any(f.severity == "error" for f in findings) else 0
