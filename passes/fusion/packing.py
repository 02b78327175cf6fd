"""Packing projections that read the same input into one matmul: the weights of plain
``MatMul`` nodes concatenated along N, and ``MatMulNBits`` (ONNX Runtime contrib op) nodes
packed the same way: its ``B [N, k_blocks, blob]``, ``scales [N * k_blocks]`` or
``[N, k_blocks]`` and ``zero_points`` are all row-major in N, so packing concatenates them along
their first axis. Used by ``packed_qkv.py`` and ``packed_gate_up.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from passes.fusion.common import add_initializer, constant_array

MS = "com.microsoft"
# MatMulNBits attributes the packed projections must share.
SAME_ATTRIBUTES = ("K", "bits", "block_size", "accuracy_level")


def packed_matmul_weight(weights: list[ir.Value]) -> np.ndarray | str:
    """The constant [K, N] weights side by side, or why they cannot be packed."""
    arrays = [constant_array(w) for w in weights]
    if any(a is None or a.ndim != 2 for a in arrays) or len({a.shape[0] for a in arrays}) != 1:  # type: ignore[union-attr]
        return "the weights are not constant [K, N] matrices of one K"
    return np.concatenate(arrays, axis=1)  # type: ignore[arg-type]


@dataclass
class PackedNBits:
    """The inputs (after ``x``) and attributes of one MatMulNBits equal to the packed nodes."""

    tensors: list[np.ndarray]
    attributes: dict[str, int]
    hint: str

    def node(self, op: Any, graph: ir.Graph, x: Any, suffix: str) -> Any:
        names = [add_initializer(graph, a, f"{self.hint}_{i}_{suffix}") for i, a in enumerate(self.tensors)]
        return op.MatMulNBits(x, *names, **self.attributes, _domain=MS)


def packed_nbits(nodes: list[ir.Node]) -> PackedNBits | str:
    """One MatMulNBits doing the work of ``nodes`` (outputs side by side), or why not."""
    attributes = [{name: n.attributes.get_int(name) for name in SAME_ATTRIBUTES} for n in nodes]
    if any(a != attributes[0] for a in attributes):
        return "the projections differ in K, bits, block size or accuracy level"
    inputs = [n.inputs for n in nodes]
    widths = {len(i) for i in inputs}
    if len(widths) != 1 or widths.pop() > 4:  # x, B, scales[, zero_points]; no g_idx or bias
        return "the projections take different or unsupported inputs"
    packed = []
    for slot in range(1, len(inputs[0])):
        arrays = [constant_array(i[slot]) if i[slot] is not None else None for i in inputs]
        if any(a is None for a in arrays):
            return "a weight, scale or zero point is not constant"
        packed.append(np.concatenate(arrays, axis=0))  # type: ignore[arg-type]
    width = sum(n.attributes.get_int("N") for n in nodes)
    return PackedNBits(packed, {**attributes[0], "N": width}, nodes[0].inputs[1].name or "proj")
