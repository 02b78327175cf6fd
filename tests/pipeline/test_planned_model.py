"""The planned model (pipeline/core/planned_model.py): what each pass will receive, known before
any pass runs, so a model-dependent knob fails at start-up, on the real passes and tiny Llama."""

from __future__ import annotations

from pathlib import Path

import pytest

from calibration.datasets import CalibrationConfig
from passes.export import ExportPass
from passes.fusion.fuse import FusionPass
from passes.gptq import GptqPass
from passes.kv_cache import KvCachePass
from passes.ort_build import OrtCpuBuildPass
from passes.prune import PrunePass
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.cache import Cache
from pipeline.core.errors import ConfigError, PassError, SourceError
from pipeline.core.manager import PassManager, check_against_model
from pipeline.core.planned_model import PlannedModel

SMALL = CalibrationConfig(num_samples=2, seq_len=16)


@pytest.fixture
def source(tiny_llama: Path) -> Artifact:
    return Artifact.from_dir(Kind.TORCH, tiny_llama)


def test_each_pass_hands_on_what_it_produces(source: Artifact) -> None:
    """The tiny Llama: hidden 64, MLP 128, 2 layers. Prune cuts the MLP to 96 channels, export
    sets the opset, kv_cache the layout, fusion its rules; the layers' widths follow the config."""
    facts = PlannedModel.of(source)
    assert facts is not None and facts.teacher is None and facts.opset is None and facts.fusion is None
    assert facts.linears["model.layers.1.mlp.down_proj"] == (128, 64)
    assert facts.linears["lm_head"] == (64, facts.config["vocab_size"])
    for step in (PrunePass(mlp_ratio=0.25, calibration=SMALL), ExportPass(opset=21)):
        facts = step.check_model(facts)
    assert facts.config["intermediate_size"] == 96 and facts.teacher["intermediate_size"] == 128
    assert facts.linears["model.layers.1.mlp.down_proj"] == (96, 64)
    assert facts.linears["model.layers.0.mlp.up_proj"] == (64, 96)
    assert facts.opset == 21
    facts = KvCachePass(layout="shared", window=8).check_model(facts)
    assert facts.kv_cache == {
        "layout": "shared",
        "dtype": "fp32",
        "window": 8,
        "paged_block_size": 0,
        "capacity": [10, 10],  # one buffer per layer
    }
    facts = FusionPass().check_model(facts)
    assert facts.fusion is not None and "group_query_attention" in facts.fusion
    with pytest.raises(PassError, match="already fused"):
        KvCachePass().check_model(facts)


def test_no_config_json_means_nothing_to_check(tmp_path: Path) -> None:
    (tmp_path / "artifact.json").write_text('{"kind": "graph", "metadata": {}}')
    assert PlannedModel.of(Artifact.from_dir(Kind.GRAPH, tmp_path)) is None


def test_a_knob_wrong_only_for_the_pruned_model_fails_before_the_first_pass(
    source: Artifact, tmp_path: Path
) -> None:
    """group_size=64 divides every width of the source (64, 128) but not the pruned MLP's 96: the
    recipe fails at start-up, before the prune pass calibrates, and the cache stays empty."""
    recipe = [PrunePass(mlp_ratio=0.25, calibration=SMALL), GptqPass(group_size=64, calibration=SMALL)]
    with pytest.raises(
        ConfigError, match=r"^quant\.group_size=64 does not divide the input width 96 of model"
    ):
        PassManager(recipe, Cache(tmp_path / "cache"), final_kind=None).run(source)
    assert not any((tmp_path / "cache").rglob("artifact.json"))
    check_against_model([GptqPass(group_size=64, calibration=SMALL)], source)  # unpruned: accepted


def test_a_cache_layout_the_recipe_never_fuses_fails_before_the_export(
    source: Artifact, tmp_path: Path
) -> None:
    recipe = [ExportPass(), KvCachePass(layout="shared"), OrtCpuBuildPass()]
    with pytest.raises(
        PassError, match=r"^build: kv_cache=shared needs the attention fused to GroupQueryAttention"
    ):
        PassManager(recipe, Cache(tmp_path / "cache")).run(source)
    assert not any((tmp_path / "cache").rglob("artifact.json"))
    fp8 = [ExportPass(), KvCachePass(dtype="fp8"), OrtCpuBuildPass()]
    with pytest.raises(PassError, match=r"^build: kv_cache\.dtype=fp8 is stored by the fusion pass"):
        PassManager(fp8, Cache(tmp_path / "cache")).run(source)
    without_gqa = [
        ExportPass(),
        KvCachePass(layout="shared"),
        FusionPass(rules=["rms_norm"]),
        OrtCpuBuildPass(),
    ]
    with pytest.raises(PassError, match="kv_cache=shared needs the attention fused"):
        PassManager(without_gqa, Cache(tmp_path / "cache")).run(source)


def test_the_command_line_refuses_it_in_one_line_before_any_pass(tiny_llama: Path, tmp_path: Path) -> None:
    """prune=... quant=int4_gptq with a group size the pruned MLP cannot take: exit 2, one
    ``error:`` line naming the knob, no pass run and nothing in the cache."""
    from tests.pipeline.test_main import run_pipeline

    result = run_pipeline(
        tiny_llama,
        tmp_path,
        "run",
        "prune=width25",
        "prune.calibration.num_samples=2",
        "prune.calibration.seq_len=16",
        "quant=int4_gptq",
        "quant.group_size=64",
        "quant.calibration.num_samples=2",
        "quant.calibration.seq_len=16",
        "bench=none",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "quant.group_size=64 does not divide the input width 96" in errors[0]
    assert "pass 1/" not in result.stdout + result.stderr
    assert not any((tmp_path / "cache").rglob("artifact.json"))


def test_a_config_transformers_cannot_build_is_one_line(tiny_llama: Path, tmp_path: Path) -> None:
    facts = PlannedModel.of(Artifact.from_dir(Kind.TORCH, tiny_llama))
    assert facts is not None
    broken = facts.replace(config={**facts.config, "model_type": "no-such-model"})
    with pytest.raises(
        SourceError, match=r"^config\.json \(model_type 'no-such-model'\) does not describe"
    ) as info:
        broken.linears  # noqa: B018 - the property builds the skeleton
    assert "\n" not in str(info.value)


def test_the_skeleton_gives_every_stored_tensor_and_ties_the_head(tiny_llama: Path, tmp_path: Path) -> None:
    """One meta-device skeleton serves the layers' widths and the tensors a checkpoint stores
    (the source check compares the safetensors headers with these)."""
    import torch

    from pipeline.core.torch_model import meta_model
    from tests.conftest import make_tiny_llama

    facts = PlannedModel.of(Artifact.from_dir(Kind.TORCH, tiny_llama))
    assert facts is not None
    tensors = facts.tensors
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # 2 KV heads of 16
    assert tensors["lm_head.weight"].tied == ("model.embed_tokens.weight",)  # tie_word_embeddings
    assert "model.rotary_emb.inv_freq" not in tensors  # a buffer the checkpoint does not store
    assert facts.replace(opset=21).__dict__["skeleton"] is facts.skeleton  # built once
    untied = PlannedModel.of(
        Artifact.from_dir(Kind.TORCH, make_tiny_llama(tmp_path / "u", tie_word_embeddings=False))
    )
    assert untied is not None and untied.tensors["lm_head.weight"].tied == ()
    skeleton = meta_model(tiny_llama)
    assert skeleton.lm_head.weight.device == torch.device("meta")
    with pytest.raises(SourceError, match="cannot read") as error:
        meta_model(tmp_path / "nowhere")
    assert "\n" not in str(error.value)
