"""Staging folders on storage that jobs on several hosts share, and the safe removal of the ones
their owners abandoned.

A staging folder ``<parent>/<name>`` is owned through an exclusive lock on ``<parent>/<name>.lock``
(``filelock``: ``flock``, which NFSv4 and Lustre carry across hosts), taken *before* the folder
is made and held until the folder has been renamed into place or removed. Anyone may remove a
staging folder whose lock it can take at once: the owner is provably gone (a crash or SIGKILL
releases the lock with the process), whichever host or PID namespace it ran in. A local PID check
cannot say that: a PID from another host or container means nothing here. For file systems whose
locks do not reach every host, ``max_age_s`` also removes folders older than that age whatever
their lock says (``pipeline.staging_max_age_h``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"


def unique_name(prefix: str) -> str:
    """``<prefix>.<pid>.<random>``: unique across processes and hosts (the pid is only a hint)."""
    return f"{prefix}.{os.getpid()}.{uuid.uuid4().hex[:12]}"


def lock_path(folder: Path) -> Path:
    return folder.with_name(folder.name + LOCK_SUFFIX)


@contextlib.contextmanager
def owned_folder(folder: Path) -> Iterator[Path]:
    """Create ``folder`` (which must not exist) owned by this process; remove it on any exit,
    unless it was renamed away. Its lock is held for the whole block and removed afterwards."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path(folder)), thread_local=False)
    lock.acquire(timeout=0)  # a fresh unique name: nobody else holds it
    try:
        folder.mkdir()
        yield folder
    finally:
        try:
            if folder.exists():
                shutil.rmtree(folder, ignore_errors=True)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(lock_path(folder))
            lock.release()


def remove_abandoned(parent: Path, prefix: str = "", max_age_s: float | None = None) -> list[Path]:
    """Remove the staging folders (and files) under ``parent`` whose names start with ``prefix``
    and whose owner is gone (their lock is free) or that are older than ``max_age_s``. Returns
    what was removed. Lock files whose folder is gone are removed too."""
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    now = time.time()
    for path in sorted(parent.iterdir()):
        if not path.name.startswith(prefix) or path.name.endswith(LOCK_SUFFIX):
            continue
        try:
            age = now - path.lstat().st_mtime
        except FileNotFoundError:
            continue
        too_old = max_age_s is not None and age > max_age_s
        lock = FileLock(str(lock_path(path)), thread_local=False)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if not too_old:
                continue  # its owner is alive, on this host or another
            log.warning("removing %s: older than %.0f h, although a lock is still held", path, age / 3600)
            _remove(path)
            removed.append(path)
            continue
        try:
            _remove(path)
            removed.append(path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(lock_path(path))
            lock.release()
    for stray in parent.glob(f"{prefix}*{LOCK_SUFFIX}"):  # a lock whose folder is gone
        folder = stray.with_name(stray.name[: -len(LOCK_SUFFIX)])
        if folder.exists():
            continue
        lock = FileLock(str(stray), thread_local=False)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        try:
            with contextlib.suppress(OSError):
                os.unlink(stray)
        finally:
            lock.release()
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
