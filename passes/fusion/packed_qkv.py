"""Packed QKV rule: the three projections feeding a ``GroupQueryAttention`` become one matmul
whose output the kernel splits itself (GroupQueryAttention's packed-QKV form: ``query`` holds
[Q | K | V] along the last axis, ``key`` and ``value`` are left empty).

One matmul of width (H + 2 Hkv) D instead of three reads the same weights with two fewer kernel
launches per layer and one read of the input; ONNX Runtime GenAI's model builder emits the same
form. Spec: ONNX Runtime contrib op ``GroupQueryAttention`` (packed QKV), ``MatMulNBits``
(``B [N, k_blocks, blob]``, ``scales [N * k_blocks]`` or ``[N, k_blocks]``, ``zero_points``
packed per row: all three are row-major in N, so packing concatenates along N).
Handled: plain ``MatMul`` with constant [K, N] weights (concatenated along N) and ``MatMulNBits``
with equal ``K``, ``bits``, ``block_size`` and ``accuracy_level``. Other projections (e.g. Q/DQ)
are left alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes.fusion.common import add_initializer, constant_array

MS = "com.microsoft"
SAME_ATTRIBUTES = ("K", "bits", "block_size", "accuracy_level")


def _gqa(op: Any, query: Any, key: Any, value: Any, *rest: Any) -> Any:
    return op.GroupQueryAttention(
        query,
        key,
        value,
        *rest,
        _domain=MS,
        _allow_other_attributes=True,
        _outputs=["attended", "present_key", "present_value"],
    )


class PackedQkvMatMul(pattern.RewriteRuleClassBase):
    def __init__(self, graph: ir.Graph) -> None:
        super().__init__("PackedQkvMatMul", remove_nodes=True)
        self._graph = graph

    def pattern(
        self,
        op: Any,
        x: Any,
        wq: Any,
        wk: Any,
        wv: Any,
        pk: Any,
        pv: Any,
        sk: Any,
        tl: Any,
        cos: Any,
        sin: Any,
    ) -> Any:
        return _gqa(op, op.MatMul(x, wq), op.MatMul(x, wk), op.MatMul(x, wv), pk, pv, sk, tl, cos, sin)

    def check(self, context: Any, wq: Any, wk: Any, wv: Any, **_: Any) -> Any:
        result = pattern.MatchResult()
        arrays = [constant_array(w) for w in (wq, wk, wv)]
        if any(a is None or a.ndim != 2 for a in arrays) or len({a.shape[0] for a in arrays}) != 1:  # type: ignore[union-attr]
            return result.fail("Q/K/V weights are not constant [K, N] matrices of one K", [wq, wk, wv])
        self._packed = np.concatenate(arrays, axis=1)  # type: ignore[arg-type]
        return result

    def rewrite(
        self,
        op: Any,
        x: Any,
        wq: Any,
        pk: Any,
        pv: Any,
        sk: Any,
        tl: Any,
        cos: Any,
        sin: Any,
        attended: Any,
        **_: Any,
    ) -> Any:
        weight = add_initializer(self._graph, self._packed, f"{wq.name or 'proj'}_qkv")
        qkv = op.MatMul(x, weight)
        return _packed_gqa(op, attended, qkv, pk, pv, sk, tl, cos, sin)


class PackedQkvMatMulNBits(pattern.RewriteRuleClassBase):
    def __init__(self, graph: ir.Graph) -> None:
        super().__init__("PackedQkvMatMulNBits", remove_nodes=True)
        self._graph = graph

    def pattern(self, op: Any, x: Any, pk: Any, pv: Any, sk: Any, tl: Any, cos: Any, sin: Any) -> Any:
        def nbits(name: str) -> Any:
            return op.MatMulNBits(
                x, _domain=MS, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=[name]
            )

        return _gqa(op, nbits("q"), nbits("k"), nbits("v"), pk, pv, sk, tl, cos, sin)

    def check(self, context: Any, q: Any, k: Any, v: Any, **_: Any) -> Any:
        result = pattern.MatchResult()
        nodes = [value.producer() for value in (q, k, v)]
        attributes = [{name: n.attributes.get_int(name) for name in SAME_ATTRIBUTES} for n in nodes]
        if any(a != attributes[0] for a in attributes):
            return result.fail("the projections differ in K, bits, block size or accuracy level", nodes)
        inputs = [n.inputs for n in nodes]
        widths = {len(i) for i in inputs}
        if len(widths) != 1 or widths.pop() > 4:  # x, B, scales[, zero_points]; no g_idx or bias
            return result.fail("the projections take different or unsupported inputs", nodes)
        packed = []
        for slot in range(1, len(inputs[0])):
            arrays = [constant_array(i[slot]) if i[slot] is not None else None for i in inputs]
            if any(a is None for a in arrays):
                return result.fail("a weight, scale or zero point is not constant", nodes)
            packed.append(np.concatenate(arrays, axis=0))  # type: ignore[arg-type]
        self._packed = packed
        self._attributes = {**attributes[0], "N": sum(n.attributes.get_int("N") for n in nodes)}
        self._hint = nodes[0].inputs[1].name or "proj"
        return result

    def rewrite(
        self, op: Any, x: Any, pk: Any, pv: Any, sk: Any, tl: Any, cos: Any, sin: Any, attended: Any, **_: Any
    ) -> Any:
        tensors = [
            add_initializer(self._graph, array, f"{self._hint}_{i}_qkv")
            for i, array in enumerate(self._packed)
        ]
        qkv = op.MatMulNBits(x, *tensors, **self._attributes, _domain=MS)
        return _packed_gqa(op, attended, qkv, pk, pv, sk, tl, cos, sin)


def _packed_gqa(op: Any, attended: Any, qkv: Any, *rest: Any) -> Any:
    attributes = {name: attr.value for name, attr in attended.producer().attributes.items()}
    return op.GroupQueryAttention(qkv, None, None, *rest, **attributes, _domain=MS, _outputs=3)


def packed_qkv_rules(graph: ir.Graph) -> pattern.RewriteRuleSet:
    return pattern.RewriteRuleSet([PackedQkvMatMul.rule(graph), PackedQkvMatMulNBits.rule(graph)])
