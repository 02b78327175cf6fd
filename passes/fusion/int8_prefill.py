"""The prefill graph of an int8-KV engine: the same model, its attention in fp32 over keys and
values quantized once, for steps of many new tokens.

Why: ONNX Runtime's CPU GroupQueryAttention with an int8 cache (``kv_cache_dtype.py``,
``PER_CHANNEL``) dequantizes inside the attention loop, which is bandwidth-cheap for a decode
step but leaves prefill off the fp32 GEMM path: the default model's int4_awq engine reaches its
first token after a 512-token prompt in 906 ms on the kernel and 543 ms with this graph, after
2048 tokens in 8.4 s and 3.0 s (the same recipe with an fp32 cache: 649 ms and 3.5 s; 2 cores,
ONNX Runtime 1.32; ``benchmarks/kv_int8_prefill.py``). The kernel attends over
the dequantized cache for every token, the new ones included (prefilling 40 tokens at once or
in two chunks gives bit-identical logits), so prefix-cache hits and chunked prefill are exact.

What: per layer, the attention's fused steps are spelled out so the quantization stays where the
kernel puts it and everything else runs on the fp32 path:

1. the packed QKV is split; Q and K get ONNX Runtime's ``RotaryEmbedding`` (the tables and
   interleaving of the attention node, positions ``max(length - new, 0) + i`` as the kernel
   derives them from ``seqlens_k``);
2. the new K and V are fake-quantized with the cache's per-channel scales, ``s * clip(round(x /
   s), -128, 127)`` (the range the kernel clips to, measured), so the attention reads exactly the
   values the int8 cache will hold;
3. the past cache (int8, as the engine keeps it) is dequantized, ``s * q``;
4. ``GroupQueryAttention`` with an fp32 cache and ``do_rotary=0`` attends; its present, the
   dequantized past and the fake-quantized new tokens, is quantized back to int8 (exact: every
   value is ``s * q``).

And the LM head computes only the positions a caller asks for: an extra input
``logits_positions`` [batch, k] (indices into the step's tokens; ``GatherND`` on the final hidden
states), so a prefill that only needs each row's last token skips the [tokens, vocab] product
(the default model at 2048 tokens: 367 of 2655 ms in an ONNX Runtime profile, and 400 MB of
logits) while scoring still
gets every position.

The graph's other inputs and outputs are the engine's own (int8 caches), so the runtime feeds it
the same cache, as a concat cache (``pipeline/runtime/ort.py`` copies the new positions into a
shared buffer). It reads the engine's weights from the same external-data file.

Not a pattern rule: it rewrites nodes the attention rule already made, one graph variant for the
engine build (``passes/ort_build.py``); the protobuf is edited directly, as in
``kv_cache_dtype.restore_fp32_cache``, so the weights are never loaded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.core.engine import LOGITS_POSITIONS
from pipeline.core.errors import PassError

PREFILL_MODEL_FILE = "model.prefill.onnx"
INT8_RANGE = (-128.0, 127.0)  # GroupQueryAttention's int8 cache saturates here (measured)
# GroupQueryAttention's inputs (ONNX Runtime contrib op spec).
_QUERY, _KEY, _VALUE, _PAST_KEY, _PAST_VALUE, _SEQLENS_K = 0, 1, 2, 3, 4, 5
_COS, _SIN, _K_SCALE, _V_SCALE = 7, 8, 12, 13
_QUANT_ATTRIBUTES = ("k_quant_type", "v_quant_type", "kv_cache_bit_width")


def is_int8_cache(model: Any) -> bool:
    """Whether ``model`` (``onnx.ModelProto``) holds a GroupQueryAttention with an int8 cache."""
    return any(_quantized(node) for node in model.graph.node)


def _quantized(node: Any) -> bool:
    return (
        node.op_type == "GroupQueryAttention"
        and node.domain == "com.microsoft"
        and any(a.name == "k_quant_type" and a.s != b"NONE" for a in node.attribute)
    )


def prefill_model(model: Any) -> int:
    """Rewrite ``model`` (``onnx.ModelProto``, weights not loaded) in place into the prefill
    graph described in the module docstring; returns the number of attention nodes rewritten and
    raises PassError when there is none or one lacks what the rewrite needs."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    names = _Names({v.name for v in (*graph.input, *graph.output, *graph.value_info)} | set(initializers))
    for node in graph.node:
        names.taken.update(node.output)

    def constant(array: np.ndarray, name: str) -> str:
        unique = names.new(name)
        graph.initializer.append(numpy_helper.from_array(array, unique))
        return unique

    def node(op: str, inputs: list[str], name: str, domain: str = "", **attributes: Any) -> tuple[Any, str]:
        output = names.new(name)
        return helper.make_node(op, inputs, [output], name=output, domain=domain, **attributes), output

    low = constant(np.array(INT8_RANGE[0], np.float32), "int8_min")
    high = constant(np.array(INT8_RANGE[1], np.float32), "int8_max")
    rewritten: list[Any] = []
    positions: str | None = None
    count = 0
    for attention in graph.node:
        if not _quantized(attention):
            rewritten.append(attention)
            continue
        layer = count
        inputs = list(attention.input) + [""] * (14 - len(attention.input))
        attributes = {a.name: helper.get_attribute_value(a) for a in attention.attribute}
        scales = {}
        for kind, slot in (("key", _K_SCALE), ("value", _V_SCALE)):
            if inputs[slot] not in initializers:
                raise PassError(f"{attention.name}: its {kind} cache scale is not an initializer")
            scales[kind] = numpy_helper.to_array(initializers[inputs[slot]]).astype(np.float32)
        kv_heads, heads = int(attributes["kv_num_heads"]), int(attributes["num_heads"])
        head_dim = scales["key"].shape[-1]
        before: list[Any] = []

        # steps 1-2 (module docstring): Q, K, V split, Q and K rotated as the kernel would
        if inputs[_KEY]:
            query, key, value = inputs[_QUERY], inputs[_KEY], inputs[_VALUE]
        else:
            split = constant(
                np.array([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]), "qkv_split"
            )
            outputs = [names.new(f"prefill.{layer}.{part}") for part in ("query", "key", "value")]
            before.append(
                helper.make_node("Split", [inputs[_QUERY], split], outputs, axis=-1, name=outputs[0])
            )
            query, key, value = outputs
        if attributes.get("do_rotary", 0):
            if positions is None:
                position_nodes, positions = _positions(node, constant, inputs[_SEQLENS_K], _input_ids(graph))
                before.extend(position_nodes)
            rotary = {"interleaved": int(attributes.get("rotary_interleaved", 0))}
            for part in ("query", "key"):
                source = query if part == "query" else key
                made, rotated = node(
                    "RotaryEmbedding",
                    [source, positions, inputs[_COS], inputs[_SIN]],
                    f"prefill.{layer}.{part}.rotated",
                    domain="com.microsoft",
                    **rotary,
                    num_heads=heads if part == "query" else kv_heads,
                )
                before.append(made)
                query, key = (rotated, key) if part == "query" else (query, rotated)

        # steps 3-4: the new K, V fake-quantized; the past dequantized
        quantized_inputs = {}
        for kind, new, past in (("key", key, inputs[_PAST_KEY]), ("value", value, inputs[_PAST_VALUE])):
            flat = constant(scales[kind].reshape(-1), f"kv_scale.{layer}.{kind}.flat")
            steps = [("Div", [flat]), ("Round", []), ("Clip", [low, high]), ("Mul", [flat])]
            current = new
            for op, extra in steps:
                made, current = node(op, [current, *extra], f"prefill.{layer}.{kind}.{op.lower()}")
                before.append(made)
            cast, as_float = node("Cast", [past], f"{past}.float", to=TensorProto.FLOAT)
            scaled, dequantized = node(
                "Mul", [as_float, inputs[_K_SCALE if kind == "key" else _V_SCALE]], f"{past}.dequantized"
            )
            before.extend([cast, scaled])
            quantized_inputs[kind] = (current, dequantized)

        # steps 5-6: fp32 attention; its present quantized back into the int8 outputs
        new_inputs = inputs[:_K_SCALE]
        new_inputs[_QUERY], new_inputs[_KEY], new_inputs[_VALUE] = (
            query,
            *[quantized_inputs[k][0] for k in ("key", "value")],
        )
        new_inputs[_PAST_KEY], new_inputs[_PAST_VALUE] = (quantized_inputs[k][1] for k in ("key", "value"))
        new_inputs[_COS] = new_inputs[_SIN] = ""
        while new_inputs and not new_inputs[-1]:
            new_inputs.pop()
        kept = {k: v for k, v in attributes.items() if k not in _QUANT_ATTRIBUTES}
        kept["do_rotary"] = 0
        presents = list(attention.output[1:3])
        outputs = [attention.output[0], *(names.new(f"{p}.float") for p in presents)]
        after: list[Any] = []
        for present, unquantized, slot in zip(presents, outputs[1:], (_K_SCALE, _V_SCALE), strict=True):
            current = unquantized
            for op, extra in (("Div", [inputs[slot]]), ("Round", []), ("Clip", [low, high])):
                made, current = node(op, [current, *extra], f"{present}.{op.lower()}")
                after.append(made)
            after.append(
                helper.make_node("Cast", [current], [present], to=TensorProto.INT8, name=f"{present}.int8")
            )
        fp32_attention = helper.make_node(
            "GroupQueryAttention", new_inputs, outputs, name=attention.name, domain="com.microsoft", **kept
        )
        rewritten.extend([*before, fp32_attention, *after])
        count += 1
    if not count:
        raise PassError("the graph has no GroupQueryAttention with an int8 cache: no prefill graph to make")
    del graph.node[:]
    graph.node.extend(rewritten)
    _select_logits(graph, node, constant)
    return count


def _select_logits(graph: Any, node: Any, constant: Any) -> None:
    """Feed the LM head only the hidden states at ``logits_positions`` (per row)."""
    from onnx import TensorProto, helper

    index, head = next(
        ((i, n) for i, n in enumerate(graph.node) if n.output and n.output[0] == "logits"),
        (-1, None),
    )
    if head is None or head.op_type not in ("MatMul", "MatMulNBits", "Gemm"):
        raise PassError("the graph's logits do not come from one LM head matmul: no prefill graph to make")
    graph.input.append(
        helper.make_tensor_value_info(LOGITS_POSITIONS, TensorProto.INT64, ["batch_size", "logits_positions"])
    )
    axis = constant(np.array([-1], np.int64), "axis_last")
    unsqueeze, indices = node("Unsqueeze", [LOGITS_POSITIONS, axis], "prefill.logits_indices")
    gather, selected = node("GatherND", [head.input[0], indices], "prefill.selected_hidden", batch_dims=1)
    head.input[0] = selected
    for offset, made in enumerate((unsqueeze, gather)):
        graph.node.insert(index + offset, made)


def _input_ids(graph: Any) -> str:
    if not any(value.name == "input_ids" for value in graph.input):
        raise PassError("the graph has no input_ids input: no prefill graph to make")
    return "input_ids"


def _positions(node: Any, constant: Any, seqlens_k: str, input_ids: str) -> tuple[list[Any], str]:
    """Nodes computing each new token's position ``[batch, new]``, ``max(length - new, 0) + i``
    with ``length = seqlens_k + 1``: the kernel's own rule (a first prompt starts at 0)."""
    from onnx import TensorProto

    one = constant(np.array(1, np.int64), "one")
    zero = constant(np.array(0, np.int64), "zero")
    axis = constant(np.array([1], np.int64), "axis_1")
    nodes = []
    shape, shape_out = node("Shape", [input_ids], "prefill.new_shape", start=1, end=2)
    squeeze, new = node("Squeeze", [shape_out], "prefill.new")
    cast, lengths = node("Cast", [seqlens_k], "prefill.lengths_minus_one", to=TensorProto.INT64)
    add, length = node("Add", [lengths, one], "prefill.lengths")
    sub, start = node("Sub", [length, new], "prefill.start_signed")
    clamp, first = node("Max", [start, zero], "prefill.start")
    unsqueeze, column = node("Unsqueeze", [first, axis], "prefill.start_column")
    arange, offsets = node("Range", [zero, new, one], "prefill.offsets")
    total, positions = node("Add", [column, offsets], "prefill.position_ids")
    nodes += [shape, squeeze, cast, add, sub, clamp, unsqueeze, arange, total]
    return nodes, positions


class _Names:
    """Value names not yet used in the graph."""

    def __init__(self, taken: set[str]) -> None:
        self.taken = taken

    def new(self, name: str) -> str:
        unique, index = name, 0
        while unique in self.taken:
            index += 1
            unique = f"{name}_{index}"
        self.taken.add(unique)
        return unique
