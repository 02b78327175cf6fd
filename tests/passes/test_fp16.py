"""quant=fp16 (passes/fp16.py): ONNX Runtime's float16 converter on the tiny Llama's graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from passes.fp16 import Fp16Pass
from pipeline.core.artifacts import Artifact
from pipeline.core.errors import PassError
from pipeline.core.graph_io import load_proto
from pipeline.core.lint import lint
from pipeline.core.plugins import build_passes
from tests.conftest import run_pass
from tests.pipeline.recipe import compose_recipe


@pytest.fixture(scope="module")
def fp16_graph(tiny_graph: Artifact, tmp_path_factory: pytest.TempPathFactory) -> tuple[Artifact, dict]:
    return run_pass(Fp16Pass(), tiny_graph, tmp_path_factory.mktemp("fp16"))


def test_weights_are_half_and_io_stays_as_the_runtime_expects(fp16_graph: tuple[Artifact, dict]) -> None:
    graph, metrics = fp16_graph
    model = load_proto(graph.path)
    fp32, fp16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    floats = [i for i in model.graph.initializer if i.data_type in (fp32, fp16)]
    half = [i for i in floats if i.data_type == fp16]
    assert len(half) / len(floats) > 0.9  # every weight matrix; a few fp32 constants feed fp32 islands
    assert all(i.data_type == fp16 for i in model.graph.initializer if "proj" in i.name)
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)}
    assert types["logits"] == fp32 and types["past_key_values.0.key"] == fp32
    assert graph.metadata["quantization"]["scheme"] == "fp16"
    assert metrics["fp32_ops"] == ["Pow", "ReduceMean", "Softmax", "Sqrt"] and metrics["added_casts"] > 0
    assert metrics["vs_input"]["top1_agreement"] == 1.0 and metrics["vs_input"]["max_abs_diff"] > 0


def test_fp16_graph_is_tensorrt_clean(fp16_graph: tuple[Artifact, dict]) -> None:
    assert lint(fp16_graph[0].path) == []


def test_fp16_engine_generates_like_fp32(
    fp16_graph: tuple[Artifact, dict], tiny_engine: Artifact, tmp_path: Path
) -> None:
    from passes.ort_build import OrtCpuBuildPass
    from pipeline.runtime import Engine, GenerationConfig

    OrtCpuBuildPass().run(fp16_graph[0], tmp_path)
    config = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    ids = Engine(tmp_path).generate_ids([[5, 6, 7, 8]], config).tokens
    assert ids == Engine(tiny_engine.path).generate_ids([[5, 6, 7, 8]], config).tokens


def test_quant_fp16_composes_and_refuses_a_quantized_graph(fp16_graph: tuple[Artifact, dict]) -> None:
    passes = build_passes(compose_recipe(["quant=fp16"]))
    assert [p.name for p in passes] == ["export", "fp16", "ort_build"]
    with pytest.raises(PassError, match="already quantized"):
        Fp16Pass().requires(fp16_graph[0])


def test_a_graph_that_disagrees_fails_ensures(
    tiny_graph: Artifact, fp16_graph: tuple[Artifact, dict]
) -> None:
    step = Fp16Pass()
    step.config.min_top1_agreement = 1.01  # set past validate(): a bar that no graph clears
    with pytest.raises(PassError, match="min_top1_agreement"):
        step.ensures(tiny_graph, fp16_graph[0])
    assert np.isfinite(fp16_graph[1]["vs_input"]["max_abs_diff"])
