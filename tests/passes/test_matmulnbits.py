"""INT4 lowering in the graph: MatMulNBits and block-wise Q/DQ placement and types, both equal to
the fake-quantized torch model, exclusions kept in fp32, stale or mismatched parameters caught,
and ``python -m pipeline quant=int4_gptq`` end to end (plus the real model, integration)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, numpy_helper

from passes.export import ExportPass
from passes.formats.int4 import INFO_FILE, INT4_DIR, PARAMS_FILE, quantize_rtn
from passes.gptq import GptqPass
from passes.int4 import EXTRAS_DIR
from passes.matmulnbits import DATA_FILE, MODEL_FILE, Int4LoweringPass, transposed
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.engine import graph_io
from pipeline.core.errors import ConfigError, PassError
from pipeline.core.graph_io import load_proto
from pipeline.core.manager import check_against_model
from pipeline.core.torch_model import load_causal_lm
from tests.conftest import run_pass
from tests.pipeline.test_main import pipeline_command

REPO = Path(__file__).resolve().parents[2]
CALIBRATION = {"num_samples": 8, "seq_len": 64}
PROMPT = np.array([[1, 5, 9, 42, 7, 100, 3, 64, 200, 11, 17, 250]], dtype=np.int64)
GROUP = 32


def lower(graph: Artifact, out: Path, **config: object) -> Artifact:
    """Lower with fp32 compute (accuracy_level=0) unless told otherwise: exact against torch."""
    step = Int4LoweringPass(**{"group_size": GROUP, "accuracy_level": 0, **config})
    return run_pass(step, graph, out)[0]


@pytest.fixture(scope="module")
def quantized(tiny_source: Artifact, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Artifact]:
    """GPTQ torch artifact, its export, and the two lowerings of it."""
    root = tmp_path_factory.mktemp("lowering")
    (root / "torch").mkdir()
    GptqPass(group_size=GROUP, calibration=CALIBRATION).run(tiny_source, root / "torch")
    torch_artifact = Artifact.from_dir(Kind.TORCH, root / "torch")
    (root / "graph").mkdir()
    ExportPass().run(torch_artifact, root / "graph")
    graph = Artifact.from_dir(Kind.GRAPH, root / "graph")
    for name in ("nbits", "nbits_int8", "qdq"):
        (root / name).mkdir()
    return {
        "torch": torch_artifact,
        "graph": graph,
        "nbits": lower(graph, root / "nbits"),
        "nbits_int8": lower(graph, root / "nbits_int8", accuracy_level=4),  # the recipe's default
        "qdq": lower(graph, root / "qdq", lowering="qdq"),
    }


def logits(folder: Path, **session_config: str) -> np.ndarray:
    options = ort.SessionOptions()
    for key, value in session_config.items():
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(str(folder / MODEL_FILE), options, providers=["CPUExecutionProvider"])
    io = graph_io(folder)
    feeds = {
        "input_ids": PROMPT,
        "attention_mask": np.ones_like(PROMPT),
        "position_ids": np.arange(PROMPT.shape[1])[None],
    }
    for name in io.past_names():
        feeds[name] = np.zeros((1, io.num_kv_heads, 0, io.head_dim), np.float32)
    return session.run(["logits"], feeds)[0][0]


def initializers(folder: Path) -> dict[str, onnx.TensorProto]:
    model = onnx.load(str(folder / MODEL_FILE), load_external_data=False)
    return {init.name: init for init in model.graph.initializer}


@pytest.mark.parametrize("band_bytes", [4, 300, 1 << 20])
def test_transposed_reads_a_mapped_weight_in_bands(tmp_path: Path, band_bytes: int) -> None:
    weight_t = np.random.default_rng(0).standard_normal((37, 23)).astype(np.float32)
    np.save(tmp_path / "w.npy", weight_t)
    mapped = np.load(tmp_path / "w.npy", mmap_mode="r")  # [in, out] as the graph stores it
    out = transposed(mapped, band_bytes=band_bytes)  # one row a band, a few, all of them
    assert out.is_contiguous() and torch.equal(out, torch.from_numpy(weight_t.T.copy()))


def test_matmulnbits_placement_and_types(quantized: dict[str, Artifact]) -> None:
    folder = quantized["nbits"].path
    model = onnx.load(str(folder / MODEL_FILE), load_external_data=False)
    weights = quantized["graph"].metadata["linear_weights"]
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == len(weights) == 15
    assert not any(n.op_type == "MatMul" and n.input[1] in weights.values() for n in model.graph.node)
    inits = initializers(folder)
    assert not set(weights.values()) & set(inits)  # the fp32 weights are gone
    assert {o.domain: o.version for o in model.opset_import}["com.microsoft"] == 1
    for node in nodes:
        attrs = {a.name: a.i for a in node.attribute}
        assert node.domain == "com.microsoft" and attrs["bits"] == 4 and attrs["block_size"] == GROUP
        k, n = attrs["K"], attrs["N"]
        b, scales, zeros = (inits[name] for name in node.input[1:])
        assert b.data_type == TensorProto.UINT8 and list(b.dims) == [n, k // GROUP, GROUP // 2]
        assert scales.data_type == TensorProto.FLOAT and list(scales.dims) == [n, k // GROUP]
        assert zeros.data_type == TensorProto.UINT8 and list(zeros.dims) == [n, (k // GROUP + 1) // 2]
    assert all("accuracy_level" not in {a.name for a in n.attribute} for n in nodes)  # fp32 compute
    int8_model = onnx.load(str(quantized["nbits_int8"].path / MODEL_FILE), load_external_data=False)
    levels = {a.i for n in int8_model.graph.node for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {4}
    lm_head = next(n for n in nodes if n.name == "/model/lm_head/MatMul_Q4")
    assert list(lm_head.output) == ["logits"]
    meta = quantized["nbits"].metadata
    assert meta["quantization"]["algorithm"] == "gptq" and meta["quantization"]["lowering"] == "matmulnbits"
    assert set(meta["quantization"]["modules"].values()) == {"stored"}
    assert meta["io"] == quantized["graph"].metadata["io"]  # everything export wrote is kept
    graph_files = {p.name for p in quantized["graph"].path.iterdir()}
    assert graph_files <= {p.name for p in folder.iterdir()}
    assert (folder / EXTRAS_DIR / INT4_DIR / INFO_FILE).is_file()
    # The torch pass's extras reach the lowering as hard links, never copies (export, then lowering).
    copies = [
        quantized[kind].path / EXTRAS_DIR / INT4_DIR / PARAMS_FILE for kind in ("torch", "graph", "nbits")
    ]
    assert len({path.stat().st_ino for path in copies}) == 1
    assert (folder / DATA_FILE).stat().st_size < 0.4 * (quantized["graph"].path / DATA_FILE).stat().st_size


def test_qdq_placement_and_types(quantized: dict[str, Artifact]) -> None:
    folder = quantized["qdq"].path
    onnx.checker.check_model(str(folder / MODEL_FILE), full_check=True)
    model = onnx.load(str(folder / MODEL_FILE), load_external_data=False)
    inits = initializers(folder)
    dq_nodes = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq_nodes) == 15
    consumers = {i: n for n in model.graph.node for i in n.input}
    for node in dq_nodes:
        attrs = {a.name: a.i for a in node.attribute}
        assert attrs == {"axis": 0, "block_size": GROUP}
        codes, scales, zeros = (inits[name] for name in node.input)
        k, n = codes.dims
        assert codes.data_type == TensorProto.UINT4 and zeros.data_type == TensorProto.UINT4
        assert list(scales.dims) == list(zeros.dims) == [k // GROUP, n]
        assert consumers[node.output[0]].op_type == "MatMul"
    assert {o.domain: o.version for o in model.opset_import}[""] == 21


def test_lowerings_equal_each_other_and_the_fake_quantized_torch_model(
    quantized: dict[str, Artifact],
) -> None:
    nbits = logits(quantized["nbits"].path)
    # ORT fuses DQ + MatMul into MatMulNBits at accuracy level 4 unless told otherwise.
    qdq = logits(quantized["qdq"].path, **{"session.qdq_matmulnbits_accuracy_level": "0"})
    qdq_default = logits(quantized["qdq"].path)
    with torch.no_grad():
        reference = load_causal_lm(quantized["torch"].path)(torch.from_numpy(PROMPT)).logits[0].numpy()
    np.testing.assert_allclose(nbits, reference, atol=1e-4, rtol=0)
    np.testing.assert_allclose(qdq, reference, atol=1e-4, rtol=0)
    # With int8 activations (accuracy_level=4, the default) both forms run the same kernel.
    nbits_int8 = logits(quantized["nbits_int8"].path)
    np.testing.assert_allclose(qdq_default, nbits_int8, atol=1e-5, rtol=0)
    np.testing.assert_allclose(nbits_int8, reference, atol=0.05, rtol=0)
    assert (nbits_int8.argmax(-1) == reference.argmax(-1)).mean() >= 0.9


def test_symmetric_qdq_is_signed_int4_without_zero_points(tiny_source: Artifact, tmp_path: Path) -> None:
    (tmp_path / "torch").mkdir()
    GptqPass(group_size=GROUP, symmetric=True, calibration=CALIBRATION).run(tiny_source, tmp_path / "torch")
    torch_artifact = Artifact.from_dir(Kind.TORCH, tmp_path / "torch")
    (tmp_path / "graph").mkdir()
    ExportPass().run(torch_artifact, tmp_path / "graph")
    graph = Artifact.from_dir(Kind.GRAPH, tmp_path / "graph")
    lowered = {
        lowering: lower(graph, tmp_path / lowering, lowering=lowering, symmetric=True).path
        for lowering in ("qdq", "matmulnbits")
    }
    model = onnx.load(str(lowered["qdq"] / MODEL_FILE), load_external_data=False)
    dq_nodes = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    inits = initializers(lowered["qdq"])
    assert all(len(n.input) == 2 and inits[n.input[0]].data_type == TensorProto.INT4 for n in dq_nodes)
    nbits = onnx.load(str(lowered["matmulnbits"] / MODEL_FILE), load_external_data=False)
    assert all(len(n.input) == 3 for n in nbits.graph.node if n.op_type == "MatMulNBits")
    with torch.no_grad():
        reference = load_causal_lm(torch_artifact.path)(torch.from_numpy(PROMPT)).logits[0].numpy()
    qdq = logits(lowered["qdq"], **{"session.qdq_matmulnbits_accuracy_level": "0"})
    np.testing.assert_allclose(qdq, reference, atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits(lowered["matmulnbits"]), reference, atol=1e-4, rtol=0)


def test_exclude_keeps_those_matmuls_in_fp32(quantized: dict[str, Artifact], tmp_path: Path) -> None:
    result = lower(quantized["graph"], tmp_path, exclude=["lm_head", "*.mlp.down_proj"])
    model = onnx.load(str(result.path / MODEL_FILE), load_external_data=False)
    kept = {n.input[1] for n in model.graph.node if n.op_type == "MatMul"}
    fp32 = {
        "lm_head.weight_t",
        "model.layers.0.mlp.down_proj.weight_t",
        "model.layers.1.mlp.down_proj.weight_t",
    }
    assert fp32 <= kept and fp32 <= set(initializers(result.path))
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 12
    assert "lm_head" not in result.metadata["quantization"]["modules"]


def test_graph_without_stored_parameters_is_round_to_nearest(tiny_graph: Artifact, tmp_path: Path) -> None:
    result = lower(tiny_graph, tmp_path, exclude=["model.layers.*"])
    assert result.metadata["quantization"]["modules"] == {"lm_head": "rtn"}
    assert result.metadata["quantization"]["algorithm"] == "rtn"
    inits = initializers(result.path)
    model = load_proto(tiny_graph.path, MODEL_FILE)
    weight_t = next(numpy_helper.to_array(i) for i in model.graph.initializer if i.name == "lm_head.weight_t")
    expected = quantize_rtn(torch.from_numpy(weight_t.T.copy()), GROUP, False)
    loaded = load_proto(result.path, MODEL_FILE)
    scales = next(
        numpy_helper.to_array(i) for i in loaded.graph.initializer if i.name == "lm_head.weight_scales"
    )
    np.testing.assert_array_equal(scales, expected.scales.numpy())
    assert "lm_head.weight_q4" in inits


def test_stale_parameters_are_caught(quantized: dict[str, Artifact], tmp_path: Path) -> None:
    stale = Path(shutil.copytree(quantized["graph"].path, tmp_path / "stale"))
    model = load_proto(stale, MODEL_FILE)
    for init in model.graph.initializer:
        if init.name == "model.layers.0.mlp.up_proj.weight_t":
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 1.01, init.name))
    (stale / DATA_FILE).unlink()
    onnx.save_model(model, str(stale / MODEL_FILE), save_as_external_data=True, location=DATA_FILE)
    (tmp_path / "out").mkdir()
    with pytest.raises(PassError, match=r"graph weight of model.layers.0.mlp.up_proj is not the dequantized"):
        lower(Artifact.from_dir(Kind.GRAPH, stale), tmp_path / "out")


def test_lowering_config_errors(
    quantized: dict[str, Artifact], tiny_source: Artifact, tmp_path: Path
) -> None:
    with pytest.raises(PassError, match=r"quant.group_size=64 but the torch stage stored group_size=32"):
        Int4LoweringPass(group_size=64).run(quantized["graph"], tmp_path)
    with pytest.raises(ConfigError, match=r"quant.exclude pattern 'lm_haed' matches no linear module"):
        check_against_model([Int4LoweringPass(exclude=["lm_haed"])], quantized["graph"])
    (tmp_path / "g18").mkdir()
    ExportPass(opset=18).run(tiny_source, tmp_path / "g18")
    with pytest.raises(
        PassError, match=r"quant.lowering=qdq needs block-wise DequantizeLinear \(opset >= 21\)"
    ):
        check_against_model(
            [Int4LoweringPass(lowering="qdq")], Artifact.from_dir(Kind.GRAPH, tmp_path / "g18")
        )


# ---------------------------------------------------------------------------------------------
# The CLI, end to end.


def run_cli(model: Path, workdir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = pipeline_command(model, workdir, "run", "bench=none", "quality.enabled=false", *extra)
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)


def test_cli_int4_gptq_builds_an_engine_that_generates(tiny_llama: Path, tmp_path: Path) -> None:
    from pipeline.runtime import Engine, GenerationConfig

    result = run_cli(
        tiny_llama, tmp_path, "quant=int4_gptq", "quant.group_size=32", "quant.calibration.num_samples=8",
        "quant.calibration.seq_len=64",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    names = ["gptq", "export", "int4_lowering", "ort_build"]  # no fallback=auto: no scan
    assert [p["name"] for p in manifest["passes"]] == names
    assert manifest["passes"][2]["metrics"]["parity_vs_input_graph"]["top1_agreement"] == 1.0
    engine = Engine(tmp_path / "run" / "engine")
    answer = engine.generate("The quick brown fox", GenerationConfig(max_new_tokens=8))
    assert 0 < len(answer[0].token_ids) <= 8
    model = onnx.load(str(tmp_path / "run" / "engine" / MODEL_FILE), load_external_data=False)
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 15


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["quant.group_size=96"], "quant.group_size=96 is not supported"),
        (
            ["quant.group_size=128"],
            "quant.group_size=128 does not divide the input width 64 of model.layers.0",
        ),
        (["quant.calibration.num_samples=0"], "quant.calibration.num_samples=0"),
    ],
)
def test_cli_user_mistakes_are_one_line_and_cache_nothing(
    tiny_llama: Path, tmp_path: Path, overrides: list[str], needle: str
) -> None:
    result = run_cli(tiny_llama, tmp_path, "quant=int4_awq", *overrides)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr[-2000:]
    cache = tmp_path / "cache"
    assert not cache.exists() or not [p for p in cache.iterdir() if p.name != ".staging"]


# ---------------------------------------------------------------------------------------------
# The real default model (SmolLM2-135M-Instruct), kept short: 8 windows of 128 tokens.


@pytest.mark.integration
def test_int4_gptq_on_the_default_model(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from pipeline.config import ModelConfig
    from pipeline.core.cache import Cache
    from pipeline.core.manager import PassManager
    from pipeline.core.plugins import build_passes
    from pipeline.runtime import Engine
    from pipeline.sources import resolve_source
    from tests.pipeline.recipe import compose_recipe

    calibration = ["quant.calibration.num_samples=8", "quant.calibration.seq_len=128"]
    # accuracy_level=0: fp32 compute, so the graph must equal the fake-quantized torch model (the
    # default, 4, quantizes activations to int8 per block: ~92% greedy agreement with it).
    # No sensitivity scan here (it was most of this test's time): its ranking is checked on the tiny
    # model (tests/passes/test_sensitivity.py), and the layer count below on the real one.
    cfg = compose_recipe(["model=llama", "quant=int4_gptq", *calibration, "quant.accuracy_level=0"])
    model_cfg = OmegaConf.to_object(cfg.model)
    assert isinstance(model_cfg, ModelConfig)
    source = resolve_source(model_cfg, REPO / "artifacts" / "models")  # shared with the CLI: converted once
    engine_artifact, records = PassManager(build_passes(cfg), Cache(tmp_path / "cache")).run(source)
    assert [r.name for r in records] == ["gptq", "export", "int4_lowering", "ort_build"]
    assert records[0].metrics["quantized_layers"] == 30 * 7 + 1 and records[0].metrics["untied_lm_head"]
    assert records[2].metrics["parity_vs_input_graph"]["top1_agreement"] == 1.0
    graph = onnx.load(str(engine_artifact.path / MODEL_FILE), load_external_data=False)
    assert sum(n.op_type == "MatMulNBits" for n in graph.graph.node) == 211
    assert (engine_artifact.path / DATA_FILE).stat().st_size < 250_000_000  # fp32: 651 MB

    engine = Engine(engine_artifact.path)
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    ids = np.array([engine.tokenizer(text)["input_ids"][:512]], dtype=np.int64)
    logits_, _ = engine.model.step(ids, np.ones_like(ids), np.arange(512)[None], engine.model.empty_cache(1))
    shifted = logits_[0, :-1].astype(np.float64)
    log_z = np.log(np.exp(shifted - shifted.max(-1, keepdims=True)).sum(-1)) + shifted.max(-1)
    perplexity = float(np.exp((log_z - shifted[np.arange(511), ids[0, 1:]]).mean()))
    assert perplexity < 40, perplexity  # fp32: ~25 on this text; a broken lowering gives thousands
