"""INT8 in the graph: explicit QuantizeLinear/DequantizeLinear on the linear layers (graph stage),
and the ``quant=int8`` recipe (SmoothQuant in torch, ``passes/smoothquant.py``, then this pass).

Numerics (SmoothQuant W8A8, Xiao et al. 2022, arXiv:2211.10438; its static per-tensor activation
scheme, with per-channel weights):

- weights: symmetric INT8 per output channel, ``scale_j = max_i |W_ij| / 127``,
  ``q = clip(round(W / scale), -127, 127)`` (round half to even, as ONNX QuantizeLinear);
- activations of W8A8 layers: symmetric INT8 per tensor, static, ``scale = max|X| / 127`` from the
  calibrated ranges the SmoothQuant pass wrote to ``extras/int8/activations.json`` (zero point 0;
  values beyond the calibrated range saturate);
- ``weight_only`` layers (default ``*.mlp.down_proj`` and ``lm_head``): the same INT8 weights,
  fp32 activations.

Graph form (per-axis DequantizeLinear needs opset >= 13; our export uses 21)::

    X -> QuantizeLinear(s_x, 0: int8) -> DequantizeLinear -> MatMul -> Y       (W8A8)
    W_q int8 [in, out] -> DequantizeLinear(s_w [out], 0, axis=1) ---^          (both kinds)

Lowering for ``target=ort-cpu`` (checked with ``optimized_model_filepath``; ``ensures`` repeats
the check on every build and records the kernel counts): ONNX Runtime 1.32's QDQ transformer turns
each W8A8 group into ``QuantizeLinear`` + ``com.microsoft.MatMulIntegerToFloat`` (int8 x int8 ->
int32 -> float, weights pre-packed, MLAS VNNI kernels) and each weight-only DQ + MatMul into
``com.microsoft.MatMulNBits`` (bits=8; on CPU it quantizes the fp32 input to int8 per block of 32,
ORT's default accuracy level 4). We emit standard Q/DQ only, so the same graph is TensorRT's
strongly typed INT8 input. Two details decide whether the fusion fires or runs fast (measured):

- one Q -> DQ pair per MatMul, each with its own scale and zero-point initializers: where q/k/v
  (gate/up) share one Q, or their Qs share initializers (ORT's CSE then merges them), ORT leaves
  the DQ + MatMul unfused (fp32 simulation);
- signed int8 activations: uint8 with zero point 128 (same values) ran ~4x slower at batch 1 here.

Why ``weight_only`` defaults to down_proj and lm_head (SmolLM2-135M, perplexity / KL / top-1 vs
fp32 on the GPL-3 held-out text, fp32 perplexity 24.92): with every layer W8A8 the best alpha (0.8)
gives 27.01 / 0.098 / 80.9% (naive static W8A8 without smoothing: 68.16 / 1.13 / 47.3%). A torch
fake-quant sensitivity scan put nearly all of the loss in the activations of down_proj and
lm_head: keeping q/k/v, o or gate/up activations in fp32 changed KL by < 1%, keeping down_proj and
lm_head activations in fp32 cut it 8x. down_proj's input (``silu(gate) * up``) has per-token
outliers (after smoothing, max|X| is 4-8x its 99.99th percentile), which per-channel smoothing
cannot move and a per-tensor static scale must cover; lm_head is tied to the embedding, so it
cannot be smoothed in torch. Weight-only INT8 on those two costs no decode speed (both kernels
read one byte per weight) and gives 25.30 / 0.012 / 93.2% (alpha 0.8). ``quant.weight_only=[]``
selects pure W8A8.

The graph is read and written through ``pipeline/core/graph_io.py`` (onnx-ir, weights memory-mapped: an
fp32 weight is read only while its INT8 codes are made); every other file of the input folder
(tokenizer, ``extras/``) is hard-linked; the artifact metadata gains ``quantization``. ``ensures``
compares the graph with its input by prefill and decode steps (``graph_io.compare_graphs``).
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from passes.formats.int8 import activation_scale, weight_params
from passes.selection import check_patterns, matches, select_modules
from passes.smoothquant import (
    read_activations,
)
from pipeline.core.artifacts import Artifact, Kind, write_metadata
from pipeline.core.base import Pass
from pipeline.core.errors import CalibrationError, PassError
from pipeline.core.graph_io import (
    MODEL_FILE,
    check_data_files,
    link_folder_files,
    load_graph,
    new_initializer,
    save_graph,
)
from pipeline.core.planned_model import PlannedModel
from pipeline.runtime.ort import int8_kernels_saturate
from pipeline.runtime.parity import PARITY_PROMPT_TEXT, compare_graphs

log = logging.getLogger(__name__)

W8A8_KERNELS = ("MatMulIntegerToFloat", "QLinearMatMul")  # com.microsoft / ONNX integer MatMuls
WEIGHT_ONLY_KERNEL = "MatMulNBits"  # com.microsoft, bits=8


# Linear layers whose activations stay fp32 by default (INT8 weights only); see the module docstring.
DEFAULT_WEIGHT_ONLY = ["*.mlp.down_proj", "lm_head"]


@dataclass
class Int8QDQConfig:
    """Q/DQ insertion for W8A8 (graph stage)."""

    _target_: str = "passes.int8.Int8QDQPass"
    exclude: list[str] = field(default_factory=list)
    weight_only: list[str] = field(default_factory=lambda: list(DEFAULT_WEIGHT_ONLY))
    # ensures: ONNX Runtime must lower every quantized MatMul to an integer kernel.
    check_lowering: bool = True


# --------------------------------------------------------------------------------------------
# The graph rewrite


def insert_qdq(
    model: Any,
    linear_weights: dict[str, str],
    ranges: dict[str, float],
    modules: list[str],
    weight_only: frozenset[str] = frozenset(),
) -> int:
    """Rewrite ``model`` (an ``onnx_ir.Model``, weights left on disk: ``pipeline.core.graph_io``) in
    place: a weight DequantizeLinear on the MatMul of each module in ``modules`` and, unless the
    module is in ``weight_only``, a QuantizeLinear/DequantizeLinear pair on its activation input.
    Each fp32 weight is read (memory-mapped) only while its INT8 codes are made. Returns the
    number of bytes of fp32 weights replaced."""
    import onnx_ir as ir

    graph = model.graph
    initializers = graph.initializers
    plan: dict[int, tuple[str, str]] = {}  # id(MatMul node) -> (module, weight initializer)
    for module in modules:
        weight = linear_weights[module]
        value = initializers.get(weight)
        users = list(value.uses()) if value is not None else []
        if value is None or len(users) != 1 or users[0].node.op_type != "MatMul":
            raise PassError(f"int8: {module}'s weight {weight} is not the initializer of exactly one MatMul")
        if module not in weight_only:
            if module not in ranges:
                raise PassError(
                    f"int8: no calibrated activation range for {module} in extras/int8/activations.json"
                )
            if not (math.isfinite(ranges[module]) and ranges[module] >= 0):
                raise CalibrationError(
                    f"quant.calibration: the activation range of {module} is {ranges[module]}; recalibrate"
                )
        plan[id(users[0].node)] = (module, weight)

    replaced = 0
    for node in list(graph):
        if id(node) not in plan:
            continue
        module, weight = plan[id(node)]
        fp32 = np.asarray(initializers[weight].const_value.numpy(), dtype=np.float32)
        if not np.isfinite(fp32).all():
            raise PassError(
                f"int8: {module}'s weight holds NaN/inf; exclude it (quant.exclude) or fix the model"
            )
        codes, w_scale = weight_params(fp32)
        del fp32
        replaced += codes.size * 4
        old = initializers.pop(weight)
        old.const_value = None  # drops the memory map of the fp32 weight
        w_inputs = [
            new_initializer(graph, f"{weight}_quantized", codes),
            new_initializer(graph, f"{weight}_scale", w_scale),
            new_initializer(graph, f"{weight}_zero_point", np.zeros_like(w_scale, dtype=np.int8)),
        ]
        new_nodes = [
            ir.node(
                "DequantizeLinear",
                w_inputs,
                attributes={"axis": 1},
                name=f"{module}/weight/DequantizeLinear",
                outputs=[ir.Value(name=f"{weight}_dequantized")],
            )
        ]
        node.replace_input_with(1, new_nodes[0].outputs[0])
        if module not in weight_only:
            # A dedicated QuantizeLinear -> DequantizeLinear pair per MatMul, with its own scale
            # and zero-point initializers, even where q/k/v (gate/up) read one tensor: ORT 1.32
            # fuses DQ+DQ+MatMul into MatMulIntegerToFloat only when the activation Q feeds a
            # single DQ (measured: a shared Q, or Qs sharing scale initializers, which ORT's CSE
            # merges, stay unfused fp32 MatMuls).
            base = f"{module}.input"
            scale = new_initializer(
                graph, f"{base}_scale", np.array(activation_scale(ranges[module]), np.float32)
            )
            zero = new_initializer(graph, f"{base}_zero_point", np.array(0, np.int8))
            quantize = ir.node(
                "QuantizeLinear",
                [node.inputs[0], scale, zero],
                name=f"{module}/input/QuantizeLinear",
                outputs=[ir.Value(name=f"{base}_quantized")],
            )
            dequantize = ir.node(
                "DequantizeLinear",
                [quantize.outputs[0], scale, zero],
                name=f"{module}/input/DequantizeLinear",
                outputs=[ir.Value(name=f"{module}.input_dequantized")],
            )
            node.replace_input_with(0, dequantize.outputs[0])
            new_nodes += [quantize, dequantize]
        graph.insert_before(node, new_nodes)
    return replaced


def lowered_kernels(model_path: Path) -> Counter[str]:
    """Op counts of the graph ONNX Runtime actually runs (optimization level "all", CPU)."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", "optimized.onnx.data"
        )
        options.log_severity_level = 3
        ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(str(Path(tmp) / "optimized.onnx"), load_external_data=False)
    return Counter(node.op_type for node in optimized.graph.node)


class Int8QDQPass(Pass):
    """Graph -> graph: per-channel INT8 weights and static per-tensor INT8 activations as Q/DQ."""

    Config = Int8QDQConfig
    name = "int8_qdq"
    drift = "bits8"
    version = 2  # 2: onnx-ir with lazy weights; unchanged data files linked, new ones sharded
    memory_profile = "graph"  # weights memory-mapped; one fp32 weight read at a time
    consumes = Kind.GRAPH
    produces = Kind.GRAPH

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        check_patterns(facts.linears, self.config.weight_only, "quant.weight_only")
        check_patterns(facts.linears, self.config.exclude)
        return facts

    def requires(self, source: Artifact) -> None:
        if "linear_weights" not in source.metadata:
            raise PassError(f"int8: {source.path} records no linear_weights: re-export it")
        if "quantization" in source.metadata:
            raise PassError(f"int8: the graph is already quantized ({source.metadata['quantization']})")
        read_activations(source.path)

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:

        linear_weights: dict[str, str] = source.metadata["linear_weights"]
        names = sorted(linear_weights)
        config = self.config
        check_patterns(names, config.weight_only, "quant.weight_only")
        modules = select_modules(names, config.exclude, source.path)
        weight_only = [n for n in modules if matches(n, config.weight_only)]
        w8a8 = [n for n in modules if n not in weight_only]
        activations = read_activations(source.path)
        model = load_graph(source.path)
        log.info(
            "int8: %d W8A8 and %d weight-only INT8 layers, %d fp32",
            len(w8a8),
            len(weight_only),
            len(names) - len(modules),
        )
        replaced = insert_qdq(model, linear_weights, activations["absmax"], modules, frozenset(weight_only))
        saved = save_graph(model, out_dir, source_dirs=[source.path])
        link_folder_files(source.path, out_dir)  # tokenizer, config, extras/
        quantization = {
            "recipe": "int8",
            "algorithm": "smoothquant" if activations.get("smooth", True) else "static",
            "alpha": activations.get("alpha"),
            "weights": "int8 symmetric per output channel (DequantizeLinear axis=1)",
            "activations": "int8 symmetric per tensor, static (absmax / 127); fp32 for weight_only",
            "format": "qdq",
            "w8a8": w8a8,
            "weight_only": weight_only,
            "excluded": [n for n in names if n not in modules],
            "calibration": activations.get("calibration"),
        }
        write_metadata(
            out_dir, Kind.GRAPH, {**source.metadata, "model_file": MODEL_FILE, "quantization": quantization}
        )
        return {
            "w8a8_layers": len(w8a8),
            "weight_only_layers": len(weight_only),
            "fp32_layers": len(names) - len(modules),
            "fp32_weight_bytes_replaced": replaced,
            "disk": saved.as_dict(),
        }

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        check_data_files(result.path, "int8")
        vs_input = compare_graphs(source.path, result.path, PARITY_PROMPT_TEXT)
        if not vs_input["finite"]:
            raise PassError("int8: the quantized graph gives non-finite logits on a short prompt")
        quantization = result.metadata["quantization"]
        w8a8, weight_only = len(quantization["w8a8"]), len(quantization["weight_only"])
        if not self.config.check_lowering or w8a8 + weight_only == 0:
            return {"vs_input": vs_input}
        kernels = lowered_kernels(result.path / MODEL_FILE)
        found = {k: kernels[k] for k in (*W8A8_KERNELS, WEIGHT_ONLY_KERNEL) if kernels[k]}
        integer = sum(kernels[k] for k in W8A8_KERNELS)
        if integer < w8a8 or kernels[WEIGHT_ONLY_KERNEL] < weight_only:
            raise PassError(
                f"int8: ONNX Runtime lowered {integer} of {w8a8} W8A8 MatMuls to integer kernels and "
                f"{kernels[WEIGHT_ONLY_KERNEL]} of {weight_only} weight-only ones to {WEIGHT_ONLY_KERNEL} "
                f"({json.dumps(found)}); the rest would run as slow fp32 simulation "
                "(quant.check_lowering=false keeps it anyway)"
            )
        metrics = {"vs_input": vs_input, "ort_kernels": found, "dequantize_left": kernels["DequantizeLinear"]}
        if integer and int8_kernels_saturate():
            log.warning(
                "int8: this CPU has no VNNI, so ONNX Runtime's int8 kernels saturate on it: the "
                "engine is less accurate here (and judged so by the gate) than on a CPU with VNNI"
            )
            metrics["host_int8_saturates"] = True
        return metrics


__all__ = ["Int8QDQConfig", "Int8QDQPass"]
