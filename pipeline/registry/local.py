"""The local registry (the embedded default): engines published from run folders, pulled back
with every byte verified.

Layout under the root (``artifacts/registry`` by default)::

    blobs/sha256/<2 hex>/<sha256>                 engine files, content-addressed, read-only
    versions/<model>/<recipe>/<target>/<n>.json   one immutable record per version
    channels/<model>/<recipe>/<target>/<ch>.json  a movable alias (nightly, candidate, stable) + history
    index.json                                    every version and channel, rebuilt from the above
    registry.json                                 the marker: this folder is a registry
    .staging/                                     a publish in progress (a folder owned by a lock)
    .lock                                         one writer at a time (publish, promote, gc)

Publishing first checks the run's record (``engine.path`` and every file path stay inside the run
and engine folders, symlinks included; sha256 and sizes well-formed; the engine folder holds
exactly the files listed), copies each engine file into ``.staging`` while hashing it, checks the
sha256 the run recorded, and only when every file matched renames them into ``blobs`` (a blob of
the same name is hashed too: one whose bytes do not match its name is replaced, with a warning);
then the version record is linked into place (``os.link`` fails on an existing name, so a version
is never overwritten). That link is the commit: a publisher killed before it leaves only a
staging folder and unreferenced blobs, which ``gc`` removes; killed after it, the version is
complete. An engine a version of the same model/recipe/target already holds (the same digest,
computed from the file list: path and sha256 of every file) makes no new version: under the lock
that allocates versions, the requested channel moves to that version, which is returned (its
blobs were still hashed and repaired as above; no record is written). The index is derived
from the version and channel files: readers compute it from them, and a stale ``index.json``
(killed between the two) is rewritten by the next writer or ``verify``.
Writers hold a file lock (``filelock``) for the whole publish, so concurrent publishers queue:
versions stay distinct and ``gc`` never sees another publisher's blobs before their record.

Nothing read is trusted: a version record, channel file or index that is not what this code
writes (bad JSON, not an object, missing keys, wrong types, paths leaving the engine folder,
malformed sha256) is reported by its path and skipped by ``list`` (a warning), ``verify`` (a
problem: exit 1) and ``gc`` (which then removes no blob: such a record may use any), and refused by
``show``/``pull`` of that version. A record whose files collide (``a`` and ``a/sub``), repeat,
or are no plain relative file name is malformed too. Records, channels, the index and blobs are
read as regular files only (``pipeline/core/files.py``: a FIFO or a device there is refused by
name, never read), and a pulled engine must load: its ``engine.json`` and graph are checked
(``pipeline.core.engine.read_engine_spec``) before the pulled folder is renamed into place, as
they are before a publish stores anything. A folder is a registry when it holds ``registry.json``
(written when the first publish creates it) or, for registries older than the marker,
``versions/``, ``blobs/``, ``channels/`` or ``index.json``. A folder holding anything else is
refused by every command; a missing or empty one reads as an empty registry for ``list``,
``show`` and ``pull``, is an error for ``verify`` and ``gc``, and is created by ``publish``.
``list``, ``show`` and ``pull`` never write under the root (a read-only registry serves them).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from pipeline.core.artifacts import sha256_file, write_json
from pipeline.core.errors import PipelineError
from pipeline.core.files import UnsafeFileError, loads_bounded, read_regular_text
from pipeline.core.staging import check_lock_path, owned_folder, remove_abandoned, unique_name
from pipeline.registry.records import (
    ENGINE_DIR,
    RECORD_SCHEMA,
    REUSED,
    SHA256,
    Publication,
    check_channel_file,
    check_engine_spec,
    check_record,
    check_tensorrt,
    copy_hashed,
    describe,
    load_json,
    now,
    prepare_publication,
    pulled_folder,
    safe_relative,
    stage_file,
)
from pipeline.registry.refs import CHANNELS as CHANNEL_NAMES
from pipeline.registry.refs import Ref, RegistryError, RegistryIOError, check_channel

log = logging.getLogger(__name__)

# Called at each step of a publish ("blob <path>", "blobs", "record", "index", "channel").
StageHook = Callable[[str], None]

MARKER = "registry.json"
LAYOUT = (MARKER, "versions", "blobs", "channels", "index.json")  # any one marks a registry


@contextmanager
def _writing(what: str) -> Iterator[None]:
    """An OS error (read-only registry, permission denied, disk full) as one line naming the
    path and what was being written."""
    try:
        yield
    except OSError as exc:
        raise RegistryIOError(f"cannot write {what}: {describe(exc)}") from None


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

    def _state(self) -> str:
        """``registry``, or ``absent`` (no folder, or an empty one); a folder holding anything
        else is not a registry and is refused, whatever the command."""
        try:
            names = set(os.listdir(self.root))
        except FileNotFoundError:
            return "absent"
        except NotADirectoryError:
            raise RegistryError(
                f"{self.root} is a file, not a registry folder: check --root (registry.root)"
            ) from None
        except OSError as exc:
            raise RegistryIOError(f"cannot read the registry {self.root}: {describe(exc)}") from None
        if names & set(LAYOUT):
            return "registry"
        if not names:
            return "absent"
        raise RegistryError(
            f"{self.root} is not a registry (it holds no {MARKER}, versions/ or blobs/): "
            "pass the folder a publish created (--root, registry.root)"
        )

    def _require(self) -> None:
        """For verify and gc: a registry must be there (a typo in --root is not '0 problems')."""
        if self._state() == "absent":
            what = "is empty" if self.root.is_dir() else "does not exist"
            raise RegistryError(
                f"{self.root} {what}: no registry there to check; pass the folder a publish created (--root)"
            )

    def _create(self) -> None:
        """Make the root a registry: created with its marker in one rename when missing (so no
        half-made registry is ever seen), the marker added to an empty or older one."""
        if self._state() == "registry" and (self.root / MARKER).is_file():
            return
        marker = {"schema": RECORD_SCHEMA, "kind": "llm-pipeline registry", "created_at": now()}
        with _writing(f"the registry {self.root}"):
            if self.root.is_dir():
                write_json(self.root / MARKER, marker)
                return
            parent = self.root.parent
            parent.mkdir(parents=True, exist_ok=True)
            prefix = f".{self.root.name}.new"
            remove_abandoned(parent, prefix + ".")
            with owned_folder(parent / unique_name(prefix)) as fresh:
                write_json(fresh / MARKER, marker)
                try:
                    os.rename(fresh, self.root)
                except OSError:
                    if self._state() != "registry":  # not another publisher creating it first
                        raise

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with _writing(f"the registry lock in {self.root}"):
            check_lock_path(self.root / ".lock")  # FileLock would follow a planted symlink
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
        manifest: dict[str, Any] | None = None,
        on_stage: StageHook | None = None,
    ) -> dict[str, Any]:
        """Publish the engine of a finished run as the next version of model/recipe/target; move
        ``channel`` to it. ``manifest`` is the run's own record (``publish_run`` passes it), else
        ``run_dir/manifest.json`` is read; the engine folder must match it file for file, byte
        for byte. Refused unless the run's gate verdict is PASS, or ``force`` gives the reason to
        publish anyway. An engine a version of model/recipe/target already holds (the same files,
        byte for byte) makes no new version: ``channel`` is moved to that version and its record
        returned with ``reused``, the line saying so."""
        stage = on_stage or (lambda _: None)
        publication = prepare_publication(run_dir, model, recipe, channel, force, manifest)
        ref = publication.ref
        self._create()
        with self._locked(), _writing(f"a new version into {self.root}"):
            if channel:
                self._read_channel(self._channel_file(ref, channel))  # a broken one stops us here
            with _writing(f"the staging folder {self.root / '.staging'}"):
                staging_root = self.root / ".staging"
                staging_root.mkdir(exist_ok=True)
            with owned_folder(staging_root / unique_name("publish")) as staging:
                staged = []
                for number, entry in enumerate(publication.files):
                    tmp = staging / f"{number}.blob"
                    stage_file(
                        publication.engine_dir / entry["path"], tmp, entry, within=publication.engine_dir
                    )
                    staged.append((entry["sha256"], tmp))
                    stage(f"blob {entry['path']}")
                for sha256, tmp in staged:  # every file matched its record: store them
                    self._place_blob(sha256, tmp)
                stage("blobs")
                # Under the lock that allocates versions: an engine a version already holds is
                # not published again (its blobs were checked above, and repaired if corrupt).
                holder = publication.holder(self._records_of(ref))
                if holder is None:
                    version = self._next_version(ref)
                    record = publication.record(version)
                    self._commit_record(ref.at(version), record, staging)
            if holder is not None:
                return self._reuse(publication, holder, stage)
            stage("record")
            self._write_index()
            stage("index")
            if channel:
                self._move_channel(ref.at(version), channel, f"published {version}")
                self._write_index()
                stage("channel")
        log.info("published %s", ref.at(version))
        return record

    def _records_of(self, ref: Ref) -> Iterator[dict[str, Any]]:
        """The well-formed version records of model/recipe/target (a malformed one is skipped:
        ``list`` and ``verify`` name it)."""
        for path in sorted(self._versions_dir(ref).glob("*.json")):
            if path.stem.isdigit():
                try:
                    yield self._read_record(path)
                except RegistryError:
                    continue

    def _reuse(self, publication: Publication, holder: dict[str, Any], stage: StageHook) -> dict[str, Any]:
        """The publish of an engine the version ``holder`` holds already (the lock held): the
        channel asked for moved to it (unless it points there), no version made."""
        ref, channel = publication.ref.at(holder["version"]), publication.channel
        moved = False
        if channel:
            current = self._read_channel(self._channel_file(ref, channel))
            if current is None or current["version"] != holder["version"]:
                self._move_channel(ref, channel, f"published {holder['version']} again")
                moved = True
        self._write_index()  # a stale one (a publisher killed before it) is rewritten, as always
        stage("index")
        if moved:
            stage("channel")
        result = publication.reused(holder, moved)
        log.info("%s", result[REUSED])
        return result

    def _place_blob(self, sha256: str, staged: Path) -> None:
        """Store a staged file (its sha256 checked) as the blob of that name. A blob already there
        is hashed: kept when it matches its name, else reported and replaced, never reused."""
        blob = self._blob(sha256)
        if blob.is_file() and not blob.is_symlink():
            try:
                actual = sha256_file(blob)
            except OSError as exc:
                actual = f"unreadable ({exc.strerror or exc})"
            if actual == sha256:
                return  # content-addressed: the same bytes are stored already
            log.warning(
                "blob %s was corrupt (content hashes to %s); replaced it with the run's copy", blob, actual
            )
        elif blob.exists() or blob.is_symlink():
            log.warning("blob %s was not a regular file; replaced it with the run's copy", blob)
        with _writing(f"blob {blob}"):
            os.chmod(staged, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
            blob.parent.mkdir(parents=True, exist_ok=True)
            if blob.is_dir() and not blob.is_symlink():
                raise IsADirectoryError(21, "a folder stands where the blob goes", str(blob))
            os.replace(staged, blob)

    def _next_version(self, ref: Ref) -> int:
        folder = self._versions_dir(ref)
        numbers = [int(p.stem) for p in folder.glob("*.json") if p.stem.isdigit()] if folder.is_dir() else []
        return max(numbers, default=0) + 1

    def _commit_record(self, ref: Ref, record: dict[str, Any], staging: Path) -> None:
        final = self._versions_dir(ref) / f"{ref.selector}.json"
        tmp = staging / unique_name("record")
        with _writing(f"the version record {final}"):
            final.parent.mkdir(parents=True, exist_ok=True)
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

    def _read_record(self, path: Path) -> dict[str, Any]:
        """A version record, checked: it must be what a publish wrote, at the place it names."""
        try:
            record = check_record(load_json(path, "a version record", follow_symlinks=False), str(path))
            model, recipe, target = path.parent.relative_to(self.root / "versions").parts
            found = (record["model"], record["recipe"], record["target"], str(record["version"]))
            if found != (model, recipe, target, path.stem):
                raise RegistryError(
                    f"{path}: the record is of {'/'.join(found[:3])}@{found[3]}, not of where it is stored"
                )
        except RegistryIOError:
            raise
        except RegistryError as exc:
            raise RegistryError(f"{exc} (a malformed version record: restore it from a backup)") from None
        return record

    def _read_channel(self, path: Path) -> dict[str, Any] | None:
        if not os.path.lexists(path):
            return None
        try:
            return check_channel_file(load_json(path, "a channel", follow_symlinks=False), str(path))
        except RegistryIOError:
            raise
        except RegistryError as exc:
            raise RegistryError(
                f"{exc} (a malformed channel: restore it, or delete it to start its history afresh)"
            ) from None

    def resolve(self, ref: Ref) -> dict[str, Any]:
        """The record of the version ``ref`` names (a number, a channel, or the latest)."""
        if self._state() == "absent":
            raise RegistryError(f"nothing is published as {ref.at(None)}: {self.root} holds no registry yet")
        folder = self._versions_dir(ref)
        if not folder.is_dir():
            known = sorted(p.name for p in folder.parent.glob("*")) if folder.parent.is_dir() else []
            hint = f"; published targets: {', '.join(known)}" if known else ""
            raise RegistryError(f"nothing is published as {ref.model}/{ref.recipe}/{ref.target}{hint}")
        version = ref.selector
        if version is None:
            version = self._next_version(ref) - 1
        elif isinstance(version, str):
            channel = self._read_channel(self._channel_file(ref, version))
            if channel is None:
                raise RegistryError(f"channel {version} of {ref.at(None)} points at no version yet")
            version = channel["version"]
        path = folder / f"{version}.json"
        if not os.path.lexists(path):  # anything else there (a FIFO, a link) is refused by name
            raise RegistryError(f"{ref.at(version)} does not exist (latest: {self._next_version(ref) - 1})")
        return self._read_record(path)

    def _scan_records(self) -> tuple[list[dict[str, Any]], list[str]]:
        """(the well-formed version records, a problem line naming each malformed one)."""
        records: list[dict[str, Any]] = []
        problems: list[str] = []
        for path in sorted((self.root / "versions").glob("*/*/*/*.json")):
            if not path.stem.isdigit():
                continue
            try:
                records.append(self._read_record(path))
            except RegistryError as exc:
                problems.append(f"{exc}; skipped")
        return records, problems

    def _records(self) -> Iterator[dict[str, Any]]:
        yield from self._scan_records()[0]

    def _scan_channels(self) -> tuple[dict[str, dict[str, int]], list[str]]:
        channels: dict[str, dict[str, int]] = {}
        problems: list[str] = []
        for path in sorted((self.root / "channels").glob("*/*/*/*.json")):
            key = "/".join(path.parent.relative_to(self.root / "channels").parts)
            if path.stem not in CHANNEL_NAMES:
                problems.append(f"{path}: {path.stem!r} is not a channel; skipped")
                continue
            try:
                channel = self._read_channel(path)
            except RegistryError as exc:
                problems.append(f"{exc}; skipped")
                continue
            if channel is not None:
                channels.setdefault(key, {})[path.stem] = channel["version"]
        return channels, problems

    def _channels(self) -> dict[str, dict[str, int]]:
        return self._scan_channels()[0]

    def _scan(self, problems: list[str] | None = None) -> dict[str, Any]:
        records, bad_records = self._scan_records()
        channels, bad_channels = self._scan_channels()
        if problems is not None:
            problems += bad_records + bad_channels
        versions = [
            {
                "model": r["model"],
                "recipe": r["recipe"],
                "target": r["target"],
                "version": r["version"],
                "published_at": r["published_at"],
                "verdict": r["gate"]["verdict"],
                "forced": r["forced"],
                "engine_digest": r["engine"].get("digest"),
                "bytes": sum(int(f["bytes"]) for f in r["engine"]["files"]),
            }
            for r in records
        ]
        versions.sort(key=lambda v: (v["model"], v["recipe"], v["target"], v["version"]))
        return {"schema": RECORD_SCHEMA, "versions": versions, "channels": channels}

    def _write_index(self) -> dict[str, Any]:
        index = self._scan()
        with _writing(f"the index {self.root / 'index.json'}"):
            write_json(self.root / "index.json", index)
        return index

    def _stored_index(self) -> Any:
        try:
            return loads_bounded(
                read_regular_text(self.root / "index.json", follow_symlinks=False, what="the index")
            )
        except (OSError, ValueError, RecursionError, PipelineError):
            return None  # missing or unreadable: stale, rebuilt by the next writer or verify

    def index(self) -> dict[str, Any]:
        """Every version and channel, read from the version and channel files (the truth; the
        stored ``index.json`` is rewritten by writers and ``verify``, never here: readers do not
        write). A malformed version or channel file is skipped with a warning naming it."""
        if self._state() == "absent":
            return {"schema": RECORD_SCHEMA, "versions": [], "channels": {}}
        problems: list[str] = []
        index = self._scan(problems)
        for problem in problems:
            log.warning("%s", problem)
        return index

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
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    actual = copy_hashed(blob, target, follow_symlinks=False)  # blobs are never links
                except UnsafeFileError as exc:
                    raise RegistryError(f"{name}: {exc}; run `python -m pipeline.registry verify`") from None
                except OSError as exc:
                    if exc.filename is not None and Path(exc.filename) == blob:
                        raise RegistryIOError(f"cannot read blob {blob}: {describe(exc)}") from None
                    raise RegistryIOError(f"cannot write the pulled folder {to}: {describe(exc)}") from None
                if actual != entry["sha256"]:
                    raise RegistryError(
                        f"{name}: blob {entry['sha256']} ({rel}) is corrupt (its content hashes to "
                        f"{actual}); nothing was pulled; run `python -m pipeline.registry verify`"
                    )
            check_engine_spec(staging / ENGINE_DIR, f"{name}: nothing was pulled")
        return Path(to)

    # -- channels -----------------------------------------------------------------------------

    def promote(self, ref: Ref, channel: str, reason: str | None = None) -> dict[str, Any]:
        """Point ``channel`` at the version ``ref`` names (its history keeps where it pointed)."""
        check_channel(channel)
        self.resolve(ref)  # refuses a missing registry or version before anything is written
        with self._locked():
            record = self.resolve(ref)
            moved = self._move_channel(ref.at(record["version"]), channel, reason or "promoted")
            self._write_index()
        return moved

    def _move_channel(self, ref: Ref, channel: str, reason: str) -> dict[str, Any]:
        path = self._channel_file(ref, channel)
        current = self._read_channel(path) or {"history": []}
        entry = {"version": ref.selector, "at": now(), "reason": reason}
        moved = {"version": ref.selector, "history": [*current["history"], entry]}
        with _writing(f"channel {channel} ({path})"):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, moved)
        return moved

    def channel_history(self, ref: Ref, channel: str) -> list[dict[str, Any]]:
        if self._state() == "absent":
            return []
        current = self._read_channel(self._channel_file(ref, check_channel(channel)))
        return current["history"] if current else []

    # -- maintenance --------------------------------------------------------------------------

    def verify(self) -> list[str]:
        """Every problem found: a malformed version record or channel file (by path), a blob
        whose content does not hash to its name (with the versions using it), a version whose
        blob is missing, a channel pointing at no version. Also rebuilds a stale or unreadable
        index (not a problem: the version files are the truth). Refused on a folder that holds
        no registry."""
        self._require()
        problems: list[str] = []
        records, bad_records = self._scan_records()
        problems += bad_records
        users: dict[str, list[str]] = {}
        for record in records:
            name = f"{record['model']}/{record['recipe']}/{record['target']}@{record['version']}"
            for entry in record["engine"]["files"]:
                users.setdefault(entry["sha256"], []).append(f"{name} ({entry['path']})")
                if not self._blob(entry["sha256"]).is_file():
                    problems.append(f"{name}: blob {entry['sha256']} ({entry['path']}) is missing")
        for blob in sorted((self.root / "blobs" / "sha256").glob("*/*")):
            used = ", ".join(users.get(blob.name, [])) or "no version"
            if not SHA256.fullmatch(blob.name) or blob.parent.name != blob.name[:2]:
                problems.append(f"{blob} is not a blob this registry writes (name or folder); used by {used}")
                continue
            if blob.is_symlink() or not blob.is_file():
                problems.append(f"blob {blob.name} is not a regular file; used by {used}")
                continue
            try:
                actual = sha256_file(blob)
            except OSError as exc:
                problems.append(f"blob {blob.name} is unreadable ({exc.strerror or exc}); used by {used}")
                continue
            if actual != blob.name:
                problems.append(f"blob {blob.name} is corrupt (content hashes to {actual}); used by {used}")
        channels, bad_channels = self._scan_channels()
        problems += bad_channels
        for key, pointers in channels.items():
            for channel, version in pointers.items():
                if not (self.root / "versions" / key / f"{version}.json").is_file():
                    problems.append(f"channel {channel} of {key} points at missing version {version}")
        if self._stored_index() != self._scan():
            try:
                with self._locked():
                    self._write_index()
            except RegistryIOError as exc:
                log.warning("the stale index was not rebuilt: %s", exc)
        return problems

    def gc(self) -> dict[str, int]:
        """Remove what no version references: staging leftovers of killed publishers and blobs
        stored by a publish that never committed its record. While any version record is
        malformed no blob is removed (that record may use it); it is named in a warning."""
        self._require()
        with self._locked():  # no publish is running: every staging folder left is abandoned
            with _writing(f"the staging folder {self.root / '.staging'}"):
                leftovers = remove_abandoned(self.root / ".staging")
            records, bad_records = self._scan_records()
            used = {e["sha256"] for r in records for e in r["engine"]["files"]}
            orphans = [b for b in (self.root / "blobs" / "sha256").glob("*/*") if b.name not in used]
            if bad_records:  # what they reference is unknown: removing a blob could lose a version
                for problem in bad_records:
                    log.warning("%s", problem)
                if orphans:
                    log.warning(
                        "kept %d unreferenced blobs: %d version records are malformed (above) and may "
                        "use them; restore or delete those records, then run gc again",
                        len(orphans),
                        len(bad_records),
                    )
                orphans = []
            freed = 0
            removed = 0
            for blob in orphans:
                if blob.is_dir() and not blob.is_symlink():
                    log.warning("%s is a folder, not a blob; left in place", blob)
                    continue
                with _writing(f"(removing) blob {blob}"):
                    freed += blob.lstat().st_size
                    blob.unlink()
                removed += 1
            self._write_index()
        return {"staging_files": len(leftovers), "orphan_blobs": removed, "bytes_freed": freed}
