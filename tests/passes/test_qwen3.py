"""Qwen3 (issue 51, step 4): a Llama block with a ``head_dim`` of its own and a per-head RMSNorm
of q and k before rotary. On a tiny random checkpoint of Qwen3's config layout (built with
transformers' own classes; heads of 32 values where hidden / heads is 16; random norm weights):
the export and the fused graph (the q/k norms outside GroupQueryAttention, before its rotary)
match transformers' forward over 2048 positions, the fused decode matches its prefill, prune
keeps the shared q/k norms, and every quantized recipe and the int8 cache build end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.artifacts import Artifact
from pipeline.core.families import QWEN3, family_of
from pipeline.core.graph_io import graph_layer_windows
from pipeline.sources import check_hf_llama
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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("qwen3", tmp_path_factory.mktemp("tiny-qwen3"), head_dim=32)


def test_a_qwen3_checkpoint_is_a_source_of_the_qwen3_family(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    assert family_of(config) is QWEN3 and config["head_dim"] == 32
    assert check_hf_llama(checkpoint)["architecture"] == "Qwen3ForCausalLM"


def test_the_export_matches_transformers_over_2048_positions(graph: Artifact, reference: np.ndarray) -> None:
    assert relative_error(onnx_prefill(graph.path, random_ids()), reference) <= TOLERANCE


def test_the_fused_graph_keeps_the_qk_norms_before_the_kernel_and_matches_transformers(
    fused: tuple[Artifact, dict], reference: np.ndarray
) -> None:
    artifact, metrics = fused
    assert metrics["rewrites"]["rms_norm"] == 5 + 4  # the block norms, and q/k norms of 2 layers
    assert metrics["rewrites"]["group_query_attention"] == 2
    assert metrics["warnings"] == [
        "fusion rule 'packed_qkv' skipped: the per-head q/k norms sit between the projections and "
        "the attention kernel; its sites stay unfused"
    ]
    assert relative_error(onnx_prefill(artifact.path, random_ids()), reference) <= TOLERANCE


def test_the_fused_decode_matches_its_prefill(fused: tuple[Artifact, dict], reference: np.ndarray) -> None:
    steps = 24
    decoded = onnx_decode(fused[0].path, random_ids(), PARITY_POSITIONS - steps)
    assert relative_error(decoded, reference[-steps:]) <= TOLERANCE


def test_sliding_layers_past_max_window_layers_are_exact_fused_and_in_decode(tmp_path: Path) -> None:
    """Qwen3's use_sliding_window with max_window_layers=1, as Qwen2's: layer 1 attends within 64
    positions; the fused graph gives each layer's kernel its own window and, prefill and decode,
    matches transformers over 2048 positions."""

    from passes.export import ExportPass
    from passes.fusion.fuse import FusionPass
    from pipeline.core.artifacts import Kind
    from pipeline.core.families import layer_windows
    from tests.conftest import run_pass

    source = make_tiny(
        "qwen3",
        tmp_path / "windowed",
        head_dim=32,
        use_sliding_window=True,
        sliding_window=64,
        max_window_layers=1,
    )
    assert layer_windows(json.loads((source / "config.json").read_text())) == (0, 64)
    ids = random_ids()
    reference = transformers_logits(source, ids)
    graph = run_pass(ExportPass(), Artifact.from_dir(Kind.TORCH, source), tmp_path / "graph")[0]
    fused = run_pass(FusionPass(), graph, tmp_path / "fused")[0]
    # each layer's kernel its own window (-1: every position), read as the runtime reads it
    assert graph_layer_windows(fused.path / "model.onnx") == {0: -1, 1: 64}
    assert relative_error(onnx_prefill(fused.path, ids), reference) <= TOLERANCE
    assert relative_error(onnx_decode(fused.path, ids, PARITY_POSITIONS - 16), reference[-16:]) <= TOLERANCE


def test_prune_keeps_the_shared_qk_norms(checkpoint: Path) -> None:
    assert dead_heads_pruned_error(checkpoint, QWEN3) <= TOLERANCE


@pytest.mark.parametrize("recipe", list(QUANT_RECIPES.values()), ids=list(QUANT_RECIPES))
def test_every_quantized_recipe_builds_a_qwen3_engine(
    checkpoint: Path, tmp_path: Path, recipe: list[str]
) -> None:
    engine, by_name = build(recipe, checkpoint, tmp_path)
    assert_built(engine, by_name)


def test_a_qwen3_gguf_converts_to_the_same_model(tmp_path: Path) -> None:
    """llama.cpp's ``qwen3`` GGUF (written here with gguf-py, float32) becomes a checkpoint that
    passes the source checks and computes what the original does."""
    from pipeline.sources import convert_gguf

    source = make_tiny(
        "qwen3", tmp_path / "hf", head_dim=128
    )  # transformers reads no head_dim from a qwen3 GGUF: 128
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    write_gguf(source, gguf_dir / "tiny.gguf", "qwen3")
    convert_gguf(gguf_dir / "tiny.gguf", tmp_path / "converted")
    assert check_hf_llama(tmp_path / "converted")["architecture"] == "Qwen3ForCausalLM"
    ids = random_ids(128)
    assert (
        relative_error(transformers_logits(tmp_path / "converted", ids), transformers_logits(source, ids))
        <= 1e-6
    )


def test_a_gguf_of_another_family_is_refused_before_it_is_loaded(tmp_path: Path) -> None:
    import gguf

    from pipeline.core.errors import SourceError
    from pipeline.sources import convert_gguf

    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SourceError) as error:
        convert_gguf(tmp_path / "other.gguf", tmp_path / "converted")
    assert str(error.value) == (
        f"{tmp_path / 'other.gguf'} holds llama.cpp architecture 'phi3': the GGUFs converted are llama, "
        "qwen2, qwen3, gemma3 (Llama (LlamaForCausalLM), Qwen2 (Qwen2ForCausalLM), "
        "Mistral (MistralForCausalLM), Qwen3 (Qwen3ForCausalLM), Gemma 3 (Gemma3ForCausalLM))"
    )
    assert not (tmp_path / "converted").exists()


def test_width_pruning_with_distillation_builds_a_fused_qwen3_engine(
    checkpoint: Path, tmp_path: Path
) -> None:
    assert_pruned_and_distilled(checkpoint, tmp_path)


def test_a_qwen3_engine_decodes_speculatively_with_its_draft_and_serves(
    checkpoint: Path, tmp_path: Path
) -> None:
    assert_drafts_and_serves(checkpoint, tmp_path)
