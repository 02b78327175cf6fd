"""Attention rule: grouped-query attention with rotary Q/K, KV-cache concat, K/V head repeat,
scaled softmax and the output transpose becomes one ``com.microsoft.GroupQueryAttention``
(rotary inside: ``do_rotary=1``; the cache is appended inside the kernel).

Algorithm: Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from
Multi-Head Checkpoints". Spec: ONNX Runtime contrib op ``GroupQueryAttention``
(``docs/ContribOperators.md``): query [B, S, H*D], key/value [B, S, Hkv*D], past/present
[B, Hkv, T, D], ``seqlens_k`` = valid tokens - 1 per row (int32), ``total_sequence_length``
(int32 scalar), cos/sin caches [max_positions, D/2]. It runs after the rotary rule, whose
``RotaryEmbedding`` nodes and caches it absorbs.
GroupQueryAttention masks causally from ``seqlens_k`` alone: it supports right padding, not the
left padding of a batched prompt, which is why a fused engine records ``left_padding: false``
(``pipeline.runtime`` then pads a batch of unequal prompts on the right instead).
onnxscript's ``ort_fusions.gqa`` matches the dynamo exporter's SDPA and transformers' mask
construction; the TorchScript export traces eager attention, hence this rule. It matches from
the attention output alone (a pattern with the two cache outputs as well makes onnxscript's
matcher try every combination of candidate nodes: minutes on a 30-layer graph);
``reroute_cache_outputs`` then points ``present.*`` at the kernel's cache outputs.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes.fusion.common import constant_scalar

BHSD = [0, 2, 1, 3]


def _repeat_heads(op: Any, cache: Any) -> Any:
    """transformers' ``repeat_kv``: absent when every query head has its own KV head."""
    repeated = op.Reshape(op.Expand(op.Unsqueeze(cache, [2]), pattern.ANY_VALUE), pattern.ANY_VALUE)
    return pattern.OrValue([repeated, cache])


class GroupQueryAttention(pattern.RewriteRuleClassBase):
    def __init__(
        self,
        name: str,
        attention_mask: ir.Value,
        heads: tuple[int, int],
        divide: bool,
        window: int = -1,
        window_cache: bool = False,
    ) -> None:
        super().__init__(name, remove_nodes=False)
        self._attention_mask = attention_mask
        self._num_heads, self._kv_heads = heads
        self._divide = divide
        self._window = window
        # The cache holds the window only (ORT's sliding_window_cache: evicts in place).
        self._window_cache = window_cache

    def pattern(
        self,
        op: Any,
        query: Any,
        key: Any,
        value: Any,
        past_key: Any,
        past_value: Any,
        position_ids: Any,
        cos_cache: Any,
        sin_cache: Any,
        scale: Any,
        mask: Any,
    ) -> Any:
        """The exported attention: rotary Q/K, cache concat, head repeat, scaled scores plus the
        additive mask, softmax, weighted values (the context [B, H, S, D]), then ``output``."""

        def heads(x: Any, name: str) -> Any:
            return op.Transpose(op.Reshape(x, pattern.ANY_VALUE), perm=BHSD, _outputs=[name])

        def rope(x: Any, name: str) -> Any:
            return self.rope(op, x, position_ids, cos_cache, sin_cache, name)

        query_rotated = rope(heads(query, "query_heads"), "query_rotated")
        present_key = op.Concat(past_key, rope(heads(key, "key_heads"), "key_rotated"), axis=-2)
        present_value = op.Concat(past_value, heads(value, "value_heads"), axis=-2)
        keys = op.Transpose(_repeat_heads(op, present_key), perm=[0, 1, 3, 2])
        scores = op.MatMul(query_rotated, keys)
        scores = op.Div(scores, scale) if self._divide else op.Mul(scores, scale)
        probs = op.Softmax(op.Add(scores, mask), axis=-1)
        return self.output(op, op.MatMul(probs, _repeat_heads(op, present_value)))

    def rope(self, op: Any, x: Any, position_ids: Any, cos_cache: Any, sin_cache: Any, name: str) -> Any:
        """The rotary node the rotary family left (here ONNX Runtime's contrib op)."""
        return op.RotaryEmbedding(
            x, position_ids, cos_cache, sin_cache, interleaved=0, _domain="com.microsoft", _outputs=[name]
        )

    def output(self, op: Any, context: Any) -> Any:
        """What the match ends with: here the context back to [B, S, H*D] (the kernel's output)."""
        return op.Reshape(op.Transpose(context, perm=BHSD), pattern.ANY_VALUE)

    def check(
        self,
        context: Any,
        query: Any,
        key: Any,
        value: Any,
        query_heads: Any,
        scale: Any,
        mask: Any,
        past_key: Any,
        past_value: Any,
        position_ids: Any = None,
        **_: Any,
    ) -> Any:
        result = pattern.MatchResult()
        graph = context.graph_or_function
        # The kernel's own rotary counts positions from the cache length; positions computed in
        # the graph (longrope's shift into its long rows, rotary.py) rotate before it instead.
        self._rotary_inside = position_ids is None or position_ids in graph.inputs
        if past_key not in graph.inputs or past_value not in graph.inputs:
            return result.fail(
                "the concatenated K/V are not the graph's past cache inputs", [past_key, past_value]
            )
        if self._attention_mask not in _graph_inputs_above(mask, graph):
            return result.fail("the attention mask does not come from attention_mask", mask)
        factor = constant_scalar(scale)
        if not isinstance(factor, float | int) or factor == 0:
            return result.fail("the score scale is not a constant", scale)
        # Head counts come from the model config; where shape inference knows the projection
        # widths (not through contrib ops such as MatMulNBits) they must agree with it.
        head_dim = _last_dim(query_heads)
        if head_dim is not None:
            expected = (self._num_heads * head_dim, self._kv_heads * head_dim, self._kv_heads * head_dim)
            for projection, width in zip((query, key, value), expected, strict=True):
                if _last_dim(projection) not in (None, width):
                    return result.fail("projection width disagrees with the config's head counts", projection)
        self._scale = 1.0 / factor if self._divide else float(factor)
        return result

    def rewrite(
        self,
        op: Any,
        query: Any,
        key: Any,
        value: Any,
        past_key: Any,
        past_value: Any,
        cos_cache: Any,
        sin_cache: Any,
        position_ids: Any = None,
        **_: Any,
    ) -> Any:
        mask = self._attention_mask
        rotary: dict[str, Any] = {"do_rotary": 1, "rotary_interleaved": 0}
        tables = [cos_cache, sin_cache]
        if not self._rotary_inside:  # q and k rotated apart, on [batch, seq, heads * head_dim]
            query, key = (
                op.RotaryEmbedding(
                    x,
                    position_ids,
                    cos_cache,
                    sin_cache,
                    interleaved=0,
                    num_heads=heads,
                    _domain="com.microsoft",
                )
                for x, heads in ((query, self._num_heads), (key, self._kv_heads))
            )
            rotary, tables = {"do_rotary": 0}, []
        valid = op.ReduceSum(mask, op.Constant(value_ints=[1]), keepdims=0)
        seqlens_k = op.Cast(op.Sub(valid, op.Constant(value_int=1)), to=ir.DataType.INT32)
        total = op.Gather(op.Shape(mask), op.Constant(value_int=1), axis=0)
        total_length = op.Cast(total, to=ir.DataType.INT32)
        attended, _present_key, _present_value = op.GroupQueryAttention(
            query,
            key,
            value,
            past_key,
            past_value,
            seqlens_k,
            total_length,
            *tables,
            num_heads=self._num_heads,
            kv_num_heads=self._kv_heads,
            scale=self._scale,
            **rotary,
            local_window_size=self._window,
            sliding_window_cache=int(self._window_cache),
            _domain="com.microsoft",
            _outputs=3,
        )
        return attended


def _last_dim(value: ir.Value) -> int | None:
    if value.shape is None or value.shape.rank() < 1 or not isinstance(value.shape[-1], int):
        return None
    return value.shape[-1]


def _graph_inputs_above(value: ir.Value, graph: Any, limit: int = 400) -> list[ir.Value]:
    """Graph inputs among the ancestors of ``value`` (constants and initializers excluded)."""
    inputs, seen, stack = [], set(), [value]
    while stack and len(seen) < limit:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if current in graph.inputs:
            inputs.append(current)
        producer = current.producer()
        if producer is not None:
            stack.extend(v for v in producer.inputs if v is not None)
    return inputs


# (past input, new K/V input, present output) slots of the attention kernels.
GQA_CACHE_SLOTS = ((3, 1, 1), (4, 2, 2))


def reroute_cache_outputs(
    graph: ir.Graph,
    op_type: str = "GroupQueryAttention",
    domain: str = "com.microsoft",
    slots: tuple[tuple[int, int, int], ...] = GQA_CACHE_SLOTS,
) -> int:
    """Point each layer's ``present.*`` at its attention kernel's cache outputs.

    The rule matches from the attention output alone: a pattern with three output nodes makes
    onnxscript's matcher try every combination of candidate nodes (minutes on a 30-layer graph).
    The replaced ``Concat(past, new)`` nodes are then unused and removed with the other dead nodes.
    """
    rerouted = 0
    for node in list(graph):
        if node.op_type != op_type or node.domain != domain:
            continue
        for past_slot, new_slot, present_slot in slots:
            past, fresh = node.inputs[past_slot], node.inputs[new_slot]
            for user, _ in list(past.uses()):
                if user is node or user.op_type != "Concat" or not _appends(user, past, fresh):
                    continue
                _replace_value(graph, user.outputs[0], node.outputs[present_slot])
                rerouted += 1
    return rerouted


def _appends(concat: ir.Node, past: ir.Value, fresh: ir.Value) -> bool:
    """``concat`` is ``Concat(past, fresh, axis=-2)`` or ``Concat(past, heads(fresh) [rotated],
    axis=-2)`` for this layer's new K or V."""
    if concat.attributes.get_int("axis", 0) != -2 or len(concat.inputs) != 2 or concat.inputs[0] is not past:
        return False
    value = concat.inputs[1]
    if value is fresh:
        return True
    rotated = fresh.producer() if fresh is not None else None
    if rotated is not None and rotated.op_type == "RotaryEmbedding":  # rotated before the kernel
        fresh = rotated.inputs[0]
    for expected in ("RotaryEmbedding", "Transpose", "Reshape"):
        producer = value.producer() if value is not None else None
        if producer is None:
            return False
        if producer.op_type != expected:
            if expected == "RotaryEmbedding":
                continue  # values are not rotated
            return False
        value = producer.inputs[0]
    return value is fresh


def _replace_value(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """Replace every use of ``old`` by ``new``; a graph output keeps its name."""
    name, was_output = old.name, old.is_graph_output()
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    if was_output:
        old.name = f"{name}__replaced"
        new.name = name


def expose_head_norms(graph: ir.Graph) -> int:
    """Make a per-head q/k norm (Qwen3's ``q_norm``/``k_norm``: RMSNorm over each head's values,
    between the projection's head reshape and the transpose) visible to the attention rule.

    GroupQueryAttention takes Q and K as [B, S, H*D] and rotates them itself; the norm comes
    before rotary, so it stays outside the kernel: ``Transpose(Norm(Reshape(x, s)))`` becomes
    ``Transpose(Reshape(Reshape(Norm(Reshape(x, s)), [0, 0, -1]), s))``, whose inner
    ``Reshape(..., [0, 0, -1])`` is the [B, S, H*D] input the rule hands the kernel (the outer
    pair goes with the matched nodes). Runs after the rms_norm rules made the norm one node.

    Gemma 3 normalizes after the transpose (``Norm(Transpose(Reshape(x, s)))``); a norm over each
    head's values commutes with the transpose, so the norm moves before it first."""
    exposed = 0
    for node in list(graph):
        if node.op_type != "SimplifiedLayerNormalization" or node.attributes.get_int("axis", -1) != -1:
            continue
        _move_before_transpose(graph, node)
        reshape = node.inputs[0].producer() if node.inputs[0] is not None else None
        users = [user for user, _ in node.outputs[0].uses()]
        if reshape is None or reshape.op_type != "Reshape" or len(users) != 1:
            continue
        transpose = users[0]
        if transpose.op_type != "Transpose" or list(transpose.attributes.get_ints("perm", [])) != BHSD:
            continue
        flat_shape = ir.Value(name=f"{node.name}_flat_shape")
        flat_shape.const_value = ir.tensor(np.array([0, 0, -1], dtype=np.int64), name=flat_shape.name)
        graph.register_initializer(flat_shape)
        flat = ir.node("Reshape", [node.outputs[0], flat_shape], name=f"{node.name}_flat")
        heads = ir.node("Reshape", [flat.outputs[0], reshape.inputs[1]], name=f"{node.name}_heads")
        graph.insert_after(node, [flat, heads])
        transpose.replace_input_with(0, heads.outputs[0])
        exposed += 1
    return exposed


def _move_before_transpose(graph: ir.Graph, norm: ir.Node) -> None:
    """``Norm(Transpose(Reshape(x, s), BHSD))`` -> ``Transpose(Norm(Reshape(x, s)), BHSD)`` where
    the transpose feeds only the norm: the same values (the norm is over the last axis, which
    the transpose keeps last), in the order :func:`expose_head_norms` reads."""
    transpose = norm.inputs[0].producer() if norm.inputs[0] is not None else None
    if transpose is None or transpose.op_type != "Transpose":
        return
    if list(transpose.attributes.get_ints("perm", [])) != BHSD or len(transpose.outputs[0].uses()) != 1:
        return
    reshape = transpose.inputs[0].producer() if transpose.inputs[0] is not None else None
    if reshape is None or reshape.op_type != "Reshape":
        return
    after = list(norm.outputs[0].uses())
    moved = ir.node("Transpose", [norm.outputs[0]], attributes={"perm": BHSD}, name=f"{norm.name}_transpose")
    norm.replace_input_with(0, transpose.inputs[0])
    graph.insert_after(norm, [moved])
    for user, index in after:
        user.replace_input_with(index, moved.outputs[0])
    graph.remove(transpose, safe=True)


def set_layer_windows(graph: ir.Graph, windows: tuple[int, ...]) -> list[str]:
    """Give each layer's ``GroupQueryAttention`` its own ``local_window_size``: ``windows[i]``
    for the kernel whose past key is the graph input ``past_key_values.{i}.key`` (through a
    ``Cast``, as an fp16 graph with fp32 IO has it); 0: none, -1 for the kernel. The rule itself
    sets one window for all. Returns the kernels whose layer could not be told (none where every
    layer's window is set)."""
    unknown = []
    for node in graph:
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            continue
        past = node.inputs[3] if len(node.inputs) > 3 else None
        while past is not None and past.producer() is not None and past.producer().op_type == "Cast":
            past = past.producer().inputs[0]
        match = re.fullmatch(r"past_key_values\.(\d+)\.key", (past.name or "") if past is not None else "")
        if match is None or int(match.group(1)) >= len(windows):
            unknown.append(node.name or "GroupQueryAttention")
            continue
        size = windows[int(match.group(1))]
        node.attributes["local_window_size"] = ir.AttrInt64("local_window_size", size or -1)
        if not size and "sliding_window_cache" in node.attributes:  # a full layer keeps max_length
            node.attributes["sliding_window_cache"] = ir.AttrInt64("sliding_window_cache", 0)
    return unknown


def attention_rules(
    attention_mask: ir.Value, num_heads: int, num_kv_heads: int, window: int = -1, window_cache: bool = False
) -> pattern.RewriteRuleSet:
    heads = (num_heads, num_kv_heads)
    return pattern.RewriteRuleSet(
        [
            GroupQueryAttention.rule(
                name, attention_mask, heads, divide=divide, window=window, window_cache=window_cache
            )
            for name, divide in (("GroupQueryAttention", False), ("GroupQueryAttentionDiv", True))
        ]
    )
