"""The fusion pass: config checks, what it records, parity of prefill, decode and multi-token
continuation against the unfused graph, and the runtime's handling of a right-padding graph."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from passes.fusion.fuse import FusionPass
from passes.ort_build import OrtCpuBuildPass
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.engine import graph_io
from pipeline.core.errors import PassError
from pipeline.core.graph_io import load_proto
from pipeline.runtime.generate import GenerationConfig
from pipeline.runtime.ort import Engine, OrtModel
from tests.conftest import genai_greedy_tokens, run_pass


@pytest.fixture(scope="module")
def fused_graph(tiny_graph: Artifact, tmp_path_factory: pytest.TempPathFactory) -> tuple[Artifact, dict]:
    return run_pass(FusionPass(), tiny_graph, tmp_path_factory.mktemp("fused-graph"))


@pytest.fixture(scope="module")
def fused_engine(fused_graph: tuple[Artifact, dict], tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    return run_pass(OrtCpuBuildPass(), fused_graph[0], tmp_path_factory.mktemp("fused-engine"))[0]


def test_the_pass_records_rewrites_and_parity(fused_graph: tuple[Artifact, dict]) -> None:
    graph, metrics = fused_graph
    assert metrics["rewrites"] == {
        "rms_norm": 5,
        "skip_rms_norm": 4,
        "rotary_embedding": 4,
        "group_query_attention": 2,
        "packed_qkv": 2,
    }
    assert metrics["not_applicable"] == []
    assert metrics["warnings"] == []
    assert metrics["nodes"]["after"] < metrics["nodes"]["before"] / 3
    parity = metrics["parity_vs_input_graph"]
    assert parity["top1_agreement"] == 1.0 and parity["max_abs_diff"] < 1e-4
    io = graph.metadata["io"]
    assert io["left_padding"] is False  # GroupQueryAttention masks from lengths
    assert io["has_position_ids"] is False  # positions come from the cache length now
    assert graph.metadata["fusion"] == metrics["rewrites"]


def test_a_family_that_matches_nothing_is_a_warning(tiny_graph: Artifact, tmp_path: Path) -> None:
    metrics = FusionPass(rules=["group_query_attention"]).run(tiny_graph, tmp_path)
    assert metrics["rewrites"] == {"group_query_attention": 0}
    assert metrics["warnings"] == ["fusion rule 'group_query_attention' matched nothing on this graph"]


@pytest.mark.parametrize(
    ("rules", "message"),
    [(["rms_norm", "flash"], "unknown rule family 'flash'"), ([], "fusion.rules is empty")],
)
def test_bad_rule_lists_are_refused(rules: list[str], message: str) -> None:
    with pytest.raises(PassError, match=message):
        FusionPass(rules=rules)


def test_a_fused_graph_is_not_fused_twice(fused_graph: tuple[Artifact, dict]) -> None:
    with pytest.raises(PassError, match="already fused"):
        FusionPass().requires(fused_graph[0])


def test_continuation_on_a_cache_matches_the_unfused_graph(
    tiny_graph: Artifact, fused_graph: tuple[Artifact, dict]
) -> None:
    """lm-eval scoring runs several tokens on a cached prefix: GroupQueryAttention's
    past + multi-token path must give the unfused logits."""
    models = [OrtModel(a.path / "model.onnx", graph_io(a.path)) for a in (tiny_graph, fused_graph[0])]
    ids = np.random.default_rng(0).integers(3, 300, size=(1, 14))
    logits = []
    for model in models:
        _, cache = model.step(
            ids[:, :10], np.ones((1, 10), np.int64), np.arange(10)[None], model.empty_cache(1)
        )
        out, _ = model.step(ids[:, 10:], np.ones((1, 14), np.int64), np.arange(10, 14)[None], cache)
        logits.append(out)
    assert np.abs(logits[0] - logits[1]).max() < 1e-4


def test_unequal_prompts_on_a_right_padding_engine_decode_in_one_batch_as_if_alone(
    tiny_engine: Artifact, fused_engine: Artifact
) -> None:
    """GroupQueryAttention takes the batch padded on the right: one step a token for both rows,
    each row's tokens those of the unfused engine alone."""
    fused, plain = Engine(fused_engine.path), Engine(tiny_engine.path)
    assert fused.io.left_padding is False
    prompts = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51]]
    config = GenerationConfig(max_new_tokens=6, stop_at_eos=False)
    streamed: list[np.ndarray] = []
    batched = fused.generate_ids(prompts, config, on_tokens=streamed.append)
    alone = [plain.generate_ids([p], config).tokens[0] for p in prompts]
    assert batched.tokens == alone
    assert len(streamed) == 6 and len(batched.step_seconds) == 5
    assert [[int(token) for token in step] for step in streamed] == [
        list(pair) for pair in zip(*alone, strict=True)
    ]


def test_onnxruntime_genai_generates_our_greedy_tokens_from_the_fused_engine(fused_engine: Artifact) -> None:
    pytest.importorskip("onnxruntime_genai")
    prompt = [1, 40, 41, 42, 43, 44, 45, 46]
    config = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    ours = Engine(fused_engine.path).generate_ids([prompt], config)
    assert genai_greedy_tokens(fused_engine.path, prompt, 8) == ours.tokens[0]


def test_fusion_keeps_the_io_spec_fields(fused_graph: tuple[Artifact, dict], tiny_graph: Artifact) -> None:
    before, after = graph_io(tiny_graph.path), graph_io(fused_graph[0].path)
    assert dataclasses.replace(after, has_position_ids=True, left_padding=True) == before


@pytest.mark.parametrize("accuracy_level", [0, 4])
def test_an_int4_matmulnbits_graph_fuses_fully(
    tiny_graph: Artifact, tmp_path: Path, accuracy_level: int
) -> None:
    """Shape inference stops at the contrib op MatMulNBits; the pass annotates its outputs so the
    rules still see [batch, seq, hidden]. At accuracy_level 4 (int8 activations) the rewrite is
    judged on exact-arithmetic copies, and the as-built agreement is reported beside it."""
    int4 = int4_graph(tiny_graph, tmp_path / "int4", accuracy_level)
    fusion = FusionPass()
    (tmp_path / "fused").mkdir()
    metrics = fusion.run(int4, tmp_path / "fused")
    assert metrics["rewrites"] == {
        "rms_norm": 5,
        "skip_rms_norm": 4,
        "rotary_embedding": 4,
        "group_query_attention": 2,
        "packed_qkv": 2,
    }
    checked = fusion.ensures(int4, Artifact.from_dir(Kind.GRAPH, tmp_path / "fused"))
    assert checked["parity_vs_input_graph"]["max_abs_diff"] < 1e-4
    assert ("parity_as_built" in checked) == bool(accuracy_level)


def int4_graph(graph: Artifact, out: Path, accuracy_level: int) -> Artifact:
    """``graph`` lowered to MatMulNBits by round-to-nearest INT4 (blocks of 32)."""
    from passes.matmulnbits import Int4LoweringPass

    out.mkdir()
    Int4LoweringPass(group_size=32, accuracy_level=accuracy_level).run(graph, out)
    return Artifact.from_dir(Kind.GRAPH, out)


@pytest.mark.parametrize("lowering", ["fp32", "int4"])
def test_packed_qkv_merges_the_three_projections(tiny_graph: Artifact, tmp_path: Path, lowering: str) -> None:
    """Q, K and V projections become one matmul (MatMul or MatMulNBits) feeding
    GroupQueryAttention's packed form; the logits stay those of the unfused graph."""
    import onnx

    graph = int4_graph(tiny_graph, tmp_path / "int4", 0) if lowering == "int4" else tiny_graph
    fusion = FusionPass()  # the default rule set ends with packed_qkv
    (tmp_path / "fused").mkdir()
    metrics = fusion.run(graph, tmp_path / "fused")
    assert metrics["rewrites"]["packed_qkv"] == 2
    result = Artifact.from_dir(Kind.GRAPH, tmp_path / "fused")
    nodes = onnx.load(str(result.path / "model.onnx"), load_external_data=False).graph.node
    matmuls = [n for n in nodes if n.op_type in ("MatMul", "MatMulNBits")]
    assert len(matmuls) == 2 * 5 + 1  # qkv o gate up down per layer, lm_head
    for node in (n for n in nodes if n.op_type == "GroupQueryAttention"):
        assert list(node.input[1:3]) == ["", ""]  # key and value come packed in query
    parity = fusion.ensures(graph, result)["parity_vs_input_graph"]
    assert parity["top1_agreement"] == 1.0 and parity["max_abs_diff"] < 1e-4


def test_packed_gate_up_merges_the_int4_mlp_projections(tiny_graph: Artifact, tmp_path: Path) -> None:
    """Each layer's gate and up MatMulNBits become one of twice the width, split back into
    gate and up before SwiGLU; the logits stay those of the unfused graph. (Opt-in: no shipped
    rule set lists the family.)"""
    import onnx

    graph = int4_graph(tiny_graph, tmp_path / "int4", 0)
    fusion = FusionPass(rules=[*FusionPass().config.rules, "packed_gate_up"])
    (tmp_path / "fused").mkdir()
    assert fusion.run(graph, tmp_path / "fused")["rewrites"]["packed_gate_up"] == 2
    result = Artifact.from_dir(Kind.GRAPH, tmp_path / "fused")
    model = load_proto(result.path)
    intermediate = json.loads((tiny_graph.path / "config.json").read_text())["intermediate_size"]
    splits = [n for n in model.graph.node if n.op_type == "Split"]
    assert len(splits) == 2
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    for split in splits:
        assert weights[split.input[1]].tolist() == [intermediate, intermediate]
        packed = next(n for n in model.graph.node if n.output[0] == split.input[0])
        assert packed.op_type == "MatMulNBits"
        assert {a.name: a.i for a in packed.attribute}["N"] == 2 * intermediate
    parity = fusion.ensures(graph, result)["parity_vs_input_graph"]
    assert parity["top1_agreement"] == 1.0 and parity["max_abs_diff"] < 1e-4


def test_packed_gate_up_is_not_applicable_to_an_fp32_graph(tiny_graph: Artifact, tmp_path: Path) -> None:
    """Listed on a graph without MatMulNBits, the family is reported not applicable, not as a
    pattern that matched nothing (no warning), and the fp32 matmuls stay apart."""
    fusion = FusionPass(rules=[*FusionPass().config.rules, "packed_gate_up"])
    (tmp_path / "fused").mkdir()
    metrics = fusion.run(tiny_graph, tmp_path / "fused")
    assert metrics["not_applicable"] == ["packed_gate_up"] and "packed_gate_up" not in metrics["rewrites"]
    assert metrics["warnings"] == []


def test_lm_evals_onnxruntime_genai_backend_scores_the_fused_engine_like_ours(fused_engine: Artifact) -> None:
    """lm-eval's own ``onnxruntime-genai`` model loads the engine folder through its
    genai_config.json and gives the log-likelihoods our ``pipeline-engine`` model gives."""
    pytest.importorskip("onnxruntime_genai")
    from lm_eval.api.registry import get_model

    from evals.lm_model import EngineLM

    class Req:
        def __init__(self, *args: str) -> None:
            self.args = args

    requests = [Req("The quick brown fox", c) for c in (" jumps over the lazy dog", " counts one, two")]
    theirs = get_model("onnxruntime-genai")(pretrained=str(fused_engine.path), execution_provider="cpu")
    ours = EngineLM(engine=str(fused_engine.path))
    expected = ours.loglikelihood(requests, disable_tqdm=True)
    actual = theirs.loglikelihood(requests, disable_tqdm=True)
    for (mine, greedy_mine), (other, greedy_other) in zip(expected, actual, strict=True):
        assert other == pytest.approx(mine, abs=1e-3)
        assert greedy_other == greedy_mine


def test_the_tensorrt_rule_set_from_config_gives_a_standard_op_graph(
    tiny_graph: Artifact, tmp_path: Path
) -> None:
    """``fusion=tensorrt`` as Hydra composes it: the graph is converted to opset 23, every family
    rewrites, the result keeps left padding (attention stays as exported) and its logits; the
    engine ONNX Runtime builds from it generates like the unfused one."""
    import onnx

    from pipeline.core.plugins import build_passes
    from tests.pipeline.recipe import compose_recipe

    fusion = next(p for p in build_passes(compose_recipe(["fusion=tensorrt"])) if isinstance(p, FusionPass))
    (tmp_path / "graph").mkdir()
    metrics = fusion.run(tiny_graph, tmp_path / "graph")
    result = Artifact.from_dir(Kind.GRAPH, tmp_path / "graph")
    checks = fusion.ensures(tiny_graph, result)
    assert metrics["rewrites"] == {"onnx_rms_norm": 5, "onnx_rotary_embedding": 4}
    assert metrics["warnings"] == [] and checks["parity_vs_input_graph"]["top1_agreement"] == 1.0
    model = onnx.load(str(result.path / "model.onnx"), load_external_data=False)
    assert {o.domain: o.version for o in model.opset_import}.get("", 0) == 23
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
    assert result.metadata["io"]["left_padding"] is True
    (tmp_path / "engine").mkdir()
    OrtCpuBuildPass().run(result, tmp_path / "engine")
    config = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    prompts = [[1, 40, 41], [1, 50, 51, 52, 53]]  # unequal: one left-padded batch
    plain = OrtCpuBuildPass()
    (tmp_path / "plain").mkdir()
    plain.run(tiny_graph, tmp_path / "plain")
    assert Engine(tmp_path / "engine").generate_ids(prompts, config).tokens == (
        Engine(tmp_path / "plain").generate_ids(prompts, config).tokens
    )
