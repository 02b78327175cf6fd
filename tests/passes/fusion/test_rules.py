"""Each rule family on the tiny Llama graph (2 layers, 4 heads, 2 KV heads): how many sites it
rewrites, and the rewritten graph's logits against the unfused graph, prefill and decode."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from passes.fusion.fuse import RULE_FAMILIES, ModelFacts
from pipeline.core.artifacts import Artifact
from tests.passes.fusion.conftest import prepared_model

# family -> (sites on the 2-layer graph, op it emits); each family runs after those before it.
EXPECTED = {
    "rms_norm": (5, "SimplifiedLayerNormalization"),  # 2 per layer + the final norm
    "skip_rms_norm": (4, "SkipSimplifiedLayerNormalization"),  # every norm after a residual add
    "rotary_embedding": (4, "RotaryEmbedding"),  # Q and K per layer
    "group_query_attention": (2, "GroupQueryAttention"),
}


def ops(model: Any) -> Counter[str]:
    return Counter(node.op_type for node in model.graph)


def test_attention_fusion_leaves_no_attention_decomposition(
    tiny_graph: Artifact, tiny_facts: ModelFacts, fused_parity: Any
) -> None:
    model = fully_fused("ort", tiny_graph, tiny_facts, fused_parity)
    counts = ops(model)
    for decomposed in ("Softmax", "Concat", "Expand", "Transpose", "RotaryEmbedding", "Neg", "Pow"):
        assert counts[decomposed] == 0, (decomposed, counts)
    assert counts["MatMul"] == 2 * 7 + 1  # q k v o gate up down per layer, lm_head
    present = [value.name for value in model.graph.outputs if value.name.startswith("present.")]
    assert all(value.producer().op_type == "GroupQueryAttention" for value in model.graph.outputs[1:])
    assert len(present) == 4


def test_rules_match_nothing_on_a_graph_without_their_pattern(
    tiny_graph: Artifact, tiny_facts: ModelFacts
) -> None:
    """Attention without rotary (the rotary family not run) is not fused: the rule needs
    RotaryEmbedding nodes, and a half-fused attention must not appear."""
    model = prepared_model(tiny_graph)
    assert RULE_FAMILIES["group_query_attention"](model, tiny_facts) == 0
    assert RULE_FAMILIES["skip_rms_norm"](model, tiny_facts) == 0  # no SimplifiedLayerNormalization yet


# The TensorRT rule set: ONNX standard ops of opset 23 (the pass converts the graph first).
STANDARD = {
    "onnx_rms_norm": (5, "RMSNormalization"),
    "onnx_rotary_embedding": (4, "RotaryEmbedding"),
    "onnx_attention": (2, "Attention"),
}


def opset23_model(tiny_graph: Artifact) -> Any:
    from onnxscript import version_converter

    model = prepared_model(tiny_graph)
    version_converter.convert_version(model, target_version=23)
    return model


# rule set -> (families in order with their sites and op, how the graph is prepared for them)
RULE_SETS = {"ort": (EXPECTED, prepared_model), "tensorrt": (STANDARD, opset23_model)}


def fully_fused(rule_set: str, tiny_graph: Artifact, tiny_facts: ModelFacts, fused_parity: Any) -> Any:
    """The tiny graph after every family of a rule set, dead nodes removed."""
    families, load = RULE_SETS[rule_set]
    model = load(tiny_graph)
    for family in families:
        RULE_FAMILIES[family](model, tiny_facts)
    fused_parity(model)  # saves the graph, removing dead nodes
    return model


@pytest.mark.parametrize(
    ("rule_set", "family"),
    [(name, family) for name, (families, _) in RULE_SETS.items() for family in families],
)
def test_each_rule_family_rewrites_every_site_and_keeps_the_logits(
    rule_set: str, family: str, tiny_graph: Artifact, tiny_facts: ModelFacts, fused_parity: Any
) -> None:
    families, load = RULE_SETS[rule_set]
    order = list(families)
    model = load(tiny_graph)
    for earlier in order[: order.index(family)]:
        RULE_FAMILIES[earlier](model, tiny_facts)
    sites, op = families[family]
    assert RULE_FAMILIES[family](model, tiny_facts) == sites
    parity = fused_parity(model)
    assert ops(model)[op] == sites
    assert parity["top1_agreement"] == 1.0
    assert parity["max_abs_diff"] < 1e-4


def test_the_standard_op_rule_set_leaves_no_contrib_op_and_no_decomposition(
    tiny_graph: Artifact, tiny_facts: ModelFacts, fused_parity: Any
) -> None:
    model = fully_fused("tensorrt", tiny_graph, tiny_facts, fused_parity)
    assert {node.domain for node in model.graph} == {""}  # nothing but the ONNX domain
    counts = ops(model)
    for decomposed in ("Softmax", "Neg", "Pow", "Sqrt", "Cos", "Sin"):
        assert counts[decomposed] == 0, (decomposed, counts)
    past = {value.name for value in model.graph.inputs if value.name.startswith("past_key_values.")}
    assert not [n for n in model.graph if n.op_type == "Concat" and {i.name for i in n.inputs} & past]
    assert all(value.producer().op_type == "Attention" for value in model.graph.outputs[1:])


def test_standard_attention_keeps_left_padding(
    tiny_graph: Artifact, tiny_facts: ModelFacts, tmp_path: Any
) -> None:
    """Attention-23 takes the graph's own additive mask: a left-padded row of a batch gets the
    logits it gets alone (GroupQueryAttention cannot, it masks from lengths)."""
    import numpy as np

    from pipeline.core.engine import graph_io
    from pipeline.runtime.ort import OrtModel
    from tests.passes.fusion.conftest import save_beside

    model = opset23_model(tiny_graph)
    for family in STANDARD:
        RULE_FAMILIES[family](model, tiny_facts)
    folder = save_beside(model, tiny_graph, tmp_path / "fused")
    fused = OrtModel(folder / "model.onnx", graph_io(folder))
    alone, _ = fused.step(
        np.array([[5, 6, 7]]), np.ones((1, 3), np.int64), np.arange(3)[None], fused.empty_cache(1)
    )
    ids = np.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    batch, _ = fused.step(ids, mask, positions, fused.empty_cache(2))
    assert np.abs(batch[0, 2:] - alone[0]).max() < 1e-4
