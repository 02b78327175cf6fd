"""Integration: fusion=ort kv_cache=shared on the real default model rewrites every site of all
30 layers, matches the unfused graph, and the shared-buffer engine decodes like the plain one."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.config import ModelConfig
from pipeline.core.cache import Cache
from pipeline.core.manager import PassManager
from pipeline.core.plugins import build_passes
from pipeline.runtime import Engine, GenerationConfig
from pipeline.sources import resolve_source
from tests.pipeline.recipe import compose_recipe

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO / "artifacts" / "models"
LAYERS = 30


def test_fused_shared_engine_on_the_default_model(tmp_path: Path) -> None:
    cfg = compose_recipe(
        ["model=llama", "quant=none", "fusion=ort", "kv_cache=shared", "target.max_length=512"]
    )
    model = OmegaConf.to_object(cfg.model)
    assert isinstance(model, ModelConfig)
    source = resolve_source(model, MODELS_DIR)
    engine_artifact, records = PassManager(build_passes(cfg), Cache(tmp_path / "cache")).run(source)
    fusion = next(r for r in records if r.name == "fusion")
    assert fusion.metrics["rewrites"] == {
        "rms_norm": 2 * LAYERS + 1,
        "skip_rms_norm": 2 * LAYERS,
        "rotary_embedding": 2 * LAYERS,
        "group_query_attention": LAYERS,
        "packed_qkv": LAYERS,
    }
    assert fusion.metrics["warnings"] == []
    parity = fusion.metrics["parity_vs_input_graph"]
    assert parity["top1_agreement"] == 1.0 and parity["max_abs_diff"] < 1e-2
    engine = Engine(engine_artifact.path)
    assert engine.io.kv_layout == "shared" and engine.max_length == 512
    answer = engine.generate("What is the capital of France?", GenerationConfig(max_new_tokens=16), chat=True)
    assert "Paris" in answer[0].text
