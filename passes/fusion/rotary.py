"""Rotary embedding rule: ``x * cos + rotate_half(x) * sin``, with cos/sin computed in the graph
from ``position_ids`` and the constant inverse frequencies, becomes
``com.microsoft.RotaryEmbedding(x, position_ids, cos_cache, sin_cache)``.

Algorithm: Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding"
(non-interleaved halves, as in Hugging Face Llama). Spec: ONNX Runtime contrib op
``RotaryEmbedding`` (4-D input [batch, heads, seq, head_dim]; caches [max_positions, head_dim/2]);
for standard-op targets the ONNX ``RotaryEmbedding`` of opset 23 (the same caches, inputs ordered
``x, cos_cache, sin_cache, position_ids``).
The caches are tabulated here from the graph's own inverse frequencies and attention scaling,
for every position up to the model's ``max_position_embeddings``. onnxscript's
``ort_fusions.rotary_embedding`` targets a proposed op ONNX Runtime does not run and needs static
head counts, which the TorchScript export does not give; hence this rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes.fusion.common import add_initializer, constant_array, constant_scalar

INT64_MAX = 9223372036854775807


class RotaryTables:
    """cos/sin caches shared by every rotary site of one graph, made on first use."""

    def __init__(self, graph: ir.Graph, max_positions: int) -> None:
        self.graph = graph
        self.max_positions = max_positions
        self._made: dict[tuple[bytes, float], tuple[ir.Value, ir.Value]] = {}

    def get(self, inv_freq: np.ndarray, scaling: float) -> tuple[ir.Value, ir.Value]:
        key = (inv_freq.astype(np.float32).tobytes(), scaling)
        if key not in self._made:
            positions = np.arange(self.max_positions, dtype=np.float32)[:, None]
            angles = positions * inv_freq.astype(np.float32).reshape(1, -1)
            values = [
                add_initializer(self.graph, (table * scaling).astype(np.float32), name)
                for name, table in (("cos_cache", np.cos(angles)), ("sin_cache", np.sin(angles)))
            ]
            self._made[key] = (values[0], values[1])
        return self._made[key]


class Rotary(pattern.RewriteRuleClassBase):
    """Half-rotation RoPE on a [batch, heads, seq, head_dim] tensor -> ``RotaryEmbedding``."""

    def __init__(self, tables: RotaryTables, standard: bool = False) -> None:
        super().__init__("OnnxRotaryEmbedding" if standard else "RotaryEmbedding", remove_nodes=False)
        self._tables = tables
        self._standard = standard

    def pattern(
        self, op: Any, x: Any, position_ids: Any, inv_freq: Any, cos_scale: Any, sin_scale: Any, half: Any
    ) -> Any:
        positions = op.Cast(op.Unsqueeze(position_ids, [2]), to=ir.DataType.FLOAT)
        freqs = op.Mul(positions, inv_freq)
        angles = op.Concat(freqs, freqs, axis=-1)
        cos = pattern.OrValue([op.Mul(op.Cos(angles), cos_scale), op.Cos(angles)])
        sin = pattern.OrValue([op.Mul(op.Sin(angles), sin_scale), op.Sin(angles)])
        first = op.Slice(x, [0], half, [3], [1])
        second = op.Slice(x, half, [INT64_MAX], [3], [1])
        rotated = op.Concat(op.Neg(second), first, axis=-1)
        return op.Add(op.Mul(x, op.Unsqueeze(cos, [1])), op.Mul(rotated, op.Unsqueeze(sin, [1])))

    def check(
        self,
        context: Any,
        x: Any,
        position_ids: Any,
        inv_freq: Any,
        cos_scale: Any = None,
        sin_scale: Any = None,
        **_: Any,
    ) -> Any:
        result = pattern.MatchResult()
        if position_ids not in context.graph_or_function.inputs:
            return result.fail("rotary positions are not a graph input", position_ids)
        frequencies = constant_array(inv_freq)
        if frequencies is None or frequencies.size * 2 != _head_dim(x, frequencies.size * 2):
            return result.fail("inverse frequencies are not a constant of head_dim/2 values", inv_freq)
        scales = [1.0 if s is None else constant_scalar(s) for s in (cos_scale, sin_scale)]
        if scales[0] is None or scales[0] != scales[1]:
            return result.fail("cos and sin scaling differ or are not constant", [cos_scale, sin_scale])
        self._frequencies, self._scaling = frequencies.reshape(-1), float(scales[0])
        return result

    def rewrite(self, op: Any, x: Any, position_ids: Any, **_: Any) -> Any:
        cos_cache, sin_cache = self._tables.get(self._frequencies, self._scaling)
        if self._standard:  # ONNX RotaryEmbedding-23: same caches, inputs in another order
            return op.RotaryEmbedding(x, cos_cache, sin_cache, position_ids, interleaved=0)
        return op.RotaryEmbedding(
            x, position_ids, cos_cache, sin_cache, interleaved=0, _domain="com.microsoft"
        )


def _head_dim(x: ir.Value, fallback: int) -> int:
    """The last dim of ``x`` when shape inference knows it, else ``fallback``."""
    if x.shape is not None and x.shape.rank() == 4 and isinstance(x.shape[3], int):
        return x.shape[3]
    return fallback


def rotary_rules(tables: RotaryTables, standard: bool = False) -> pattern.RewriteRuleSet:
    return pattern.RewriteRuleSet([Rotary.rule(tables, standard)])
