"""GPU targets: ``target=tensorrt`` (passes/tensorrt_build.py), ``ort-cuda`` and ``ort-trt``
(passes/ort_build.py), and the TensorRT runtime's checks (pipeline/runtime/tensorrt.py).

On CPU (every machine here): the recipe composes, the optimization profiles, the lint in
``requires``, the refusal of a machine without GPU/TensorRT before any pass runs, and the
runtime's refusal of a plan built for another TensorRT or GPU. Where ``tensorrt`` imports and a
CUDA GPU is present, the engine is built from the tiny Llama and its logits and greedy tokens
are compared with the ONNX Runtime CPU engine; elsewhere those tests skip and say why.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from passes.fusion.fuse import FusionPass
from passes.kv_cache import KvCachePass
from passes.ort_build import OrtCudaBuildPass, OrtTrtBuildPass
from passes.tensorrt_build import TensorRtBuildPass, profile_shapes, save_timing_cache, timing_cache_file
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.engine import IOSpec
from pipeline.core.errors import EngineError, PassError
from pipeline.core.gpu import GpuInfo
from pipeline.core.manager import check_against_model
from pipeline.core.plugins import build_passes
from pipeline.runtime.tensorrt import check_build_match, pick_profile
from tests.pipeline.recipe import compose_recipe

REPO = Path(__file__).resolve().parents[2]
IO = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 320, "has_position_ids": True}
H100 = GpuInfo(name="NVIDIA H100 80GB HBM3", compute_capability="9.0", cuda="13.0", memory_gib=79.1)


def _gpu_with_tensorrt() -> str | None:
    """Why the GPU tests cannot run here (None: they can)."""
    if importlib.util.find_spec("tensorrt") is None:
        return "tensorrt is not installed (pip install '.[gpu]' on a machine with an NVIDIA GPU)"
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch {torch.__version__}"
    return None


GPU_SKIP = _gpu_with_tensorrt()
needs_gpu = pytest.mark.skipif(GPU_SKIP is not None, reason=f"TensorRT GPU test: {GPU_SKIP}")


# ---------------------------------------------------------------- config and profiles (CPU)
def test_targets_compose_to_their_passes() -> None:
    for target, cls in (
        ("tensorrt", TensorRtBuildPass),
        ("ort-cuda", OrtCudaBuildPass),
        ("ort-trt", OrtTrtBuildPass),
    ):
        passes = build_passes(compose_recipe([f"target={target}"]))
        assert type(passes[-1]) is cls
    trt = build_passes(compose_recipe(["target=tensorrt", "target.builder_optimization_level=5"]))[-1]
    assert trt.config.builder_optimization_level == 5 and trt.config.decode_tokens == 8


def test_bad_hardware_compatibility_is_refused_by_the_schema() -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="hardware_compatibility"):
        compose_recipe(["target=tensorrt", "target.hardware_compatibility=any"])


def test_profiles_cover_prefill_and_decode() -> None:
    profiles = profile_shapes(IO, max_batch=4, max_input_length=1024, max_length=4096, decode_tokens=8)
    assert list(profiles) == ["prefill", "decode"]
    prefill, decode = profiles["prefill"], profiles["decode"]
    assert prefill["input_ids"] == ([1, 1], [1, 512], [4, 1024])
    assert decode["input_ids"] == ([1, 1], [1, 1], [4, 8])
    # every profile takes an empty cache up to max_length - 1 cached positions
    for profile in profiles.values():
        low, _, high = profile["past_key_values.1.value"]
        assert low == [1, 2, 0, 16] and high == [4, 2, 4095, 16]
        assert profile["position_ids"] == profile["input_ids"]
        for low, opt, high in profile.values():
            assert all(a <= b <= c for a, b, c in zip(low, opt, high, strict=True))
        assert profile["attention_mask"][2][1] == 4096  # never more than max_length positions
    assert decode["attention_mask"][1] == [1, 2049]  # opt: one token on a half-full cache
    assert len(prefill) == 3 + 2 * 2


def test_one_profile_without_decode_tokens_and_no_position_ids() -> None:
    io = {**IO, "has_position_ids": False}
    (profile,) = profile_shapes(io, 1, 256, 256).values()
    assert "position_ids" not in profile and profile["input_ids"] == ([1, 1], [1, 256], [1, 256])


@pytest.mark.parametrize(
    ("args", "knob"),
    [((1, 0, 256, 8), "max_input_length"), ((1, 512, 256, 8), "max_input_length"),
     ((0, 64, 256, 8), "max_batch"), ((1, 64, 256, 65), "decode_tokens")],
)  # fmt: skip
def test_bad_profile_settings_name_the_knob(args: tuple[int, int, int, int], knob: str) -> None:
    with pytest.raises(PassError, match=knob):
        profile_shapes(IO, *args)


def test_timing_cache_is_per_tensorrt_version_and_gpu(tmp_path: Path) -> None:
    path = timing_cache_file(str(tmp_path), "11.4.0.106", H100.to_dict())
    assert path == tmp_path / "timing-trt11.4.0.106-sm9.0-nvidia-h100-80gb-hbm3.cache"
    other = timing_cache_file(str(tmp_path), "11.4.0.106", {**H100.to_dict(), "compute_capability": "8.0"})
    assert other != path
    assert timing_cache_file("", "11.4.0.106", H100.to_dict()) is None


# ---------------------------------------------------------------- requires: lint and layout (CPU)
def test_requires_refuses_a_graph_with_ort_contrib_ops(tiny_graph: Artifact, tmp_path: Path) -> None:
    (tmp_path / "fused").mkdir()
    FusionPass().run(tiny_graph, tmp_path / "fused")
    fused = Artifact.from_dir(Kind.GRAPH, tmp_path / "fused")
    for step in (TensorRtBuildPass(), OrtTrtBuildPass()):
        refused = r"TensorRT-compatible for target=.*: (contrib|unsupported)-op at node node_\w+ \("
        with pytest.raises(PassError, match=refused) as info:
            step.requires(fused)
        assert "python -m pipeline.lint" in str(info.value) and "more)" in str(info.value)
    OrtTrtBuildPass(lint=False).requires(fused)  # ort-trt may leave those nodes to CUDA
    OrtCudaBuildPass().requires(fused)  # the CUDA EP runs contrib ops


def test_requires_accepts_the_exported_graph(tiny_graph: Artifact) -> None:
    TensorRtBuildPass().requires(tiny_graph)
    OrtTrtBuildPass().requires(tiny_graph)


def test_ort_only_kv_layouts_are_refused_before_any_pass_runs(tiny_graph: Artifact, tmp_path: Path) -> None:
    (tmp_path / "kv").mkdir()
    KvCachePass(layout="shared").run(tiny_graph, tmp_path / "kv")
    shared = Artifact.from_dir(Kind.GRAPH, tmp_path / "kv")
    with pytest.raises(PassError, match="kv_cache=none or kv_cache=concat"):
        check_against_model([TensorRtBuildPass()], shared)
    with pytest.raises(PassError, match="kv_cache=none or kv_cache=concat"):  # from the recipe alone
        check_against_model([KvCachePass(layout="shared"), TensorRtBuildPass()], tiny_graph)


# ---------------------------------------------------------------- no GPU: fail before any pass (CPU)
@pytest.mark.skipif(
    GPU_SKIP is None, reason="a GPU with TensorRT is here: the refusal needs a machine without"
)
@pytest.mark.parametrize(
    ("target", "says"),
    [("tensorrt", "TensorRT is not installed"), ("ort-cuda", "has no CUDAExecutionProvider"),
     ("ort-trt", "has no TensorrtExecutionProvider")],
)  # fmt: skip
def test_gpu_target_without_gpu_fails_before_any_pass(
    tiny_llama: Path, tmp_path: Path, target: str, says: str
) -> None:
    if target != "tensorrt":
        import onnxruntime as ort

        if "CUDAExecutionProvider" in ort.get_available_providers():
            pytest.skip("onnxruntime-gpu is installed here")
    command = [
        sys.executable, "-m", "pipeline", f"model.path={tiny_llama}", f"target={target}",
        f"pipeline.cache_dir={tmp_path / 'cache'}", f"pipeline.models_dir={tmp_path / 'models'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "pass 1/" not in result.stderr + result.stdout  # nothing ran
    assert not (tmp_path / "cache").exists() or not any(
        p.name != ".staging" for p in (tmp_path / "cache").iterdir()
    )


# ---------------------------------------------------------------- runtime checks (CPU)
def test_runtime_refuses_another_tensorrt_version(tmp_path: Path) -> None:
    recorded = {"version": "11.3.0.1", "gpu": H100.to_dict(), "hardware_compatibility": "none"}
    with pytest.raises(EngineError, match=r"built with TensorRT 11\.3\.0\.1, this machine has 11\.4"):
        check_build_match(recorded, "11.4.0.106", H100, tmp_path)


def test_runtime_refuses_another_compute_capability(tmp_path: Path) -> None:
    a100 = GpuInfo(name="NVIDIA A100-SXM4-80GB", compute_capability="8.0", cuda="13.0", memory_gib=79.2)
    recorded = {"version": "11.4.0.106", "gpu": H100.to_dict(), "hardware_compatibility": "none"}
    with pytest.raises(EngineError, match=r"compute capability 9\.0 .*A100.* \(8\.0\)"):
        check_build_match(recorded, "11.4.0.106", a100, tmp_path)


def test_runtime_takes_a_sibling_gpu_only_with_hardware_compatibility(tmp_path: Path) -> None:
    h200 = GpuInfo(name="NVIDIA H200", compute_capability="9.0", cuda="13.0", memory_gib=139.8)
    recorded = {"version": "11.4.0.106", "gpu": H100.to_dict(), "hardware_compatibility": "none"}
    with pytest.raises(EngineError, match="same_compute_capability"):
        check_build_match(recorded, "11.4.0.106", h200, tmp_path)
    check_build_match(
        {**recorded, "hardware_compatibility": "same_compute_capability"}, "11.4.0.106", h200, tmp_path
    )
    check_build_match(recorded, "11.4.0.106", H100, tmp_path)


def test_steps_pick_the_decode_profile_for_few_tokens() -> None:
    profiles = profile_shapes(IO, 1, 1024, 4096, decode_tokens=5)
    assert [pick_profile(profiles, n) for n in (1, 5, 6, 900)] == [1, 1, 0, 0]
    assert pick_profile(profile_shapes(IO, 1, 256, 256), 100) == 0


# ---------------------------------------------------------------- on a GPU with TensorRT
@pytest.fixture(scope="module")
def trt_engine(tiny_graph: Artifact, tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    out = tmp_path_factory.mktemp("trt") / "engine"
    out.mkdir()
    step = TensorRtBuildPass(
        max_input_length=128, max_length=256, timing_cache_dir=str(out.parent / "timing")
    )
    step.preflight()
    step.requires(tiny_graph)
    metrics = step.run(tiny_graph, out)
    engine = Artifact.from_dir(Kind.ENGINE, out)
    assert step.ensures(tiny_graph, engine) == {"engine_check": "ok"}
    assert metrics["timing_cache_hit"] is False
    return engine


@needs_gpu
def test_tensorrt_engine_matches_ort_cpu_logits(trt_engine: Artifact, tiny_engine: Artifact) -> None:
    from pipeline.runtime import Engine

    spec = json.loads((trt_engine.path / "engine.json").read_text())
    assert spec["target"] == "tensorrt" and spec["tensorrt"]["gpu"]["compute_capability"]
    trt, cpu = Engine(trt_engine.path), Engine(tiny_engine.path)
    ids = np.array([[5, 17, 42, 99, 3, 250]])
    mask, positions = np.ones_like(ids), np.arange(ids.shape[1])[None]
    ours, _ = trt.model.step(ids, mask, positions, trt.model.empty_cache(1))
    reference, _ = cpu.model.step(ids, mask, positions, cpu.model.empty_cache(1))
    assert np.abs(ours - reference).max() < 1e-2
    assert (ours.argmax(-1) == reference.argmax(-1)).all()


@needs_gpu
def test_tensorrt_engine_generates_the_cpu_greedy_tokens(trt_engine: Artifact, tiny_engine: Artifact) -> None:
    from pipeline.runtime import Engine, GenerationConfig

    config = GenerationConfig(max_new_tokens=12, stop_at_eos=False)
    prompt = [[7, 8, 9, 10, 11]]
    ours = Engine(trt_engine.path).generate_ids(prompt, config).tokens
    assert ours == Engine(tiny_engine.path).generate_ids(prompt, config).tokens


@needs_gpu
def test_tensorrt_engine_with_an_fp8_cache_decodes_like_ort_cpu(tiny_graph: Artifact, tmp_path: Path) -> None:
    """kv_cache.dtype=fp8 for TensorRT: the cache is FP8 network I/O behind per-tensor Q/DQ. The
    same graph's ORT CPU engine is the reference (both round the cache to the same E4M3 codes)."""
    from passes.ort_build import OrtCpuBuildPass
    from pipeline.runtime import Engine, GenerationConfig

    calibration = {"num_samples": 4, "seq_len": 64}
    (tmp_path / "kv").mkdir()
    KvCachePass(dtype="fp8", fp8_scale="tensor", calibration=calibration).run(tiny_graph, tmp_path / "kv")
    (tmp_path / "fused").mkdir()
    rules = ["onnx_rms_norm", "onnx_rotary_embedding"]
    FusionPass(rules=rules).run(Artifact.from_dir(Kind.GRAPH, tmp_path / "kv"), tmp_path / "fused")
    graph = Artifact.from_dir(Kind.GRAPH, tmp_path / "fused")
    engines = []
    for name, step in (
        (
            "trt",
            TensorRtBuildPass(max_input_length=128, max_length=256, timing_cache_dir=str(tmp_path / "t")),
        ),
        ("cpu", OrtCpuBuildPass(max_length=256)),
    ):
        step.requires(graph)
        (tmp_path / name).mkdir()
        step.run(graph, tmp_path / name)
        engines.append(Engine(tmp_path / name))
    assert str(engines[0].model.empty_cache(1)[0].dtype) == "torch.float8_e4m3fn"
    config = GenerationConfig(max_new_tokens=12, stop_at_eos=False)
    ours, reference = (e.generate_ids([[7, 8, 9, 10, 11]], config).tokens[0] for e in engines)
    assert sum(a == b for a, b in zip(ours, reference, strict=True)) >= 10


@needs_gpu
def test_second_build_reuses_the_timing_cache(
    tiny_graph: Artifact, trt_engine: Artifact, tmp_path: Path
) -> None:
    step = TensorRtBuildPass(
        max_input_length=128, max_length=256, timing_cache_dir=str(trt_engine.path.parent / "timing")
    )
    assert step.run(tiny_graph, tmp_path)["timing_cache_hit"] is True


@needs_gpu
def test_runtime_refuses_a_plan_recorded_for_another_gpu(trt_engine: Artifact, tmp_path: Path) -> None:
    import shutil

    from pipeline.runtime import Engine

    copy = tmp_path / "engine"
    shutil.copytree(trt_engine.path, copy)
    spec = json.loads((copy / "engine.json").read_text())
    spec["tensorrt"]["gpu"]["compute_capability"] = "1.0"
    (copy / "engine.json").write_text(json.dumps(spec))
    with pytest.raises(EngineError, match="rebuild the engine on this GPU"):
        Engine(copy)


def test_io_spec_of_the_profiles_matches_the_runtime_names() -> None:
    """The profile's input names are exactly the runtime's (IOSpec) input names."""
    io = IOSpec.from_dict(IO)
    (profile,) = profile_shapes(IO, 1, 64, 128).values()
    assert set(profile) == {"input_ids", "attention_mask", "position_ids", *io.past_names()}


class _TimingCache:
    """Stands in for TensorRT's ITimingCache (it needs a GPU): bytes, and a ``combine`` that TensorRT
    may refuse (it returns False for a cache of another TensorRT or device)."""

    def __init__(self, data: bytes, accepts: bool) -> None:
        self.data, self.accepts = data, accepts

    def combine(self, other: _TimingCache, ignore_mismatch: bool) -> bool:
        if self.accepts:
            self.data += other.data
        return self.accepts

    def serialize(self) -> bytes:
        return self.data


class _BuilderConfig:
    def __init__(self, timings: bytes, file_accepted: bool) -> None:
        self.timings, self.file_accepted = _TimingCache(timings, True), file_accepted

    def get_timing_cache(self) -> _TimingCache:
        return self.timings

    def create_timing_cache(self, data: bytes) -> _TimingCache:
        return _TimingCache(data, self.file_accepted)


def test_timing_cache_merges_and_a_refused_merge_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """save_timing_cache adds each build's timings to the file; when TensorRT refuses the merge it
    warns, says so in its result (recorded in engine.json), and keeps this build's timings."""
    path = tmp_path / "timing.cache"
    assert save_timing_cache(path, _BuilderConfig(b"first", True)) == "created"
    assert save_timing_cache(path, _BuilderConfig(b"+second", True)) == "merged"
    assert path.read_bytes() == b"first+second"
    with caplog.at_level("WARNING"):
        assert save_timing_cache(path, _BuilderConfig(b"third", False)) == "replaced"
    assert path.read_bytes() == b"third"
    assert "refused to merge" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timing.cache", "timing.cache.lock"]


# ---------------------------------------------------------------- ort-cuda / ort-trt folders (CPU)
def test_ort_gpu_engine_folders_record_their_providers(tiny_graph: Artifact, tmp_path: Path) -> None:
    """The folders build anywhere (the session check needs the GPU); engine.json and
    genai_config.json name the providers, and the ORT TensorRT EP gets one profile and a cache
    folder resolved on the serving machine."""
    from passes.ort_build import GENAI_CONFIG
    from pipeline.runtime.ort import ORT_TRT_CACHE_ENV, resolve_provider_options

    cuda, trt = tmp_path / "cuda", tmp_path / "trt"
    cuda.mkdir()
    trt.mkdir()
    OrtCudaBuildPass().run(tiny_graph, cuda)
    OrtTrtBuildPass(max_input_length=64).run(tiny_graph, trt)
    spec = json.loads((cuda / "engine.json").read_text())
    assert spec["target"] == "ort-cuda" and spec["providers"] == [
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]
    genai = json.loads((cuda / GENAI_CONFIG).read_text())["model"]["decoder"]["session_options"]
    assert genai["provider_options"] == [{"cuda": {"device_id": "0"}}]
    spec = json.loads((trt / "engine.json").read_text())
    options = spec["provider_options"][0]
    assert spec["providers"][0] == "TensorrtExecutionProvider" and options["trt_engine_cache_enable"] is True
    assert options["trt_profile_min_shapes"].startswith("input_ids:1x1,attention_mask:1x1,position_ids:1x1,")
    assert "past_key_values.1.value:1x2x255x16" in options["trt_profile_max_shapes"]
    assert "input_ids:1x64" in options["trt_profile_max_shapes"]
    resolved = resolve_provider_options(spec["provider_options"])
    assert resolved is not None and resolved[0]["trt_engine_cache_path"] == os.environ.get(
        ORT_TRT_CACHE_ENV, str(Path("~/.cache/llm-pipeline/ort-trt").expanduser())
    )


def test_ort_gpu_engine_on_cpu_onnxruntime_is_refused(tiny_graph: Artifact, tmp_path: Path) -> None:
    import onnxruntime as ort

    from pipeline.runtime import Engine

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here")
    OrtCudaBuildPass().run(tiny_graph, tmp_path)
    with pytest.raises(
        EngineError, match=r"is a ort-cuda engine: this ONNX Runtime .* has no CUDAExecutionProvider"
    ):
        Engine(tmp_path)
