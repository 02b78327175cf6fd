"""Content-addressed cache of pass outputs.

Key = sha256 of (input digest, pass name, pass version, resolved pass config, versions of the
libraries that shape outputs). Olive leaves library versions out of its key and its users hit
stale caches (Olive #1936, #2552); we put them in.

An entry is ``<root>/<key>/`` holding ``output/`` (the artifact folder) and ``entry.json``.
It is built in ``<root>/.staging/<key>.<pid>.<nonce>/`` and published with one atomic
``rename``, so a run killed at any moment (even SIGKILL) never leaves a half-written entry.
The cache may be shared by jobs on several hosts or containers (NFS, Lustre): a staging folder is
owned through a lock (``pipeline/core/staging.py``), and opening the cache removes only those whose
owner is gone, whichever host it ran on (or, with ``max_age_s``, that nobody wrote for that long).
An entry that cannot be read or does not match its digest is evicted and recomputed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.artifacts import Artifact, Kind, folder_digest, write_json
from pipeline.core.errors import StorageError
from pipeline.core.staging import (
    LOCK_SUFFIX,
    is_owned,
    key_lock,
    owned_folder,
    remove_abandoned,
    storage_error,
    unique_name,
    write_json_staged,
)

log = logging.getLogger(__name__)

# Libraries whose version changes what a pass writes.
KEY_LIBRARIES = ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "onnx-ir", "tensorrt")
ENTRY_FILE = "entry.json"
OUTPUT_DIR = "output"
STAGING_DIR = ".staging"
CHECKPOINTS_DIR = ".checkpoints"


def computing_once(root: Path, name: str, what: str) -> contextlib.AbstractContextManager[float]:
    """Hold the lock of ``name`` (a cache key, or a record's name) under the cache ``root`` while
    computing it (yields the seconds waited): the other jobs of a sweep wait on it, then reuse
    what it wrote. The lock lies in the staging folder, whose cleanup removes one nobody holds."""
    return key_lock(Path(root) / STAGING_DIR / f"{name}.compute{LOCK_SUFFIX}", what)


RECORD_DIRS = ("quality", "bench", "eval")
# What is wrong with a cached record's fields (None: nothing): ``load_record``'s ``check``.
RecordCheck = Callable[[dict[str, Any]], str | None]  # JSON records kept beside the entries


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
    """Pass-output store. ``enabled=False`` still stages atomically but never reads entries.
    ``max_age_s`` (``pipeline.staging_max_age_h`` in seconds): staging folders nobody wrote for
    that long are removed even if a lock still says their owner lives (None: by lock only)."""

    def __init__(self, root: Path, enabled: bool = True, max_age_s: float | None = None) -> None:
        self.root = Path(root)
        self.enabled = enabled
        self.max_age_s = max_age_s
        self.staging_root = self.root / STAGING_DIR
        try:
            self.staging_root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = storage_error(exc, "cannot create the cache", "pipeline.cache_dir")
            if error is None:
                raise
            raise error from None
        self._remove_abandoned()

    def _remove_abandoned(self) -> None:
        """Remove what interrupted runs left: staging folders (entries, trash, records) whose
        owner's lock is free, and checkpoints of keys already cached that nobody works on."""
        for path in remove_abandoned(self.staging_root, "", self.max_age_s):
            log.info("removed %s: its run was interrupted", path.name)
        checkpoints = self.root / CHECKPOINTS_DIR
        if checkpoints.is_dir():
            for folder in sorted(checkpoints.iterdir()):
                if (self.root / folder.name / ENTRY_FILE).is_file():
                    self._remove_checkpoints(folder.name)

    def checkpoint_dir(self, key: str) -> Path:
        """Where ``key``'s checkpoints go, outliving an interrupted run (``.checkpoints/``); the
        pass creates it if it checkpoints at all. Once ``key`` is cached it is removed, unless
        another job (on any host) is still working on ``key``: that job may be writing it."""
        return self.root / CHECKPOINTS_DIR / key

    def _working_on(self, key: str, own: Path | None = None) -> bool:
        """Whether a live job other than the one staging in ``own`` stages ``key`` now."""
        try:
            names = os.listdir(self.staging_root)
        except OSError:
            return True
        for name in names:
            folder = self.staging_root / name
            mine = name.startswith(f"{key}.") and ".trash." not in name and not name.endswith(".lock")
            if mine and folder != own and is_owned(folder):
                return True
        return False

    def _remove_checkpoints(self, key: str, own: Path | None = None) -> None:
        folder = self.checkpoint_dir(key)
        if folder.exists() and not self._working_on(key, own):
            shutil.rmtree(folder, ignore_errors=True)

    def recorded_output(self, key: str) -> str | None:
        """The output digest ``key``'s entry records, read without hashing its files (a
        prediction of :meth:`lookup`, which verifies them): None when there is no readable entry."""
        if not self.enabled:
            return None
        record, problem = _checked_record(self.root / key / ENTRY_FILE)
        if record is None or problem is not None:
            return None
        digest = record.get("output_digest")
        return digest if isinstance(digest, str) else None

    def lookup(self, key: str, kind: Kind) -> CacheEntry | None:
        """Return the verified entry for ``key``; an unreadable, malformed or modified entry is
        evicted and ignored (the caller recomputes it)."""
        if not self.enabled:
            return None
        entry_dir = self.root / key
        entry_file = entry_dir / ENTRY_FILE
        if not entry_file.is_file():
            return None
        judged = _identity(entry_file)  # which entry we judge, should another job replace it
        record, problem = _checked_record(entry_file)
        output = entry_dir / OUTPUT_DIR
        digest = None
        if problem is None:
            try:
                digest = folder_digest(output) if output.is_dir() else None
            except OSError as exc:
                problem = f"cannot read its output ({exc.strerror}: {exc.filename})"
            else:
                if digest is None:
                    problem = "its output folder is missing"
                elif digest != record["output_digest"]:
                    problem = "it was modified on disk"
        if problem is not None:
            log.warning("cache entry %s: %s; discarding it and recomputing", key[:12], problem)
            self.evict(key, judged)
            return None
        return CacheEntry(key, Artifact.from_dir(kind, output, digest), record)

    def evict(self, key: str, judged: tuple[int, int] | None = None) -> None:
        """Remove ``key``'s entry (moved into a lock-owned trash folder first, so that a crash
        mid-removal leaves no half entry). With ``judged`` (the identity of the ``entry.json``
        found bad), an entry that another job committed since then is put back, not evicted."""
        target = self.root / key
        try:
            with owned_folder(self.staging_root / unique_name(f"{key}.trash")) as trash:
                try:
                    os.rename(target, trash / key)
                except FileNotFoundError:
                    return  # evicted by another job already
                if judged is not None and _identity(trash / key / ENTRY_FILE) != judged:
                    with contextlib.suppress(OSError):  # a fresh entry: put it back if still free
                        os.rename(trash / key, target)
        except OSError as exc:  # a read-only cache: the entry stays, it is recomputed each run
            log.warning("cannot evict cache entry %s (%s); recomputing it without caching", key[:12], exc)

    @contextlib.contextmanager
    def computing(self, key: str, what: str) -> Iterator[float]:
        """Hold ``key``'s compute lock for the block (yields the seconds waited for it): jobs that
        share this cache (a sweep, on one host or many) compute one key once; the others wait,
        then look it up. A disabled cache computes without it."""
        if not self.enabled:
            yield 0.0
            return
        with contextlib.ExitStack() as stack:
            try:
                waited = stack.enter_context(computing_once(self.root, key, what))
            except OSError as exc:  # an unwritable cache: one line naming it
                error = self.storage_error(exc, f"cannot lock {what}")
                if error is None:
                    raise
                raise error from None
            yield waited

    @contextlib.contextmanager
    def stage(self, key: str, label: str = "a cache entry") -> Iterator[Path]:
        """Yield an empty staging folder for ``key``, owned by this process through its lock;
        removed on any exit (error, Ctrl-C, SIGTERM) unless :meth:`commit` took it. An OS error
        writing under the cache (full disk, read-only folder, permission) becomes one
        :class:`~pipeline.core.errors.StorageError` naming ``label`` (what was being written) and
        the file."""
        try:
            with owned_folder(self.staging_root / unique_name(key)) as staging:
                (staging / OUTPUT_DIR).mkdir()
                yield staging
        except OSError as exc:
            error = self.storage_error(exc, f"cannot write {label}")
            if error is None:
                raise
            raise error from None

    def storage_error(self, exc: OSError, doing: str) -> StorageError | None:
        """``exc`` as a one-line error when it is a full disk or an unwritable folder under the
        cache; None otherwise (an error elsewhere, or not one the user fixes)."""
        if exc.filename is not None and not _under(Path(str(exc.filename)), self.root):
            return None
        if exc.filename is None or _under(Path(str(exc.filename)), self.staging_root):
            exc = OSError(exc.errno, exc.strerror, f"the cache folder {self.root}")  # what to fix
        return storage_error(exc, doing, "pipeline.cache_dir")

    def commit(self, key: str, staging: Path, kind: Kind, record: dict[str, Any]) -> CacheEntry:
        """Publish a staged output under ``key`` with one atomic rename. When a concurrent job
        (on any host) published ``key`` first, its entry is kept and ours dropped; a broken
        entry in the way is evicted."""
        final = self.root / key
        try:
            write_json(staging / ENTRY_FILE, record)
            for _ in range(3):
                try:
                    os.rename(staging, final)
                    break
                except OSError:
                    if not final.exists():
                        raise
                judged = _identity(final / ENTRY_FILE)
                theirs, _ = read_record(final / ENTRY_FILE)
                if theirs is not None and _entry_problem(theirs) is None:
                    shutil.rmtree(staging, ignore_errors=True)
                    record = theirs
                    break
                self.evict(key, judged)  # a broken entry in the way: ours replaces it
            else:
                os.rename(staging, final)  # raises, naming the entry in the way
        except OSError as exc:
            error = self.storage_error(exc, f"cannot write cache entry {key[:12]}")
            if error is None:
                raise
            raise error from None
        self._remove_checkpoints(key, staging)  # the work is done, unless another job still does it
        output = final / OUTPUT_DIR
        return CacheEntry(key, Artifact.from_dir(kind, output, record["output_digest"]), record)

    def write_record(self, path: Path, record: dict[str, Any]) -> None:
        """Write a JSON record under the cache (``quality/<key>.json``...) by atomic rename; the
        temporary file lies in a lock-owned staging folder, so nothing half-written stays, even
        after a SIGKILL (the next cache open removes it)."""
        write_record(self.root, path, record)

    def read_record(self, path: Path, check: RecordCheck | None = None) -> dict[str, Any] | None:
        """A JSON record written by :meth:`write_record`, or None when absent; an unreadable or
        malformed one (or one ``check`` finds a problem in) is removed (with a warning) so that it
        is recomputed."""
        return load_record(path, check)


def write_record(root: Path, path: Path, record: dict[str, Any]) -> None:
    """:meth:`Cache.write_record` for code that holds the cache folder (``root``) rather than a
    :class:`Cache` (``pipeline/bench.py``, ``evals/gate.py``)."""
    write_json_staged(
        path, record, Path(root) / STAGING_DIR, f"cannot write the record {path.name}", "pipeline.cache_dir"
    )


def load_record(path: Path, check: RecordCheck | None = None) -> dict[str, Any] | None:
    """:meth:`Cache.read_record` for code that holds a record's path rather than a :class:`Cache`.
    ``check(record)`` says what is wrong with a well-formed JSON object (a field of the wrong type
    or out of range), or None: a record it faults is discarded like a malformed one."""
    if not path.is_file():
        return None
    record, problem = read_record(path)
    if record is not None and check is not None and (problem := check(record)) is not None:
        record = None
    if record is None:
        log.warning("cached record %s: %s; discarding it and recomputing", path, problem)
        with contextlib.suppress(OSError):
            path.unlink()
    return record


def read_record(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the JSON object in ``path``, None) or (None, what is wrong with it)."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None, "it is missing"
    except OSError as exc:
        return None, f"cannot read it ({exc.strerror})"
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"it is not valid JSON ({exc})"
    if not isinstance(record, dict):
        return None, f"it holds a JSON {type(record).__name__}, not an object"
    return record, None


def _checked_record(entry_file: Path) -> tuple[dict[str, Any] | None, str | None]:
    """An entry's record and what is wrong with it (unreadable, malformed), None when nothing."""
    record, problem = read_record(entry_file)
    if record is not None:
        problem = _entry_problem(record)
    return record, problem


def _entry_problem(record: dict[str, Any]) -> str | None:
    """What makes an ``entry.json`` object unusable, or None."""
    if not isinstance(record.get("output_digest"), str):
        return f"{ENTRY_FILE} has no output_digest"
    if not isinstance(record.get("config"), dict) or not isinstance(record.get("input_digest"), str):
        return f"{ENTRY_FILE} lacks its config or input_digest"
    if not isinstance(record.get("metrics", {}), dict):
        return f"{ENTRY_FILE} has malformed metrics"
    return None


def _under(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root.resolve())
    except OSError:
        return False


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns
