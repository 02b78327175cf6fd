"""Run folders to publish: an engine folder and the manifest a pipeline run writes for it (the
registry reads only the manifest's engine, gate and target fields and the files)."""

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
    """A run folder holding ``engine/`` (a model file of ``size`` random bytes, a config) and its
    ``manifest.json``."""
    engine = folder / "engine"
    engine.mkdir(parents=True)
    (engine / "model.onnx").write_bytes(os.urandom(size) if seed < 0 else bytes([seed % 256]) * size)
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


@pytest.fixture
def run_factory(tmp_path: Path) -> Callable[..., Path]:
    count = iter(range(10_000))

    def factory(**kwargs: Any) -> Path:
        return make_run(tmp_path / "runs" / str(next(count)), **kwargs)

    return factory
