"""One Q -> DQ chain per consumer: after the split ONNX Runtime picks its integer kernel for
every quantized MatMul, and the outputs do not change."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from passes.fusion.qdq import duplicate_shared_dequantize


def shared_chain_model() -> onnx.ModelProto:
    """x -> Q -> DQ -> three MatMuls with int8 per-channel weights (one shared activation chain)."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero"], ["xdq"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(0.05, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(0, np.int8), "x_zero"),
    ]
    outputs = []
    for name in ("q", "k", "v"):
        # 7-bit weights: on a CPU without VNNI (AVX2 only: AMD EPYC Zen 2/3) MLAS's u8s8 kernel
        # sums pairs of products in int16 (vpmaddubsw), which saturates past 255 * 64 * 2; the
        # test compares the two graphs, not that kernel's overflow (seen 2026-12-06: 0.74 apart).
        weight = rng.integers(-63, 64, size=(16, 8), dtype=np.int8)
        inits += [
            numpy_helper.from_array(weight, f"{name}_w"),
            numpy_helper.from_array(np.full(8, 0.01, np.float32), f"{name}_s"),
            numpy_helper.from_array(np.zeros(8, np.int8), f"{name}_z"),
        ]
        nodes += [
            helper.make_node(
                "DequantizeLinear", [f"{name}_w", f"{name}_s", f"{name}_z"], [f"{name}_wdq"], axis=1
            ),
            helper.make_node("MatMul", ["xdq", f"{name}_wdq"], [name]),
        ]
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 8]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])], outputs, inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def optimized_ops(path: Path, tmp_path: Path) -> Counter[str]:
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / f"opt-{path.stem}.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)


def run(path: Path, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def test_each_matmul_gets_its_own_chain_and_the_integer_kernel(tmp_path: Path) -> None:
    shared = tmp_path / "shared.onnx"
    onnx.save(shared_chain_model(), shared)
    model = ir.load(shared)
    assert duplicate_shared_dequantize(model.graph) == 4  # 2 DQ copies, then 2 Q copies
    split = tmp_path / "split.onnx"
    ir.save(model, split)
    nodes = onnx.load(split).graph.node
    activation_dq = [n for n in nodes if n.op_type == "DequantizeLinear" and not n.input[0].endswith("_w")]
    assert len(activation_dq) == 3 and len({n.input[0] for n in activation_dq}) == 3
    assert len({n.input[1] for n in nodes if n.op_type == "QuantizeLinear"}) == 3  # own scales
    assert optimized_ops(shared, tmp_path)["MatMulIntegerToFloat"] < 3
    assert optimized_ops(split, tmp_path)["MatMulIntegerToFloat"] == 3
    x = np.random.default_rng(1).normal(size=(2, 16)).astype(np.float32)
    for before, after in zip(run(shared, x), run(split, x), strict=True):
        np.testing.assert_allclose(before, after, rtol=1e-5, atol=1e-5)
