"""INT4 lowering (graph stage): each quantized ``MatMul(x, <module>.weight_t)`` becomes ONNX
Runtime's ``com.microsoft.MatMulNBits`` (``quant.lowering=matmulnbits``) or a block-wise
``DequantizeLinear`` (UINT4 codes, or INT4 when symmetric; ``axis=0``, ``block_size``; opset >= 21)
feeding the MatMul (``quant.lowering=qdq``, the form TensorRT builds from).

Rules: layers are found through the graph metadata ``linear_weights`` (module -> initializer,
written by export); a layer excluded by ``quant.exclude`` keeps its fp32 MatMul; a layer whose
exact INT4 parameters a torch pass stored in ``extras/int4/`` (GPTQ, AWQ) is lowered from them,
after checking that the graph's weight is their dequantization (so graph == fake-quantized torch);
any other layer is quantized here by round-to-nearest (``passes.int4``), e.g. ``lm_head`` when the
recipe's torch stage did not run. Specs: ONNX Runtime contrib op ``MatMulNBits`` (B ``uint8
[N, k_blocks, block_size/2]``, scales ``[N, k_blocks]``, zero points ``uint8 [N, ceil(k_blocks/2)]``,
low nibble first; checked against ``onnxruntime.quantization``'s packing in the tests); ONNX
``DequantizeLinear``-21 blocked quantization.

The graph is read and written through ``pipeline/core/graph_io.py`` (onnx-ir: each fp32 weight is
memory-mapped and read only while it is lowered; unchanged data files hard-linked).

``ensures``: the lowered graph against its input graph on a fixed prompt and decode steps
(``graph_io.compare_graphs``: max |logit diff|, KL, top-1 agreement); when every layer came from
stored parameters the two compute the same weights and the pass fails below
``min_top1_agreement``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from passes.formats.int4 import (
    BITS,
    INT4_DIR,
    QuantizedLinear,
    check_group_size,
    load_params,
    matmulnbits_tensors,
    qdq_tensors,
    quantize_rtn,
)
from passes.int4 import EXTRAS_DIR, Int4LoweringSettings, Int4Settings, Lowering, validate_settings
from passes.selection import select_modules
from pipeline.core.artifacts import Artifact, Kind, read_metadata, write_metadata
from pipeline.core.base import Pass
from pipeline.core.config import check_number
from pipeline.core.errors import PassError
from pipeline.core.graph_io import (
    DATA_FILE,
    MODEL_FILE,
    check_data_files,
    link_folder_files,
    load_graph,
    save_graph,
)
from pipeline.core.planned_model import PlannedModel
from pipeline.runtime.parity import compare_graphs

log = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
QDQ_MIN_OPSET = 21
PARITY_PROMPT_IDS = (1, 42, 7, 99, 3, 250, 17, 5, 64, 128, 11, 300)


@dataclass
class Int4LoweringConfig(Int4Settings, Int4LoweringSettings):
    _target_: str = "passes.matmulnbits.Int4LoweringPass"
    # Fail when stored-parameter lowering changes the greedy token on more prompt positions.
    min_top1_agreement: float = 0.99

    def validate(self) -> None:
        self.lowering = Lowering(self.lowering)
        validate_settings(self)
        check_number("quant.min_top1_agreement", self.min_top1_agreement, low=0, high=1)


class Int4LoweringPass(Pass):
    Config = Int4LoweringConfig
    name = "int4_lowering"
    drift = "bits4"
    version = 2  # 2: onnx-ir with lazy weights (pipeline.core.graph_io); unchanged data files linked
    memory_profile = "graph"  # weights memory-mapped; one fp32 weight read at a time
    consumes = Kind.GRAPH
    produces = Kind.GRAPH

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        selected = select_modules(facts.linears, self.config.exclude)
        check_group_size(self.config.group_size, {name: facts.linears[name][0] for name in selected})
        opset = facts.opset or 0
        if self.config.lowering == Lowering.qdq and opset < QDQ_MIN_OPSET:
            raise PassError(
                f"quant.lowering=qdq needs block-wise DequantizeLinear (opset >= {QDQ_MIN_OPSET}); "
                f"the graph has opset {opset}: set export.opset={QDQ_MIN_OPSET}"
            )
        return facts

    def requires(self, source: Artifact) -> None:
        if not source.metadata.get("linear_weights"):
            raise PassError(f"{self.name}: {source.path} records no linear_weights; re-run export")

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        metadata = read_metadata(source.path)
        weights: dict[str, str] = metadata["linear_weights"]
        info, stored = load_params(source.path / EXTRAS_DIR / INT4_DIR)
        self._check_stored(info)
        targets = select_modules(weights, self.config.exclude, source.path)
        model = load_graph(source.path, MODEL_FILE)
        graph = model.graph
        initializers = graph.initializers
        widths = {m: int(initializers[weights[m]].const_value.shape[0]) for m in targets}
        check_group_size(self.config.group_size, widths)

        origin: dict[str, str] = {}
        for module in targets:
            init_name = weights[module]
            value = initializers[init_name]
            users = [user for user, index in value.uses() if index == 1]
            node = users[0] if len(users) == 1 else None
            if node is None or node.op_type != "MatMul" or len(node.inputs) != 2:
                raise PassError(f"{self.name}: no MatMul consumes {init_name} ({module}); re-run export")
            weight_t = np.asarray(value.const_value.numpy())  # [in, out], memory-mapped
            layer, origin[module] = self._parameters(module, weight_t, stored)
            del weight_t
            shim = SimpleNamespace(
                input=[node.inputs[0].name, init_name], output=[o.name for o in node.outputs], name=node.name
            )
            nodes, inits = self._lower(module, shim, layer)
            replace_with_protos(graph, node, nodes, inits)
            initializers.pop(init_name).const_value = None  # drops the fp32 weight's memory map
        if self.config.lowering == Lowering.matmulnbits and MS_DOMAIN not in model.opset_imports:
            model.opset_imports[MS_DOMAIN] = 1
        saved = save_graph(model, out_dir, source_dirs=[source.path])
        link_folder_files(source.path, out_dir)
        unplaced = sorted(set(stored) - set(origin) - (set(weights) - set(targets)))
        if unplaced:  # the graph still computes their fake-quantized weights, uncompressed
            log.warning("%s: no graph weight for stored INT4 layers %s; left as fp32", self.name, unplaced)
        counts = {kind: sum(1 for v in origin.values() if v == kind) for kind in sorted(set(origin.values()))}
        quantization = {
            "method": "int4_weight_only",
            "algorithm": info.get("algorithm", "rtn"),
            "bits": BITS,
            "group_size": self.config.group_size,
            "symmetric": self.config.symmetric,
            "lowering": self.config.lowering.value,
            "accuracy_level": self.config.accuracy_level,
            "exclude": list(self.config.exclude),
            "modules": origin,
        }
        write_metadata(out_dir, Kind.GRAPH, {**metadata, "quantization": quantization})
        return {
            "lowered": len(origin),
            "from": counts,
            "lowering": self.config.lowering.value,
            "disk": saved.as_dict(),
        }

    def _check_stored(self, info: dict[str, Any]) -> None:
        if not info:
            return
        for knob in ("group_size", "symmetric"):
            if info.get(knob) != getattr(self.config, knob):
                raise PassError(
                    f"{self.name}: quant.{knob}={getattr(self.config, knob)} but the torch stage stored "
                    f"{knob}={info.get(knob)} in extras/int4; rebuild with one recipe"
                )

    def _parameters(
        self, module: str, weight_t: np.ndarray, stored: dict[str, QuantizedLinear]
    ) -> tuple[QuantizedLinear, str]:
        """The layer's INT4 parameters: stored ones (checked against the graph) or round-to-nearest."""

        weight = transposed(weight_t)
        if module not in stored:
            return quantize_rtn(weight, self.config.group_size, self.config.symmetric), "rtn"
        layer = stored[module]
        same_shape = layer.codes.shape == weight.shape
        diff = float(layer.dequantize().sub_(weight).abs_().max()) if same_shape else np.inf
        if diff > 1e-6 * max(1.0, float(weight.abs().max())):
            raise PassError(
                f"{self.name}: the graph weight of {module} is not the dequantized INT4 weight stored by the "
                f"torch stage (max |diff| {diff:.3g}); a pass changed weights after quantization"
            )
        return layer, "stored"

    def _lower(self, module: str, node: Any, layer: QuantizedLinear) -> tuple[list[Any], list[Any]]:
        """Nodes replacing ``node`` (same output name) and their initializers."""
        from onnx import TensorProto, helper, numpy_helper

        out_features, in_features = layer.codes.shape
        base = f"{module}.weight"
        if self.config.lowering == Lowering.matmulnbits:
            packed, scales, zeros = matmulnbits_tensors(layer)
            inits = [
                numpy_helper.from_array(packed, f"{base}_q4"),
                numpy_helper.from_array(scales, f"{base}_scales"),
            ]
            inputs = [node.input[0], f"{base}_q4", f"{base}_scales"]
            if not self.config.symmetric:
                inits.append(numpy_helper.from_array(zeros, f"{base}_zero_points"))
                inputs.append(f"{base}_zero_points")
            attributes: dict[str, Any] = {"K": in_features, "N": out_features, "bits": BITS}
            attributes["block_size"] = layer.group_size
            if self.config.accuracy_level:
                attributes["accuracy_level"] = self.config.accuracy_level
            lowered = helper.make_node(
                "MatMulNBits",
                inputs,
                list(node.output),
                name=f"{node.name}_Q4",
                domain=MS_DOMAIN,
                **attributes,
            )
            return [lowered], inits
        codes, scales, zeros = qdq_tensors(layer, self.config.symmetric)
        code_type = TensorProto.INT4 if self.config.symmetric else TensorProto.UINT4
        inits = [
            helper.make_tensor(
                f"{base}_q4", code_type, [in_features, out_features], codes.tobytes(), raw=True
            ),
            numpy_helper.from_array(scales, f"{base}_scales"),
        ]
        dq_inputs = [f"{base}_q4", f"{base}_scales"]
        if zeros is not None:
            inits.append(
                helper.make_tensor(
                    f"{base}_zero_points", code_type, list(scales.shape), zeros.tobytes(), raw=True
                )
            )
            dq_inputs.append(f"{base}_zero_points")
        dequantized = f"{base}_dq"
        dq = helper.make_node(
            "DequantizeLinear",
            dq_inputs,
            [dequantized],
            name=f"{node.name}_DQ",
            axis=0,
            block_size=layer.group_size,
        )
        matmul = helper.make_node("MatMul", [node.input[0], dequantized], list(node.output), name=node.name)
        return [dq, matmul], inits

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        check_data_files(result.path, self.name)
        parity = compare_graphs(source.path, result.path, PARITY_PROMPT_IDS)
        origins = set(result.metadata.get("quantization", {}).get("modules", {}).values())
        exact = origins <= {"stored"} and not self.config.accuracy_level
        if exact and parity["top1_agreement"] < self.config.min_top1_agreement:
            raise PassError(
                f"{self.name}: the INT4 graph agrees with the fake-quantized graph on "
                f"{parity['top1_agreement']:.1%} of greedy tokens "
                f"(max |logit diff| {parity['max_abs_diff']:.3g}); the lowering is wrong"
            )
        return {"parity_vs_input_graph": parity}


def transposed(weight_t: np.ndarray, band_bytes: int = 32 << 20) -> Any:
    """``weight_t.T`` as a contiguous float32 torch tensor, for a memory-mapped ``weight_t``: read
    in file order, ``band_bytes`` of rows at a time, each band transposed by torch's blocked 2-D
    copy. ``np.ascontiguousarray(weight_t.T)`` reads the map a column at a time and slows down as
    the weight grows (measured in memory: 3.0 ns a weight for 960 x 2560, 11.4 for 3072 x 8192,
    15.5 for the 3B head's 3072 x 49152, where this stays at 6.5-7.5)."""
    import torch

    rows, columns = weight_t.shape
    out = torch.empty(columns, rows, dtype=torch.float32)
    band = max(1, band_bytes // (columns * 4))
    for start in range(0, rows, band):
        block = torch.from_numpy(np.array(weight_t[start : start + band], dtype=np.float32))
        out[:, start : start + band] = block.T.contiguous()
    return out


def replace_with_protos(graph: Any, node: Any, nodes: list[Any], inits: list[Any]) -> None:
    """Replace IR ``node`` by the ONNX ``NodeProto``s ``nodes`` (which keep its output names) and
    register the ``TensorProto``s ``inits`` as initializers (wrapped, not copied)."""
    import onnx
    import onnx_ir as ir

    local: dict[str, Any] = {}
    for proto in inits:
        tensor = ir.serde.deserialize_tensor(proto)
        value = ir.Value(
            name=proto.name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor
        )
        graph.register_initializer(value)
        local[proto.name] = value
    known = {v.name: v for v in node.inputs if v is not None}
    old_outputs = {v.name: v for v in node.outputs}
    new_nodes, replacements = [], {}
    for proto in nodes:
        inputs = [local.get(name) or known[name] for name in proto.input]
        outputs = [ir.Value(name=f"{name}.lowered" if name in old_outputs else name) for name in proto.output]
        new_nodes.append(
            ir.node(
                proto.op_type,
                inputs,
                attributes={a.name: onnx.helper.get_attribute_value(a) for a in proto.attribute},
                domain=proto.domain,
                name=proto.name,
                outputs=outputs,
            )
        )
        for name, value in zip(proto.output, outputs, strict=True):
            local[name] = value
            if name in old_outputs:
                replacements[name] = value
    old = list(node.outputs)
    new = [replacements[v.name] for v in old]
    ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, old, new)
    for old_value, new_value in zip(old, new, strict=True):
        name = old_value.name
        old_value.name = f"{name}.replaced"
        new_value.name = name


__all__ = ["DATA_FILE", "MODEL_FILE", "Int4LoweringConfig", "Int4LoweringPass"]
