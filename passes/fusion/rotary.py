"""Rotary embedding rule: ``x * cos + rotate_half(x) * sin``, with cos/sin computed in the graph
from ``position_ids`` and the constant inverse frequencies, becomes
``com.microsoft.RotaryEmbedding(x, position_ids, cos_cache, sin_cache)``.

Algorithm: Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding"
(non-interleaved halves, as in Hugging Face Llama). Spec: ONNX Runtime contrib op
``RotaryEmbedding`` (4-D input [batch, heads, seq, head_dim]; caches [max_positions, head_dim/2]);
for standard-op targets the ONNX ``RotaryEmbedding`` of opset 23 (the same caches, inputs ordered
``x, cos_cache, sin_cache, position_ids``).
The caches are tabulated here from the graph's own inverse frequencies and attention scaling,
for every position up to the model's ``max_position_embeddings``. longrope (Phi-3.5-mini) as the
export writes it, ``Where(past the switch, long, short)`` of two constant frequency vectors, gets
one table of the short rows then the long rows, read at positions shifted past the short rows
once the sequence is past the switch: ONNX Runtime GenAI's builder chooses between two caches
with an ``If`` on the length instead (``make_rotary_embedding_multi_cache``); a shift of the
positions copies no table per step. onnxscript's
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
    """cos/sin caches shared by every rotary site of one graph, made on first use. With
    ``switch_at`` (longrope's ``original_max_position_embeddings``), a switched site's caches hold
    the short factors' rows for positions below it, then the long factors' rows for every position:
    the site reads row ``position + switch_at`` once the sequence is past it."""

    def __init__(self, graph: ir.Graph, max_positions: int, switch_at: int = 0) -> None:
        self.graph = graph
        self.max_positions = max_positions
        self.switch_at = switch_at
        self._made: dict[tuple[bytes, float], tuple[ir.Value, ir.Value]] = {}
        self._shifted: dict[tuple[int, int], ir.Value] = {}

    def get(
        self, inv_freq: np.ndarray, scaling: float, short: np.ndarray | None = None
    ) -> tuple[ir.Value, ir.Value]:
        """The caches of ``inv_freq``; with ``short``, the switched caches whose first
        ``switch_at`` rows are ``short``'s and the rest ``inv_freq``'s (the long factors)."""
        key = (inv_freq.astype(np.float32).tobytes(), scaling)
        if short is not None:
            key = (key[0] + short.astype(np.float32).tobytes(), scaling)
        if key not in self._made:
            angles = _angles(self.max_positions, inv_freq)
            if short is not None:
                angles = np.concatenate([_angles(self.switch_at, short), angles])
            values = [
                add_initializer(self.graph, (table * scaling).astype(np.float32), name)
                for name, table in (("cos_cache", np.cos(angles)), ("sin_cache", np.sin(angles)))
            ]
            self._made[key] = (values[0], values[1])
        return self._made[key]

    def shifted(self, condition: ir.Value, position_ids: ir.Value) -> ir.Value:
        """``position_ids + switch_at`` past the switch (``condition``), else ``position_ids``:
        made once, right after the condition, so that every site (q and k of every layer) reads
        the same value, as the attention rule needs of the two it absorbs."""
        key = (id(condition), id(position_ids))
        if key not in self._shifted:
            switch = add_initializer(self.graph, np.array(self.switch_at, dtype=np.int64), "rope_switch_at")
            cast = ir.node("Cast", [condition], attributes={"to": ir.DataType.INT64})
            scaled = ir.node("Mul", [cast.outputs[0], switch])
            shifted = ir.node("Add", [position_ids, scaled.outputs[0]])
            for made in (cast, scaled, shifted):
                made.outputs[0].dtype = ir.DataType.INT64
            shifted.outputs[0].shape = position_ids.shape
            shifted.outputs[0].name = "rope_shifted_position_ids"
            producer = condition.producer()
            assert producer is not None  # _switched: the condition is computed from the positions
            self.graph.insert_after(producer, [cast, scaled, shifted])
            self._shifted[key] = shifted.outputs[0]
        return self._shifted[key]


def _angles(positions: int, inv_freq: np.ndarray) -> np.ndarray:
    return np.arange(positions, dtype=np.float32)[:, None] * inv_freq.astype(np.float32).reshape(1, -1)


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
        self._switch = self._short = None
        switched = _switched(inv_freq) if frequencies is None and self._tables.switch_at else None
        if switched is not None:  # longrope: Where(past the switch, long, short)
            self._switch, frequencies, self._short = switched
        if frequencies is None or frequencies.size * 2 != _head_dim(x, frequencies.size * 2):
            return result.fail("inverse frequencies are not a constant of head_dim/2 values", inv_freq)
        scales = [1.0 if s is None else constant_scalar(s) for s in (cos_scale, sin_scale)]
        if scales[0] is None or scales[0] != scales[1]:
            return result.fail("cos and sin scaling differ or are not constant", [cos_scale, sin_scale])
        self._frequencies, self._scaling = frequencies.reshape(-1), float(scales[0])
        return result

    def rewrite(self, op: Any, x: Any, position_ids: Any, **_: Any) -> Any:
        cos_cache, sin_cache = self._tables.get(self._frequencies, self._scaling, self._short)
        if self._switch is not None:  # past the switch: the long rows, after the short ones
            position_ids = self._tables.shifted(self._switch, position_ids)
        if self._standard:  # ONNX RotaryEmbedding-23: same caches, inputs in another order
            return op.RotaryEmbedding(x, cos_cache, sin_cache, position_ids, interleaved=0)
        return op.RotaryEmbedding(
            x, position_ids, cos_cache, sin_cache, interleaved=0, _domain="com.microsoft"
        )


def _switched(inv_freq: ir.Value) -> tuple[ir.Value, np.ndarray, np.ndarray] | None:
    """longrope's frequencies as the export writes them (pipeline/core/torch_model.py
    ``switched_longrope``): ``Where(past_the_switch, long, short)`` of two constants; (the
    condition, long, short), else None."""
    producer = inv_freq.producer()
    if producer is None or producer.op_type != "Where" or producer.domain not in ("", "ai.onnx"):
        return None
    condition, long, short = producer.inputs
    arrays = constant_array(long), constant_array(short)
    if (
        condition is None
        or condition.producer() is None
        or arrays[0] is None
        or arrays[1] is None
        or arrays[0].shape != arrays[1].shape
    ):
        return None
    return condition, arrays[0].reshape(-1), arrays[1].reshape(-1)


def _head_dim(x: ir.Value, fallback: int) -> int:
    """The last dim of ``x`` when shape inference knows it, else ``fallback``."""
    if x.shape is not None and x.shape.rank() == 4 and isinstance(x.shape[3], int):
        return x.shape[3]
    return fallback


def rotary_rules(tables: RotaryTables, standard: bool = False) -> pattern.RewriteRuleSet:
    return pattern.RewriteRuleSet([Rotary.rule(tables, standard)])
