"""Speculative decoding over real ONNX Runtime sessions: a 3-layer "sharp" tiny Llama as the
target, drafts cut from it (the same model: everything accepted; its first layer alone: most
proposals rejected), with both KV layouts. The output must be the target's greedy output token
for token, whatever the draft proposes; bad drafts are refused with one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from passes.export import ExportPass
from passes.ort_build import OrtCpuBuildPass
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.errors import EngineError
from pipeline.runtime.generate import GenerationConfig, generate
from pipeline.runtime.ort import Engine
from pipeline.runtime.speculative import speculative_generate
from tests.conftest import make_tiny_llama
from tests.passes.test_kv_cache import layout

PROMPTS = [[1, 40, 41, 42], [1, 7, 9, 11, 200, 100], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
NEW_TOKENS = 40


def _engine(source: Path, out: Path, kv: str) -> Path:
    graph = out / "graph"
    graph.mkdir(parents=True)
    ExportPass().run(Artifact.from_dir(Kind.TORCH, source), graph)
    artifact = Artifact.from_dir(Kind.GRAPH, graph)
    if kv == "shared":
        artifact = layout(artifact, out / "kv", layout="shared")
    (out / "engine").mkdir()
    OrtCpuBuildPass(max_length=128).run(artifact, out / "engine")
    return out / "engine"


def _with_draft(target: Path, draft: Path, folder: Path, k: int) -> Path:
    shutil.copytree(target, folder)
    shutil.copytree(draft, folder / "draft")
    spec = json.loads((folder / "engine.json").read_text())
    spec["speculative"] = {"draft": "draft", "k": k}
    (folder / "engine.json").write_text(json.dumps(spec))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("speculative")
    target = make_tiny_llama(root / "target", seed=0, initializer_range=0.3, num_hidden_layers=3)
    model = AutoModelForCausalLM.from_pretrained(target)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(root / "first-layer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / name, root / "first-layer" / name)
    return {"target": target, "first-layer": root / "first-layer"}


@pytest.fixture(scope="module", params=["concat", "shared"])
def engines(
    request: pytest.FixtureRequest, models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
):
    root = tmp_path_factory.mktemp(f"engines-{request.param}")
    return {name: _engine(path, root / name, request.param) for name, path in models.items()}


def _greedy(engine: Engine, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    return engine.generate_ids(
        [prompt], GenerationConfig(max_new_tokens=new_tokens, stop_at_eos=False)
    ).tokens[0]


@pytest.mark.parametrize("draft", ["target", "first-layer"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_output_is_the_target_greedy_output(
    engines: dict[str, Path], draft: str, k: int, tmp_path: Path
) -> None:
    folder = _with_draft(engines["target"], engines[draft], tmp_path / "engine", k)
    speculative, alone = Engine(folder), Engine(folder, speculative=False)
    assert speculative.draft is not None and alone.draft is None
    for prompt in PROMPTS:
        assert _greedy(speculative, prompt) == _greedy(alone, prompt)
        stats = speculative.last_draft_stats
        assert stats is not None and stats.proposed > 0
        if draft == "target":  # a draft equal to the target: every proposal is accepted
            assert stats.acceptance_rate == 1.0
            assert stats.tokens_per_round == pytest.approx(k + 1, rel=0.2)
    if draft == "first-layer":  # a real draft: most proposals are rejected and rolled back
        assert speculative.last_draft_stats.acceptance_rate < 0.5


def test_speculative_rounds_and_timings_add_up(engines: dict[str, Path]) -> None:
    target, draft = Engine(engines["target"]), Engine(engines["first-layer"])
    streamed: list[int] = []
    result, stats = speculative_generate(
        target.model, draft.model, PROMPTS[0], k=4, max_new_tokens=NEW_TOKENS, on_token=streamed.append
    )
    assert result.tokens == [streamed] and len(streamed) == NEW_TOKENS
    assert len(result.step_seconds) == NEW_TOKENS - 1  # every token after the prefill's
    assert result.prefill_seconds > 0 and all(s > 0 for s in result.step_seconds)
    # Each round emits its accepted proposals plus the target's own token.
    assert stats.accepted + stats.rounds == NEW_TOKENS - 1
    assert stats.proposed <= 4 * stats.rounds


@pytest.mark.parametrize("new_tokens", [1, 2, 5])
def test_short_budgets_and_the_end_of_sequence(engines: dict[str, Path], new_tokens: int) -> None:
    target, draft = Engine(engines["target"]), Engine(engines["target"])
    plain = generate(target.model, [PROMPTS[1]], GenerationConfig(max_new_tokens=new_tokens), pad_id=0)
    result, _ = speculative_generate(target.model, draft.model, PROMPTS[1], k=4, max_new_tokens=new_tokens)
    assert result.tokens == plain.tokens and len(result.tokens[0]) == new_tokens
    # An end-of-sequence token in the middle of an accepted run ends the output there.
    full = _greedy(target, PROMPTS[1])
    eos = full[6]
    expected = full[: full.index(eos) + 1]
    result, _ = speculative_generate(
        target.model, draft.model, PROMPTS[1], k=4, max_new_tokens=40, eos_ids=[eos]
    )
    assert result.tokens == [expected]
    with pytest.raises(ValueError, match="k must be at least 1"):
        speculative_generate(target.model, draft.model, PROMPTS[1], k=0, max_new_tokens=4)


def test_sampling_and_batches_run_the_target_alone(engines: dict[str, Path], tmp_path: Path) -> None:
    engine = Engine(_with_draft(engines["target"], engines["first-layer"], tmp_path / "engine", 3))
    sampled = GenerationConfig(max_new_tokens=8, do_sample=True, seed=3)
    assert (
        engine.generate_ids([PROMPTS[0]], sampled).tokens
        == Engine(engines["target"]).generate_ids([PROMPTS[0]], sampled).tokens
    )
    assert engine.last_draft_stats is None
    batch = [PROMPTS[0], [1, 50, 51, 52]]
    config = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    assert (
        engine.generate_ids(batch, config).tokens
        == Engine(engines["target"]).generate_ids(batch, config).tokens
    )


def test_a_prompt_that_leaves_no_room_for_the_draft_tokens_is_refused(
    engines: dict[str, Path], tmp_path: Path
) -> None:
    engine = Engine(_with_draft(engines["target"], engines["first-layer"], tmp_path / "engine", 6))
    with pytest.raises(EngineError, match="and 6 draft tokens exceeds max_length 128"):
        engine.generate_ids([[1] * 100], GenerationConfig(max_new_tokens=24))


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused(
    engines: dict[str, Path], models: dict[str, Path], tmp_path: Path
) -> None:
    other = make_tiny_llama(tmp_path / "other-vocab", vocab_size=384, num_hidden_layers=1)
    other_engine = _engine(other, tmp_path / "other", "concat")
    folder = _with_draft(engines["target"], other_engine, tmp_path / "vocab", 3)
    with pytest.raises(EngineError, match="vocabulary of 384 tokens, the target 320"):
        Engine(folder)
    folder = _with_draft(engines["target"], engines["first-layer"], tmp_path / "tokenizer", 3)
    tokenizer = json.loads((folder / "draft" / "tokenizer.json").read_text())
    tokenizer["added_tokens"][0]["content"] = "<|other|>"
    (folder / "draft" / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(EngineError, match="has another tokenizer than the target"):
        Engine(folder)
    spec = json.loads((folder / "engine.json").read_text())
    spec["speculative"] = {"draft": "draft", "k": 0}
    (folder / "engine.json").write_text(json.dumps(spec))
    with pytest.raises(EngineError, match=r"speculative\.k=0 must be an integer from 1 to 64"):
        Engine(folder)


def test_a_rolled_back_cache_gives_the_same_logits(engines: dict[str, Path]) -> None:
    model = Engine(engines["target"]).model
    ids = np.array([PROMPTS[2]])
    ones = np.ones_like(ids)
    full, cache = model.step(ids, ones, np.arange(ids.shape[1])[None], model.empty_cache(1))
    cut = model.truncate_cache(cache, 5)
    again, _ = model.step(ids[:, 5:], ones, np.arange(5, ids.shape[1])[None], cut)
    np.testing.assert_allclose(again[0], full[0, 5:], atol=1e-5)
