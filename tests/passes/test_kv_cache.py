"""KV-cache layout: what the pass records, sliding-window attention through the fused graph
against the unfused graph with the old positions masked out, the shared buffer against the
concat layout token for token, and the build's refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from passes.fusion.fuse import FusionPass
from passes.kv_cache import KvCachePass
from passes.ort_build import OrtCpuBuildPass
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.engine import graph_io
from pipeline.core.errors import EngineError, PassError, PipelineError
from pipeline.core.graph_io import load_proto
from pipeline.core.manager import check_against_model
from pipeline.runtime.generate import GenerationConfig
from pipeline.runtime.ort import Engine, OrtModel
from tests.conftest import genai_greedy_tokens, run_pass

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
    return run_pass(OrtCpuBuildPass(**config), graph, out)[0]


def with_io(engine: Artifact, folder: Path, **io: object) -> Path:
    """A copy of ``engine`` whose engine.json records other IO fields."""
    import json
    import shutil

    shutil.copytree(engine.path, folder)
    spec = json.loads((folder / "engine.json").read_text())
    spec["io"].update(io)
    (folder / "engine.json").write_text(json.dumps(spec))
    return folder


def test_the_layout_is_recorded_for_fusion_build_and_runtime(tiny_graph: Artifact, tmp_path: Path) -> None:
    graph = layout(tiny_graph, tmp_path, fuse=False, layout="shared", window=64, paged_block_size=16)
    assert graph.metadata["kv_cache"] == {
        "layout": "shared",
        "dtype": "fp32",
        "window": 64,
        "paged_block_size": 16,
        "capacity": [80, 80],  # each layer's shared buffer: the window and a quarter more
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
        check_against_model([OrtCpuBuildPass()], graph)  # from the recipe, before any pass runs
    with pytest.raises(PassError, match=message):
        OrtCpuBuildPass().requires(graph)  # from the graph itself


def test_an_engine_whose_layout_its_graph_cannot_run_is_refused(
    tiny_engine: Artifact, tmp_path: Path
) -> None:
    folder = with_io(tiny_engine, tmp_path / "shared", kv_layout="shared")
    with pytest.raises(EngineError, match="no GroupQueryAttention: rebuild the engine with fusion=ort"):
        Engine(folder)
    with pytest.raises(EngineError, match=r"""kv_layout[ =]["']paged["']"""):  # engine.json's schema
        Engine(with_io(tiny_engine, tmp_path / "paged", kv_layout="paged"))


@pytest.mark.parametrize(
    "config",
    [
        {"layout": "shared"},
        {"layout": "shared", "dtype": "int8"},
        {"layout": "shared", "window": WINDOW},
        {"layout": "concat", "dtype": "fp8"},
    ],
    ids=["fp32", "int8", "window", "fp8-concat"],
)
def test_onnxruntime_genai_runs_the_engine(
    tiny_graph: Artifact, tmp_path: Path, config: dict[str, object]
) -> None:
    """GenAI binds a max_length buffer of the recorded dtype; with a window its kernel evicts
    in that buffer as in ours (GenAI knows no window-sized buffer). An fp8 cache is graph IO
    of type float8e4m3fn, which GenAI allocates from the graph's own input types. (The tiny
    random model's greedy tokens repeat the prompt's last token; the logits tests above are
    the numerical check, this one proves GenAI loads and steps each engine.)"""
    pytest.importorskip("onnxruntime_genai")
    calibration = {"num_samples": 4, "seq_len": 64}
    graph = layout(tiny_graph, tmp_path, calibration=calibration, **config)
    engine = build(graph, tmp_path / "engine", max_length=64)
    prompt = [1, 40, 41, 42, 43, 44]
    ours = Engine(engine.path).generate_ids([prompt], GenerationConfig(max_new_tokens=10, stop_at_eos=False))
    assert genai_greedy_tokens(engine.path, prompt, 10) == ours.tokens[0]


def side_by_side(models: list[OrtModel], ids: np.ndarray, steps: int) -> tuple[float, float, list]:
    """Prefill ``ids`` and ``steps - 1`` greedy decode steps (the first model's tokens) on two
    models; the largest |logit difference|, the first model's largest logit range, the caches."""
    caches = [m.empty_cache(1) for m in models]
    positions = np.arange(ids.shape[1])[None]
    worst, spread = 0.0, 0.0
    for _ in range(steps):
        mask = np.ones((1, positions[0, -1] + 1), np.int64)
        (a, caches[0]), (b, caches[1]) = (
            m.step(ids, mask, positions, c) for m, c in zip(models, caches, strict=True)
        )
        worst, spread = max(worst, float(np.abs(a - b).max())), max(spread, float(np.ptp(a)))
        ids, positions = a[:, -1:].argmax(-1), positions[:, -1:] + 1
    return worst, spread, caches


def cache_bytes(model: OrtModel, tokens: int) -> int:
    """Bytes of every layer's cache after a prefill of ``tokens`` tokens."""
    ids = np.arange(1, tokens + 1)[None] % model.io.vocab_size
    _, cache = model.step(ids, np.ones_like(ids), np.arange(tokens)[None], model.empty_cache(1))
    return sum(value.numpy().nbytes for value in cache)


def test_int8_cache_is_calibrated_stored_in_the_graph_and_recorded(
    tiny_graph: Artifact, tmp_path: Path
) -> None:
    import onnx

    step = KvCachePass(dtype="int8", calibration={"num_samples": 4, "seq_len": 64})
    (tmp_path / "kv").mkdir()
    record = step.run(tiny_graph, tmp_path / "kv")
    io = graph_io(tiny_graph.path)
    per_head = record["amax_per_head"]
    assert np.array(per_head["key"]).shape == (io.num_layers, io.num_kv_heads)
    assert min(np.array(per_head["value"]).ravel()) > 0  # every head saw values
    assert record["kv_cache"]["calibration"]["tokens"] == 4 * 64
    (tmp_path / "fused").mkdir()
    FusionPass().run(Artifact.from_dir(Kind.GRAPH, tmp_path / "kv"), tmp_path / "fused")
    fused = Artifact.from_dir(Kind.GRAPH, tmp_path / "fused")
    assert fused.metadata["io"]["kv_dtype"] == "int8"
    model = load_proto(fused.path)
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)}
    assert {types[n] for n in io.past_names() + io.present_names()} == {onnx.TensorProto.INT8}
    scales = {
        t.name: onnx.numpy_helper.to_array(t)
        for t in model.graph.initializer
        if t.name.startswith("kv_scale")
    }
    assert len(scales) == 2 * io.num_layers
    with np.load(tmp_path / "kv" / "kv_cache_amax.npz") as amax:
        np.testing.assert_allclose(scales["kv_scale.0.key"][0, :, 0, :], amax["key"][0] / 127, rtol=1e-6)
    # The fusion is judged exact on fp32-cache copies; the int8 cache is reported as built.
    checks = FusionPass().ensures(Artifact.from_dir(Kind.GRAPH, tmp_path / "kv"), fused)
    assert checks["parity_vs_input_graph"]["max_abs_diff"] < 1e-4
    assert 0 < checks["parity_as_built"]["max_abs_diff"] < 0.1


@pytest.mark.parametrize(
    ("dtype", "ratio", "bound"), [("fp16", 2, 1e-3), ("int8", 4, 0.03), ("fp8", 4, 0.03)]
)
def test_a_smaller_cache_dtype_shrinks_the_cache_and_bounds_the_error(
    tiny_graph: Artifact, tmp_path: Path, dtype: str, ratio: int, bound: float
) -> None:
    """The same fused graph with an fp32 and an fp16/int8/fp8 cache: the cache is 2x/4x/4x smaller
    and the logits of a prefill and 8 decode steps stay close (measured: fp16 0.004%, int8 0.9%,
    fp8 0.4% of the logit range)."""
    calibration = {"num_samples": 4, "seq_len": 64}
    full = layout(tiny_graph, tmp_path / "fp32")
    small = layout(tiny_graph, tmp_path / dtype, dtype=dtype, calibration=calibration)
    models = [OrtModel(g.path / "model.onnx", graph_io(g.path)) for g in (full, small)]
    assert cache_bytes(models[0], 32) == ratio * cache_bytes(models[1], 32)
    ids = np.array([[1, 40, 41, 42, 43, 44, 45, 46]])
    worst, spread, _ = side_by_side(models, ids, steps=9)
    assert 0 < worst < bound * spread


def test_int8_cache_engine_decodes_and_a_shared_fp8_cache_is_refused(
    tiny_graph: Artifact, tmp_path: Path
) -> None:
    graph = layout(
        tiny_graph, tmp_path, layout="shared", dtype="int8", calibration={"num_samples": 4, "seq_len": 64}
    )
    engine = Engine(build(graph, tmp_path / "engine", max_length=64).path)
    assert engine.io.kv_dtype == "int8" and engine.model.empty_cache(1)[0].data_type() == "tensor(int8)"
    result = engine.generate_ids([[1, 40, 41, 42]], GenerationConfig(max_new_tokens=12, stop_at_eos=False))
    assert len(result.tokens[0]) == 12
    with pytest.raises(PassError, match=r"kv_cache\.dtype=fp8 needs layout=concat"):
        KvCachePass(dtype="fp8", layout="shared")
    unfused = layout(tiny_graph, tmp_path / "unfused", fuse=False, dtype="fp16")
    with pytest.raises(PassError, match=r"kv_cache\.dtype=fp16 needs the attention fused"):
        OrtCpuBuildPass().requires(unfused)


FP8_CALIBRATION = {"num_samples": 4, "seq_len": 64}
TRT_RULES = ["onnx_rms_norm", "onnx_rotary_embedding"]  # configs/fusion/tensorrt.yaml


def test_fp8_cache_is_qdq_at_the_cache_io_with_calibrated_per_head_scales(
    tiny_graph: Artifact, tmp_path: Path
) -> None:
    import onnx

    step = KvCachePass(dtype="fp8", calibration=FP8_CALIBRATION)
    (tmp_path / "kv").mkdir()
    record = step.run(tiny_graph, tmp_path / "kv")
    io = graph_io(tiny_graph.path)
    assert np.array(record["amax_per_head"]["key"]).shape == (io.num_layers, io.num_kv_heads)
    kv = Artifact.from_dir(Kind.GRAPH, tmp_path / "kv")
    (tmp_path / "fused").mkdir()
    FusionPass().run(kv, tmp_path / "fused")
    fused = Artifact.from_dir(Kind.GRAPH, tmp_path / "fused")
    assert fused.metadata["io"]["kv_dtype"] == "float8_e4m3fn"
    model = load_proto(fused.path)
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)}
    assert {types[n] for n in io.past_names() + io.present_names()} == {onnx.TensorProto.FLOAT8E4M3FN}
    producers = {o: n for n in model.graph.node for o in n.output}
    for name in io.present_names():
        assert producers[name].op_type == "QuantizeLinear"
        assert [(a.name, a.i) for a in producers[name].attribute] == [("axis", 1)]
    readers = [n for n in model.graph.node if n.input and n.input[0] in io.past_names()]
    assert sorted(n.op_type for n in readers) == ["DequantizeLinear"] * len(io.past_names())
    scales = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    with np.load(tmp_path / "kv" / "kv_cache_amax.npz") as amax:
        expected = amax["value"][1].max(axis=-1) / 448
    np.testing.assert_allclose(scales[producers["present.1.value"].input[1]], expected, rtol=1e-6)
    # The fusion is judged exact with the Q/DQ made Identity; the fp8 cache is reported as built.
    checks = FusionPass().ensures(kv, fused)
    assert checks["parity_vs_input_graph"]["max_abs_diff"] < 1e-4
    assert 0 < checks["parity_as_built"]["max_abs_diff"] < 0.2


def test_fp8_cache_error_is_bounded_by_e4m3_rounding(tiny_graph: Artifact, tmp_path: Path) -> None:
    """Each cached key/value read back is the fp32 one rounded to E4M3 at its head's scale:
    within 2^-4 relative (3 mantissa bits) or half the subnormal step, s * 2^-10; beyond the
    calibrated range it saturates at 448 s."""
    import ml_dtypes

    full = layout(tiny_graph, tmp_path / "fp32")
    small = layout(tiny_graph, tmp_path / "fp8", dtype="fp8", calibration=FP8_CALIBRATION)
    models = [OrtModel(g.path / "model.onnx", graph_io(g.path)) for g in (full, small)]
    ids = np.array([[1, 40, 41, 42, 43, 44, 45, 46, 300, 7, 250, 99]])
    mask, positions = np.ones_like(ids), np.arange(ids.shape[1])[None]
    (_, exact), (_, stored) = (m.step(ids, mask, positions, m.empty_cache(1)) for m in models)
    with np.load(small.path / "kv_cache_amax.npz") as amax:
        head_amax = {kind: amax[kind].max(axis=-1) for kind in amax.files}
    checked = 0
    for index, (x, codes) in enumerate(zip(exact, stored, strict=True)):
        layer, kind = divmod(index, 2)
        assert codes.data_type() == "tensor(float8e4m3fn)"
        scale = (head_amax[("key", "value")[kind]][layer] / 448)[None, :, None, None]
        read = codes.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
        x = x.numpy()
        inside = np.abs(x) <= 448 * scale
        error = np.abs(read - x)
        assert (error <= np.maximum(np.abs(x) * 2**-4, scale * 2**-10) * (1 + 1e-5))[inside].all()
        np.testing.assert_allclose(
            np.abs(read[~inside]), np.broadcast_to(448 * scale, x.shape)[~inside], rtol=1e-6
        )
        checked += int(inside.sum())
    assert checked > 0.99 * sum(x.numpy().size for x in exact)


@pytest.mark.parametrize(
    ("rules", "scale"), [(None, "head"), (TRT_RULES, "tensor")], ids=["ort-per-head", "tensorrt-per-tensor"]
)
def test_fp8_cache_engine_decodes_with_either_rule_set(
    tiny_graph: Artifact, tmp_path: Path, rules: list[str] | None, scale: str
) -> None:
    """The ort-cpu engine decodes from an fp8 cache with GroupQueryAttention (per-head scales),
    and with the attention TensorRT takes (per-tensor scales; there also serving, which
    rearranges cache rows between steps). The TensorRT build takes only the per-tensor graph,
    whose cache Q/DQ the lint passes, and no build takes an fp8 cache no fusion pass stored."""
    from passes.tensorrt_build import TensorRtBuildPass
    from pipeline.core.lint import lint
    from pipeline.runtime.serving import Request, ServingLimits

    (tmp_path / "kv").mkdir()
    KvCachePass(dtype="fp8", fp8_scale=scale, calibration=FP8_CALIBRATION).run(tiny_graph, tmp_path / "kv")
    kv = Artifact.from_dir(Kind.GRAPH, tmp_path / "kv")
    (tmp_path / "fused").mkdir()
    FusionPass(**({"rules": rules} if rules else {})).run(kv, tmp_path / "fused")
    graph = Artifact.from_dir(Kind.GRAPH, tmp_path / "fused")
    engine = Engine(build(graph, tmp_path / "engine", max_length=64).path)
    assert engine.model.empty_cache(1)[0].data_type() == "tensor(float8e4m3fn)"
    config = GenerationConfig(max_new_tokens=12, stop_at_eos=False)
    reference = Engine(build(tiny_graph, tmp_path / "fp32-engine", max_length=64).path)
    prompt = [1, 40, 41, 42]
    ours, exact = (e.generate_ids([prompt], config).tokens[0] for e in (engine, reference))
    assert sum(a == b for a, b in zip(ours, exact, strict=True)) >= 9
    if rules:  # continuous batching takes left-padded batches: not GroupQueryAttention's
        requests = [Request([1, 40, 41, 42], 6, False), Request([1, 50, 51], 9, False)]
        served = engine.serve(requests, ServingLimits(max_sequences=2))
        assert [len(c.tokens) for c in served] == [6, 9]
        assert served[0].tokens == ours[:6]
        check_against_model([TensorRtBuildPass()], graph)
        TensorRtBuildPass().requires(graph)
        assert [f for f in lint(graph.path) if f.node.startswith("kv_")] == []
    else:  # refused before any pass runs, from the recipe alone
        with pytest.raises(PassError, match=r"set kv_cache\.fp8_scale=tensor"):
            check_against_model([TensorRtBuildPass()], graph)
    for build_pass in (OrtCpuBuildPass(), TensorRtBuildPass()):
        with pytest.raises(PassError, match="fp8 is stored by the fusion pass"):
            build_pass.requires(kv)  # the graph
        with pytest.raises(PassError, match="fp8 is stored by the fusion pass"):
            check_against_model([build_pass], kv)  # the recipe


def test_a_windowed_shared_buffer_keeps_only_the_window(tiny_graph: Artifact, tmp_path: Path) -> None:
    """layout=shared with a window: the buffer holds window + window // 4 positions, and a prefill
    longer than it plus decode steps far past it give the logits of the same window over a
    cache that keeps every token (concat)."""
    bounded = Engine(
        build(layout(tiny_graph, tmp_path / "s", layout="shared", window=WINDOW), tmp_path / "se").path
    )
    growing = Engine(
        build(layout(tiny_graph, tmp_path / "c", layout="concat", window=WINDOW), tmp_path / "ce").path
    )
    assert set(bounded.io.kv_capacity) == {WINDOW + WINDOW // 4}
    models = [bounded.model, growing.model]
    worst, _, caches = side_by_side(models, np.array([[1, 40, 41, 42, 43, 44, 45, 46, 47, 48]]), steps=30)
    assert worst < 1e-4
    assert caches[0][0].shape()[2] == WINDOW + WINDOW // 4  # constant memory after 39 tokens
    assert caches[1][0].shape()[2] == 39


def test_the_fusion_check_runs_a_windowed_shared_buffer_as_the_runtime_does(
    tiny_graph: Artifact, tmp_path: Path
) -> None:
    """The fusion pass's parity check binds the window-sized buffer GroupQueryAttention expects
    (an empty concat-style cache fails in the kernel: capacity 0 < local_window_size)."""
    window = 64  # longer than the parity prompt and its decode steps: the unfused graph agrees
    source = layout(tiny_graph, tmp_path, fuse=False, layout="shared", window=window)
    (tmp_path / "fused").mkdir()
    FusionPass().run(source, tmp_path / "fused")
    parity = FusionPass().ensures(source, Artifact.from_dir(Kind.GRAPH, tmp_path / "fused"))
    assert parity["parity_vs_input_graph"]["top1_agreement"] == 1.0


def test_an_engine_with_a_window_buffer_but_no_window_is_refused(
    tiny_engine: Artifact, tmp_path: Path
) -> None:
    folder = with_io(tiny_engine, tmp_path / "engine", kv_capacity=8)
    with pytest.raises(EngineError, match="only a shared layout holds window buffers"):
        Engine(folder)


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (
            {"layout": "shared", "window": 257},
            "kv_cache.window=257: more positions than the model's context of 256",
        ),
        ({"paged_block_size": 512}, "kv_cache.paged_block_size=512: more positions than the model's context"),
        ({"dtype": "int8", "calibration": {"seq_len": 300}}, "kv_cache.calibration.seq_len=300: longer than"),
    ],
)
def test_knobs_past_the_model_context_are_refused_before_the_pass_runs(
    tiny_graph: Artifact, tmp_path: Path, config: dict, needle: str
) -> None:
    step = KvCachePass(**config)
    with pytest.raises(PipelineError) as error:
        check_against_model([step], tiny_graph)
    assert needle in str(error.value) and "at most 256" in str(error.value), str(error.value)
    with pytest.raises(PipelineError, match=needle.split(":")[0].replace(".", r"\.")):
        run_pass(step, tiny_graph, tmp_path / "cache")  # the manager checks before it runs anything
    assert not any(p for p in (tmp_path / "cache").glob("*") if not p.name.startswith("."))


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"window": 10**8}, "kv_cache.window=100000000: use 0 (unbounded) or from 2 to 1048576"),
        ({"window": 1}, "kv_cache.window=1: use 0 (unbounded)"),
        ({"paged_block_size": 10**6}, "kv_cache.paged_block_size=1000000: must be from 0 to 4096"),
        ({"paged_block_size": -1}, "kv_cache.paged_block_size=-1: must be from 0 to 4096"),
        (
            {"dtype": "int8", "calibration": {"num_samples": 0}},
            "kv_cache.calibration.num_samples=0: at least one",
        ),
    ],
)
def test_knobs_out_of_range_are_refused_when_built(config: dict, needle: str) -> None:
    with pytest.raises(PipelineError) as error:
        KvCachePass(**config)
    assert needle in str(error.value), str(error.value)


def test_a_window_of_the_whole_context_is_accepted(tiny_graph: Artifact) -> None:
    check_against_model([KvCachePass(layout="shared", window=256, paged_block_size=256)], tiny_graph)
