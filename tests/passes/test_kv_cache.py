"""KV-cache layout: what the pass records, sliding-window attention through the fused graph
against the unfused graph with the old positions masked out, the shared buffer against the
concat layout token for token, and the build's refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from passes.build import OrtCpuBuildPass
from passes.fusion.fuse import FusionPass
from passes.kv_cache import KvCachePass
from pipeline.artifacts import Artifact, Kind
from pipeline.errors import EngineError, PassError
from pipeline.runtime.generate import GenerationConfig
from pipeline.runtime.ort import Engine, OrtModel, graph_io
from tests.conftest import genai_greedy_tokens

WINDOW = 4


def layout(graph: Artifact, out: Path, fuse: bool = True, **config: object) -> Artifact:
    step = KvCachePass(**config)
    step.requires(graph)
    (out / "kv").mkdir(parents=True)
    step.run(graph, out / "kv")
    result = Artifact.from_dir(Kind.GRAPH, out / "kv")
    if not fuse:
        return result
    (out / "fused").mkdir()
    FusionPass().run(result, out / "fused")
    return Artifact.from_dir(Kind.GRAPH, out / "fused")


def build(graph: Artifact, out: Path, **config: object) -> Artifact:
    step = OrtCpuBuildPass(**config)
    step.requires(graph)
    out.mkdir()
    step.run(graph, out)
    engine = Artifact.from_dir(Kind.ENGINE, out)
    step.ensures(graph, engine)
    return engine


def test_the_layout_is_recorded_for_fusion_build_and_runtime(tiny_graph: Artifact, tmp_path: Path) -> None:
    graph = layout(tiny_graph, tmp_path, fuse=False, layout="shared", window=64, paged_block_size=16)
    assert graph.metadata["kv_cache"] == {
        "layout": "shared",
        "dtype": "fp32",
        "window": 64,
        "paged_block_size": 16,
    }
    assert (graph.path / "model.onnx").read_bytes() == (tiny_graph.path / "model.onnx").read_bytes()


@pytest.mark.parametrize("bad", [{"window": 1}, {"window": -5}, {"paged_block_size": -1}])
def test_bad_settings_are_refused(bad: dict[str, int]) -> None:
    with pytest.raises(PassError, match="kv_cache"):
        KvCachePass(**bad)


def test_sliding_window_prefill_and_decode_match_masked_attention(
    tiny_graph: Artifact, tmp_path: Path
) -> None:
    """Token t attends to t-WINDOW+1..t. The unfused graph does the same when fed one token at a
    time with earlier positions masked out of attention_mask; the windowed GroupQueryAttention
    must agree in a prefill longer than the window and in decode steps."""
    windowed = layout(tiny_graph, tmp_path, window=WINDOW)
    fused = OrtModel(windowed.path / "model.onnx", graph_io(windowed.path))
    plain = OrtModel(tiny_graph.path / "model.onnx", graph_io(tiny_graph.path))
    ids = np.array([[1, 40, 41, 42, 43, 44, 45, 46, 47, 48]])
    prefill, cache = fused.step(ids, np.ones_like(ids), np.arange(10)[None], fused.empty_cache(1))
    reference, plain_cache = [], plain.empty_cache(1)
    for t in range(10):
        mask = np.ones((1, t + 1), np.int64)
        mask[:, : max(0, t + 1 - WINDOW)] = 0
        logits, plain_cache = plain.step(ids[:, t : t + 1], mask, np.array([[t]]), plain_cache)
        reference.append(logits[0, -1])
    assert np.abs(prefill[0] - np.stack(reference)).max() < 1e-4
    unbounded, _ = plain.step(ids, np.ones_like(ids), np.arange(10)[None], plain.empty_cache(1))
    assert np.abs(prefill[0, -1] - unbounded[0, -1]).max() > 1e-3  # the window changed something
    token = prefill[:, -1:].argmax(-1)
    decoded, _ = fused.step(token, np.ones((1, 11), np.int64), np.array([[10]]), cache)
    mask = np.ones((1, 11), np.int64)
    mask[:, : 11 - WINDOW] = 0
    expected, _ = plain.step(token, mask, np.array([[10]]), plain_cache)
    assert np.abs(decoded - expected).max() < 1e-4


def test_shared_buffer_decodes_token_for_token_like_concat(tiny_graph: Artifact, tmp_path: Path) -> None:
    shared = build(
        layout(tiny_graph, tmp_path / "s", layout="shared"), tmp_path / "shared-engine", max_length=64
    )
    concat = build(
        layout(tiny_graph, tmp_path / "c", layout="concat"), tmp_path / "concat-engine", max_length=64
    )
    engines = [Engine(shared.path), Engine(concat.path)]
    assert engines[0].io.kv_layout == "shared" and engines[1].io.kv_layout == "concat"
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False)
    prompts = [[1, 40, 41, 42, 43], [1, 50, 51, 52, 53]]  # equal lengths: one batch
    results = [engine.generate_ids(prompts, config) for engine in engines]
    assert results[0].tokens == results[1].tokens
    cache = engines[0].model.empty_cache(1)
    assert cache[0].shape()[2] == 64  # preallocated to max_length, bound once


def test_shared_buffer_refuses_what_does_not_fit(tiny_graph: Artifact, tmp_path: Path) -> None:
    engine = Engine(build(layout(tiny_graph, tmp_path, layout="shared"), tmp_path / "e", max_length=16).path)
    with pytest.raises(EngineError, match="max_length 16"):
        engine.generate_ids([[1] * 12], GenerationConfig(max_new_tokens=8))


@pytest.mark.parametrize(
    ("config", "message"), [({"layout": "shared"}, "kv_cache=shared"), ({"window": 8}, "window")]
)
def test_build_refuses_layouts_an_unfused_graph_cannot_honour(
    tiny_graph: Artifact, tmp_path: Path, config: dict[str, object], message: str
) -> None:
    graph = layout(tiny_graph, tmp_path, fuse=False, **config)
    with pytest.raises(PassError, match=message):
        OrtCpuBuildPass().requires(graph)


def test_an_engine_whose_layout_its_graph_cannot_run_is_refused(
    tiny_engine: Artifact, tmp_path: Path
) -> None:
    import json
    import shutil

    folder = tmp_path / "engine"
    shutil.copytree(tiny_engine.path, folder)
    spec = json.loads((folder / "engine.json").read_text())
    spec["io"]["kv_layout"] = "shared"
    (folder / "engine.json").write_text(json.dumps(spec))
    with pytest.raises(EngineError, match="no GroupQueryAttention: rebuild the engine with fusion=ort"):
        Engine(folder)
    spec["io"]["kv_layout"] = "paged"
    (folder / "engine.json").write_text(json.dumps(spec))
    with pytest.raises(EngineError, match="kv_layout 'paged'"):
        Engine(folder)


def test_onnxruntime_genai_runs_the_shared_buffer_engine(tiny_graph: Artifact, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime_genai")
    engine = build(layout(tiny_graph, tmp_path, layout="shared"), tmp_path / "engine", max_length=64)
    prompt = [1, 40, 41, 42, 43, 44]
    ours = Engine(engine.path).generate_ids([prompt], GenerationConfig(max_new_tokens=10, stop_at_eos=False))
    assert genai_greedy_tokens(engine.path, prompt, 10) == ours.tokens[0]
