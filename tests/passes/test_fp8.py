"""quant=fp8 on a tiny random Llama: Q/DQ placement and types, scales against independent
references, numerics against a torch fake-quant simulation, config and opset errors, the CLI
end to end with a cached rerun; one integration test on the default model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from calibration.datasets import CalibrationConfig, token_windows
from passes.fp8 import STATS_FILE, CalibratePass, Fp8QdqPass
from passes.recipes import Fp8Recipe
from pipeline.core.artifacts import Artifact, Kind, read_metadata
from pipeline.core.engine import graph_io
from pipeline.core.errors import PassError
from pipeline.core.graph_io import load_proto
from pipeline.runtime import Engine, GenerationConfig
from pipeline.runtime.ort import OrtModel
from tests.conftest import run_pass as run_through_manager

REPO = Path(__file__).resolve().parents[2]
CALIBRATION = {"num_samples": 4, "seq_len": 32}


def run_pass(step, source: Artifact, out: Path) -> Artifact:
    """The pass run by the pass manager, in a throwaway cache at ``out``."""
    return run_through_manager(step, source, out)[0]


@pytest.fixture(scope="module")
def calibrated(tiny_graph: Artifact, tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    step = CalibratePass(calibration=CalibrationConfig(**CALIBRATION))
    return run_pass(step, tiny_graph, tmp_path_factory.mktemp("fp8") / "calibrated")


@pytest.fixture(scope="module")
def quantized(calibrated: Artifact, tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    return run_pass(Fp8QdqPass(), calibrated, tmp_path_factory.mktemp("fp8") / "quantized")


def load(artifact: Artifact) -> onnx.ModelProto:
    return load_proto(artifact.path)


def producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in model.graph.node for out in node.output}


def linear_nodes(model: onnx.ModelProto, metadata: dict) -> dict[str, onnx.NodeProto]:
    weights = {w: m for m, w in metadata["linear_weights"].items()}
    return {
        weights[n.input[1]]: n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights
    }


def test_qdq_placement_and_types(quantized: Artifact) -> None:
    model = load(quantized)
    made_by, inits = producers(model), {i.name: i for i in model.graph.initializer}
    nodes = linear_nodes(model, quantized.metadata)
    assert set(nodes) == set(quantized.metadata["linear_weights"])
    activation_inputs = set()
    for module, node in nodes.items():
        if module == "lm_head":  # excluded by default: fp32 weight, fp32 input
            assert inits[node.input[1]].data_type == TensorProto.FLOAT
            assert node.input[0] not in made_by or made_by[node.input[0]].op_type != "DequantizeLinear"
            continue
        dq_w = made_by[node.input[1]]
        assert dq_w.op_type == "DequantizeLinear" and node.input[1] not in inits
        assert inits[dq_w.input[0]].data_type == TensorProto.FLOAT8E4M3FN
        assert next(a.i for a in dq_w.attribute if a.name == "axis") == 1
        assert list(inits[dq_w.input[1]].dims) == [inits[dq_w.input[0]].dims[1]]  # one scale per out channel
        dq_x = made_by[node.input[0]]
        q_x = made_by[dq_x.input[0]]
        assert (dq_x.op_type, q_x.op_type) == ("DequantizeLinear", "QuantizeLinear")
        assert inits[q_x.input[2]].data_type == TensorProto.FLOAT8E4M3FN  # Q output type: FP8
        assert list(inits[q_x.input[1]].dims) == [] and q_x.input[1:] == dq_x.input[1:]
        activation_inputs.add(q_x.input[0])
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") == len(activation_inputs) == 4 * 2  # q/k/v and gate/up share inputs
    assert ops.count("DequantizeLinear") == len(activation_inputs) + len(nodes) - 1
    attention = [n for n in model.graph.node if n.op_type == "MatMul" and n not in nodes.values()]
    assert attention and not any(
        made_by.get(i, n).op_type == "DequantizeLinear" for n in attention for i in n.input
    )
    fp8 = [i for i in model.graph.initializer if i.data_type == TensorProto.FLOAT8E4M3FN]
    assert len(fp8) == len(nodes) - 1 + 1  # quantized weights + the shared zero point


def test_weight_scales_and_values_match_a_numpy_reference(tiny_graph: Artifact, quantized: Artifact) -> None:
    original = {i.name: numpy_helper.to_array(i) for i in load(tiny_graph).graph.initializer}
    inits = {i.name: i for i in load(quantized).graph.initializer}
    for module, weight_name in quantized.metadata["linear_weights"].items():
        if module == "lm_head":
            continue
        weight = original[weight_name]  # [in, out]
        scale = np.abs(weight).max(axis=0) / np.float32(448.0)
        np.testing.assert_allclose(numpy_helper.to_array(inits[f"{weight_name}_scale"]), scale, rtol=1e-6)
        expected = np.clip(weight / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        stored = numpy_helper.to_array(inits[f"{weight_name}_fp8"])
        assert stored.dtype == ml_dtypes.float8_e4m3fn
        assert (stored.view(np.uint8) != expected.view(np.uint8)).mean() < 1e-3  # x/s rounding ties


def record_activations(graph: Artifact, tensors: list[str]) -> dict[str, float]:
    """Independently: run the fp32 graph with the tensors as outputs, max |x| over the windows."""
    from transformers import AutoTokenizer

    model = load_proto(graph.path)
    model.graph.output.extend(onnx.helper.make_tensor_value_info(t, TensorProto.FLOAT, None) for t in tensors)
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    io = graph_io(graph.path)
    windows = token_windows(AutoTokenizer.from_pretrained(graph.path), CalibrationConfig(**CALIBRATION))
    amax = dict.fromkeys(tensors, 0.0)
    for window in windows:
        feed = {"input_ids": window[None], "attention_mask": np.ones((1, len(window)), np.int64),
                "position_ids": np.arange(len(window))[None]}  # fmt: skip
        feed.update({n: np.zeros((1, io.num_kv_heads, 0, io.head_dim), np.float32) for n in io.past_names()})
        for name, value in zip(tensors, session.run(tensors, feed), strict=True):
            amax[name] = max(amax[name], float(np.abs(value).max()))
    return amax


def test_activation_scales_are_the_recorded_amax(tiny_graph: Artifact, quantized: Artifact) -> None:
    model = load(quantized)
    made_by, inits = producers(model), {i.name: i for i in model.graph.initializer}
    q_nodes = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    reference = record_activations(tiny_graph, [q.input[0] for q in q_nodes])
    for q in q_nodes:
        scale = float(numpy_helper.to_array(inits[q.input[1]]))
        assert scale == pytest.approx(reference[q.input[0]] / 448.0, rel=1e-5), q.input[0]
    assert made_by  # the graph is connected


def test_graph_matches_a_torch_fake_quant_simulation(
    tiny_llama: Path, calibrated: Artifact, quantized: Artifact
) -> None:
    """Torch with every quantized Linear fed fake-quantized inputs and weights (torch's own float8)."""
    import torch
    from transformers import LlamaForCausalLM

    model = load_proto(quantized.path)
    made_by, inits = producers(model), {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    nodes = linear_nodes(model, quantized.metadata)

    def fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * scale

    torch_model = LlamaForCausalLM.from_pretrained(tiny_llama, attn_implementation="eager").eval()
    for module, node in nodes.items():
        if module == "lm_head":
            continue
        linear = torch_model.get_submodule(module)
        w_scale = torch.from_numpy(inits[made_by[node.input[1]].input[1]].astype(np.float32))
        with torch.no_grad():
            linear.weight.copy_(fake_quant(linear.weight, w_scale[:, None]))  # torch weight is [out, in]
        x_scale = torch.tensor(float(inits[made_by[node.input[0]].input[1]]))
        linear.register_forward_pre_hook(lambda _m, args, s=x_scale: (fake_quant(args[0], s),))

    ids = np.array([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128, 31, 8]], dtype=np.int64)
    graph = OrtModel(quantized.path / "model.onnx", graph_io(quantized.path))
    ours = graph.step(ids, np.ones_like(ids), np.arange(ids.shape[1])[None], graph.empty_cache(1))[0][0]
    with torch.no_grad():
        simulated = torch_model(torch.from_numpy(ids)).logits[0].numpy()
    np.testing.assert_allclose(ours, simulated, atol=1e-4 * np.abs(simulated).max())
    fp32 = OrtModel(calibrated.path / "model.onnx", graph_io(calibrated.path))
    reference = fp32.step(ids, np.ones_like(ids), np.arange(ids.shape[1])[None], fp32.empty_cache(1))[0][0]
    assert np.abs(ours - simulated).max() < 0.2 * np.abs(ours - reference).max()  # FP8 error >> mismatch


def test_output_keeps_every_input_file_and_all_metadata(calibrated: Artifact, quantized: Artifact) -> None:
    before = {p.relative_to(calibrated.path).as_posix() for p in calibrated.path.rglob("*") if p.is_file()}
    after = {p.relative_to(quantized.path).as_posix() for p in quantized.path.rglob("*") if p.is_file()}
    assert before <= after and STATS_FILE in after
    assert sorted(p.name for p in quantized.path.glob("*.data")) == ["model.onnx.data"]
    onnx.checker.check_model(str(quantized.path / "model.onnx"), full_check=True)
    meta = read_metadata(quantized.path)
    assert {k: v for k, v in meta.items() if k != "quantization"} == read_metadata(calibrated.path)
    quant = meta["quantization"]
    assert quant["format"] == "float8e4m3fn" and quant["excluded"] == ["lm_head"] and quant["modules"] == 14
    assert quant["activations"]["observer"] == "minmax"
    assert quant["activations"]["calibration"]["num_samples"] == 4
    assert read_metadata(calibrated.path)["calibration"]["tensors"] == 4 * 2 + 1  # lm_head's input too


def test_exclusion_patterns_and_weight_only(calibrated: Artifact, tmp_path: Path) -> None:
    step = Fp8QdqPass(exclude=["*.mlp.*", "lm_head"], observer="entropy")
    model = load(run_pass(step, calibrated, tmp_path / "no-mlp"))
    made_by = producers(model)
    for module, node in linear_nodes(model, calibrated.metadata).items():
        quantized = node.input[1] in made_by
        assert quantized == (".mlp." not in module and module != "lm_head"), module
        assert (
            node.input[0] in made_by and made_by[node.input[0]].op_type == "DequantizeLinear"
        ) == quantized
    weight_only = load(run_pass(Fp8QdqPass(activations=False), calibrated, tmp_path / "w-only"))
    ops = [n.op_type for n in weight_only.graph.node]
    assert "QuantizeLinear" not in ops and ops.count("DequantizeLinear") == 14


def test_opset_below_19_is_one_line_naming_the_knob(tiny_graph: Artifact, tmp_path: Path) -> None:
    shutil.copytree(tiny_graph.path, tmp_path / "g", ignore=shutil.ignore_patterns("*.data"))
    model = onnx.load(str(tmp_path / "g" / "model.onnx"), load_external_data=False)
    model.opset_import[0].version = 17
    onnx.save_model(model, str(tmp_path / "g" / "model.onnx"))
    old = Artifact.from_dir(Kind.GRAPH, tmp_path / "g")
    message = r"^quant=fp8 needs export.opset >= 19 \(got 17\): set export.opset=19 or higher$"
    for step in (CalibratePass(), Fp8QdqPass(activations=False)):
        with pytest.raises(PassError, match=message):
            step.requires(old)


def test_missing_statistics_and_bad_config_raise(tiny_graph: Artifact) -> None:
    with pytest.raises(PassError, match=r"no activation statistics.*calibrate-activations"):
        Fp8QdqPass().requires(tiny_graph)
    with pytest.raises(PassError, match="bad config"):
        Fp8Recipe(observers="minmax")


def test_recipe_expands_to_graph_passes() -> None:
    from pipeline.core.plugins import build_passes
    from tests.pipeline.recipe import compose_recipe

    scan = "quant.sensitivity.enabled=true"  # for the record: by default only fallback=auto scans
    cfg = compose_recipe(["quant=fp8", "quant.calibration.num_samples=8", "quant.observer=mse", scan])
    passes = build_passes(cfg)
    assert [p.name for p in passes] == [
        "sensitivity",
        "export",
        "calibrate-activations",
        "fp8-qdq",
        "ort_build",
    ]
    assert passes[2].config.calibration.num_samples == 8 and passes[3].config.observer == "mse"
    assert all(p.consumes == p.produces == Kind.GRAPH for p in passes[2:4])
    assert passes[0].config.weight == "fp8" and passes[0].config.activations
    weight_only = build_passes(compose_recipe(["quant=fp8", "quant.activations=false", scan]))
    assert [p.name for p in weight_only] == ["sensitivity", "export", "fp8-qdq", "ort_build"]
    assert not weight_only[0].config.activations
    with pytest.raises(Exception, match="observer"):
        compose_recipe(["quant=fp8", "quant.observer=median"])  # Hydra rejects it at parse time


def test_cli_builds_a_generating_engine_and_reruns_from_cache(tiny_llama: Path, tmp_path: Path) -> None:
    def run(name: str) -> dict:
        command = [
            sys.executable, "-m", "pipeline", f"model.path={tiny_llama}", "quant=fp8", "bench=none",
            "quality.enabled=false", "quant.calibration.num_samples=4", "quant.calibration.seq_len=32",
            f"pipeline.cache_dir={tmp_path / 'cache'}", f"pipeline.models_dir={tmp_path / 'models'}",
            f"hydra.run.dir={tmp_path / name}",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads((tmp_path / name / "manifest.json").read_text())

    first = run("run1")
    names = ["export", "calibrate-activations", "fp8-qdq", "ort_build"]  # no fallback=auto: no scan
    assert [p["name"] for p in first["passes"]] == names
    assert not any(p["cache_hit"] for p in first["passes"])
    assert first["passes"][2]["metrics"]["vs_input"]["finite"]
    engine = Engine(tmp_path / "run1" / "engine")
    tokens = engine.generate_ids([[5, 17, 42]], GenerationConfig(max_new_tokens=6, stop_at_eos=False)).tokens
    assert len(tokens[0]) == 6
    second = run("run2")
    assert all(p["cache_hit"] for p in second["passes"])
    assert second["engine"]["digest"] == first["engine"]["digest"]


@pytest.mark.integration
def test_default_model_fp8(tmp_path: Path) -> None:
    """Short calibration on SmolLM2-135M: every linear layer but lm_head in FP8, close to fp32."""
    from omegaconf import OmegaConf

    from pipeline.config import ModelConfig
    from pipeline.core.cache import Cache
    from pipeline.core.manager import PassManager
    from pipeline.core.plugins import build_passes
    from pipeline.sources import resolve_source
    from tests.pipeline.recipe import compose_recipe

    cfg = compose_recipe(["model=llama", "quant=fp8", "quant.calibration.num_samples=8",
                          "quant.calibration.seq_len=128",
                          "quant.sensitivity.enabled=false"])  # the scan: test_matmulnbits  # fmt: skip
    model = OmegaConf.to_object(cfg.model)
    assert isinstance(model, ModelConfig)
    source = resolve_source(model, REPO / "artifacts" / "models")
    engine, records = PassManager(build_passes(cfg), Cache(tmp_path / "cache")).run(source)
    quant = records[2].metrics
    assert quant["modules"] == 210 and quant["QuantizeLinear"] == 4 * 30
    assert quant["vs_input"]["top1_agreement"] >= 0.8 and quant["vs_input"]["finite"]
    question, config = "What is the capital of France?", GenerationConfig(max_new_tokens=12)
    answer = Engine(engine.path).generate(question, config, chat=True)
    assert "Paris" in answer[0].text
