"""The run record (``manifest.json``): how an engine was made and how fast it is.

Schema version 1: ``source``, ``recipe`` (resolved config) and ``overrides``, ``passes``
(name, version, config, input/output digests, seconds, cache hit, metrics, and ``resources``: CPU
seconds, peak RSS and GPU bytes measured while the pass ran, next to the memory preflight's
estimate; for a cache hit those of the run that computed it), ``engine`` (files
with sha256 and size), ``libraries``, ``host``, ``benchmark``, ``quality`` (perplexity, KL and
top-1 agreement vs the reference engine on held-out text), ``gate``, ``code`` (the package
version, and the git commit and dirty flag when run from a checkout; null when not).
Bump :data:`SCHEMA_VERSION` on any incompatible change; consumers check it.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.bench import host_info
from pipeline.core.artifacts import Artifact, file_digests
from pipeline.core.cache import installed_versions, library_versions
from pipeline.core.manager import PassRecord
from pipeline.core.staging import write_json_staged

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
EXTRA_LIBRARIES = ("numpy", "safetensors", "hydra-core", "gguf")
DISTRIBUTION = "llm-pipeline"
REPO_ROOT = Path(__file__).resolve().parents[1]  # the checkout, when run from one
GIT_TIMEOUT_S = 5.0


def all_library_versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "llm-pipeline": __version__,
        **library_versions(),
        **installed_versions(EXTRA_LIBRARIES),
    }


def _git(root: Path, *args: str) -> str | None:
    """``git -C root args`` stdout, or None when git is missing, fails or hangs. ``GIT_*``
    variables (``GIT_DIR`` from a hook, ...) are dropped: they would name another repository."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("GIT_")}
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            env=env,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def code_revision(root: Path = REPO_ROOT) -> dict[str, Any]:
    """What code made the run: ``version`` (the installed package's), and ``git_commit`` and
    ``git_dirty`` (uncommitted or untracked changes) when ``root`` is a git checkout's top
    folder; None for what cannot be told (no git, not a checkout, an installed wheel), never
    an error."""
    try:
        version: str | None = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = None
    commit = dirty = None
    top = _git(root, "rev-parse", "--show-toplevel")
    # Only the checkout holding this package: not some other repository the install lies in.
    if top is not None and Path(top.strip()).resolve() == root.resolve():
        head = _git(root, "rev-parse", "HEAD")
        commit = head.strip() if head and head.strip() else None
        status = _git(root, "status", "--porcelain") if commit else None
        dirty = None if status is None else bool(status.strip())
    return {"version": version, "git_commit": commit, "git_dirty": dirty}


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
    drift_family: str | None = None,
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
        # The recipe's family among the gate's token-level bounds (pipeline.run.drift_family), so
        # a later standalone gate judges this engine by the same bounds.
        "drift_family": drift_family,
        "code": code_revision(),
    }


def write_manifest(run_dir: Path, manifest: dict[str, Any]) -> Path:
    """Write ``run_dir/manifest.json`` by atomic rename from a lock-owned staging folder
    (``.manifest.json.<pid>.<random>``: removed on any exit, or by the next run after a SIGKILL)."""
    path = run_dir / MANIFEST_FILE
    write_json_staged(path, manifest, run_dir, f"cannot write the run record in {run_dir}", "hydra.run.dir")
    return path
