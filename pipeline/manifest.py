"""The run record (``manifest.json``): how an engine was made and how fast it is.

Schema version 1: ``source``, ``recipe`` (resolved config) and ``overrides``, ``passes``
(name, version, config, input/output digests, seconds, cache hit, metrics), ``engine`` (files
with sha256 and size), ``libraries``, ``host``, ``benchmark``, ``quality`` (perplexity, KL and
top-1 agreement vs the reference engine on held-out text), ``gate``.
Bump :data:`SCHEMA_VERSION` on any incompatible change; consumers check it.
"""

from __future__ import annotations

import datetime as dt
import platform
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.artifacts import Artifact, file_digests, write_json
from pipeline.bench import host_info
from pipeline.cache import installed_versions, library_versions
from pipeline.manager import PassRecord

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
EXTRA_LIBRARIES = ("numpy", "safetensors", "hydra-core", "gguf")


def all_library_versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "llm-pipeline": __version__,
        **library_versions(),
        **installed_versions(EXTRA_LIBRARIES),
    }


def engine_files(folder: Path) -> list[dict[str, Any]]:
    digests = file_digests(folder)
    return [
        {"path": rel, "sha256": sha, "bytes": (folder / rel).stat().st_size} for rel, sha in digests.items()
    ]


def build_manifest(
    *,
    source: Artifact,
    recipe: dict[str, Any],
    overrides: list[str],
    records: list[PassRecord],
    engine: Artifact,
    engine_dir: Path,
    benchmark: dict[str, Any] | None,
    quality: dict[str, Any] | None,
    gate: dict[str, Any] | None = None,
    speculative: dict[str, Any] | None = None,
    started: dt.datetime,
) -> dict[str, Any]:
    finished = dt.datetime.now(dt.UTC)
    return {
        "schema_version": SCHEMA_VERSION,
        "created_at": finished.isoformat(timespec="seconds"),
        "duration_seconds": round((finished - started).total_seconds(), 1),
        "source": {"path": str(source.path), "digest": source.digest, **source.metadata},
        "recipe": recipe,
        "overrides": overrides,
        "passes": [r.to_dict() for r in records],
        "engine": {
            "path": engine_dir.name,
            "digest": engine.digest,
            "target": engine.metadata.get("target"),
            # target=tensorrt: the TensorRT version and GPU the plan is tied to
            **({"tensorrt": engine.metadata["tensorrt"]} if "tensorrt" in engine.metadata else {}),
            "files": engine_files(engine_dir),
        },
        "libraries": all_library_versions(),
        "host": host_info(),
        "benchmark": benchmark,
        "quality": quality,
        "gate": gate or {"verdict": "not-run", "reason": "no eval gate configured (eval=none)"},
        "speculative": speculative,
    }


def write_manifest(run_dir: Path, manifest: dict[str, Any]) -> Path:
    path = run_dir / MANIFEST_FILE
    write_json(path, manifest)
    return path
