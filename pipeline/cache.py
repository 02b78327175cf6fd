"""Content-addressed cache of pass outputs.

Key = sha256 of (input digest, pass name, pass version, resolved pass config, versions of the
libraries that shape outputs). Olive leaves library versions out of its key and its users hit
stale caches (Olive #1936, #2552); we put them in.

An entry is ``<root>/<key>/`` holding ``output/`` (the artifact folder) and ``entry.json``.
It is built in ``<root>/.staging/<key>.<pid>.<nonce>/`` and published with one atomic
``rename``, so a run killed at any moment (even SIGKILL) never leaves a half-written entry;
staging folders of dead processes are removed when the next cache opens.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from pipeline.artifacts import Artifact, Kind, folder_digest, write_json

log = logging.getLogger(__name__)

# Libraries whose version changes what a pass writes.
KEY_LIBRARIES = ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "onnx-ir", "tensorrt")
ENTRY_FILE = "entry.json"
OUTPUT_DIR = "output"


def installed_versions(names: tuple[str, ...]) -> dict[str, str]:
    """Installed distribution versions (``"absent"`` when not installed)."""
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def library_versions() -> dict[str, str]:
    """Versions of :data:`KEY_LIBRARIES`, the libraries that shape pass outputs."""
    return installed_versions(KEY_LIBRARIES)


def cache_key(input_digest: str, pass_name: str, pass_version: int, config: dict[str, Any]) -> str:
    payload = {
        "input": input_digest,
        "pass": pass_name,
        "version": pass_version,
        "config": config,
        "libraries": library_versions(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class CacheEntry:
    key: str
    artifact: Artifact
    record: dict[str, Any]


class Cache:
    """Pass-output store. ``enabled=False`` still stages atomically but never reads entries."""

    def __init__(self, root: Path, enabled: bool = True) -> None:
        self.root = Path(root)
        self.enabled = enabled
        self.staging_root = self.root / ".staging"
        self.staging_root.mkdir(parents=True, exist_ok=True)
        self._remove_dead_staging()

    def _remove_dead_staging(self) -> None:
        for stale in self.staging_root.iterdir():
            parts = stale.name.split(".")
            pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
            if pid is None or not psutil.pid_exists(pid):
                log.info("removing unfinished cache entry %s (its run was interrupted)", stale.name)
                shutil.rmtree(stale, ignore_errors=True)

    def checkpoint_dir(self, key: str) -> Path:
        """Where ``key``'s checkpoints go, outliving an interrupted run (``.checkpoints/``); the
        pass creates it if it checkpoints at all, and :meth:`commit` removes it."""
        return self.root / ".checkpoints" / key

    def lookup(self, key: str, kind: Kind) -> CacheEntry | None:
        """Return the verified entry for ``key``; a corrupted entry is evicted and ignored."""
        if not self.enabled:
            return None
        entry_dir = self.root / key
        entry_file = entry_dir / ENTRY_FILE
        if not entry_file.is_file():
            return None
        record = json.loads(entry_file.read_text())
        output = entry_dir / OUTPUT_DIR
        digest = folder_digest(output)
        if digest != record.get("output_digest"):
            log.warning("cache entry %s was modified on disk; discarding it and recomputing", key[:12])
            self.evict(key)
            return None
        return CacheEntry(key, Artifact.from_dir(kind, output, digest), record)

    def evict(self, key: str) -> None:
        target = self.root / key
        if target.exists():
            trash = self.staging_root / f"{key}.trash.{uuid.uuid4().hex[:8]}"
            os.rename(target, trash)
            shutil.rmtree(trash, ignore_errors=True)

    @contextlib.contextmanager
    def stage(self, key: str) -> Iterator[Path]:
        """Yield an empty staging folder for ``key``; removed unless :meth:`commit` took it."""
        staging = self.staging_root / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            (staging / OUTPUT_DIR).mkdir(parents=True)
            yield staging
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)

    def commit(self, key: str, staging: Path, kind: Kind, record: dict[str, Any]) -> CacheEntry:
        """Publish a staged output under ``key`` with one atomic rename."""
        write_json(staging / ENTRY_FILE, record)
        final = self.root / key
        try:
            os.rename(staging, final)
        except OSError:  # a concurrent run published this key first: keep theirs, drop ours
            if not (final / ENTRY_FILE).is_file():
                raise
            shutil.rmtree(staging, ignore_errors=True)
            record = json.loads((final / ENTRY_FILE).read_text())
        shutil.rmtree(self.root / ".checkpoints" / key, ignore_errors=True)  # the work is done
        output = final / OUTPUT_DIR
        return CacheEntry(key, Artifact.from_dir(kind, output, record["output_digest"]), record)
