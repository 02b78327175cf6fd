"""Export pass on a tiny random Llama: GenAI IO names, dynamic axes, external data, parity."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from passes.export import DATA_FILE, MODEL_FILE, ExportPass, check_parity
from pipeline.artifacts import Artifact, Kind
from pipeline.errors import PassError


def test_graph_has_genai_io_and_dynamic_axes(tiny_graph: Artifact) -> None:
    model = onnx.load(str(tiny_graph.path / MODEL_FILE), load_external_data=False)
    inputs = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
    }
    outputs = {
        o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output
    }
    assert inputs["input_ids"] == ["batch_size", "sequence_length"]
    assert inputs["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert inputs["position_ids"] == ["batch_size", "sequence_length"]
    assert inputs["past_key_values.1.value"] == ["batch_size", 2, "past_sequence_length", 16]
    assert outputs["logits"][:2] == ["batch_size", "sequence_length"]
    assert outputs["present.0.key"] == ["batch_size", 2, "total_sequence_length", 16]
    assert len(inputs) == 3 + 2 * 2 and len(outputs) == 1 + 2 * 2


def test_weights_live_in_external_data(tiny_graph: Artifact) -> None:
    assert (tiny_graph.path / DATA_FILE).stat().st_size > 100_000
    assert (tiny_graph.path / MODEL_FILE).stat().st_size < 200_000
    onnx.checker.check_model(str(tiny_graph.path / MODEL_FILE), full_check=True)


def test_metadata_and_tokenizer_travel_with_the_graph(tiny_graph: Artifact) -> None:
    meta = tiny_graph.metadata
    assert meta["io"] == {
        "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 320,
        "kv_dtype": "float32", "has_position_ids": True,
        "left_padding": True, "kv_layout": "concat", "window": 0, "kv_capacity": 0,
    }  # fmt: skip
    assert meta["tokens"]["eos_token_ids"] == [2]
    assert meta["tokens"]["pad_token_id"] == 0
    assert (tiny_graph.path / "tokenizer.json").is_file()


def test_ensures_records_parity(tiny_source: Artifact, tiny_graph: Artifact) -> None:
    metrics = ExportPass().ensures(tiny_source, tiny_graph)
    parity = metrics["parity"]
    assert parity["top1_agreement"] == 1.0
    assert parity["max_abs_diff"] < 1e-3
    assert parity["tokens"] > 5


def test_ensures_fails_on_a_wrong_graph(tiny_source: Artifact, tiny_graph: Artifact, tmp_path: Path) -> None:
    broken_dir = Path(shutil.copytree(tiny_graph.path, tmp_path / "broken"))
    model = onnx.load(str(broken_dir / MODEL_FILE))
    # Scramble the largest weight (the embedding / lm_head): logits become unrelated to torch's.
    largest = max(model.graph.initializer, key=lambda t: np.prod(t.dims))
    rng = np.random.default_rng(0)
    largest.CopyFrom(
        numpy_helper.from_array(rng.standard_normal(tuple(largest.dims)).astype(np.float32), largest.name)
    )
    (broken_dir / DATA_FILE).unlink()
    onnx.save_model(model, str(broken_dir / MODEL_FILE), save_as_external_data=True, location=DATA_FILE)
    assert check_parity(tiny_source.path, broken_dir, "The quick brown fox")["top1_agreement"] < 0.99
    with pytest.raises(PassError, match="export: ONNX Runtime agrees with torch on"):
        ExportPass().ensures(tiny_source, Artifact.from_dir(Kind.GRAPH, broken_dir))


def test_opset_is_configurable(tiny_source: Artifact, tmp_path: Path) -> None:
    ExportPass(opset=18).run(tiny_source, tmp_path)
    model = onnx.load(str(tmp_path / MODEL_FILE), load_external_data=False)
    assert {o.domain: o.version for o in model.opset_import}[""] == 18


def test_export_is_deterministic(tiny_source: Artifact, tiny_graph: Artifact, tmp_path: Path) -> None:
    # Later passes are keyed by this output's digest: re-exporting must not change it.
    ExportPass().run(tiny_source, tmp_path)
    assert Artifact.from_dir(Kind.GRAPH, tmp_path).digest == tiny_graph.digest


def test_sdpa_attention_exports_with_parity(tiny_source: Artifact, tmp_path: Path) -> None:
    export = ExportPass(attention="sdpa")
    export.run(tiny_source, tmp_path)
    graph = onnx.load(str(tmp_path / MODEL_FILE), load_external_data=False)
    assert "IsNaN" in {node.op_type for node in graph.graph.node}  # SDPA's decomposition, not eager's
    assert (
        export.ensures(tiny_source, Artifact.from_dir(Kind.GRAPH, tmp_path))["parity"]["top1_agreement"]
        == 1.0
    )


def test_eager_attention_is_the_default(tiny_graph: Artifact) -> None:
    graph = onnx.load(str(tiny_graph.path / MODEL_FILE), load_external_data=False)
    assert "IsNaN" not in {node.op_type for node in graph.graph.node}


def test_linear_weights_are_named_after_their_modules(tiny_llama: Path, tiny_graph: Artifact) -> None:
    from safetensors.numpy import load_file

    weights = load_file(str(tiny_llama / "model.safetensors"))
    graph = onnx.load(str(tiny_graph.path / MODEL_FILE))
    initializers = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    linear = tiny_graph.metadata["linear_weights"]
    assert len(linear) == 2 * 7 + 1  # q k v o gate up down per layer, and lm_head
    for module, name in linear.items():
        torch_name = "model.embed_tokens.weight" if module == "lm_head" else f"{module}.weight"  # tied
        np.testing.assert_array_equal(initializers[name], weights[torch_name].T)


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"opset": 5}, "export.opset=5: choose an opset from 18 to 23"),
        ({"opset": 24}, "export.opset=24: choose an opset from 18 to 23"),
        ({"min_top1_agreement": 1.5}, "export.min_top1_agreement=1.5: must be from 0 to 1"),
    ],
)
def test_settings_out_of_range_are_refused_when_built(settings: dict, needle: str) -> None:
    with pytest.raises(PassError, match=needle.replace(".", r"\.")):
        ExportPass(**settings)
