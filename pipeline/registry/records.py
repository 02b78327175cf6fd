"""What every registry backend shares: checking a run folder before it is published, the
version record, and the checks on the way out (paths, sha256, TensorRT build)."""

from __future__ import annotations

import datetime as dt
import getpass
import hashlib
import json
import os
import platform
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from pipeline.artifacts import write_json
from pipeline.registry.refs import Ref, RegistryError, check_channel

RECORD_SCHEMA = 1
MANIFEST_FILE = "manifest.json"  # the run record, in a run folder and in a pulled folder
ENGINE_DIR = "engine"
_CHUNK = 1 << 20


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def safe_relative(path: str, where: str) -> PurePosixPath:
    """A file path from a manifest, refused if it could leave the folder it belongs to."""
    rel = PurePosixPath(path)
    if not path or rel.is_absolute() or ".." in rel.parts or "\\" in path:
        raise RegistryError(f"{where}: file path {path!r} leaves the engine folder; refusing it")
    return rel


def copy_hashed(source: Path, target: Path) -> str:
    """Copy ``source`` to ``target`` and return the sha256 of what was copied."""
    digest = hashlib.sha256()
    with open(source, "rb") as reader, open(target, "wb") as writer:
        while chunk := reader.read(_CHUNK):
            digest.update(chunk)
            writer.write(chunk)
    return digest.hexdigest()


@dataclass
class Publication:
    """A run folder that may be published: its manifest, engine files and the names it gets."""

    run_dir: Path
    manifest: dict[str, Any]
    ref: Ref  # model/recipe/target, no version yet
    engine_dir: Path
    files: list[dict[str, Any]]
    channel: str | None
    forced: str | None  # the reason, when the verdict is not PASS

    def record(self, version: int) -> dict[str, Any]:
        """The version record a backend stores (the run manifest inside)."""
        gate = self.manifest.get("gate") or {}
        engine = self.manifest["engine"]
        return {
            "schema": RECORD_SCHEMA,
            "model": self.ref.model,
            "recipe": self.ref.recipe,
            "target": self.ref.target,
            "version": version,
            "published_at": now(),
            "published_by": f"{getpass.getuser()}@{platform.node()}",
            "forced": self.forced,
            "gate": {k: gate.get(k) for k in ("verdict", "reason")},
            "engine": {
                "digest": engine.get("digest"),
                "files": [{k: f[k] for k in ("path", "sha256", "bytes")} for f in self.files],
                "tensorrt": engine.get("tensorrt"),
            },
            "run": str(self.run_dir),
            "manifest": self.manifest,
        }


def prepare_publication(
    run_dir: Path | str, model: str, recipe: str, channel: str | None, force: str | None
) -> Publication:
    """Check a run folder before anything is stored: a manifest, a PASS (or a forced reason), an
    engine target, files whose paths stay inside the engine folder."""
    run_dir = Path(run_dir)
    path = run_dir / MANIFEST_FILE
    if not path.is_file():
        raise RegistryError(f"{run_dir} holds no {MANIFEST_FILE}: publish a folder a pipeline run wrote")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RegistryError(f"{path} is unreadable ({exc})") from None
    gate = manifest.get("gate") or {}
    verdict = gate.get("verdict", "not-run")
    if force is not None and not str(force).strip():
        raise RegistryError("--force needs a reason (it is recorded with the version)")
    if verdict != "PASS" and force is None:
        raise RegistryError(
            f"{run_dir}: the gate verdict is {verdict} ({gate.get('reason', 'no reason recorded')}); "
            "only a PASS is published (force it with a reason: --force '<why>')"
        )
    engine = manifest.get("engine") or {}
    if not engine.get("target"):
        raise RegistryError(f"{path} names no engine target")
    ref = Ref(model, recipe, engine["target"])
    if channel is not None:
        check_channel(channel)
    files = engine.get("files") or []
    if not files:
        raise RegistryError(f"{path} lists no engine files")
    for entry in files:
        safe_relative(str(entry.get("path", "")), str(path))
    forced = None if verdict == "PASS" else str(force)
    engine_dir = run_dir / str(engine.get("path") or ENGINE_DIR)
    return Publication(run_dir, manifest, ref, engine_dir, files, channel, forced)


def check_tensorrt(record: dict[str, Any], tensorrt_version: str | None, gpu_arch: str | None) -> None:
    """Refuse a TensorRT engine built for another TensorRT version or GPU compute capability."""
    name = f"{record['model']}/{record['recipe']}/{record['target']}@{record['version']}"
    trt = record["engine"].get("tensorrt") or {}
    for asked, key, what in (
        (tensorrt_version, "version", "TensorRT"),
        (gpu_arch, "compute_capability", "GPU compute capability"),
    ):
        if asked and trt.get(key) and str(trt[key]) != str(asked):
            raise RegistryError(
                f"{name} was built for {what} {trt[key]}, not {asked}: a TensorRT engine runs only "
                "where it was built; pull one built for this machine or rebuild"
            )


@contextmanager
def pulled_folder(to: Path | str, record: dict[str, Any]) -> Iterator[Path]:
    """A staging folder beside ``to`` for a backend to fill with ``engine/``; on success the
    pulled ``manifest.json`` is added and it becomes ``to`` in one rename, else it is removed."""
    to = Path(to)
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise RegistryError(f"{to} exists and is not empty: pull into a new folder")
    to.parent.mkdir(parents=True, exist_ok=True)
    staging = to.parent / f".{to.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.pull"
    try:
        staging.mkdir()
        yield staging
        write_json(staging / MANIFEST_FILE, pulled_manifest(record))
        if to.is_dir():
            to.rmdir()
        os.rename(staging, to)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def pulled_manifest(record: dict[str, Any]) -> dict[str, Any]:
    """The run manifest written into a pulled folder, saying where it came from."""
    manifest = dict(record["manifest"])
    manifest["engine"] = {**manifest.get("engine", {}), "path": ENGINE_DIR}
    manifest["registry"] = {k: record[k] for k in ("model", "recipe", "target", "version", "forced")}
    return manifest


class Registry(Protocol):
    """What the CLI, the pipeline and the report use; ``LocalRegistry`` and ``MlflowRegistry``."""

    root: Any

    def publish(
        self,
        run_dir: Path | str,
        *,
        model: str,
        recipe: str,
        channel: str | None = None,
        force: str | None = None,
    ) -> dict[str, Any]: ...

    def resolve(self, ref: Ref) -> dict[str, Any]: ...

    def index(self) -> dict[str, Any]: ...

    def pull(
        self, ref: Ref, to: Path | str, *, tensorrt_version: str | None = None, gpu_arch: str | None = None
    ) -> Path: ...

    def promote(self, ref: Ref, channel: str, reason: str | None = None) -> dict[str, Any]: ...

    def channel_history(self, ref: Ref, channel: str) -> list[dict[str, Any]]: ...

    def verify(self) -> list[str]: ...

    def gc(self) -> dict[str, int]: ...
