"""KV-cache storage type of the fused graph: GroupQueryAttention keeps keys and values in fp16
or int8 instead of fp32 (ONNX Runtime's GroupQueryAttention, ``T_CACHE``; its
``docs/ContribOperators.md``, "Quantization").

- ``fp16``: the cache tensors are float16; the kernel converts on write and read. No scale.
- ``int8``: symmetric int8 with one scale per KV head and channel (GQA's ``PER_CHANNEL`` mode,
  scale shape ``[1, kv_heads, 1, head_dim]``): ``q = round(x / s)``, which the kernel clips to
  [-128, 127] (measured),
  ``s = amax / 127`` with ``amax`` the largest ``|x|`` of that head and channel on the
  calibration text (``passes/kv_cache.py`` measures it). Per-channel keys follow KIVI (Liu et
  al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"): key outliers sit
  in fixed channels, so a per-token or per-tensor key scale wastes most of the int8 range. The
  kernel quantizes the new tokens it appends and dequantizes the cache it reads; a value beyond
  the calibrated range saturates.

- ``fp8``: FP8 E4M3 (OCP 8-bit floating point spec; Micikevicius et al. 2022, "FP8 Formats for
  Deep Learning") with one scale per KV head, ``s = amax / 448`` (or one per tensor, the form
  TensorRT takes), as explicit Q/DQ at the cache boundary (:func:`quantize_cache_io`): each
  ``past_key_values.*`` input is float8e4m3fn and goes through ``DequantizeLinear(past, s,
  axis=1)`` before the attention; each ``present.*`` output is ``QuantizeLinear(present, s,
  axis=1)``. GroupQueryAttention's own fp8 cache has no
  CPU kernel in ONNX Runtime 1.32 (measured: "Could not find an implementation"), but its CPU
  Q/DQ kernels take float8 (opset 19+), and explicit Q/DQ is also how TensorRT's strongly typed
  networks take precision, so one graph serves both. The attention itself runs in fp32 on the
  dequantized past: the cache held between steps is a quarter of fp32, the step computes as
  before. Needs a concat cache (``passes/kv_cache.py`` refuses ``layout=shared``: an in-place
  buffer is one tensor, so a Q/DQ pair cannot sit between its past and present).

Not a pattern rule: the change is to the types of graph inputs and outputs, to attributes of
nodes the attention rule already made, and to Q/DQ nodes at the graph's boundary, so it is a
direct onnx-ir edit of those nodes.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import onnx_ir as ir

from calibration.observers import FP8_E4M3
from passes.fusion.common import add_initializer
from pipeline.core.errors import PassError

CACHE_TYPES = {"fp16": ir.DataType.FLOAT16, "int8": ir.DataType.INT8}
# Our names for the cache dtypes -> the IO spec's numpy names (pipeline/runtime/ort.py).
IO_DTYPES = {"fp32": "float32", "fp16": "float16", "int8": "int8", "fp8": "float8_e4m3fn"}
# Dtypes stored by explicit Q/DQ at the graph's cache inputs and outputs (any attention).
QDQ_CACHE_TYPES = {"fp8": ir.DataType.FLOAT8E4M3FN}
FP8_MIN_OPSET = 19  # DequantizeLinear / QuantizeLinear with float8 and an axis
INT8_MAX = 127.0
# GroupQueryAttention's inputs: past_key 3, past_value 4, k_scale 12, v_scale 13.
_PAST_KEY, _PAST_VALUE, _K_SCALE, _V_SCALE = 3, 4, 12, 13
_LAYER = re.compile(r"past_key_values\.(\d+)\.key$")
_CACHE_INPUT = re.compile(r"past_key_values\.(\d+)\.(key|value)$")
_CACHE_OUTPUT = re.compile(r"present\.(\d+)\.(key|value)$")


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


def fp8_scales(amax: np.ndarray, per_head: bool = True) -> np.ndarray:
    """FP8 E4M3 scales from calibrated ``amax`` ``[kv_heads, head_dim]``: one per KV head, or
    one scalar for the tensor; the largest ``|x|`` maps to 448 (a head that never fired gets
    scale 1)."""
    amax = np.asarray(amax, dtype=np.float32)
    return FP8_E4M3.scale(amax.max(axis=-1) if per_head else amax.max())


def quantize_cache_io(
    graph: ir.Graph, dtype: str, amax: dict[str, np.ndarray], opset: int, per_head: bool = True
) -> int:
    """Store the cache as ``dtype`` (``fp8``) through Q/DQ at the graph's cache inputs and
    outputs, with one scale per KV head (axis 1 of ``[batch, kv_heads, seq, head_dim]``) or
    per tensor, from ``amax`` (``key``/``value``: ``[layers, kv_heads, head_dim]``). Returns the
    number of cache tensors quantized (2 per layer); raises PassError when a layer's cache is
    not graph IO."""
    if dtype not in QDQ_CACHE_TYPES:
        raise PassError(f"kv_cache.dtype={dtype!r}: Q/DQ caches are {', '.join(QDQ_CACHE_TYPES)}")
    if opset < FP8_MIN_OPSET:
        raise PassError(
            f"kv_cache.dtype={dtype} needs export.opset >= {FP8_MIN_OPSET} (got {opset}): set "
            f"export.opset={FP8_MIN_OPSET} or higher"
        )
    element = QDQ_CACHE_TYPES[dtype]
    inputs = {m.groups(): v for v in graph.inputs if (m := _CACHE_INPUT.match(v.name or ""))}
    outputs = {m.groups(): i for i, v in enumerate(graph.outputs) if (m := _CACHE_OUTPUT.match(v.name or ""))}
    if not inputs or set(inputs) != set(outputs):
        raise PassError(
            f"kv_cache.dtype={dtype}: the graph's past_key_values.* inputs and present.* outputs do not "
            "pair up; re-export it"
        )
    first = graph.node(0)
    axis = [ir.AttrInt64("axis", 1)] if per_head else []
    for (layer, kind), past in sorted(inputs.items()):
        scale = fp8_scales(amax[kind][int(layer)], per_head)
        zero = np.zeros(scale.shape, dtype=element.numpy())  # symmetric: the zero point sets the type
        qparams = [
            add_initializer(graph, scale, f"kv_scale.{layer}.{kind}"),
            add_initializer(graph, zero, f"kv_zero_point.{layer}.{kind}"),
        ]
        users = list(past.uses())
        dequantize = _qdq("DequantizeLinear", past, qparams, axis, f"kv_dequantize.{layer}.{kind}")
        graph.insert_before(first, dequantize)
        dequantized = _name_output(dequantize, f"{past.name}.dequantized", past, ir.DataType.FLOAT)
        for user, slot in users:
            user.replace_input_with(slot, dequantized)
        past.dtype = element

        index = outputs[(layer, kind)]
        present = graph.outputs[index]
        name = present.name
        present.name = f"{name}.unquantized"
        quantize = _qdq("QuantizeLinear", present, qparams, axis, f"kv_quantize.{layer}.{kind}")
        graph.append(quantize)
        graph.outputs[index] = _name_output(quantize, name, present, element)
    return len(inputs)


def _qdq(op: str, value: ir.Value, qparams: list[ir.Value], axis: list[Any], name: str) -> ir.Node:
    return ir.Node("", op, inputs=[value, *qparams], attributes=axis, name=name)


def _name_output(node: ir.Node, name: str, like: ir.Value, dtype: ir.DataType) -> ir.Value:
    """``node``'s output named ``name``, with ``like``'s shape and element type ``dtype``."""
    output = node.outputs[0]
    output.name, output.shape, output.type = name, like.shape, ir.TensorType(dtype)
    return output


def restore_fp32_cache(model: Any) -> int:
    """Undo ``set_cache_dtype`` and ``quantize_cache_io`` on an ``onnx.ModelProto`` in place:
    fp32 caches, no scales, no quantization attributes, the cache Q/DQ nodes made Identity (the
    exact graph the fusion itself is judged on). Returns the number of nodes changed."""
    import onnx

    graph = model.graph
    caches: set[str] = set()
    restored = 0
    inputs = {v.name for v in graph.input if _CACHE_INPUT.match(v.name)}
    outputs = {v.name for v in graph.output if _CACHE_OUTPUT.match(v.name)}
    for node in graph.node:
        if (node.op_type == "DequantizeLinear" and node.input[0] in inputs) or (
            node.op_type == "QuantizeLinear" and node.output[0] in outputs
        ):
            node.op_type = "Identity"
            del node.input[1:]
            del node.attribute[:]
            caches.update((node.input[0], node.output[0]))
            restored += 1
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
