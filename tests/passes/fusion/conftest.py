"""The tiny Llama graph prepared as every rule family expects it (optimized, CSE), and helpers
that run a graph beside the unfused one."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from passes.fusion.fuse import ModelFacts, drop_unused_input, prepare
from pipeline.core.artifacts import Artifact, Kind, read_metadata, write_metadata
from pipeline.core.graph_io import MODEL_FILE, load_graph, save_graph
from pipeline.runtime.parity import compare_graphs


def prepared_model(graph: Artifact) -> Any:

    return prepare(load_graph(graph.path, MODEL_FILE))


def save_beside(model: Any, graph: Artifact, out: Path) -> Path:
    """Write ``model`` as a graph folder with the IO spec of ``graph`` (position_ids as the model has it)."""
    import onnx_ir.passes.common as common_passes

    common_passes.RemoveUnusedNodesPass()(model)
    has_positions = drop_unused_input(model.graph, "position_ids")
    out.mkdir(parents=True, exist_ok=True)
    save_graph(model, out, source_dirs=[graph.path])
    metadata = read_metadata(graph.path)
    metadata["io"] = {**metadata["io"], "has_position_ids": has_positions}
    write_metadata(out, Kind.GRAPH, metadata)
    shutil.copy2(graph.path / "config.json", out / "config.json")
    return out


@pytest.fixture(scope="session")
def tiny_facts(tiny_graph: Artifact) -> ModelFacts:
    return ModelFacts.from_config(json.loads((tiny_graph.path / "config.json").read_text()))


@pytest.fixture
def fused_parity(tiny_graph: Artifact, tmp_path: Path) -> Callable[[Any], dict[str, Any]]:
    """Save a rewritten tiny model and compare it with the unfused graph (prefill + decode)."""

    def check(model: Any) -> dict[str, Any]:
        folder = save_beside(model, tiny_graph, tmp_path / "fused")
        return compare_graphs(tiny_graph.path, folder)

    return check
