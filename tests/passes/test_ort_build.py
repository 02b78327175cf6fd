"""ort-cpu build pass: engine.json, genai_config.json, a real session check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from passes.ort_build import GENAI_CONFIG, OrtCpuBuildPass
from pipeline.core.artifacts import ARTIFACT_FILE, Artifact, Kind
from pipeline.core.engine import ENGINE_FILE
from pipeline.core.errors import PassError


def test_engine_json_describes_how_to_run(tiny_engine: Artifact) -> None:
    spec = json.loads((tiny_engine.path / ENGINE_FILE).read_text())
    assert spec["target"] == "ort-cpu"
    assert spec["providers"] == ["CPUExecutionProvider"]
    assert spec["io"]["num_layers"] == 2 and spec["io"]["kv_layout"] == "concat"
    assert spec["max_length"] == 256
    assert (tiny_engine.path / spec["model_file"]).is_file()


def test_genai_config_follows_the_onnxruntime_genai_schema(tiny_engine: Artifact) -> None:
    config = json.loads((tiny_engine.path / GENAI_CONFIG).read_text())
    decoder = config["model"]["decoder"]
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert decoder["outputs"]["present_value_names"] == "present.%d.value"
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]) == (2, 2, 16)
    assert config["model"]["eos_token_id"] == 2
    assert config["search"]["max_length"] == 256


def test_max_length_is_capped_by_the_model(tiny_graph: Artifact, tmp_path: Path) -> None:
    OrtCpuBuildPass(max_length=100_000).run(tiny_graph, tmp_path)
    assert json.loads((tmp_path / ENGINE_FILE).read_text())["max_length"] == 256


def test_ensures_opens_a_real_session(tiny_graph: Artifact, tiny_engine: Artifact) -> None:
    assert OrtCpuBuildPass().ensures(tiny_graph, tiny_engine) == {"session_check": "ok"}


def test_engine_holds_the_graph_files_as_hard_links(tiny_graph: Artifact, tmp_path: Path) -> None:
    out = tmp_path / "engine"
    out.mkdir()
    metrics = OrtCpuBuildPass().run(tiny_graph, out)
    for name in ("model.onnx", "model.onnx.data", "tokenizer.json"):
        assert (out / name).stat().st_ino == (tiny_graph.path / name).stat().st_ino
    assert metrics["disk"]["written_bytes"] == metrics["disk"]["copied_bytes"] == 0
    assert metrics["disk"]["linked_bytes"] >= (tiny_graph.path / "model.onnx.data").stat().st_size
    OrtCpuBuildPass().ensures(tiny_graph, Artifact.from_dir(Kind.ENGINE, out))  # ONNX Runtime loads links


def test_requires_an_exported_graph(tiny_graph: Artifact, tmp_path: Path) -> None:
    bare = Path(shutil.copytree(tiny_graph.path, tmp_path / "bare"))
    (bare / ARTIFACT_FILE).unlink()
    with pytest.raises(PassError, match="records no IO spec"):
        OrtCpuBuildPass().requires(Artifact.from_dir(Kind.GRAPH, bare))


@pytest.mark.parametrize("knob", ["intra_op_num_threads", "max_length"])
def test_negative_target_settings_are_refused_when_built(knob: str) -> None:
    with pytest.raises(PassError, match=rf"^target\.{knob}=-3: must be 0 \(the default\) or more$"):
        OrtCpuBuildPass(**{knob: -3})


def test_window_buffers_keep_only_the_buffers_shorter_than_max_length() -> None:
    """Per layer: a window buffer shorter than the engine's max_length evicts in place; one at least
    as long never fills and is dropped (0: max_length); none shorter: no window buffers at all. A
    record written before buffers were per layer holds one int for every layer."""
    from passes.engine_common import window_buffers

    assert window_buffers({"capacity": [80, 0, 5120]}, 3, 2048) == [80, 0, 0]
    assert window_buffers({"capacity": [5120, 0]}, 2, 2048) == []
    assert window_buffers({"capacity": 80}, 2, 2048) == [80, 80]  # an old record
    assert window_buffers({}, 2, 2048) == []
