"""Helpers the fusion rules share: reading constants and adding initializers."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The value's constant content (initializer or ``Constant`` node), else None."""
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if tensor is None else tensor.numpy()


def add_initializer(graph: ir.Graph, array: np.ndarray, name: str) -> ir.Value:
    """Register ``array`` as a new initializer of ``graph`` named ``name`` (made unique)."""
    unique, index = name, 0
    while unique in graph.initializers:
        index += 1
        unique = f"{name}_{index}"
    tensor = ir.tensor(array, name=unique)
    value = ir.Value(name=unique, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
    value.const_value = tensor
    graph.register_initializer(value)
    return value


def constant_scalar(value: ir.Value | None) -> Any:
    """The single element of a constant (scalar or one-element tensor) as a Python number."""
    array = constant_array(value)
    if array is None or array.size != 1:
        return None
    return array.reshape(()).item()
