"""What every registry backend shares: checking a run folder before it is published, the
version record, and the checks on the way out (paths, sha256, TensorRT build)."""

from __future__ import annotations

import datetime as dt
import getpass
import hashlib
import json
import os
import platform
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from pipeline.core.artifacts import digest_of, sha256_file, write_json
from pipeline.core.engine import read_engine_spec
from pipeline.core.errors import PipelineError, first_line
from pipeline.core.files import UnsafeFileError, loads_bounded, open_regular, read_regular_text
from pipeline.core.staging import owned_folder, remove_abandoned, unique_name
from pipeline.registry.refs import Ref, RegistryError, RegistryIOError, check_channel, check_name

RECORD_SCHEMA = 1
MANIFEST_FILE = "manifest.json"  # the run record, in a run folder and in a pulled folder
ENGINE_DIR = "engine"
_CHUNK = 1 << 20
SHA256 = re.compile(r"[0-9a-f]{64}")


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


MAX_PATH_CHARS = 1024
MAX_NAME_BYTES = 255  # one path component (NAME_MAX)


def safe_relative(path: Any, where: str) -> PurePosixPath:
    """A file path from a manifest, refused if it could leave the folder it belongs to, or is
    not one a file system holds (a control character, an over-long name, ``.`` parts)."""
    if not isinstance(path, str):
        raise RegistryError(f"{where}: file path {_short(path)} is not a string; refusing it")
    rel = PurePosixPath(path)
    if not path or rel.is_absolute() or ".." in rel.parts or "\\" in path or "\0" in path or not rel.parts:
        raise RegistryError(f"{where}: file path {_short(path)} leaves the engine folder; refusing it")
    if (
        len(path) > MAX_PATH_CHARS
        or any(ord(c) < 0x20 or ord(c) == 0x7F for c in path)
        or any(len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES for part in rel.parts)
        or rel.as_posix() != path.rstrip("/")
        or path.endswith("/")
    ):
        raise RegistryError(
            f"{where}: file path {_short(path)} is not a plain relative file name (no control "
            "characters, '.' or empty parts, names of at most 255 bytes); refusing it"
        )
    return rel


def _short(value: Any) -> str:
    """``repr`` of a value from a record, cut to fit in one line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_sha256(value: Any, where: str) -> str:
    """A sha256 as the registry stores it: 64 lowercase hex characters (it names a blob file)."""
    if not isinstance(value, str) or not SHA256.fullmatch(value):
        raise RegistryError(f"{where}: sha256 {value!r} is not 64 lowercase hex characters; refusing it")
    return value


def check_bytes(value: Any, where: str) -> int:
    """A file size: a non-negative integer (``true`` is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RegistryError(f"{where}: bytes {value!r} is not a non-negative integer; refusing it")
    return value


def check_files(files: Any, where: str) -> list[dict[str, Any]]:
    """The engine file list of a manifest or record: a non-empty list of ``{path, sha256, bytes}``
    with safe, distinct paths. Returns the entries with just those three keys."""
    if not isinstance(files, list) or not files:
        raise RegistryError(f"{where} lists no engine files (engine.files must be a non-empty list)")
    checked: list[dict[str, Any]] = []
    seen: set[str] = set()
    folders: dict[str, str] = {}  # every parent folder of a listed file -> that file
    for entry in files:
        if not isinstance(entry, dict):
            raise RegistryError(f"{where}: engine file entry {_short(entry)} is not an object; refusing it")
        rel = safe_relative(entry.get("path"), where)
        name = f"{where}: {rel}"
        if rel.as_posix() in seen:
            raise RegistryError(f"{name} is listed twice; refusing it")
        seen.add(rel.as_posix())
        for parent in rel.parents:
            if parent.parts:
                folders.setdefault(parent.as_posix(), rel.as_posix())
        clash = next((p.as_posix() for p in rel.parents if p.as_posix() in seen), None)
        if rel.as_posix() in folders and folders[rel.as_posix()] != rel.as_posix():
            clash = folders[rel.as_posix()]
        if clash is not None:
            raise RegistryError(
                f"{name} collides with {clash}: one path is a file and a folder of the other; "
                "refusing the record"
            )
        checked.append(
            {
                "path": rel.as_posix(),
                "sha256": check_sha256(entry.get("sha256"), name),
                "bytes": check_bytes(entry.get("bytes"), name),
            }
        )
    return checked


def engine_folder(run_dir: Path, path: Any, where: str) -> Path:
    """The engine folder a manifest names (``engine.path``): a relative path that stays inside the
    run folder once symlinks are resolved."""
    path = ENGINE_DIR if path is None else path
    rel = PurePosixPath(path) if isinstance(path, str) else None
    inside = run_dir.resolve()
    if rel is None or not path or rel.is_absolute() or ".." in rel.parts or "\\" in path or not rel.parts:
        raise RegistryError(f"{where}: engine.path {path!r} is not a folder inside {run_dir}; refusing it")
    folder = run_dir / rel
    if not folder.resolve().is_relative_to(inside) or folder.resolve() == inside:
        raise RegistryError(f"{where}: engine.path {path!r} leads out of {run_dir}; refusing it")
    if not folder.is_dir():
        raise RegistryError(f"{folder} is missing: the run folder no longer holds the engine it recorded")
    return folder


def check_engine_layout(engine_dir: Path, files: list[dict[str, Any]], where: str) -> None:
    """Every listed file is a regular file inside ``engine_dir`` (a symlink leading out is
    refused) and the folder holds nothing the manifest does not list."""
    inside = engine_dir.resolve()
    for entry in files:
        path = engine_dir / entry["path"]
        if not path.exists():
            raise RegistryError(
                f"{path} is missing: the run folder no longer holds the engine file {where} lists"
            )
        real = path.resolve()
        if not real.is_relative_to(inside):
            raise RegistryError(f"{path} leads out of the engine folder (to {real}); refusing it")
        if not real.is_file():
            raise RegistryError(f"{path} is not a regular file; refusing it")
    listed = {entry["path"] for entry in files}
    present: list[str] = []
    for folder, dirs, names in os.walk(engine_dir):
        rel = Path(folder).relative_to(engine_dir)
        present += [(rel / d).as_posix() + "/" for d in dirs if (Path(folder) / d).is_symlink()]
        present += [(rel / n).as_posix() for n in names]
    extra = sorted(p for p in present if p not in listed)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise RegistryError(
            f"{engine_dir / extra[0]}{more} is not listed in {where}: the engine folder changed since "
            "the run; rebuild it rather than use it"
        )


def check_engine_folder(engine_dir: Path, files: list[dict[str, Any]], where: str) -> dict[str, str]:
    """:func:`check_engine_layout`, then every file hashed against the manifest. Returns the
    sha256 of each file by path (what :func:`pipeline.core.artifacts.folder_digest` is made of)."""
    check_engine_layout(engine_dir, files, where)
    digests: dict[str, str] = {}
    for entry in files:
        path = engine_dir / entry["path"]
        try:
            actual = sha256_file(path)
        except OSError as exc:
            raise RegistryError(f"{path} is unreadable ({exc.strerror or exc})") from None
        if actual != entry["sha256"]:
            raise RegistryError(
                f"{path} changed since the run recorded it (sha256 {actual[:12]}, {where} says "
                f"{entry['sha256'][:12]}); rebuild it rather than use it"
            )
        digests[entry["path"]] = actual
    return digests


def check_engine_spec(engine_dir: Path, what: str) -> None:
    """The engine folder's ``engine.json`` read and checked (``pipeline.core.engine``: typed
    fields, every file it names confined to the folder) and its ONNX graphs opened (protobuf
    parsed, external data present and long enough): a folder that cannot load is neither
    published nor pulled. One :class:`RegistryError` line naming what is wrong."""
    try:
        read_engine_spec(engine_dir)
    except PipelineError as exc:
        raise RegistryError(f"{what}: {exc}") from None


def copy_hashed(
    source: Path, target: Path, *, follow_symlinks: bool = True, within: Path | None = None
) -> str:
    """Copy ``source`` to ``target`` and return the sha256 of what was copied. ``source`` must be
    a regular file (``pipeline/core/files.py``: a FIFO or device is refused, never read, and no
    more than its size at open is copied); ``target`` is created new (``x``: never through a
    file or link already there)."""
    digest = hashlib.sha256()
    with (
        open_regular(
            source, follow_symlinks=follow_symlinks, within=within, what="an engine file copied"
        ) as reader,
        open(target, "xb") as writer,
    ):
        left = os.fstat(reader.fileno()).st_size
        while left > 0 and (chunk := reader.read(min(_CHUNK, left))):
            digest.update(chunk)
            writer.write(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def stage_file(source: Path, target: Path, entry: dict[str, Any], within: Path | None = None) -> None:
    """Copy an engine file to be published to ``target``, hashing it on the way: refused unless
    the bytes are the ones the run recorded (sha256 and size)."""
    try:
        actual = copy_hashed(source, target, within=within)
    except UnsafeFileError as exc:
        raise RegistryError(f"{exc}; refusing it") from None
    except FileNotFoundError:
        raise RegistryError(
            f"{source} is missing: the run folder no longer holds the engine it recorded"
        ) from None
    except OSError as exc:
        if exc.filename is not None and Path(exc.filename) == source:
            raise RegistryError(f"{source} is unreadable ({exc.strerror or exc})") from None
        raise RegistryIOError(f"cannot stage {source} into {target}: {exc.strerror or exc}") from None
    if actual != entry["sha256"]:
        raise RegistryError(
            f"{source} changed since the run recorded it (sha256 {actual[:12]}, manifest says "
            f"{entry['sha256'][:12]}); rebuild it rather than publish it"
        )
    size = target.stat().st_size
    if size != entry["bytes"]:
        raise RegistryError(f"{source} holds {size} bytes, its manifest says {entry['bytes']}; refusing it")


def load_json(path: Path, what: str, follow_symlinks: bool = True) -> Any:
    """A JSON file (a regular file only, at most 64 MiB), or a one-line :class:`RegistryError`
    naming it."""
    try:
        return loads_bounded(read_regular_text(path, follow_symlinks=follow_symlinks, what=what))
    except UnsafeFileError as exc:
        raise RegistryError(str(exc)) from None
    except RecursionError:
        raise RegistryError(f"{path} is not valid JSON ({what}: nested too deeply)") from None
    except FileNotFoundError:
        raise RegistryError(f"{path} is missing ({what})") from None
    except OSError as exc:
        raise RegistryIOError(f"cannot read {path} ({what}): {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RegistryError(f"{path} is not valid JSON ({what}: {first_line(exc)})") from None


def _typed(record: dict[str, Any], key: str, types: type | tuple[type, ...], where: str) -> Any:
    if key not in record:
        raise RegistryError(f"{where}: {key} is missing")
    value = record[key]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise RegistryError(f"{where}: {key} {value!r} has the wrong type")
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def check_record(record: Any, where: str, with_manifest: bool = True) -> dict[str, Any]:
    """A stored version record, checked before anything reads it: the names, version, gate,
    engine files (paths, sha256, bytes) and, ``with_manifest``, the run manifest inside."""
    if not isinstance(record, dict):
        raise RegistryError(f"{where}: a version record must be a JSON object, not {type(record).__name__}")
    for key in ("model", "recipe", "target"):
        _typed(record, key, str, where)
        check_name(key, record[key])
    version = _typed(record, "version", int, where)
    if version < 1:
        raise RegistryError(f"{where}: version {version} is not a version number")
    _typed(record, "published_at", str, where)
    _typed(record, "forced", (str, type(None)), where)
    gate = _typed(record, "gate", dict, where)
    if not isinstance(gate.get("verdict"), str):
        raise RegistryError(f"{where}: gate.verdict {gate.get('verdict')!r} is not a string")
    engine = _typed(record, "engine", dict, where)
    check_files(engine.get("files"), where)
    if not isinstance(engine.get("digest"), (str, type(None))):
        raise RegistryError(f"{where}: engine.digest {engine.get('digest')!r} is not a string")
    if not isinstance(engine.get("tensorrt"), (dict, type(None))):
        raise RegistryError(f"{where}: engine.tensorrt {engine.get('tensorrt')!r} is not an object")
    if with_manifest:
        _typed(record, "manifest", dict, where)
    return record


def check_channel_file(data: Any, where: str) -> dict[str, Any]:
    """A stored channel: the version it points at and its history of moves."""
    if not isinstance(data, dict):
        raise RegistryError(f"{where}: a channel must be a JSON object, not {type(data).__name__}")
    version = _typed(data, "version", int, where)
    if version < 1:
        raise RegistryError(f"{where}: version {version} is not a version number")
    check_history(_typed(data, "history", list, where), where)
    return data


def check_history(history: Any, where: str) -> list[dict[str, Any]]:
    """A channel's history: moves ``{version, at, reason}``, oldest first."""
    if not isinstance(history, list):
        raise RegistryError(f"{where}: the channel history must be a list")
    for move in history:
        if not isinstance(move, dict):
            raise RegistryError(f"{where}: history entry {move!r} is not an object")
        _typed(move, "version", int, f"{where}: history")
        _typed(move, "at", str, f"{where}: history")
    return history


REUSED = "reused"  # in what publish returns (never stored): the line saying no version was made


def engine_digest(files: list[dict[str, Any]]) -> str:
    """What identifies an engine: the digest of its folder (``folder_digest``, what a run records
    as ``engine.digest``), computed from its file list (path and sha256 of every file), so a run's
    manifest and a stored record compare alike whatever their ``engine.digest`` field says."""
    return digest_of({entry["path"]: entry["sha256"] for entry in files})


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

    @property
    def digest(self) -> str:
        """The engine's digest (:func:`engine_digest` of the files the run recorded)."""
        return engine_digest(self.files)

    def holder(self, records: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
        """The earliest of ``records`` (versions of any entry) that is of this model/recipe/target
        and holds this very engine (the same files, byte for byte), else None. A backend asks it
        where it allocates the next version (under its lock): publishing an engine the registry
        already holds makes no new version."""
        digest = self.digest
        same = [
            record
            for record in records
            if (record["model"], record["recipe"], record["target"]) == self.ref.key
            and engine_digest(record["engine"]["files"]) == digest
        ]
        return min(same, key=lambda record: record["version"], default=None)

    def reused(self, record: dict[str, Any], moved: bool) -> dict[str, Any]:
        """What a publish returns when ``record`` (the :meth:`holder`) already holds the engine: that
        version's record with ``reused``, the line saying so (``moved``: the channel asked for was
        moved to it; it pointed there already otherwise)."""
        version = record["version"]
        name = f"{record['model']}/{record['recipe']}/{record['target']}@{version}"
        if self.channel is None:
            outcome = "nothing published"
        elif moved:
            outcome = f"channel {self.channel} moved to @{version}"
        else:
            outcome = f"channel {self.channel} already points at @{version}"
        line = f"{name} already holds this engine (sha256 {self.digest[:12]}); {outcome}"
        return {**record, REUSED: line}

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


def load_manifest(run_dir: Path) -> dict[str, Any]:
    """``run_dir/manifest.json``, read for ``python -m pipeline.registry publish``."""
    path = run_dir / MANIFEST_FILE
    if not path.is_file():
        raise RegistryError(f"{run_dir} holds no {MANIFEST_FILE}: publish a folder a pipeline run wrote")
    manifest = load_json(path, "the run record")
    if not isinstance(manifest, dict):
        raise RegistryError(f"{path} is not a run record (a JSON object): publish a run folder")
    return manifest


def prepare_publication(
    run_dir: Path | str,
    model: str,
    recipe: str,
    channel: str | None,
    force: str | None,
    manifest: dict[str, Any] | None = None,
) -> Publication:
    """Check a run folder before anything is stored: a manifest (the one given, the run's own
    record, else ``run_dir/manifest.json``), a PASS (or a forced reason), an engine target, files
    whose paths, sha256 and sizes are well-formed, and an engine folder inside the run folder
    holding exactly the files listed (their bytes are hashed as they are stored)."""
    run_dir = Path(run_dir)
    where = str(run_dir / MANIFEST_FILE)
    if manifest is None:
        manifest = load_manifest(run_dir)
    elif not isinstance(manifest, dict):
        raise RegistryError(f"{where}: the run record is not an object; refusing it")
    else:
        where = f"the run record of {run_dir}"
    gate = manifest.get("gate") or {}
    if not isinstance(gate, dict):
        raise RegistryError(f"{where}: gate {gate!r} is not an object; refusing it")
    verdict = gate.get("verdict", "not-run")
    if force is not None and not str(force).strip():
        raise RegistryError("--force needs a reason (it is recorded with the version)")
    if verdict != "PASS" and force is None:
        raise RegistryError(
            f"{run_dir}: the gate verdict is {verdict} ({gate.get('reason', 'no reason recorded')}); "
            "only a PASS is published (force it with a reason: --force '<why>')"
        )
    engine = manifest.get("engine") or {}
    if not isinstance(engine, dict):
        raise RegistryError(f"{where}: engine {engine!r} is not an object; refusing it")
    if not engine.get("target"):
        raise RegistryError(f"{where} names no engine target")
    ref = Ref(model, recipe, check_name("engine.target", engine["target"]))
    if channel is not None:
        check_channel(channel)
    files = check_files(engine.get("files"), where)
    if not isinstance(engine.get("digest"), (str, type(None))):
        raise RegistryError(f"{where}: engine.digest {engine.get('digest')!r} is not a string")
    if not isinstance(engine.get("tensorrt"), (dict, type(None))):
        raise RegistryError(f"{where}: engine.tensorrt {engine.get('tensorrt')!r} is not an object")
    engine_dir = engine_folder(run_dir, engine.get("path"), where)
    check_engine_layout(engine_dir, files, where)
    check_engine_spec(engine_dir, f"{run_dir}: cannot publish")
    forced = None if verdict == "PASS" else str(force)
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
    """A staging folder beside ``to`` (owned through a lock, ``pipeline/core/staging.py``) for a
    backend to fill with ``engine/``; on success the pulled ``manifest.json`` is added and it
    becomes ``to`` in one rename, else it is removed (on an error, Ctrl-C or SIGTERM; what a
    SIGKILL leaves is removed by the next pull into the same folder)."""
    to = Path(to)
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise RegistryError(f"{to} exists and is not empty: pull into a new folder")
    prefix = f".{to.name}.pull"
    filling = False  # an OSError while the backend fills it is the backend's to describe
    try:
        to.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned(to.parent, prefix + ".")
        with owned_folder(to.parent / unique_name(prefix)) as staging:
            filling = True
            yield staging
            filling = False
            write_json(staging / MANIFEST_FILE, pulled_manifest(record))
            if to.is_dir():
                to.rmdir()
            os.rename(staging, to)
    except OSError as exc:
        if filling:
            raise
        raise RegistryIOError(f"cannot write the pulled folder {to}: {describe(exc)}") from None


def describe(exc: OSError) -> str:
    """``<path>: <reason>`` of an OS error, for a one-line message."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    return f"{exc.filename}: {reason}" if exc.filename else reason


def pulled_manifest(record: dict[str, Any]) -> dict[str, Any]:
    """The run manifest written into a pulled folder, saying where it came from."""
    manifest = dict(record["manifest"])
    engine = manifest.get("engine")
    manifest["engine"] = {**(engine if isinstance(engine, dict) else {}), "path": ENGINE_DIR}
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
        manifest: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The new version's record; or, when a version of model/recipe/target holds this engine
        already (:meth:`Publication.holder`), that version's record with ``REUSED`` (the line to
        print; the channel asked for is moved to it)."""
        ...

    def resolve(self, ref: Ref) -> dict[str, Any]: ...

    def index(self) -> dict[str, Any]: ...

    def pull(
        self, ref: Ref, to: Path | str, *, tensorrt_version: str | None = None, gpu_arch: str | None = None
    ) -> Path: ...

    def promote(self, ref: Ref, channel: str, reason: str | None = None) -> dict[str, Any]: ...

    def channel_history(self, ref: Ref, channel: str) -> list[dict[str, Any]]: ...

    def verify(self) -> list[str]: ...

    def gc(self) -> dict[str, int]: ...
