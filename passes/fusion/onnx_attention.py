"""Attention rule for standard-op targets (TensorRT): the decomposed grouped-query attention
(rotary Q/K, KV-cache concat, K/V head repeat, scaled softmax with the additive mask) becomes the
ONNX standard ``Attention`` of opset 23, which takes past K/V and returns the present cache.

Algorithm: Ainslie et al. 2023, "GQA". Spec: ONNX ``Attention``-23 (4-D inputs: Q [B, Hq, S, D],
K/V [B, Hkv, S, D] with Hq a multiple of Hkv; ``attn_mask`` additive, broadcast to
[B, Hq, S, T]; ``past_key``/``past_value`` [B, Hkv, P, D]; outputs Y [B, Hq, S, D] and
``present_key``/``present_value`` = past + new along the sequence). TensorRT's ONNX parser
imports it since 10.14 (onnx-tensorrt release notes); ONNX Runtime runs it on CPU, which is how
the rule is checked here. Unlike GroupQueryAttention it keeps the graph's own mask, so left
padding stays valid and the rotary embedding stays a separate (standard) node before it: the rule
runs after ``onnx_rotary_embedding`` and matches its ``RotaryEmbedding`` nodes.
"""

from __future__ import annotations

from typing import Any

from onnxscript.rewriter import pattern

from passes.fusion.attention import GroupQueryAttention, reroute_cache_outputs

# Attention-23: past_key 4 -> present_key output 1 (new K input 1), past_value 5 -> output 2.
ATTENTION_CACHE_SLOTS = ((4, 1, 1), (5, 2, 2))


class OnnxAttention(GroupQueryAttention):
    """The decomposition GroupQueryAttention matches, with standard RotaryEmbedding nodes, up to
    the attention context (before the output transpose) -> ``Attention``. The checks (cache from
    the graph inputs, mask from ``attention_mask``, constant scale, head widths) are the same."""

    def output(self, op: Any, context: Any) -> Any:
        """The match ends at the context [B, Hq, S, D]: Attention-23's output has that shape."""
        return context

    def rope(self, op: Any, x: Any, position_ids: Any, cos_cache: Any, sin_cache: Any, name: str) -> Any:
        """The standard RotaryEmbedding-23 (inputs ordered x, cos, sin, positions)."""
        return op.RotaryEmbedding(x, cos_cache, sin_cache, position_ids, interleaved=0, _outputs=[name])

    def rewrite(  # type: ignore[override]
        self,
        op: Any,
        query_rotated: Any,
        key_rotated: Any,
        value_heads: Any,
        past_key: Any,
        past_value: Any,
        mask: Any,
        **_: Any,
    ) -> Any:
        context, _present_key, _present_value = op.Attention(
            query_rotated, key_rotated, value_heads, mask, past_key, past_value, scale=self._scale, _outputs=3
        )
        return context


def onnx_attention_rules(attention_mask: Any, num_heads: int, num_kv_heads: int) -> pattern.RewriteRuleSet:
    heads = (num_heads, num_kv_heads)
    return pattern.RewriteRuleSet(
        [
            OnnxAttention.rule(name, attention_mask, heads, divide=divide)
            for name, divide in (("OnnxAttention", False), ("OnnxAttentionDiv", True))
        ]
    )


def reroute_attention_cache(graph: Any) -> int:
    """``present.*`` from each standard ``Attention``'s cache outputs. (The rewriter keeps only
    the outputs in use when it inserts a standard op, so the two cache outputs are added back.)"""
    for node in graph:
        if node.op_type == "Attention" and node.domain == "" and len(node.outputs) < 3:
            node.resize_outputs(3)
    return reroute_cache_outputs(graph, op_type="Attention", domain="", slots=ATTENTION_CACHE_SLOTS)
