"""Packed gate/up rule: the SwiGLU MLP's gate and up projections, which read the same input,
become one matmul of width 2I whose output a ``Split`` cuts back into gate and up:
``down(silu(x Wg) * (x Wu))`` -> ``g, u = Split(x [Wg | Wu]); down(silu(g) * u)``.

Measured on this CPU (2 threads), it does not pay, so no shipped rule set lists it; add it with
``fusion.rules=[..., packed_gate_up]`` where it does. In isolation the two int4 ``MatMulNBits``
of the default model (576 x 1536) take 148 us a layer and the packed one with its Split 121 us;
inside the model the decode step does not change: int4_awq fused/shared, in-process A/B with the
engine order swapped, 8.88 vs 8.84 ms at context 256 and 13.53 vs 13.33 ms at 1024 (packed vs
not; run-to-run noise ~0.3 ms). fp32 ``MatMul`` is bound by reading the weights, which packing
does not change (142 vs 139 us a projection on weights larger than the cache), so the rule
leaves it alone (``fuse.py`` reports the family not applicable on a graph without
``MatMulNBits``). ONNX Runtime GenAI's model builder does not pack these either. Weights pack as
in ``packing.py``; SwiGLU as in LLaMA (Touvron et al. 2023, after Shazeer 2020, "GLU Variants
Improve Transformer").
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes.fusion.common import add_initializer
from passes.fusion.packing import MS, PackedNBits, packed_nbits


class PackedGateUpMatMulNBits(pattern.RewriteRuleClassBase):
    def __init__(self, graph: ir.Graph) -> None:
        super().__init__("PackedGateUpMatMulNBits", remove_nodes=True)
        self._graph = graph

    def pattern(self, op: Any, x: Any) -> Any:
        gate = op.MatMulNBits(
            x, _domain=MS, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["gate"]
        )
        up = op.MatMulNBits(
            x, _domain=MS, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["up"]
        )
        return op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)

    def check(self, context: Any, gate: Any, up: Any, **_: Any) -> Any:
        result = pattern.MatchResult()
        nodes = [gate.producer(), up.producer()]
        packed = packed_nbits(nodes)
        if isinstance(packed, str):
            return result.fail(packed, nodes)
        self._packed: PackedNBits = packed
        self._widths = [n.attributes.get_int("N") for n in nodes]
        return result

    def rewrite(self, op: Any, x: Any, **_: Any) -> Any:
        packed = self._packed.node(op, self._graph, x, "gate_up")
        widths = add_initializer(self._graph, np.asarray(self._widths, dtype=np.int64), "gate_up_split")
        gate, up = op.Split(packed, widths, axis=-1, _outputs=2)
        return op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)


def packed_gate_up_rules(graph: ir.Graph) -> pattern.RewriteRuleSet:
    # commute: exporters order the operands of the two Muls either way.
    return pattern.RewriteRuleSet([PackedGateUpMatMulNBits.rule(graph)], commute=True)
