"""The tiny Llama graph prepared as every rule family expects it (optimized, CSE), and helpers
that run a graph beside the unfused one."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from passes.export import DATA_FILE, MODEL_FILE
from passes.fusion.fuse import ModelFacts, compare_decoding
from pipeline.artifacts import ARTIFACT_FILE, Artifact, Kind, read_metadata, write_metadata


def prepared_model(graph: Artifact) -> Any:
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes
    from onnxscript.optimizer import optimize

    model = ir.load(graph.path / MODEL_FILE)
    common_passes.ShapeInferencePass()(model)
    optimize(model)
    common_passes.CommonSubexpressionEliminationPass()(model)
    return model


def save_beside(model: Any, graph: Artifact, out: Path) -> Path:
    """Write ``model`` as a graph folder with the IO spec of ``graph`` (position_ids as the model has it)."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes

    common_passes.RemoveUnusedNodesPass()(model)
    out.mkdir(parents=True, exist_ok=True)
    ir.save(model, out / MODEL_FILE, external_data=DATA_FILE)
    metadata = read_metadata(graph.path)
    names = {value.name for value in model.graph.inputs}
    positions_used = any(v.name == "position_ids" and v.uses() for v in model.graph.inputs)
    if "position_ids" in names and not positions_used:
        model.graph.inputs.remove(next(v for v in model.graph.inputs if v.name == "position_ids"))
        ir.save(model, out / MODEL_FILE, external_data=DATA_FILE)
    metadata["io"] = {**metadata["io"], "has_position_ids": positions_used}
    write_metadata(out, Kind.GRAPH, metadata)
    for name in ("config.json",):
        shutil.copy2(graph.path / name, out / name)
    assert (out / ARTIFACT_FILE).is_file()
    return out


@pytest.fixture(scope="session")
def tiny_facts(tiny_graph: Artifact) -> ModelFacts:
    return ModelFacts.from_config(json.loads((tiny_graph.path / "config.json").read_text()))


@pytest.fixture
def fused_parity(tiny_graph: Artifact, tmp_path: Path) -> Callable[[Any], dict[str, Any]]:
    """Save a rewritten tiny model and compare it with the unfused graph (prefill + decode)."""

    def check(model: Any) -> dict[str, Any]:
        folder = save_beside(model, tiny_graph, tmp_path / "fused")
        return compare_decoding(tiny_graph.path, folder)

    return check
