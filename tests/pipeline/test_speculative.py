"""``speculative=draft`` end to end on the tiny Llama: the draft is pruned, distilled, exported and
built through the cache, placed inside the engine, benchmarked against the target alone and
recorded; bad settings are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.graph_io import graph_ops
from pipeline.runtime import Engine
from tests.families import DRAFT_KNOBS
from tests.pipeline.test_main import QUICK_BENCH, run_pipeline

DRAFT = [
    *DRAFT_KNOBS,
    "speculative.k=3",
    "bench.speculative_prompts=2",
    "bench.speculative_prompt_length=64",
]


@pytest.fixture(scope="module")
def speculative_run(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    workdir = tmp_path_factory.mktemp("speculative-cli")
    result = run_pipeline(tiny_llama, workdir, "run", *QUICK_BENCH, *DRAFT)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = " ".join(result.stdout.split())  # the summary wraps long lines
    assert "output identical to the target's greedy output" in printed
    return workdir, json.loads((workdir / "run" / "manifest.json").read_text())


def test_the_engine_carries_its_draft_and_decodes_with_it(speculative_run: tuple[Path, dict]) -> None:
    workdir, manifest = speculative_run
    engine = Engine(workdir / "run" / "engine")
    assert engine.draft is not None and engine.speculative_k == 3
    assert engine.draft.io.num_layers == 1 and engine.io.num_layers == 2
    plan = manifest["speculative"]
    assert plan["k"] == 3 and plan["draft_layers"] == 1
    # The default draft: depth-pruned, distilled, then INT4 (AWQ) whatever the target's precision.
    names = ["prune", "distill", "awq", "export", "int4_lowering", "ort_build"]
    assert [p["name"] for p in plan["draft_passes"]] == names
    assert [p["name"] for p in manifest["passes"]] == ["export", "ort_build"]  # the target's own
    assert "MatMulNBits" in graph_ops(engine.draft.folder / "model.onnx")
    assert "MatMulNBits" not in graph_ops(engine.folder / "model.onnx")
    bench = manifest["benchmark"]["speculative"]
    assert bench["identical_to_target"] is True and bench["k"] == 3
    assert 0.0 <= bench["acceptance_rate"] <= 1.0 and bench["tokens_per_round"] >= 1.0
    assert bench["tpot_ratio"] > 0 and bench["prompts"] == 2


def test_the_draft_takes_the_recipe_quant_when_it_names_none() -> None:
    from pipeline.core.plugins import build_passes
    from pipeline.speculative import draft_passes
    from tests.pipeline.recipe import compose_recipe

    own = compose_recipe(["speculative=draft", "quant=int8"])
    inherited = compose_recipe(["speculative=draft", "quant=int8", "speculative.draft.quant=null"])
    assert "awq" in [p.name for p in draft_passes(own)]
    assert [p.name for p in draft_passes(inherited)] == [
        "prune",
        "distill",
        *(p.name for p in build_passes(inherited)),  # the target's: int8 from smoothing to build
    ]


def test_the_registry_name_says_the_engine_has_a_draft() -> None:
    from pipeline.config import RegistryConfig
    from pipeline.publish import registry_names

    choices = {"model": "llama", "quant": "int8", "speculative": "draft", "fusion": "none"}
    assert registry_names(choices, RegistryConfig()) == ("llama", "int8+speculative-draft")


def test_a_second_run_reuses_the_draft_from_the_cache(
    speculative_run: tuple[Path, dict], tiny_llama: Path
) -> None:
    workdir, first = speculative_run
    result = run_pipeline(tiny_llama, workdir, "run2", *QUICK_BENCH, *DRAFT)
    assert result.returncode == 0, result.stderr[-3000:]
    second = json.loads((workdir / "run2" / "manifest.json").read_text())
    assert all(p["cache_hit"] for p in second["speculative"]["draft_passes"])
    assert second["speculative"]["attach_cache_hit"] is True
    assert second["engine"]["digest"] == first["engine"]["digest"]


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        (["speculative.k=0"], "speculative.k=0: the draft proposes at least 1 token a round"),
        (["speculative.draft.prune.depth_ratio=1.0"], "prune.depth_ratio=1.0: a ratio must be in [0, 1)"),
        (["speculative.draft.prune=null"], "speculative.draft.prune is empty"),
        (
            ["kv_cache=shared", "kv_cache.window=64", "fusion=ort"],
            "the buffer evicts in place and cannot roll back rejected draft tokens",
        ),
    ],
)
def test_bad_settings_are_one_line_errors(
    tiny_llama: Path, tmp_path: Path, settings: list, needle: str
) -> None:
    result = run_pipeline(tiny_llama, tmp_path, "run", "speculative=draft", "bench=none", *settings)
    assert result.returncode == 2, result.stderr[-2000:]
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "engine").exists()
