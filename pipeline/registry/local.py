"""The local registry (the embedded default): engines published from run folders, pulled back
with every byte verified.

Layout under the root (``artifacts/registry`` by default)::

    blobs/sha256/<2 hex>/<sha256>                 engine files, content-addressed, read-only
    versions/<model>/<recipe>/<target>/<n>.json   one immutable record per version
    channels/<model>/<recipe>/<target>/<ch>.json  a movable alias (nightly, candidate, stable) + history
    index.json                                    every version and channel, rebuilt from the above
    .staging/                                     partial files of a publish or pull in progress
    .lock                                         one writer at a time (publish, promote, gc)

Publishing copies each engine file into ``.staging`` while hashing it, checks the sha256 the run
recorded, and renames it into ``blobs``; then the version record is linked into place
(``os.link`` fails on an existing name, so a version is never overwritten). That link is the
commit: a publisher killed before it leaves only staging files and unreferenced blobs, which
``gc`` removes; killed after it, the version is complete. The index is derived from the version
and channel files, so a stale one (killed between the two) is rebuilt by the next reader.
Writers hold a file lock (``filelock``) for the whole publish, so concurrent publishers queue:
versions stay distinct and ``gc`` never sees another publisher's blobs before their record.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from pipeline.artifacts import sha256_file, write_json
from pipeline.registry.records import (
    ENGINE_DIR,
    RECORD_SCHEMA,
    check_tensorrt,
    copy_hashed,
    now,
    prepare_publication,
    pulled_folder,
    safe_relative,
)
from pipeline.registry.refs import Ref, RegistryError, check_channel

log = logging.getLogger(__name__)

# Called at each step of a publish ("blob <path>", "blobs", "record", "index", "channel").
StageHook = Callable[[str], None]


class LocalRegistry:
    """Engines by (model, recipe, target) and version, in a folder on this machine."""

    def __init__(self, root: Path | str, lock_timeout: float = 600.0) -> None:
        self.root = Path(root)
        self.lock_timeout = lock_timeout

    # -- layout -------------------------------------------------------------------------------

    def _blob(self, sha256: str) -> Path:
        return self.root / "blobs" / "sha256" / sha256[:2] / sha256

    def _versions_dir(self, ref: Ref) -> Path:
        return self.root / "versions" / ref.model / ref.recipe / ref.target

    def _channel_file(self, ref: Ref, channel: str) -> Path:
        return self.root / "channels" / ref.model / ref.recipe / ref.target / f"{channel}.json"

    def _staging(self) -> Path:
        path = self.root / ".staging"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.root / ".lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log.info("waiting for the registry lock (another publisher is writing %s)", self.root)
            try:
                lock.acquire(timeout=self.lock_timeout)
            except Timeout:
                raise RegistryError(
                    f"{self.root}/.lock stayed held for {self.lock_timeout:.0f} s: another publisher "
                    "is still writing; retry later"
                ) from None
        try:
            yield
        finally:
            lock.release()

    # -- publish ------------------------------------------------------------------------------

    def publish(
        self,
        run_dir: Path | str,
        *,
        model: str,
        recipe: str,
        channel: str | None = None,
        force: str | None = None,
        on_stage: StageHook | None = None,
    ) -> dict[str, Any]:
        """Publish the engine of a finished run (its folder holds ``manifest.json`` and the engine)
        as the next version of model/recipe/target; move ``channel`` to it. Refused unless the
        run's gate verdict is PASS, or ``force`` gives the reason to publish anyway."""
        stage = on_stage or (lambda _: None)
        publication = prepare_publication(run_dir, model, recipe, channel, force)
        ref = publication.ref
        with self._locked():
            staging = self._staging()
            for entry in publication.files:
                self._store_blob(publication.engine_dir, entry, staging)
                stage(f"blob {entry['path']}")
            stage("blobs")
            version = self._next_version(ref)
            record = publication.record(version)
            self._commit_record(ref.at(version), record, staging)
            stage("record")
            self._write_index()
            stage("index")
            if channel:
                self._move_channel(ref.at(version), channel, f"published {version}")
                self._write_index()
                stage("channel")
        log.info("published %s", ref.at(version))
        return record

    def _store_blob(self, engine_dir: Path, entry: dict[str, Any], staging: Path) -> None:
        source = engine_dir / str(entry["path"])
        expected = str(entry.get("sha256", ""))
        if not source.is_file():
            raise RegistryError(f"{source} is missing: the run folder no longer holds the engine it recorded")
        blob = self._blob(expected)
        if blob.is_file():  # content-addressed: the same bytes are stored already
            return
        tmp = staging / f"{os.getpid()}.{uuid.uuid4().hex}"
        try:
            actual = copy_hashed(source, tmp)
            if actual != expected:
                raise RegistryError(
                    f"{source} changed since the run recorded it (sha256 {actual[:12]}, manifest says "
                    f"{expected[:12]}); rebuild it rather than publish it"
                )
            os.chmod(tmp, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
            blob.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, blob)
        finally:
            tmp.unlink(missing_ok=True)

    def _next_version(self, ref: Ref) -> int:
        folder = self._versions_dir(ref)
        numbers = [int(p.stem) for p in folder.glob("*.json") if p.stem.isdigit()] if folder.is_dir() else []
        return max(numbers, default=0) + 1

    def _commit_record(self, ref: Ref, record: dict[str, Any], staging: Path) -> None:
        final = self._versions_dir(ref) / f"{ref.selector}.json"
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = staging / f"{os.getpid()}.{uuid.uuid4().hex}.json"
        try:
            tmp.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
            os.chmod(tmp, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
            try:
                os.link(tmp, final)  # never replaces: a version, once there, is immutable
            except FileExistsError:
                raise RegistryError(f"{ref} exists already; versions are never overwritten") from None
        finally:
            tmp.unlink(missing_ok=True)

    # -- read ---------------------------------------------------------------------------------

    def resolve(self, ref: Ref) -> dict[str, Any]:
        """The record of the version ``ref`` names (a number, a channel, or the latest)."""
        folder = self._versions_dir(ref)
        if not folder.is_dir():
            known = sorted(p.name for p in folder.parent.glob("*")) if folder.parent.is_dir() else []
            hint = f"; published targets: {', '.join(known)}" if known else ""
            raise RegistryError(f"nothing is published as {ref.model}/{ref.recipe}/{ref.target}{hint}")
        version = ref.selector
        if version is None:
            version = self._next_version(ref) - 1
        elif isinstance(version, str):
            channel = self._channel_file(ref, version)
            if not channel.is_file():
                raise RegistryError(f"channel {version} of {ref.at(None)} points at no version yet")
            version = int(json.loads(channel.read_text())["version"])
        path = folder / f"{version}.json"
        if not path.is_file():
            raise RegistryError(f"{ref.at(version)} does not exist (latest: {self._next_version(ref) - 1})")
        return json.loads(path.read_text())

    def _records(self) -> Iterator[dict[str, Any]]:
        for path in sorted((self.root / "versions").glob("*/*/*/*.json")):
            if path.stem.isdigit():
                yield json.loads(path.read_text())

    def _channels(self) -> dict[str, dict[str, int]]:
        channels: dict[str, dict[str, int]] = {}
        for path in sorted((self.root / "channels").glob("*/*/*/*.json")):
            key = "/".join(path.parent.relative_to(self.root / "channels").parts)
            channels.setdefault(key, {})[path.stem] = int(json.loads(path.read_text())["version"])
        return channels

    def _scan(self) -> dict[str, Any]:
        versions = [
            {
                "model": r["model"],
                "recipe": r["recipe"],
                "target": r["target"],
                "version": r["version"],
                "published_at": r["published_at"],
                "verdict": (r.get("gate") or {}).get("verdict"),
                "forced": r.get("forced"),
                "engine_digest": r["engine"].get("digest"),
                "bytes": sum(int(f["bytes"]) for f in r["engine"]["files"]),
            }
            for r in self._records()
        ]
        versions.sort(key=lambda v: (v["model"], v["recipe"], v["target"], v["version"]))
        return {"schema": RECORD_SCHEMA, "versions": versions, "channels": self._channels()}

    def _write_index(self) -> dict[str, Any]:
        index = self._scan()
        self.root.mkdir(parents=True, exist_ok=True)
        write_json(self.root / "index.json", index)
        return index

    def index(self) -> dict[str, Any]:
        """Every version and channel. The stored index is checked against the version and
        channel files and rebuilt when a writer stopped between the two."""
        path = self.root / "index.json"
        scanned = self._scan()
        stored = json.loads(path.read_text()) if path.is_file() else None
        if stored != scanned and self.root.is_dir():
            with self._locked():
                scanned = self._write_index()
        return scanned

    # -- pull ---------------------------------------------------------------------------------

    def pull(
        self,
        ref: Ref,
        to: Path | str,
        *,
        tensorrt_version: str | None = None,
        gpu_arch: str | None = None,
    ) -> Path:
        """Copy the version ``ref`` names into ``to`` (``manifest.json`` + ``engine/``, the layout
        of a run folder), verifying every file's sha256. A TensorRT engine is refused when the
        TensorRT version or GPU architecture asked for differs from the one it was built for."""
        record = self.resolve(ref)
        name = f"{ref.at(None)}@{record['version']}"
        check_tensorrt(record, tensorrt_version, gpu_arch)
        with pulled_folder(to, record) as staging:
            for entry in record["engine"]["files"]:
                rel = safe_relative(entry["path"], name)
                blob = self._blob(entry["sha256"])
                if not blob.is_file():
                    raise RegistryError(f"{name}: blob {entry['sha256']} ({rel}) is missing from {self.root}")
                target = staging / ENGINE_DIR / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                actual = copy_hashed(blob, target)
                if actual != entry["sha256"]:
                    raise RegistryError(
                        f"{name}: blob {entry['sha256']} ({rel}) is corrupt (its content hashes to "
                        f"{actual}); nothing was pulled; run `python -m pipeline.registry verify`"
                    )
        return Path(to)

    # -- channels -----------------------------------------------------------------------------

    def promote(self, ref: Ref, channel: str, reason: str | None = None) -> dict[str, Any]:
        """Point ``channel`` at the version ``ref`` names (its history keeps where it pointed)."""
        check_channel(channel)
        with self._locked():
            record = self.resolve(ref)
            moved = self._move_channel(ref.at(record["version"]), channel, reason or "promoted")
            self._write_index()
        return moved

    def _move_channel(self, ref: Ref, channel: str, reason: str) -> dict[str, Any]:
        path = self._channel_file(ref, channel)
        current = json.loads(path.read_text()) if path.is_file() else {"history": []}
        entry = {"version": ref.selector, "at": now(), "reason": reason}
        moved = {"version": ref.selector, "history": [*current["history"], entry]}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, moved)
        return moved

    def channel_history(self, ref: Ref, channel: str) -> list[dict[str, Any]]:
        path = self._channel_file(ref, check_channel(channel))
        return json.loads(path.read_text())["history"] if path.is_file() else []

    # -- maintenance --------------------------------------------------------------------------

    def verify(self) -> list[str]:
        """Every problem found: a blob whose content does not hash to its name (with the versions
        using it), a version whose blob is missing, a channel pointing at no version. Also
        rebuilds a stale index (not a problem: the version files are the truth)."""
        problems: list[str] = []
        users: dict[str, list[str]] = {}
        for record in self._records():
            name = f"{record['model']}/{record['recipe']}/{record['target']}@{record['version']}"
            for entry in record["engine"]["files"]:
                users.setdefault(entry["sha256"], []).append(f"{name} ({entry['path']})")
                if not self._blob(entry["sha256"]).is_file():
                    problems.append(f"{name}: blob {entry['sha256']} ({entry['path']}) is missing")
        for blob in sorted((self.root / "blobs" / "sha256").glob("*/*")):
            actual = sha256_file(blob)
            if actual != blob.name:
                used = ", ".join(users.get(blob.name, [])) or "no version"
                problems.append(f"blob {blob.name} is corrupt (content hashes to {actual}); used by {used}")
        for key, channels in self._channels().items():
            for channel, version in channels.items():
                if not (self.root / "versions" / key / f"{version}.json").is_file():
                    problems.append(f"channel {channel} of {key} points at missing version {version}")
        if self.root.is_dir():
            self.index()
        return problems

    def gc(self) -> dict[str, int]:
        """Remove what no version references: staging leftovers of killed publishers or pulls
        and blobs stored by a publish that never committed its record."""
        with self._locked():  # no publish is running: every staging file and orphan is garbage
            staging = self.root / ".staging"
            leftovers = list(staging.iterdir()) if staging.is_dir() else []
            for path in leftovers:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            used = {e["sha256"] for r in self._records() for e in r["engine"]["files"]}
            orphans = [b for b in (self.root / "blobs" / "sha256").glob("*/*") if b.name not in used]
            freed = 0
            for blob in orphans:
                freed += blob.stat().st_size
                blob.unlink()
            self._write_index()
        return {"staging_files": len(leftovers), "orphan_blobs": len(orphans), "bytes_freed": freed}
