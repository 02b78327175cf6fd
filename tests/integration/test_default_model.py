"""Integration: the real default model (SmolLM2-135M-Instruct from the bundled GGUF) is fetched,
verified, converted, exported, built and generates; the engine matches torch greedy decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.config import DEFAULT_MODEL_SHA256, ModelConfig
from pipeline.core.artifacts import Kind
from pipeline.core.cache import Cache
from pipeline.core.manager import PassManager
from pipeline.core.plugins import build_passes
from pipeline.core.torch_model import load_causal_lm
from pipeline.runtime import Engine, GenerationConfig
from pipeline.sources import resolve_source
from tests.pipeline.recipe import compose_recipe

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
# Shared with `python -m pipeline model=llama` run from the repo, so the conversion happens once.
MODELS_DIR = REPO / "artifacts" / "models"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    cfg = compose_recipe(["model=llama", "quant=none"])
    model = OmegaConf.to_object(cfg.model)
    assert isinstance(model, ModelConfig)
    source = resolve_source(model, MODELS_DIR)
    cache = Cache(tmp_path_factory.mktemp("cache"))
    engine, records = PassManager(build_passes(cfg), cache).run(source)
    return source, engine, records


def test_source_is_the_verified_default_model(built: tuple) -> None:
    source = built[0]
    assert source.metadata["origin"]["gguf_sha256"] == DEFAULT_MODEL_SHA256
    assert source.metadata["num_hidden_layers"] == 30 and source.metadata["vocab_size"] == 49152
    assert (source.path / "model.safetensors").stat().st_size > 500_000_000


def test_export_parity_on_the_real_model(built: tuple) -> None:
    parity = built[2][0].metrics["parity"]
    assert parity["top1_agreement"] >= 0.99
    assert parity["max_abs_diff"] < 1e-2


def test_engine_answers_and_matches_torch_greedy(built: tuple) -> None:
    import torch

    source, engine_artifact, _ = built
    assert engine_artifact.kind == Kind.ENGINE
    engine = Engine(engine_artifact.path)
    answer = engine.generate("What is the capital of France?", GenerationConfig(max_new_tokens=16), chat=True)
    assert "Paris" in answer[0].text

    prompt = engine.tokenizer("The three primary colours are")["input_ids"]
    ours = engine.generate_ids([prompt], GenerationConfig(max_new_tokens=16, stop_at_eos=False)).tokens[0]
    model = load_causal_lm(source.path)
    with torch.inference_mode():
        reference = model.generate(
            torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False
        )[0, len(prompt) :].tolist()
    assert ours == reference


def test_batch_with_left_padding_matches_single_prompts(built: tuple) -> None:
    engine = Engine(built[1].path)
    prompts = ["Write a haiku about the sea.", "What is 2 + 2?"]
    config = GenerationConfig(max_new_tokens=12)
    batched = engine.generate(prompts, config, chat=True)
    single = [engine.generate(p, config, chat=True)[0] for p in prompts]
    assert [b.token_ids for b in batched] == [s.token_ids for s in single]
