"""Run folders to publish: an engine folder and the manifest a pipeline run writes for it (the
registry reads the manifest's engine, gate and target fields and the files, and checks the
engine's ``engine.json`` and opens its graph before it publishes or pulls)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline.core.artifacts import folder_digest, write_json
from pipeline.manifest import engine_files


def make_run(
    folder: Path,
    verdict: str = "PASS",
    target: str = "ort-cpu",
    size: int = 300_000,
    seed: int = 0,
    tensorrt: dict[str, Any] | None = None,
) -> Path:
    """A run folder holding ``engine/`` (``engine.json``, a real ONNX graph of about ``size`` bytes
    of weights, random for a negative seed, a config, a tokenizer file) and its ``manifest.json``."""
    engine = folder / "engine"
    engine.mkdir(parents=True)
    weights = os.urandom(size) if seed < 0 else bytes([seed % 256]) * size
    (engine / "model.onnx").write_bytes(tiny_graph_bytes(weights))
    write_json(engine / "engine.json", engine_spec(target, tensorrt))
    (engine / "config.json").write_text(f'{{"seed": {seed}}}\n')
    (engine / "sub").mkdir()
    (engine / "sub" / "tokenizer.json").write_text('{"vocab": {}}\n')
    manifest = {
        "schema_version": 1,
        "source": {"digest": "0" * 64},
        "overrides": [f"seed={seed}"],
        "engine": {
            "path": "engine",
            "digest": folder_digest(engine),
            "target": target,
            "files": engine_files(engine),
            **({"tensorrt": tensorrt} if tensorrt else {}),
        },
        "gate": {"verdict": verdict, "reason": f"gate said {verdict}"},
        "benchmark": None,
    }
    write_json(folder / "manifest.json", manifest)
    return folder


def tiny_graph_bytes(weights: bytes) -> bytes:
    """A valid ONNX graph (logits = input_ids cast, plus a weight of these bytes) as bytes."""
    from onnx import TensorProto, helper

    weight = helper.make_tensor("weight", TensorProto.UINT8, [len(weights)], weights, raw=True)
    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["logits"], to=TensorProto.FLOAT)],
        "tiny",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 1])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1])],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def engine_spec(target: str = "ort-cpu", tensorrt: dict[str, Any] | None = None) -> dict[str, Any]:
    """An ``engine.json`` as the builders write it, for the graph of :func:`tiny_graph_bytes`."""
    providers = {
        "ort-cpu": ["CPUExecutionProvider"],
        "ort-cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
        "ort-trt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
    }
    spec: dict[str, Any] = {
        "schema_version": 1,
        "target": target,
        "model_file": "model.onnx",
        "io": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "vocab_size": 16},
        "kv_cache": {},
        "tokens": {"eos_token_ids": [2], "pad_token_id": 2, "bos_token_id": 1},
        "max_length": 32,
        "session": {"intra_op_num_threads": 0, "graph_optimization_level": "all"},
    }
    if target == "tensorrt":
        spec["tensorrt"] = tensorrt or {"version": "10.0", "compute_capability": "9.0", "profiles": {}}
    else:
        spec["providers"] = providers.get(target, providers["ort-cpu"])
    return spec


@pytest.fixture
def run_factory(tmp_path: Path) -> Callable[..., Path]:
    count = iter(range(10_000))

    def factory(**kwargs: Any) -> Path:
        return make_run(tmp_path / "runs" / str(next(count)), **kwargs)

    return factory
