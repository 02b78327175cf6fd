"""The three kinds of artifact that flow between passes, and their content digests.

Every artifact is a folder on disk with an ``artifact.json`` naming its kind and carrying
metadata (model shape, IO names) that later passes read instead of re-deriving it.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.files import read_regular_text, sha256_regular, walk_regular

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
    remains after a SIGKILL the next run removes."""
    text = json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"
    folder = staging if staging is not None else path.parent
    tmp = folder / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_metadata(folder: Path, kind: Kind, metadata: dict[str, Any]) -> None:
    write_json(folder / ARTIFACT_FILE, {"kind": kind.value, "metadata": metadata})


def link_tree(source: Path, target: Path, skip: tuple[str, ...] = ()) -> None:
    """Hard-link (copy across filesystems) every file of ``source`` into the existing folder
    ``target``, except the top-level names in ``skip``. Artifacts are never written in place, so
    sharing their files between cache entries is safe."""
    for item in source.iterdir():
        if item.name in skip:
            continue
        if item.is_dir():
            target.joinpath(item.name).mkdir()
            link_tree(item, target / item.name)
            continue
        try:
            os.link(item, target / item.name)
        except OSError:
            shutil.copy2(item, target / item.name)


def read_metadata(folder: Path) -> dict[str, Any]:
    path = folder / ARTIFACT_FILE
    if not path.is_file():
        return {}
    return json.loads(read_regular_text(path, what="an artifact record")).get("metadata", {})


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
