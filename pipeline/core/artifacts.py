"""The three kinds of artifact that flow between passes, and their content digests.

Every artifact is a folder on disk with an ``artifact.json`` naming its kind and carrying
metadata (model shape, IO names) that later passes read instead of re-deriving it.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.errors import PipelineError
from pipeline.core.files import (
    UnsafeFileError,
    describe_mode,
    loads_bounded,
    open_regular,
    read_regular_text,
    sha256_regular,
    walk_regular,
)

ARTIFACT_FILE = "artifact.json"


class Kind(enum.StrEnum):
    TORCH = "torch"  # HF checkpoint folder (safetensors + config + tokenizer)
    GRAPH = "graph"  # ONNX model (+ external data) + tokenizer
    ENGINE = "engine"  # a runnable engine folder for one target

    @property
    def label(self) -> str:
        return {"torch": "a torch model", "graph": "an ONNX graph", "engine": "an engine"}[self.value]


def sha256_file(path: Path, follow_symlinks: bool = True) -> str:
    """sha256 of a regular file (a FIFO, device or socket is refused: ``pipeline/core/files.py``)."""
    return sha256_regular(path, follow_symlinks=follow_symlinks)


def file_digests(folder: Path, follow_symlinks: bool = True) -> dict[str, str]:
    """sha256 of every file under ``folder``, keyed by POSIX relative path; anything that is not a
    regular file or a folder (with ``follow_symlinks=False``: any symlink) is refused in one line
    (:class:`~pipeline.core.files.UnsafeFileError`) before it is opened."""
    return {
        rel: sha256_file(path, follow_symlinks)
        for rel, path in walk_regular(folder, follow_symlinks=follow_symlinks)
    }


def folder_digest(folder: Path, follow_symlinks: bool = True) -> str:
    """Content digest of a folder: names and contents of all files, independent of mtimes."""
    return digest_of(file_digests(folder, follow_symlinks))


def digest_of(file_hashes: dict[str, str]) -> str:
    """The :func:`folder_digest` of a folder whose files (POSIX relative path -> sha256) are known."""
    digest = hashlib.sha256()
    for rel, file_hash in sorted(file_hashes.items()):
        digest.update(f"{rel}\0{file_hash}\n".encode())
    return digest.hexdigest()


def write_json(path: Path, data: Any, staging: Path | None = None) -> None:
    """Write JSON via a temporary file and an atomic rename; the temporary file is removed on any
    failure or interrupt (a full disk, Ctrl-C, SIGTERM). It lies beside ``path`` (named
    ``.<name>.<pid>.<random>.tmp``: unique across hosts sharing the folder), or in ``staging``,
    a lock-owned folder on the same file system (``pipeline.core.staging.owned_folder``), whose
    remains after a SIGKILL the next run removes. The temporary file is created with ``O_EXCL``
    and ``O_NOFOLLOW``: nothing planted at its name is followed or written through."""
    text = json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"
    folder = staging if staging is not None else path.parent
    tmp = folder / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with os.fdopen(os.open(tmp, flags, 0o666), "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_metadata(folder: Path, kind: Kind, metadata: dict[str, Any]) -> None:
    write_json(folder / ARTIFACT_FILE, {"kind": kind.value, "metadata": metadata})


def link_tree(source: Path, target: Path, skip: tuple[str, ...] = ()) -> None:
    """Hard-link (copy across filesystems) every file of ``source`` into the existing folder
    ``target``, except the top-level names in ``skip``. Artifacts are never written in place, so
    sharing their files between cache entries is safe. Only regular files and real folders are
    taken: a symlink, FIFO, device or socket in ``source`` is refused in one line
    (:class:`~pipeline.core.files.UnsafeFileError`) before anything is opened; a link is never
    followed, a copy reads exactly the size the file had when opened."""
    for item in sorted(source.iterdir()):
        if item.name in skip:
            continue
        mode = os.lstat(item).st_mode
        if stat.S_ISDIR(mode):
            target.joinpath(item.name).mkdir()
            link_tree(item, target / item.name)
            continue
        if not stat.S_ISREG(mode):
            raise UnsafeFileError(
                f"{item} is {describe_mode(mode)}, where an artifact holds only regular files and "
                "folders: remove it (links are never followed)"
            )
        try:
            os.link(item, target / item.name, follow_symlinks=False)
        except OSError:
            _copy_regular(item, target / item.name)


def _copy_regular(source: Path, target: Path) -> None:
    """Copy the regular file ``source`` (never through a symlink, never a FIFO or device) to the
    new file ``target``, with its mode and times."""
    with open_regular(source, follow_symlinks=False, what="an artifact file copied") as reader:
        info = os.fstat(reader.fileno())
        if os.path.lexists(target) and not os.path.isdir(target):
            os.unlink(target)  # replaced, never written into: it may be a link to a cached file
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(target, flags, 0o644), "wb") as writer:
            left = info.st_size
            while left > 0 and (chunk := reader.read(min(1 << 20, left))):
                writer.write(chunk)
                left -= len(chunk)
    os.chmod(target, stat.S_IMODE(info.st_mode))
    os.utime(target, ns=(info.st_atime_ns, info.st_mtime_ns))


def read_metadata(folder: Path) -> dict[str, Any]:
    """The ``metadata`` object of ``folder``'s ``artifact.json`` ({} without one); a record that is
    not JSON, not an object or whose metadata is not an object is refused in one line."""
    path = folder / ARTIFACT_FILE
    if not path.is_file():
        return {}
    text = read_regular_text(path, what="an artifact record")
    try:
        record = loads_bounded(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise PipelineError(f"{path} is not valid JSON ({exc}): it is not an artifact record") from None
    metadata = record.get("metadata", {}) if isinstance(record, dict) else None
    if not isinstance(metadata, dict):
        raise PipelineError(f"{path} holds no metadata object: it is not an artifact record")
    return metadata


@dataclass(frozen=True)
class Artifact:
    """A pass input or output: its kind, where it lives, and the digest of its content."""

    kind: Kind
    path: Path
    digest: str
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_dir(cls, kind: Kind, path: Path, digest: str | None = None) -> Artifact:
        path = Path(path)
        return cls(kind, path, digest or folder_digest(path), read_metadata(path))
