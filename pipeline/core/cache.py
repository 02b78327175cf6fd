"""Content-addressed cache of pass outputs.

Key = sha256 of (input digest, pass name, pass version, resolved pass config, versions of the
libraries that shape outputs). Olive leaves library versions out of its key and its users hit
stale caches (Olive #1936, #2552); we put them in.

An entry is ``<root>/<key>/`` holding ``output/`` (the artifact folder) and ``entry.json``.
It is built in ``<root>/.staging/<key>.<pid>.<nonce>/`` and published with one atomic
``rename``, so a run killed at any moment (even SIGKILL) never leaves a half-written entry.
The cache may be shared by jobs on several hosts or containers (NFS, Lustre): a staging folder is
owned through a lock (``pipeline/core/staging.py``), and opening the cache removes only those whose
owner is gone (their lock is free), whichever host it ran on; with ``max_age_s``, only those among
them that nobody wrote for that long (age is an extra condition, never a reason on its own).

Entries are untrusted input (other jobs and people write to shared storage): :meth:`Cache.lookup`
opens regular files only, never through a symlink (our entries hold none), reads ``entry.json``
bounded and checks the type of every field it uses, hashes the output, and checks that every
external-data location of every ``.onnx`` in it (and ``artifact.json``'s ``model_file``) names a
regular file inside that graph's folder. ``entry.json`` records what its key was computed from
(:data:`KEY_FIELDS`): a hit recomputes the key from those fields and checks that it is the key the
entry was found under and that they are the request's own (:func:`key_problem`), so an entry moved
or copied under another key is not served. An entry failing any of that is evicted with one warning
and recomputed; nothing in it can hang a run or make the pipeline read outside it. (What this
cannot catch: a writer of the cache who records consistent fields over a wrong output.)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import posixpath
import re
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.artifacts import ARTIFACT_FILE, Artifact, Kind, digest_of, file_digests, write_json
from pipeline.core.errors import PipelineError, StorageError
from pipeline.core.files import (
    UnsafeFileError,
    describe_mode,
    loads_bounded,
    read_regular_text,
    regular_size,
)
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
KEY_FIELDS = "key_fields"  # entry.json: what its key was computed from (key_fields())
OUTPUT_DIR = "output"
STAGING_DIR = ".staging"
CHECKPOINTS_DIR = ".checkpoints"
ENTRY_MAX_BYTES = 16 << 20  # an entry.json is a few KiB; a larger one is not ours
RECORD_MAX_BYTES = 64 << 20
_DIGEST = re.compile(r"[0-9a-f]{64}")


def computing_once(root: Path, name: str, what: str) -> contextlib.AbstractContextManager[float]:
    """Hold the lock of ``name`` (a cache key, or a record's name) under the cache ``root`` while
    computing it (yields the seconds waited): the other jobs of a sweep wait on it, then reuse
    what it wrote. The lock lies in the staging folder, whose cleanup removes one nobody holds; a
    symlink at that folder or at the lock is refused in one line, never followed."""
    _refuse_link(Path(root) / STAGING_DIR, "the cache's staging folder (its locks)")
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


def key_fields(
    input_digest: str, pass_name: str, pass_version: int, config: dict[str, Any]
) -> dict[str, Any]:
    """What a cache key is computed from (``entry.json`` records it as :data:`KEY_FIELDS`)."""
    return {
        "input": input_digest,
        "pass": pass_name,
        "version": pass_version,
        "config": config,
        "libraries": library_versions(),
    }


def key_of(fields: dict[str, Any]) -> str:
    """The cache key of :func:`key_fields` (or of the fields an ``entry.json`` records)."""
    return hashlib.sha256(_canonical(fields).encode()).hexdigest()


def cache_key(input_digest: str, pass_name: str, pass_version: int, config: dict[str, Any]) -> str:
    return key_of(key_fields(input_digest, pass_name, pass_version, config))


_KEY_LABELS = {
    "input": "input digest",
    "pass": "pass name",
    "version": "pass version",
    "config": "config",
    "libraries": "library versions",
}


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def key_problem(record: dict[str, Any], key: str, expected: dict[str, Any]) -> str | None:
    """What makes an entry's record (found under ``key``) not an entry of the request whose key
    was computed from ``expected`` (:func:`key_fields`), or None: the fields the record says its
    key was computed from must give ``key`` again, and be the request's own (input digest, pass,
    version, keyed config, library versions); the input digest, pass and version it shows in the
    run record must be those too. An entry found under another's key (a copy, a move, a planted
    one) fails this, whatever its output digest says."""
    recorded = record.get(KEY_FIELDS)
    if not isinstance(recorded, dict):
        return f"{ENTRY_FILE} does not record what its key was computed from ({KEY_FIELDS})"
    for name, label in _KEY_LABELS.items():
        if _canonical(recorded.get(name)) != _canonical(expected[name]):
            return f"{ENTRY_FILE} records another {label} than this run's: it is not this entry"
    if key_of(recorded) != key:
        return f"{ENTRY_FILE}'s {KEY_FIELDS} give another key ({key_of(recorded)[:12]}): it is not this entry"
    shown = {"input_digest": "input", "pass": "pass", "version": "version"}
    for field_name, name in shown.items():
        if field_name in record and record[field_name] != recorded[name]:
            return f"{ENTRY_FILE}'s {field_name} is not the one its key was computed from"
    return None


@dataclass
class CacheEntry:
    key: str
    artifact: Artifact
    record: dict[str, Any]


class Cache:
    """Pass-output store. ``enabled=False`` still stages atomically but never reads entries.
    ``max_age_s`` (``pipeline.staging_max_age_h`` in seconds): an extra condition on removing a
    staging folder whose lock is free (for storage whose locks do not reach every host): it is
    removed only once nobody wrote in it for that long. A folder whose lock is held is never
    removed, whatever its age (None: by lock only)."""

    def __init__(self, root: Path, enabled: bool = True, max_age_s: float | None = None) -> None:
        self.root = Path(root)
        self.enabled = enabled
        self.max_age_s = max_age_s
        self.staging_root = self.root / STAGING_DIR
        try:
            _refuse_link(self.staging_root, "the cache's staging folder (its locks)")
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
        if _discard_unless_folder(checkpoints, "the checkpoints folder"):
            for name in sorted(os.listdir(checkpoints)):
                if (self.root / name / ENTRY_FILE).is_file():
                    self._remove_checkpoints(name)

    def checkpoint_dir(self, key: str) -> Path:
        """Where ``key``'s checkpoints go, outliving an interrupted run (``.checkpoints/``); the
        pass creates it if it checkpoints at all. Once ``key`` is cached it is removed, unless
        another job (on any host) is still working on ``key``: that job may be writing it.
        A symlink (or anything but a real folder) at ``.checkpoints`` or at ``key``'s folder is
        discarded with one warning (the pass starts fresh), never followed."""
        folder = self.root / CHECKPOINTS_DIR / key
        with contextlib.suppress(OSError):
            _discard_unless_folder(folder.parent, "the checkpoints folder")
            _discard_unless_folder(folder, f"the checkpoints of {key[:12]}")
        return folder

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
        folder = self.root / CHECKPOINTS_DIR / key
        if os.path.lexists(folder) and not self._working_on(key, own):
            _remove_entry(folder)

    def recorded_output(self, key: str, check: RecordCheck | None = None) -> str | None:
        """The output digest ``key``'s entry records, read without hashing its files (a
        prediction of :meth:`lookup`, which verifies them): None when there is no readable entry
        (or ``check`` finds a problem in its record, as :meth:`lookup` would)."""
        if not self.enabled or os.path.islink(self.root / key):
            return None
        record, problem = _checked_record(self.root / key / ENTRY_FILE)
        if record is None or problem is not None or (check is not None and check(record) is not None):
            return None
        digest = record.get("output_digest")
        return digest if isinstance(digest, str) else None

    def lookup(self, key: str, kind: Kind, check: RecordCheck | None = None) -> CacheEntry | None:
        """Return the verified entry for ``key``; an unreadable, malformed, unsafe or modified
        entry is evicted with one warning and ignored (the caller recomputes it). ``check(record)``
        says what is wrong with a well-formed ``entry.json`` for this request (the pass manager:
        :func:`key_problem`), or None; it runs before the output is hashed."""
        if not self.enabled:
            return None
        entry_dir = self.root / key
        try:
            mode = os.lstat(entry_dir).st_mode
            if stat.S_ISDIR(mode):
                os.lstat(entry_dir / ENTRY_FILE)  # absent: not cached (entries are renamed in whole)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return self._discard(key, None, f"cannot read it ({exc.strerror}: {exc.filename})")
        judged = _identity(entry_dir / ENTRY_FILE)  # which entry we judge, should another job replace it
        if not stat.S_ISDIR(mode):
            return self._discard(key, judged, f"{entry_dir} is {describe_mode(mode)}, not a folder")
        record, problem = _checked_record(entry_dir / ENTRY_FILE)
        if record is not None and problem is None and check is not None:
            problem = check(record)
        if record is None or problem is not None:
            return self._discard(key, judged, problem)
        artifact, problem = verified_output(entry_dir / OUTPUT_DIR, kind, record["output_digest"])
        if artifact is None:
            return self._discard(key, judged, problem)
        return CacheEntry(key, artifact, record)

    def amend(self, entry: CacheEntry, fields: dict[str, Any]) -> CacheEntry:
        """``entry`` with ``fields`` added to its ``entry.json`` (rewritten by atomic rename, its
        temporary file in a lock-owned staging folder), e.g. a check an older version did not
        make, so that it is made once. A cache we may not write to keeps the entry as it was."""
        record = {**entry.record, **fields}
        try:
            with owned_folder(self.staging_root / unique_name(f"{entry.key}.amend")) as folder:
                write_json(self.root / entry.key / ENTRY_FILE, record, staging=folder)
        except OSError as exc:
            log.info("cache entry %s: not amended (%s)", entry.key[:12], exc.strerror)
            return entry
        return CacheEntry(entry.key, entry.artifact, record)

    def _discard(self, key: str, judged: tuple[int, int] | None, problem: str | None) -> None:
        """Evict ``key``'s entry with one warning saying ``problem``."""
        shown = " ".join(str(problem).split())[:500]
        log.warning("cache entry %s: %s; discarding it and recomputing", key[:12], shown)
        self.evict(key, judged)

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
            # what to fix is the cache folder; the file's name and what was being written stay
            name = "" if exc.filename is None else f" ({Path(str(exc.filename)).name})"
            notes = getattr(exc, "__notes__", [])
            exc = OSError(exc.errno, exc.strerror, f"the cache folder {self.root}{name}")
            for note in notes:
                exc.add_note(note)
        return storage_error(exc, doing, "pipeline.cache_dir")

    def commit(self, key: str, staging: Path, kind: Kind, record: dict[str, Any]) -> CacheEntry:
        """Publish a staged output under ``key`` with one atomic rename. When a concurrent job
        (on any host) published ``key`` first, its entry is kept and ours dropped; a broken
        entry in the way is evicted."""
        final = self.root / key
        try:
            write_json(staging / ENTRY_FILE, record)
            theirs: Artifact | None = None
            for _ in range(3):
                try:
                    os.rename(staging, final)
                    break
                except OSError:
                    if not os.path.lexists(final):
                        raise
                judged = _identity(final / ENTRY_FILE)
                found, problem = (None, "") if os.path.islink(final) else _checked_record(final / ENTRY_FILE)
                if found is not None and problem is None and isinstance(record.get(KEY_FIELDS), dict):
                    problem = key_problem(found, key, record[KEY_FIELDS])  # another's entry moved here?
                if found is not None and problem is None:  # verified like a hit: it is used as one
                    theirs, _ = verified_output(final / OUTPUT_DIR, kind, found["output_digest"])
                if theirs is not None and found is not None:
                    shutil.rmtree(staging, ignore_errors=True)
                    record = found
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
        if theirs is not None:
            return CacheEntry(key, theirs, record)
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
    :class:`Cache` (``pipeline/bench.py``, ``evals/gate.py``). A symlink at the record's folder
    (or at the staging folder) is refused in one line (:class:`~pipeline.core.files.UnsafeFileError`):
    nothing is written through a link."""
    _refuse_link(Path(root) / STAGING_DIR, "the cache's staging folder (its locks)")
    _refuse_link(Path(path).parent, "a folder of cached records")
    write_json_staged(
        path, record, Path(root) / STAGING_DIR, f"cannot write the record {path.name}", "pipeline.cache_dir"
    )


def load_record(path: Path, check: RecordCheck | None = None) -> dict[str, Any] | None:
    """:meth:`Cache.read_record` for code that holds a record's path rather than a :class:`Cache`.
    ``check(record)`` says what is wrong with a well-formed JSON object (a field of the wrong type
    or out of range), or None: a record it faults is discarded like a malformed one. The record
    is read as a regular file only (never through a symlink, never a FIFO or device) and bounded;
    one in a symlinked folder is ignored (with a warning), never read or removed through it."""
    path = Path(path)
    if not os.path.lexists(path):
        return None
    if os.path.islink(path.parent):
        log.warning(
            "cached record %s: its folder is a symlink; ignoring it (never read through a link)", path
        )
        return None
    record, problem = read_record(path)
    if record is not None and check is not None and (problem := check(record)) is not None:
        record = None
    if record is None:
        shown = " ".join(str(problem).split())[:500]
        log.warning("cached record %s: %s; discarding it and recomputing", path, shown)
        with contextlib.suppress(OSError):
            _remove_entry(path)
    return record


def read_record(path: Path, max_bytes: int = RECORD_MAX_BYTES) -> tuple[dict[str, Any] | None, str | None]:
    """(the JSON object in ``path``, None) or (None, what is wrong with it). Only a regular file is
    read (a symlink, FIFO or device is a problem, never opened through), at most ``max_bytes``."""
    try:
        record = loads_bounded(
            read_regular_text(path, max_bytes=max_bytes, follow_symlinks=False, what="a JSON record")
        )
    except FileNotFoundError:
        return None, "it is missing"
    except UnsafeFileError as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"cannot read it ({exc.strerror})"
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        return None, f"it is not valid JSON ({exc})"
    if not isinstance(record, dict):
        return None, f"it holds a JSON {type(record).__name__}, not an object"
    return record, None


def _checked_record(entry_file: Path) -> tuple[dict[str, Any] | None, str | None]:
    """An entry's record and what is wrong with it (unreadable, malformed), None when nothing."""
    record, problem = read_record(entry_file, ENTRY_MAX_BYTES)
    if record is not None:
        problem = _entry_problem(record)
    if problem is not None:
        return None, f"{ENTRY_FILE}: {problem}" if not problem.startswith(ENTRY_FILE) else problem
    return record, None


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _entry_problem(record: dict[str, Any]) -> str | None:
    """What makes an ``entry.json`` object unusable (a field the pass manager reads missing or of
    the wrong type), or None."""
    digest = record.get("output_digest")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        return f"{ENTRY_FILE} has no output_digest (64 hex digits)"
    if not isinstance(record.get("config"), dict) or not isinstance(record.get("input_digest"), str):
        return f"{ENTRY_FILE} lacks its config or input_digest"
    if not isinstance(record.get("metrics", {}), dict):
        return f"{ENTRY_FILE} has malformed metrics"
    if "pass" in record and not isinstance(record["pass"], str):
        return f"{ENTRY_FILE} has a pass name that is not a string"
    if "version" in record and (
        not isinstance(record["version"], int) or isinstance(record["version"], bool)
    ):
        return f"{ENTRY_FILE} has a version that is not an integer"
    seconds = record.get("seconds", 0.0)
    if not _is_number(seconds) or seconds < 0:
        return f"{ENTRY_FILE} has seconds={seconds!r}, not a non-negative number"
    placement = record.get("placement", {})
    if not isinstance(placement, dict) or not all(isinstance(v, str) for v in placement.values()):
        return f"{ENTRY_FILE} has a malformed placement"
    resources = record.get("resources", {})
    if not isinstance(resources, dict) or not all(v is None or _is_number(v) for v in resources.values()):
        return f"{ENTRY_FILE} has malformed resources"
    return None


def verified_output(output: Path, kind: Kind, expected: str) -> tuple[Artifact | None, str | None]:
    """(the artifact of a cache entry's ``output`` folder, None) when it is safe to use, or (None,
    what is wrong): a symlink or anything but a regular file or a real folder in it (refused by
    ``lstat`` before anything is opened, so a FIFO or a link to ``/dev/zero`` cannot hang the
    hash), a digest other than ``expected``, an unreadable ``artifact.json``, or a graph that
    names a file outside its folder (see :func:`graph_problem`)."""
    try:
        mode = os.lstat(output).st_mode
    except FileNotFoundError:
        return None, "its output folder is missing"
    except OSError as exc:
        return None, f"cannot read its output ({exc.strerror}: {exc.filename})"
    if not stat.S_ISDIR(mode):
        return None, f"{output} is {describe_mode(mode)}, not a folder"
    try:
        files = file_digests(output, follow_symlinks=False)
    except UnsafeFileError as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"cannot read its output ({exc.strerror}: {exc.filename})"
    digest = digest_of(files)
    if digest != expected:
        return None, "it was modified on disk"
    try:
        artifact = Artifact.from_dir(kind, output, digest)
    except (PipelineError, OSError, ValueError, AttributeError) as exc:
        return None, f"its {ARTIFACT_FILE} cannot be used ({exc})"
    problem = graph_problem(output, set(files), artifact.metadata)
    return (None, problem) if problem is not None else (artifact, None)


def _inside(folder: str, name: object) -> str | None:
    """``name`` (a path relative to ``folder``, both POSIX and relative to an output folder)
    normalised, or None when it is not a plain relative path staying inside ``folder``."""
    if not isinstance(name, str) or not name or "\0" in name or name.startswith("/") or "\\" in name:
        return None
    joined = posixpath.normpath(posixpath.join(folder, name))
    inside = joined if folder in ("", ".") else posixpath.relpath(joined, folder)
    if inside == "." or inside == ".." or inside.startswith("../") or posixpath.isabs(joined):
        return None
    return joined


def graph_problem(output: Path, files: set[str], metadata: dict[str, Any]) -> str | None:
    """What makes the ONNX graphs of ``output`` unsafe to load, or None: ``artifact.json``'s
    ``model_file``, and every external-data location of every ``.onnx`` (subfolders included),
    must name one of ``files`` (its regular files, POSIX relative paths) inside that graph's own
    folder (no ``../``, no absolute path), and every tensor's offset and length must lie within
    that file."""
    if "model_file" in metadata and _inside("", metadata["model_file"]) not in files:
        return f"{ARTIFACT_FILE}'s model_file {metadata['model_file']!r} is not a file of the entry"
    graphs = sorted(rel for rel in files if rel.endswith(".onnx"))
    if not graphs:
        return None
    from pipeline.core.graph_io import external_refs

    for folder in sorted({posixpath.dirname(rel) for rel in graphs}):
        try:
            refs = external_refs(output / folder)
        except Exception as exc:  # a crafted or damaged protobuf raises anything
            return f"a graph in {output / folder} cannot be read ({type(exc).__name__}: {exc})"
        for location, spans in sorted(refs.items(), key=lambda item: str(item[0])):
            rel = _inside(folder, location)
            if rel is None or rel not in files:
                return (
                    f"a graph in {output / folder} names external data {location!r}, which is not a "
                    "file inside its folder"
                )
            size = regular_size(output / rel, follow_symlinks=False, what="external data")
            for offset, length in spans:
                if offset < 0 or length < -1 or offset + max(length, 0) > size:
                    return (
                        f"a graph in {output / folder} reads bytes {offset}..{offset + length} of "
                        f"{rel}, which has {size}"
                    )
    return None


def _refuse_link(path: Path, what: str) -> None:
    """Refuse (one line) a symlink, or anything but a folder, at ``path``; a missing one is fine."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise UnsafeFileError(
            f"{path} is {describe_mode(mode)}, where {what} must be a real folder: remove it "
            "(nothing is written or read through a link)"
        )


def _discard_unless_folder(path: Path, what: str) -> bool:
    """Whether ``path`` is a real folder; anything else there (a symlink, a file) is removed with
    one warning, never followed."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(mode):
        return True
    log.warning("%s %s is %s, not a folder; removing it (never followed)", what, path, describe_mode(mode))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return False


def _remove_entry(path: Path) -> None:
    """Remove ``path``: a real folder with its content, anything else (a symlink: not its target)
    by unlinking it."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _under(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root.resolve())
    except OSError:
        return False


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_ino, info.st_mtime_ns
