"""Packed QKV rule: the three projections feeding a ``GroupQueryAttention`` become one matmul
whose output the kernel splits itself (GroupQueryAttention's packed-QKV form: ``query`` holds
[Q | K | V] along the last axis, ``key`` and ``value`` are left empty).

One matmul of width (H + 2 Hkv) D instead of three reads the same weights with two fewer kernel
launches per layer and one read of the input; ONNX Runtime GenAI's model builder emits the same
form. Spec: ONNX Runtime contrib op ``GroupQueryAttention`` (packed QKV); how weights pack:
``packing.py``. Handled: plain ``MatMul`` with constant [K, N] weights (concatenated along N)
and ``MatMulNBits`` with equal ``K``, ``bits``, ``block_size`` and ``accuracy_level``. Other
projections (e.g. Q/DQ) are left alone.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes.fusion.common import add_initializer
from passes.fusion.packing import MS, PackedNBits, packed_matmul_weight, packed_nbits


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
        packed = packed_matmul_weight([wq, wk, wv])
        if isinstance(packed, str):
            return result.fail(f"Q/K/V: {packed}", [wq, wk, wv])
        self._packed = packed
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
        packed = packed_nbits(nodes)
        if isinstance(packed, str):
            return result.fail(packed, nodes)
        self._packed: PackedNBits = packed
        return result

    def rewrite(
        self, op: Any, x: Any, pk: Any, pv: Any, sk: Any, tl: Any, cos: Any, sin: Any, attended: Any, **_: Any
    ) -> Any:
        qkv = self._packed.node(op, self._graph, x, "qkv")
        return _packed_gqa(op, attended, qkv, pk, pv, sk, tl, cos, sin)


def _packed_gqa(op: Any, attended: Any, qkv: Any, *rest: Any) -> Any:
    attributes = {name: attr.value for name, attr in attended.producer().attributes.items()}
    return op.GroupQueryAttention(qkv, None, None, *rest, **attributes, _domain=MS, _outputs=3)


def packed_qkv_rules(graph: ir.Graph) -> pattern.RewriteRuleSet:
    return pattern.RewriteRuleSet([PackedQkvMatMul.rule(graph), PackedQkvMatMulNBits.rule(graph)])
