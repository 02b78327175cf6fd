"""Packed QKV rule: the three projections feeding a ``GroupQueryAttention`` become one matmul
whose output the kernel splits itself (GroupQueryAttention's packed-QKV form: ``query`` holds
[Q | K | V] along the last axis, ``key`` and ``value`` are left empty).

One matmul of width (H + 2 Hkv) D instead of three reads the same weights with two fewer kernel
launches per layer and one read of the input; ONNX Runtime GenAI's model builder emits the same
form. Spec: ONNX Runtime contrib op ``GroupQueryAttention`` (packed QKV); how weights pack:
``packing.py``. Handled: plain ``MatMul`` with constant [K, N] weights (concatenated along N)
and ``MatMulNBits`` with equal ``K``, ``bits``, ``block_size`` and ``accuracy_level``, each with
or without a constant bias ``Add`` after it (Qwen2's q/k/v biases; the packed biases are
concatenated in the same order and added once after the packed matmul: GroupQueryAttention
takes no bias of its own). Other projections (e.g. Q/DQ) are left alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes.fusion.common import add_initializer, constant_array
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


class PackedQkvMatMulBias(PackedQkvMatMul):
    """Q, K and V each a ``MatMul`` then a constant bias ``Add``."""

    def __init__(self, graph: ir.Graph) -> None:
        pattern.RewriteRuleClassBase.__init__(self, "PackedQkvMatMulBias", remove_nodes=True)
        self._graph = graph

    def pattern(  # type: ignore[override]
        self,
        op: Any,
        x: Any,
        wq: Any,
        wk: Any,
        wv: Any,
        bq: Any,
        bk: Any,
        bv: Any,
        pk: Any,
        pv: Any,
        sk: Any,
        tl: Any,
        cos: Any,
        sin: Any,
    ) -> Any:
        q, k, v = (op.Add(op.MatMul(x, w), b) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
        return _gqa(op, q, k, v, pk, pv, sk, tl, cos, sin)

    def check(self, context: Any, wq: Any, wk: Any, wv: Any, bq: Any, bk: Any, bv: Any, **_: Any) -> Any:  # type: ignore[override]
        result = super().check(context, wq=wq, wk=wk, wv=wv)
        if not result:
            return result
        bias = packed_bias([bq, bk, bv], [wq, wk, wv])
        if isinstance(bias, str):
            return result.fail(f"Q/K/V: {bias}", [bq, bk, bv])
        self._bias = bias
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
    ) -> Any:  # type: ignore[override]
        weight = add_initializer(self._graph, self._packed, f"{wq.name or 'proj'}_qkv")
        bias = add_initializer(self._graph, self._bias, f"{wq.name or 'proj'}_qkv_bias")
        qkv = op.Add(op.MatMul(x, weight), bias)
        return _packed_gqa(op, attended, qkv, pk, pv, sk, tl, cos, sin)


class PackedQkvMatMulNBitsBias(PackedQkvMatMulNBits):
    """Q, K and V each a ``MatMulNBits`` then a constant bias ``Add``."""

    def __init__(self, graph: ir.Graph) -> None:
        pattern.RewriteRuleClassBase.__init__(self, "PackedQkvMatMulNBitsBias", remove_nodes=True)
        self._graph = graph

    def pattern(  # type: ignore[override]
        self,
        op: Any,
        x: Any,
        bq: Any,
        bk: Any,
        bv: Any,
        pk: Any,
        pv: Any,
        sk: Any,
        tl: Any,
        cos: Any,
        sin: Any,
    ) -> Any:
        def nbits(name: str, bias: Any) -> Any:
            matmul = op.MatMulNBits(
                x, _domain=MS, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=[name]
            )
            return op.Add(matmul, bias)

        return _gqa(op, nbits("q", bq), nbits("k", bk), nbits("v", bv), pk, pv, sk, tl, cos, sin)

    def check(self, context: Any, q: Any, k: Any, v: Any, bq: Any, bk: Any, bv: Any, **_: Any) -> Any:  # type: ignore[override]
        result = super().check(context, q=q, k=k, v=v)
        if not result:
            return result
        widths = [value.producer().attributes.get_int("N") for value in (q, k, v)]
        bias = packed_bias([bq, bk, bv], widths)
        if isinstance(bias, str):
            return result.fail(f"Q/K/V: {bias}", [bq, bk, bv])
        self._bias = bias
        return result

    def rewrite(
        self, op: Any, x: Any, pk: Any, pv: Any, sk: Any, tl: Any, cos: Any, sin: Any, attended: Any, **_: Any
    ) -> Any:  # type: ignore[override]
        qkv = self._packed.node(op, self._graph, x, "qkv")
        bias = add_initializer(self._graph, self._bias, f"{self._packed.hint}_qkv_bias")
        return _packed_gqa(op, attended, op.Add(qkv, bias), pk, pv, sk, tl, cos, sin)


def packed_bias(biases: list[Any], widths: list[Any]) -> np.ndarray | str:
    """The constant 1-D biases side by side, each as wide as its projection's output (``widths``:
    its [K, N] weight value, or N), or why they cannot be packed."""
    arrays = [constant_array(b) for b in biases]
    sizes = [
        w if isinstance(w, int) else (w.shape[1] if w.shape is not None and len(w.shape) == 2 else None)
        for w in widths
    ]
    if any(a is None or a.ndim != 1 for a in arrays) or [a.shape[0] for a in arrays] != sizes:  # type: ignore[union-attr]
        return "the biases are not constant vectors as wide as their projections"
    return np.concatenate(arrays)  # type: ignore[arg-type]


def _packed_gqa(op: Any, attended: Any, qkv: Any, *rest: Any) -> Any:
    attributes = {name: attr.value for name, attr in attended.producer().attributes.items()}
    return op.GroupQueryAttention(qkv, None, None, *rest, **attributes, _domain=MS, _outputs=3)


def packed_qkv_rules(graph: ir.Graph) -> pattern.RewriteRuleSet:
    # commute: the exporter writes a linear's bias as Add(bias, MatMul).
    rules = [PackedQkvMatMul, PackedQkvMatMulNBits, PackedQkvMatMulBias, PackedQkvMatMulNBitsBias]
    return pattern.RewriteRuleSet([rule.rule(graph) for rule in rules], commute=True)
