"""KV-cache storage type of the fused graph: GroupQueryAttention keeps keys and values in fp16
or int8 instead of fp32 (ONNX Runtime's GroupQueryAttention, ``T_CACHE``; its
``docs/ContribOperators.md``, "Quantization").

- ``fp16``: the cache tensors are float16; the kernel converts on write and read. No scale.
- ``int8``: symmetric int8 with one scale per KV head and channel (GQA's ``PER_CHANNEL`` mode,
  scale shape ``[1, kv_heads, 1, head_dim]``): ``q = round(x / s)`` clipped to [-127, 127],
  ``s = amax / 127`` with ``amax`` the largest ``|x|`` of that head and channel on the
  calibration text (``passes/kv_cache.py`` measures it). Per-channel keys follow KIVI (Liu et
  al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"): key outliers sit
  in fixed channels, so a per-token or per-tensor key scale wastes most of the int8 range. The
  kernel quantizes the new tokens it appends and dequantizes the cache it reads; a value beyond
  the calibrated range saturates.

fp8 caches exist in the operator's schema but ONNX Runtime 1.32 registers no CPU kernel for
them (measured: "Could not find an implementation"), so ``passes/kv_cache.py`` refuses fp8 for
the ``ort-cpu`` engine.

Not a pattern rule: the change is to the types of graph inputs and outputs and to attributes of
nodes the attention rule already made, so it is a direct onnx-ir edit of those nodes.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import onnx_ir as ir

from passes.fusion.common import add_initializer
from pipeline.errors import PassError

CACHE_TYPES = {"fp16": ir.DataType.FLOAT16, "int8": ir.DataType.INT8}
# Our names for the cache dtypes -> the IO spec's numpy names (pipeline/runtime/ort.py).
IO_DTYPES = {"fp32": "float32", "fp16": "float16", "int8": "int8"}
INT8_MAX = 127.0
# GroupQueryAttention's inputs: past_key 3, past_value 4, k_scale 12, v_scale 13.
_PAST_KEY, _PAST_VALUE, _K_SCALE, _V_SCALE = 3, 4, 12, 13
_LAYER = re.compile(r"past_key_values\.(\d+)\.key$")


def int8_scales(amax: np.ndarray) -> np.ndarray:
    """Per-channel int8 scales from calibrated ``amax`` (a channel that never fired gets the
    smallest positive scale, so the kernel never divides by zero)."""
    return (np.maximum(np.asarray(amax, dtype=np.float32), np.finfo(np.float32).tiny) / INT8_MAX).astype(
        np.float32
    )


def set_cache_dtype(graph: ir.Graph, dtype: str, amax: dict[str, np.ndarray] | None = None) -> int:
    """Store every GroupQueryAttention's cache as ``dtype`` (``fp16`` | ``int8``); ``amax`` holds
    ``key`` and ``value`` arrays ``[layers, kv_heads, head_dim]`` for int8. Returns the number
    of attention nodes changed; raises PassError when a layer's cache is not a graph input."""
    if dtype not in CACHE_TYPES:
        raise PassError(f"kv_cache.dtype={dtype!r}: the fused graph stores fp32, fp16 or int8 caches")
    if dtype == "int8" and amax is None:
        raise PassError("kv_cache.dtype=int8 needs calibrated scales: the kv_cache pass records them")
    changed = 0
    for node in list(graph):
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            continue
        past_key, past_value = node.inputs[_PAST_KEY], node.inputs[_PAST_VALUE]
        match = _LAYER.match(past_key.name or "") if past_key is not None else None
        if match is None or past_key not in graph.inputs or past_value not in graph.inputs:
            raise PassError(
                f"fusion: {node.name} does not read its cache from the graph's past_key_values inputs; "
                f"kv_cache.dtype={dtype} cannot be applied"
            )
        for value in (past_key, past_value, node.outputs[1], node.outputs[2]):
            value.dtype = CACHE_TYPES[dtype]
        if dtype == "int8":
            assert amax is not None
            layer = int(match.group(1))
            node.resize_inputs(_V_SCALE + 1)
            for slot, kind in ((_K_SCALE, "key"), (_V_SCALE, "value")):
                scale = int8_scales(amax[kind][layer])[None, :, None, :]
                node.replace_input_with(slot, add_initializer(graph, scale, f"kv_scale.{layer}.{kind}"))
            for name in ("k_quant_type", "v_quant_type"):
                node.attributes[name] = ir.AttrString(name, "PER_CHANNEL")
            node.attributes["kv_cache_bit_width"] = ir.AttrInt64("kv_cache_bit_width", 8)
        changed += 1
    return changed


def restore_fp32_cache(model: Any) -> int:
    """Undo ``set_cache_dtype`` on an ``onnx.ModelProto`` in place: fp32 caches, no scales, no
    quantization attributes (the exact graph the fusion itself is judged on). Returns the
    number of attention nodes changed."""
    import onnx

    graph = model.graph
    caches: set[str] = set()
    restored = 0
    for node in graph.node:
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            continue
        quantized = [
            a for a in node.attribute if a.name in ("k_quant_type", "v_quant_type", "kv_cache_bit_width")
        ]
        for attribute in quantized:
            node.attribute.remove(attribute)
        del node.input[_K_SCALE:]
        caches.update((node.input[_PAST_KEY], node.input[_PAST_VALUE], node.output[1], node.output[2]))
        restored += 1
    for value in (*graph.input, *graph.output):
        if value.name in caches and value.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    return restored
