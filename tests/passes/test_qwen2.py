"""Qwen2 / Qwen2.5 (issue 51, step 2): a Llama block whose q, k and v projections carry a bias.
On a tiny random checkpoint of Qwen2's config layout, built with transformers' own classes and
random biases: the export and the fused engine match transformers' forward over 2048 positions,
the fused decode matches its prefill, the packed QKV rule packs the biases, prune slices them,
and every quantized recipe builds end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from passes.export import ExportPass
from passes.fusion.fuse import FusionPass
from passes.prune import Shape, pruned_config
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.errors import EngineError
from pipeline.core.families import QWEN2, family_of, layer_windows
from pipeline.core.graph_io import graph_layer_windows
from pipeline.sources import check_hf_llama
from tests.conftest import run_pass
from tests.families import (
    PARITY_POSITIONS,
    QUANT_RECIPES,
    assert_built,
    assert_drafts_and_serves,
    assert_pruned_and_distilled,
    build,
    dead_heads_pruned_error,
    make_tiny,
    onnx_decode,
    onnx_prefill,
    random_ids,
    relative_error,
    transformers_logits,
    write_gguf,
)

TOLERANCE = 1e-4  # of the logit range (issue 51)
WINDOWED = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


def test_a_qwen2_checkpoint_is_a_source_of_the_qwen2_family(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    assert family_of(config) is QWEN2
    assert check_hf_llama(checkpoint)["architecture"] == "Qwen2ForCausalLM"


def test_sliding_layers_past_max_window_layers_are_exact_unfused_and_fused(tmp_path: Path) -> None:
    """use_sliding_window with max_window_layers=1: layer 0 attends to every position, layer 1
    within 64; the export and the fused graph (each GroupQueryAttention its own window) match
    transformers over 2048 positions, and the fused decode past the window too."""

    source = make_tiny(
        "qwen2", tmp_path / "windowed", use_sliding_window=True, sliding_window=64, max_window_layers=1
    )
    assert layer_windows(json.loads((source / "config.json").read_text())) == (0, 64)
    ids = random_ids()
    reference = transformers_logits(source, ids)
    graph = run_pass(ExportPass(), Artifact.from_dir(Kind.TORCH, source), tmp_path / "graph")[0]
    fused = run_pass(FusionPass(), graph, tmp_path / "fused")[0]
    # each layer's kernel its own window (-1: every position), read as the runtime reads it
    assert graph_layer_windows(fused.path / "model.onnx") == {0: -1, 1: 64}
    for artifact in (graph, fused):
        assert relative_error(onnx_prefill(artifact.path, ids), reference) <= TOLERANCE
    decoded = onnx_decode(fused.path, ids, PARITY_POSITIONS - 16)
    assert relative_error(decoded, reference[-16:]) <= TOLERANCE
    # Window-sized shared buffers (kv_cache.window=128): the full layer 0 is then windowed to 128 by
    # the build's choice, so it is compared with the same engine's prefill; layer 1 keeps its own
    # 64 and a buffer of that window only.
    engine, _ = build(["kv_cache=shared", "kv_cache.window=128", "fusion=ort"], source, tmp_path / "shared")
    spec = json.loads((engine.path / "engine.json").read_text())
    assert (spec["io"]["window"], spec["io"]["kv_capacity"]) == (128, [160, 80])
    windowed = onnx_decode(engine.path, ids, PARITY_POSITIONS - 16)
    whole = onnx_prefill(engine.path, ids)
    assert relative_error(windowed, whole[-16:]) <= TOLERANCE
    from pipeline.runtime import Engine

    assert [value.shape()[2] for value in Engine(engine.path).model.empty_cache(1)] == [160, 160, 80, 80]
    # A buffer shorter than its layer's window in the graph is refused, in one line.
    spec["io"]["kv_capacity"] = [160, 32]
    (engine.path / "engine.json").write_text(json.dumps(spec))
    refusal = r"a 32-position buffer for layer 1, whose attention window in model\.onnx is 64"
    with pytest.raises(EngineError, match=refusal):
        Engine(engine.path)


def test_calibration_longer_than_a_sliding_window_builds_each_block_on_its_own_mask(tmp_path: Path) -> None:
    """Block-by-block calibration gives each block the mask transformers gives it (full or
    sliding): windows of 128 tokens on a model whose layer 1 attends within 64 build, and the
    int8 engine keeps the greedy tokens of the graph it was lowered from."""
    source = make_tiny(
        "qwen2", tmp_path / "windowed", use_sliding_window=True, sliding_window=64, max_window_layers=1
    )
    engine, by_name = build(["quant=int8", "quant.calibration.seq_len=128"], source, tmp_path / "long")
    assert_built(engine, by_name)


def test_the_export_matches_transformers_over_2048_positions(graph: Artifact, reference: np.ndarray) -> None:
    assert relative_error(onnx_prefill(graph.path, random_ids()), reference) <= TOLERANCE


def test_the_fused_graph_packs_the_biased_projections_and_matches_transformers(
    fused: tuple[Artifact, dict], reference: np.ndarray
) -> None:
    artifact, metrics = fused
    assert metrics["rewrites"]["group_query_attention"] == 2
    assert metrics["rewrites"]["packed_qkv"] == 2  # MatMul + bias Add, packed with their biases
    assert metrics["warnings"] == []
    assert relative_error(onnx_prefill(artifact.path, random_ids()), reference) <= TOLERANCE


def test_the_fused_decode_matches_its_prefill(fused: tuple[Artifact, dict], reference: np.ndarray) -> None:
    ids, steps = random_ids(), 24
    decoded = onnx_decode(fused[0].path, ids, PARITY_POSITIONS - steps)
    assert relative_error(decoded, reference[-steps:]) <= TOLERANCE


def test_prune_slices_the_biases_with_their_heads(checkpoint: Path) -> None:
    """Each kept head keeps its own q bias rows: pruning two dead heads changes nothing."""
    assert dead_heads_pruned_error(checkpoint, QWEN2) <= TOLERANCE


@pytest.mark.parametrize("recipe", list(QUANT_RECIPES.values()), ids=list(QUANT_RECIPES))
def test_every_quantized_recipe_builds_a_qwen2_engine(
    checkpoint: Path, tmp_path: Path, recipe: list[str]
) -> None:
    engine, by_name = build(recipe, checkpoint, tmp_path)
    qdq = recipe[0] in ("quant=int8", "quant=fp8")  # Q/DQ weights are not packed
    assert_built(engine, by_name, packed_qkv=0 if qdq else 2)


def test_a_qwen2_gguf_converts_to_the_same_model(tmp_path: Path) -> None:
    """llama.cpp's ``qwen2`` GGUF (written here with gguf-py, float32) becomes a checkpoint that
    passes the source checks and computes what the original does."""
    from pipeline.sources import convert_gguf

    source = make_tiny("qwen2", tmp_path / "hf")  # q/k/v biases
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    write_gguf(source, gguf_dir / "tiny.gguf", "qwen2")
    convert_gguf(gguf_dir / "tiny.gguf", tmp_path / "converted")
    assert check_hf_llama(tmp_path / "converted")["architecture"] == "Qwen2ForCausalLM"
    ids = random_ids(128)
    assert (
        relative_error(transformers_logits(tmp_path / "converted", ids), transformers_logits(source, ids))
        <= 1e-6
    )


def test_yarn_rope_long_context_scaling_is_exact_unfused_and_fused(tmp_path: Path) -> None:
    """Qwen2.5's long-context RoPE (yarn, past original_max_position_embeddings=1024 here)."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 1e6}
    source = make_tiny("qwen2", tmp_path / "yarn", rope_parameters=rope)
    ids = random_ids()
    reference = transformers_logits(source, ids)
    graph = run_pass(ExportPass(), Artifact.from_dir(Kind.TORCH, source), tmp_path / "graph")[0]
    fused = run_pass(FusionPass(), graph, tmp_path / "fused")[0]
    for artifact in (graph, fused):
        assert relative_error(onnx_prefill(artifact.path, ids), reference) <= TOLERANCE


def test_depth_pruning_keeps_each_kept_layers_window() -> None:
    """Layer types derived from max_window_layers are written out before the layers renumber:
    keeping layers 0 and 2 of (full, full, sliding) keeps (full, sliding)."""
    config = {**json.loads(json.dumps(WINDOWED)), "num_hidden_layers": 3, "max_window_layers": 2}
    assert layer_windows(config) == (0, 0, 64)
    target = Shape(64, 128, 4, 2, 16, 2)
    assert layer_windows(pruned_config(config, target, [0, 2])) == (0, 64)


def test_width_pruning_with_distillation_builds_a_fused_qwen2_engine(
    checkpoint: Path, tmp_path: Path
) -> None:
    assert_pruned_and_distilled(checkpoint, tmp_path)


def test_a_qwen2_engine_decodes_speculatively_with_its_draft_and_serves(
    checkpoint: Path, tmp_path: Path
) -> None:
    assert_drafts_and_serves(checkpoint, tmp_path)
