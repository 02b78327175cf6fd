"""Helpers the fusion rules share: reading constants and the model's shape facts."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The value's constant content (initializer or ``Constant`` node), else None."""
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None:
        producer = value.producer()
        if producer is None or producer.op_type != "Constant" or producer.domain not in ("", "ai.onnx"):
            return None
        attribute = producer.attributes.get("value")
        if attribute is None:
            return None
        tensor = attribute.as_tensor()
    return tensor.numpy()


def constant_scalar(value: ir.Value | None) -> Any:
    """The single element of a constant (scalar or one-element tensor) as a Python number."""
    array = constant_array(value)
    if array is None or array.size != 1:
        return None
    return array.reshape(()).item()
