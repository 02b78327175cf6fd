"""The prune pass on the tiny random Llama: shapes and config consistent, the checkpoint reloads
and exports, importance ranks hand-built cases, bad ratios are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from passes.prune import PruneConfig, PrunePass, Shape, kept_heads, target_shape, top
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.errors import PassError
from pipeline.core.manager import check_against_model
from pipeline.core.placement import ResolvedPlacement
from tests.conftest import make_tiny_llama, run_pass

CALIBRATION = {"num_samples": 4, "seq_len": 32}


def prune(
    source: Path, out: Path, placement: ResolvedPlacement | None = None, **ratios: float
) -> tuple[Artifact, dict]:
    step = PrunePass(calibration=CALIBRATION, **ratios)
    if placement is not None:
        step.placement = placement
    return run_pass(step, Artifact.from_dir(Kind.TORCH, source), out)


def test_every_dimension_pruned_gives_a_consistent_checkpoint(tiny_llama: Path, tmp_path: Path) -> None:
    from pipeline.core.torch_model import load_causal_lm

    result, metrics = prune(
        tiny_llama, tmp_path / "pruned", mlp_ratio=0.25, heads_ratio=0.5, hidden_ratio=0.25, depth_ratio=0.5
    )
    config = json.loads((result.path / "config.json").read_text())
    assert (config["intermediate_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        96,
        2,
        2,
    )
    assert (config["hidden_size"], config["head_dim"], config["num_hidden_layers"]) == (48, 16, 1)
    model = load_causal_lm(result.path)  # reloads offline, strict sizes
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()  # still tied
    assert model.model.layers[0].self_attn.layer_idx == 0
    assert metrics["parameters"]["after"] < 0.7 * metrics["parameters"]["before"]
    assert metrics["holdout"]["kl_vs_teacher"] > 0 and metrics["holdout"]["perplexity"] > 1
    assert (result.path / "tokenizer.json").is_file()
    assert result.metadata["prune"]["shape_after"]["layers"] == 1


def test_the_pruned_checkpoint_goes_through_the_export_unchanged(tiny_llama: Path, tmp_path: Path) -> None:
    from passes.export import ExportPass

    pruned, _ = prune(tiny_llama, tmp_path / "pruned", mlp_ratio=0.25, heads_ratio=0.5)
    export = ExportPass()
    (tmp_path / "graph").mkdir()
    export.run(pruned, tmp_path / "graph")
    checked = export.ensures(pruned, Artifact.from_dir(Kind.GRAPH, tmp_path / "graph"))
    assert checked["parity"]["top1_agreement"] == 1.0  # ORT on the pruned graph == torch on it


DEAD = [3, 40, 77, 100]


def hand_built(folder: Path) -> tuple[Path, object]:
    """A 3-layer tiny Llama with four dead MLP channels in layer 0 (zero up projection) and an
    identity layer 1 (zero o_proj and down_proj): (its folder, the model)."""
    import torch
    from transformers import LlamaForCausalLM

    source = make_tiny_llama(folder, num_hidden_layers=3)
    model = LlamaForCausalLM.from_pretrained(source)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[DEAD] = 0
        model.model.layers[1].self_attn.o_proj.weight.zero_()
        model.model.layers[1].mlp.down_proj.weight.zero_()
    model.save_pretrained(source)
    return source, model


def test_importance_finds_dead_channels_and_an_identity_layer(tmp_path: Path) -> None:
    """MLP channels whose up projection is zero contribute nothing; a layer whose o_proj and
    down_proj are zero passes its input through (cosine 1): those are what pruning removes."""
    import torch
    from transformers import LlamaForCausalLM

    source, model = hand_built(tmp_path / "hand")
    dead = DEAD
    result, metrics = prune(source, tmp_path / "pruned", mlp_ratio=4 / 128, depth_ratio=1 / 3)
    assert metrics["layers_kept"] == [0, 2]
    assert result.metadata["prune"]["block_importance"][1] == pytest.approx(0.0, abs=1e-9)
    pruned = LlamaForCausalLM.from_pretrained(result.path)
    original = torch.cat(
        [model.model.layers[0].mlp.gate_proj.weight[i : i + 1] for i in range(128) if i not in dead]
    )
    assert torch.equal(pruned.model.layers[0].mlp.gate_proj.weight, original)


def test_a_bfloat16_placement_ranks_in_bfloat16_and_slices_the_float32_weights(tmp_path: Path) -> None:
    """pipeline.torch_dtype=bfloat16: the importance and held-out forwards run in bfloat16 (their
    numbers move), the clear-cut choice stays, and the output weights are the checkpoint's float32
    values (sliced from the checkpoint, not from the bfloat16 model)."""
    import torch
    from safetensors.torch import load_file

    source, _ = hand_built(tmp_path / "hand")
    ratios = {"mlp_ratio": 4 / 128, "depth_ratio": 1 / 3}
    fp32, fp32_metrics = prune(source, tmp_path / "fp32", **ratios)
    bf16, bf16_metrics = prune(
        source, tmp_path / "bf16", placement=ResolvedPlacement("cpu", "bfloat16"), **ratios
    )
    scores = fp32.metadata["prune"]["block_importance"], bf16.metadata["prune"]["block_importance"]
    assert scores[0] != scores[1] and scores[1] == pytest.approx(scores[0], rel=0.05, abs=1e-6)
    ppl = fp32_metrics["holdout"]["teacher_perplexity"], bf16_metrics["holdout"]["teacher_perplexity"]
    assert ppl[0] != ppl[1] and ppl[1] == pytest.approx(ppl[0], rel=0.05)
    assert bf16_metrics["layers_kept"] == fp32_metrics["layers_kept"] == [0, 2]
    a, b = load_file(fp32.path / "model.safetensors"), load_file(bf16.path / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert b[name].dtype == a[name].dtype == torch.float32 and b[name].equal(a[name]), name


def test_heads_are_kept_per_kv_group() -> None:
    shape = Shape(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, layers=30)
    target = target_shape(shape, PruneConfig(heads_ratio=0.34))
    assert target.heads == 6 and target.kv_heads == 3
    scores = np.array([0.9, 0.1, 0.5, 0.2, 0.8, 0.7, 0.3, 0.31, 0.05])
    # best two of each group of three, in order: group 0 -> 0, 2; group 1 -> 4, 5; group 2 -> 6, 7
    assert kept_heads(scores, shape, target).tolist() == [0, 2, 4, 5, 6, 7]
    assert top(np.array([1.0, 3.0, 3.0, 2.0]), 2).tolist() == [1, 2]


@pytest.mark.parametrize(
    ("ratios", "needle"),
    [
        ({"mlp_ratio": 1.0}, "prune.mlp_ratio=1.0: a ratio must be in [0, 1)"),
        ({"depth_ratio": -0.1}, "prune.depth_ratio=-0.1: a ratio must be in [0, 1)"),
        ({}, "prune: every ratio is 0, nothing to prune"),
        (
            {"heads_ratio": 0.2},
            "prune.heads_ratio=0.2: each of the 2 KV groups has 2 query heads, so this removes none",
        ),
    ],
)
def test_bad_ratios_are_one_line_errors(tiny_llama: Path, ratios: dict, needle: str) -> None:
    with pytest.raises(PassError) as error:
        check_against_model(
            [PrunePass(calibration=CALIBRATION, **ratios)], Artifact.from_dir(Kind.TORCH, tiny_llama)
        )
    assert str(error.value).startswith(needle) and "\n" not in str(error.value)


def test_a_single_head_group_cannot_lose_a_head(tmp_path: Path) -> None:
    source = make_tiny_llama(tmp_path / "mha", num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(PassError, match="single query head; pruning one would break GQA grouping"):
        check_against_model(
            [PrunePass(calibration=CALIBRATION, heads_ratio=0.5)], Artifact.from_dir(Kind.TORCH, source)
        )


def test_prune_from_the_command_line(tiny_llama: Path, tmp_path: Path) -> None:
    from tests.pipeline.test_main import QUICK_BENCH, run_pipeline

    settings = ["prune=width25", "prune.calibration.num_samples=4", "prune.calibration.seq_len=32"]
    result = run_pipeline(tiny_llama, tmp_path, "run", *settings, *QUICK_BENCH)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert [p["name"] for p in manifest["passes"]] == ["prune", "export", "ort_build"]
    assert manifest["passes"][0]["metrics"]["shape"]["after"]["intermediate"] == 96
    # A pruned engine is timed against its teacher's engine, alternately, in the run record.
    versus = manifest["benchmark"]["vs_reference"]
    assert set(versus["ttft"]) == {"16", "32"}
    for row in [*versus["ttft"].values(), versus["tpot"]]:
        assert row["engine_ms"] > 0 and row["reference_ms"] > 0
        assert row["ratio"] == pytest.approx(row["engine_ms"] / row["reference_ms"], rel=0.01)
    assert "vs the reference engine" in " ".join(result.stdout.split())
    bad = run_pipeline(tiny_llama, tmp_path, "bad", "prune=width25", "prune.mlp_ratio=1.5", "bench=none")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: prune.mlp_ratio=1.5: a ratio must be in [0, 1) (0 keeps the dimension whole)"
    ]
