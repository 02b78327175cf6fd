"""Gemma 3 (issue 52): on a tiny random checkpoint of Gemma 3's text config layout (built with
transformers' own classes: ``Gemma3ForCausalLM``, model_type gemma3_text; heads of 32 values,
``query_pre_attn_scalar`` 48, a sliding layer within 64 positions on a RoPE table of theta 10k and
a full layer on one of 1M; random norm weights in Gemma's ``1 + weight`` form): the export and the
fused graph match transformers' forward over 2048 positions, the fused decode matches its
prefill, smoothing folds into Gemma's norms without changing the function, prune keeps the
shared q/k norms and slices all four block norms, and every recipe builds end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.artifacts import Artifact
from pipeline.core.errors import SourceError
from pipeline.core.families import GEMMA3, family_of, layer_windows
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
)

TOLERANCE = 1e-4  # of the logit range (issue 52)
WINDOW = 64
GEMMA = dict(
    head_dim=32,
    query_pre_attn_scalar=48,  # the score scale is 48 ** -0.5, not head_dim ** -0.5
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("gemma3_text", tmp_path_factory.mktemp("tiny-gemma3"), **GEMMA)


def test_a_gemma3_checkpoint_is_a_source_of_the_gemma3_family(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    assert family_of(config) is GEMMA3 and layer_windows(config) == (WINDOW, 0)
    assert check_hf_llama(checkpoint)["architecture"] == "Gemma3ForCausalLM"


def test_the_export_matches_transformers_over_2048_positions(graph: Artifact, reference: np.ndarray) -> None:
    assert relative_error(onnx_prefill(graph.path, random_ids()), reference) <= TOLERANCE


def test_the_fused_graph_takes_each_layers_window_and_matches_transformers(
    fused: tuple[Artifact, dict], reference: np.ndarray
) -> None:

    artifact, metrics = fused
    assert metrics["rewrites"]["group_query_attention"] == 2
    # every norm fused: 4 a block, its q/k norms, the final one; the residual adds into 4 of them
    assert (metrics["rewrites"]["rms_norm"], metrics["rewrites"]["skip_rms_norm"]) == (2 * (4 + 2) + 1, 4)
    # each layer's kernel its own window (-1: every position), read as the runtime reads it
    assert graph_layer_windows(artifact.path / "model.onnx") == {0: WINDOW, 1: -1}
    assert relative_error(onnx_prefill(artifact.path, random_ids()), reference) <= TOLERANCE


def test_the_fused_decode_matches_its_prefill_past_the_window(
    fused: tuple[Artifact, dict], reference: np.ndarray
) -> None:
    steps = 16
    decoded = onnx_decode(fused[0].path, random_ids(), PARITY_POSITIONS - steps)
    assert relative_error(decoded, reference[-steps:]) <= TOLERANCE


def test_a_shared_cache_keeps_only_the_window_of_the_local_layer_and_decodes_exactly(
    checkpoint: Path, tmp_path: Path, reference: np.ndarray
) -> None:
    """kv_cache=shared: the sliding layer's buffer holds its window and a quarter (it evicts in
    place), the full layer's the engine's max_length; decoding past the window still matches
    transformers, whose full layer sees every position."""
    from pipeline.runtime import Engine

    engine, _ = build(["kv_cache=shared", "fusion=ort"], checkpoint, tmp_path)
    spec = json.loads((engine.path / "engine.json").read_text())
    assert (spec["io"]["window"], spec["io"]["kv_capacity"]) == (0, [WINDOW + WINDOW // 4, 0])
    cache = Engine(engine.path).model.empty_cache(1)
    assert [value.shape()[2] for value in cache] == [80, 80, spec["max_length"], spec["max_length"]]
    decoded = onnx_decode(engine.path, random_ids(), PARITY_POSITIONS - 16)
    assert relative_error(decoded, reference[-16:]) <= TOLERANCE


def test_smoothing_folds_into_gemmas_norms_without_changing_the_function(checkpoint: Path) -> None:
    """AWQ's fold of random scales into every group's producer (the 1 + weight norms, v_proj, up_proj)
    and into the final norm before the head keeps the logits."""
    import torch

    from passes.awq import fold_scales, layer_groups
    from passes.int4 import first_layer_inputs
    from pipeline.core.torch_model import load_causal_lm, untie_lm_head

    model = load_causal_lm(checkpoint)
    ids = torch.from_numpy(random_ids(64))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        before = model(ids).logits
        untie_lm_head(model)
        inputs = first_layer_inputs(model, ids.numpy()[:, :32], 1)
        folded = 0
        for index, layer in enumerate(model.model.layers):
            inputs = inputs.at(index)
            groups, inputs.hidden = layer_groups(GEMMA3, layer, inputs)
            for group in groups:
                if group.prev is not None:
                    scales = (
                        torch.rand(next(iter(group.linears.values())).in_features, generator=generator) + 0.5
                    )
                    fold_scales(group.prev, list(group.linears.values()), scales, GEMMA3.norm_offset)
                    folded += 1
        fold_scales(model.model.norm, [model.lm_head], torch.rand(64, generator=generator) + 0.5, 1.0)
        after = model(ids).logits
    assert folded == 2 * 3  # qkv, gate/up (from the pre-feedforward norm), down per layer
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_prune_keeps_the_shared_qk_norms(checkpoint: Path) -> None:
    assert dead_heads_pruned_error(checkpoint, GEMMA3) <= TOLERANCE


@pytest.mark.parametrize("recipe", list(QUANT_RECIPES.values()), ids=list(QUANT_RECIPES))
def test_every_quantized_recipe_builds_a_gemma3_engine(
    checkpoint: Path, tmp_path: Path, recipe: list[str]
) -> None:
    engine, by_name = build(recipe, checkpoint, tmp_path)
    assert_built(engine, by_name)
    if "smoothquant" in by_name:  # the smoothed fp32 model is the source's (Gemma's 1 + weight gain)
        assert by_name["smoothquant"]["fp32_parity"]["relative"] < 1e-5


def test_width_pruning_with_distillation_builds_a_fused_gemma3_engine(
    checkpoint: Path, tmp_path: Path
) -> None:
    assert_pruned_and_distilled(checkpoint, tmp_path)


def test_a_gemma3_engine_decodes_speculatively_with_its_draft_and_serves(
    checkpoint: Path, tmp_path: Path
) -> None:
    assert_drafts_and_serves(checkpoint, tmp_path)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        (
            "final_logit_softcapping",
            30.0,
            "final_logit_softcapping=30.0: this build does not implement logit",
        ),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0: this build does not implement logit"),
        ("use_bidirectional_attention", True, "use_bidirectional_attention=true: an encoder"),
        ("query_pre_attn_scalar", -1, "query_pre_attn_scalar=-1"),
    ],
)
def test_a_config_feature_without_a_build_path_is_one_line(
    checkpoint: Path, tmp_path: Path, field: str, value: object, needle: str
) -> None:
    import shutil

    folder = Path(shutil.copytree(checkpoint, tmp_path / "edited"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(SourceError) as error:
        check_hf_llama(folder)
    assert needle in str(error.value) and "\n" not in str(error.value)
