"""The int8-KV engine's prefill graph (passes/fusion/int8_prefill.py, written by
passes/ort_build.py, run by OrtModel.prompt_step) on the tiny random Llama: what the build writes
and records, that the graph computes what ONNX Runtime's int8 GroupQueryAttention kernel
computes (the same logits to float rounding, the same int8 codes in the cache), for a shared
buffer and a concat cache; that chunks and prefix hits equal one prefill; which steps run on it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from passes.fusion.fuse import FusionPass
from passes.fusion.int8_prefill import PREFILL_MODEL_FILE, is_int8_cache, prefill_model
from passes.kv_cache import KvCachePass
from passes.ort_build import OrtCpuBuildPass
from pipeline.core.artifacts import Artifact
from pipeline.core.engine import LOGITS_POSITIONS
from pipeline.core.errors import EngineError, PassError
from pipeline.core.graph_io import check_data_files
from pipeline.runtime import Engine, GenerationConfig
from pipeline.runtime.generate import prefill
from pipeline.runtime.serving import Request, serve
from tests.conftest import run_pass

CALIBRATION = {"num_samples": 4, "seq_len": 64}
PROMPT = np.array([[1, *range(40, 63)]])  # 24 tokens


def _build(graph: Artifact, cache: Path, **kv_cache: object) -> tuple[Artifact, dict]:
    graph = run_pass(KvCachePass(**kv_cache), graph, cache)[0]
    graph = run_pass(FusionPass(), graph, cache)[0]
    return run_pass(OrtCpuBuildPass(max_length=128), graph, cache)


@pytest.fixture(scope="module", params=["shared", "concat"])
def built(
    request: pytest.FixtureRequest, tiny_graph: Artifact, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Artifact, dict]:
    return _build(
        tiny_graph,
        tmp_path_factory.mktemp(request.param),
        layout=request.param,
        dtype="int8",
        calibration=CALIBRATION,
    )


def _prompt(model, ids: np.ndarray, cache, past: int = 0, prompt_step: bool = True):
    step = model.prompt_step if prompt_step else model.step
    mask = np.ones((ids.shape[0], past + ids.shape[1]), np.int64)
    return step(ids, mask, np.arange(past, past + ids.shape[1])[None], cache)


def _codes(model, cache, length: int) -> list[np.ndarray]:
    return [value.numpy()[:, :, :length].copy() for value in cache]


def test_the_build_writes_and_records_the_prefill_graph(built: tuple[Artifact, dict]) -> None:
    import onnx

    engine, metrics = built
    spec = json.loads((engine.path / "engine.json").read_text())
    assert spec["prefill_model_file"] == PREFILL_MODEL_FILE
    main = onnx.load(str(engine.path / "model.onnx"), load_external_data=False)
    graph = onnx.load(str(engine.path / PREFILL_MODEL_FILE), load_external_data=False)
    layers = spec["io"]["num_layers"]
    ops = [node.op_type for node in graph.graph.node]
    assert ops.count("GroupQueryAttention") == layers and ops.count("RotaryEmbedding") == 2 * layers
    assert is_int8_cache(main) and not is_int8_cache(graph)
    # the engine's IO, int8 caches included, and which logits to compute; the engine's weights
    # file, not a copy
    io = {v.name: v.type.tensor_type.elem_type for v in (*main.graph.input, *main.graph.output)}
    io[LOGITS_POSITIONS] = onnx.TensorProto.INT64
    assert {v.name: v.type.tensor_type.elem_type for v in (*graph.graph.input, *graph.graph.output)} == io
    assert sorted(p.name for p in engine.path.glob("*.data")) == ["model.onnx.data"]
    check_data_files(engine.path, "test")
    assert metrics["prefill_graph"]["max_abs_diff"] < 1e-3
    with pytest.raises(PassError, match="no GroupQueryAttention with an int8 cache"):
        prefill_model(graph)


def test_an_fp32_cache_engine_gets_no_prefill_graph(tiny_graph: Artifact, tmp_path: Path) -> None:
    engine, metrics = _build(tiny_graph, tmp_path, layout="shared")
    assert not (engine.path / PREFILL_MODEL_FILE).exists() and "prefill_graph" not in metrics
    assert "prefill_model_file" not in json.loads((engine.path / "engine.json").read_text())
    assert Engine(engine.path).model.prefill_session is None


def test_the_prefill_graph_computes_what_the_int8_kernel_computes(built: tuple[Artifact, dict]) -> None:
    model = Engine(built[0].path).model
    assert model.prefill_session is not None
    ours, our_cache = _prompt(model, PROMPT, model.empty_cache(1))
    kernel, kernel_cache = _prompt(model, PROMPT, model.empty_cache(1), prompt_step=False)
    assert np.abs(ours - kernel).max() < 1e-4 * np.ptp(kernel)
    assert (ours.argmax(-1) == kernel.argmax(-1)).all()
    length = PROMPT.shape[1]
    for a, b in zip(_codes(model, our_cache, length), _codes(model, kernel_cache, length), strict=True):
        assert a.dtype == np.int8 and a.shape == b.shape
        # the same int8 codes; float rounding may move a value across a rounding boundary
        assert np.abs(a.astype(int) - b).max() <= 1 and (a != b).mean() < 1e-3
    # and the decode steps after it run on the kernel, reading what the prefill graph wrote
    next_ours, _ = _prompt(model, PROMPT[:, -1:] * 0 + 5, our_cache, past=length, prompt_step=False)
    next_kernel, _ = _prompt(model, PROMPT[:, -1:] * 0 + 5, kernel_cache, past=length, prompt_step=False)
    assert np.abs(next_ours - next_kernel).max() < 1e-4 * np.ptp(next_kernel)


def test_chunks_and_a_cached_prefix_equal_one_prefill(built: tuple[Artifact, dict]) -> None:
    """Chunks after the first read the past from the int8 cache, dequantized: the attention sees
    the same values as in one step, so the logits and codes match to float rounding."""
    model = Engine(built[0].path).model
    whole, whole_cache = _prompt(model, PROMPT, model.empty_cache(1))
    _, cache = _prompt(model, PROMPT[:, :16], model.empty_cache(1))
    rest, cache = _prompt(model, PROMPT[:, 16:], cache, past=16)
    np.testing.assert_allclose(rest[0], whole[0, 16:], atol=1e-5 * np.ptp(whole))
    length = PROMPT.shape[1]
    for a, b in zip(_codes(model, cache, length), _codes(model, whole_cache, length), strict=True):
        assert (a != b).mean() < 1e-3
    chunked = prefill(model, PROMPT[0].tolist(), model.empty_cache(1), chunk=10)
    for a, b in zip(_codes(model, chunked, length), _codes(model, whole_cache, length), strict=True):
        assert (a != b).mean() < 1e-3


def test_prompts_run_on_the_prefill_graph_and_generated_tokens_on_the_kernel(
    built: tuple[Artifact, dict],
) -> None:
    engine = Engine(built[0].path)
    runs = {"prefill": 0, "decode": 0}
    for name, session in (("prefill", engine.model.prefill_session), ("decode", engine.model.session)):
        real = session.run_with_iobinding

        def counted(binding, *args, name=name, real=real):
            runs[name] += 1
            return real(binding, *args)

        session.run_with_iobinding = counted
    prompts = [PROMPT[0].tolist(), PROMPT[0, :9].tolist()]
    config = GenerationConfig(max_new_tokens=6, stop_at_eos=False)
    batched = engine.generate_ids(prompts, config).tokens
    assert runs == {"prefill": 1, "decode": 5}
    served = serve(engine, [Request(p, max_new_tokens=6, stop_at_eos=False) for p in prompts])
    assert (
        [c.tokens for c in served] == batched == [engine.generate_ids([p], config).tokens[0] for p in prompts]
    )
    assert runs["prefill"] == 1 + 2 + 2


def test_engine_refuses_a_missing_prefill_graph_and_can_run_without_it(
    built: tuple[Artifact, dict], tmp_path: Path
) -> None:
    assert Engine(built[0].path, prefill_graph=False).model.prefill_session is None
    refusals = {
        "absent.onnx": "is missing: the engine folder is incomplete",
        "../model.onnx": "leaves the engine",
    }
    for name, needle in refusals.items():
        folder = tmp_path / name.replace("/", "_")
        shutil.copytree(built[0].path, folder)
        spec = json.loads((folder / "engine.json").read_text())
        spec["prefill_model_file"] = name
        (folder / "engine.json").write_text(json.dumps(spec))
        with pytest.raises(EngineError, match=needle):
            Engine(folder)


@pytest.mark.parametrize("prefill_graph", [True, False])
def test_logits_at_gives_each_rows_position_alone(built: tuple[Artifact, dict], prefill_graph: bool) -> None:
    """Two right-padded prompts: the logits at each row's last token, asked for alone, are those
    of the full [batch, tokens, vocab] output, with the prefill graph and without it."""
    model = Engine(built[0].path, prefill_graph=prefill_graph).model
    lengths = np.array([PROMPT.shape[1], 9])
    ids = np.stack([PROMPT[0], np.r_[PROMPT[0, :9], np.full(PROMPT.shape[1] - 9, 2)]])
    mask = (np.arange(ids.shape[1]) < lengths[:, None]).astype(np.int64)
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    every, _ = model.prompt_step(ids, mask, positions, model.empty_cache(2))
    last, _ = model.prompt_step(ids, mask, positions, model.empty_cache(2), logits_at=lengths - 1)
    assert every.shape == (2, ids.shape[1], model.io.vocab_size) and last.shape == (2, 1, model.io.vocab_size)
    np.testing.assert_allclose(last[:, 0], every[[0, 1], lengths - 1], atol=1e-5 * np.ptp(every))
