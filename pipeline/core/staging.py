"""Staging folders on storage that jobs on several hosts share, and the safe removal of the ones
their owners abandoned.

A staging folder ``<parent>/<name>`` is owned through an exclusive lock on ``<parent>/<name>.lock``
(``flock``, which NFSv4 and Lustre carry across hosts), taken *before* the folder is made and held
until the folder has been renamed into place or removed. Anyone may remove a staging folder whose
lock it can take at once: the owner is provably gone (a crash or SIGKILL releases the lock with the
process), whichever host or PID namespace it ran in. A local PID check cannot say that: a PID from
another host or container means nothing here. For file systems whose locks do not reach every
host, ``max_age_s`` (``pipeline.staging_max_age_h``) adds a condition: a folder whose lock is free
is removed only once nothing was written in it for longer than that. Age is never a reason on its
own: a folder whose lock is held is never removed, however old.

A lock file is only ever unlinked by a process holding its lock, and whoever takes a lock checks
that the file it locked is still the one at that path (else it locks the new one), so a lock file
removed and recreated between ``open`` and ``flock`` never makes two owners. Lock files are opened
with ``O_NOFOLLOW`` and ``O_NONBLOCK`` and must be regular files: a symlink, FIFO, socket, device or
folder planted at a lock path is refused in one line naming it
(:class:`~pipeline.core.files.UnsafeFileError`), never followed or created through.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.core.errors import OS_ERROR_FIXES, StorageError, one_line
from pipeline.core.files import UnsafeFileError, describe_mode

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"
_RETRIES = 50  # taking a fresh lock: a remover may hold it for a moment while it checks it
# Lock files this process holds: on NFS, flock is emulated with POSIX locks, which do not
# conflict within one process, so a removal must not rely on the lock to spare our own folders.
# (A set's add and discard are atomic: no lock, which a finalizer could deadlock on.)
_held: set[str] = set()
_key_holders: dict[str, int] = {}  # key_lock files this process holds -> the holding thread
_key_guard = threading.Lock()


def unique_name(prefix: str) -> str:
    """``<prefix>.<pid>.<random>``: unique across processes and hosts (the pid is only a hint)."""
    return f"{prefix}.{os.getpid()}.{uuid.uuid4().hex[:12]}"


def lock_path(folder: Path) -> Path:
    return folder.with_name(folder.name + LOCK_SUFFIX)


def _try_lock(path: Path, create: bool = True) -> int | None:
    """An open descriptor holding the exclusive lock of ``path`` (created if missing, unless
    ``create`` is false: then a missing file raises FileNotFoundError), or None when another
    process (or another descriptor of this one) holds it."""
    if str(path) in _held:
        return None
    for _ in range(_RETRIES):
        fd = _open_lock(path, create)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                return None
            raise
        try:
            current = os.lstat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            return fd
        os.close(fd)  # unlinked by its holder meanwhile: lock the file now at that path
    return None


def _bad_lock(path: Path, mode: int) -> UnsafeFileError:
    return UnsafeFileError(
        f"{path} is {describe_mode(mode)}, where a staging lock must be a regular file (planted or "
        "left by something else): remove it; locks are never followed or created through a link"
    )


def check_lock_path(path: Path) -> None:
    """Refuse (:class:`~pipeline.core.files.UnsafeFileError`, one line naming ``path``) anything at
    a lock path that is not a regular file: a symlink (dangling or not), FIFO, socket, device or
    folder. A missing path is fine (the lock is created)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise _bad_lock(path, mode)


def _open_lock(path: Path, create: bool) -> int:
    """Open the lock file ``path`` (created when missing and ``create``): ``O_NOFOLLOW`` (a
    symlink there is refused, not followed: a planted one would otherwise create a file at its
    target), ``O_NONBLOCK`` (a FIFO there never blocks the open), and a regular file only."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        raise
    except OSError:
        check_lock_path(path)  # a symlink (ELOOP), a folder (EISDIR), a socket (ENXIO): named
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _bad_lock(path, mode)
    return fd


def _unlock(fd: int, path: Path, unlink: bool) -> None:
    """Release a lock taken by :func:`_try_lock`, unlinking its file first when asked (only the
    holder ever unlinks it)."""
    try:
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(path)
    finally:
        os.close(fd)  # closing the last descriptor releases the flock


@contextlib.contextmanager
def key_lock(path: Path, what: str, poll_s: float = 0.5, report_every_s: float = 60.0) -> Iterator[float]:
    """Hold the exclusive lock of ``path`` for the block, waiting while another job (on any host
    that shares the storage) holds it: one job computes a shared output while the others of a
    sweep wait, then find it cached. Yields the seconds spent waiting. A holder that crashes
    releases the lock with its process, so a waiter never waits on a dead job; Ctrl-C while
    waiting stops the wait. The lock file is removed by its holder on release."""
    if _key_holders.get(str(path)) == threading.get_ident():
        raise RuntimeError(f"{path} is already held by this thread: a nested key_lock would wait forever")
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    reported = 0.0
    fd = _take_key_lock(path)
    while fd is None:
        waited = time.monotonic() - started
        if waited >= reported:
            log.info("waiting for another job computing %s (lock %s, %.0f s so far)", what, path.name, waited)
            reported = waited + report_every_s
        time.sleep(poll_s)
        fd = _take_key_lock(path)
    try:
        yield time.monotonic() - started
    finally:
        with _key_guard:
            _key_holders.pop(str(path), None)
            _held.discard(str(path))
            _unlock(fd, path, unlink=True)


def _take_key_lock(path: Path) -> int | None:
    """:func:`_try_lock` for :func:`key_lock`, registered as this thread's; another thread of
    this process is then refused too (on NFS, flock does not conflict within one process)."""
    with _key_guard:
        fd = _try_lock(path)
        if fd is not None:
            _held.add(str(path))
            _key_holders[str(path)] = threading.get_ident()
        return fd


def owned_folder(folder: Path) -> OwnedFolder:
    """``with owned_folder(path) as folder:`` create ``folder`` (which must not exist, named by
    :func:`unique_name`) owned by this process; remove it on any exit unless it was renamed away.
    Its lock is held for the whole block and removed afterwards."""
    return OwnedFolder(folder)


class OwnedFolder:
    """The context manager of :func:`owned_folder`. Interrupt-safe as far as Python allows:
    whatever instruction Ctrl-C or SIGTERM lands on while the lock is taken or the folder made,
    ``__enter__`` removes what it made; a removal another interrupt cuts short is finished before
    that interrupt goes on; and should an interrupt land before ``__exit__`` could start, the
    object's finalizer removes the folder when the unwinding drops it. The unique name makes all
    of that safe without the lock: nobody else uses that name."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.lock = lock_path(self.folder)
        self._fd: int | None = None
        self._open = False

    def __enter__(self) -> Path:
        self._open = True
        try:
            self.folder.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(_RETRIES):  # a fresh name: at most a remover checking it holds it
                self._fd = _try_lock(self.lock)
                if self._fd is not None:
                    break
                time.sleep(0.01)
            if self._fd is None:
                raise FileExistsError(errno.EEXIST, "staging lock held by another process", str(self.lock))
            _held.add(str(self.lock))
            self.folder.mkdir()
        except BaseException:
            self.release()
            raise
        return self.folder

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Remove the folder (unless renamed away) and its lock; idempotent. An interrupt in the
        middle is caught, the removal finished, then the interrupt raised."""
        try:
            self._release()
        except KeyboardInterrupt:
            try:
                self._release()
            except KeyboardInterrupt:
                self._release()
                raise
            raise

    def _release(self) -> None:
        if not self._open:
            return
        if self.folder.exists():
            try:
                shutil.rmtree(self.folder, ignore_errors=True)
            except OSError:  # rmtree interrupted in its finally closes a descriptor twice (EBADF)
                shutil.rmtree(self.folder, ignore_errors=True)
        _held.discard(str(self.lock))
        with contextlib.suppress(OSError):
            os.unlink(self.lock)  # ours by its unique name, whether or not we got to lock it
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        self._open = False

    def __del__(self) -> None:
        if getattr(self, "_open", False):
            with contextlib.suppress(Exception):
                self._release()


def newest_mtime(path: Path) -> float:
    """The latest modification time of ``path`` and everything under it (0 when it is gone)."""
    try:
        newest = path.lstat().st_mtime
    except FileNotFoundError:
        return 0.0
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                with contextlib.suppress(FileNotFoundError):
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


def is_owned(folder: Path) -> bool:
    """Whether a live process (here or on another host) holds ``folder``'s staging lock."""
    path = lock_path(folder)
    if str(path) in _held:
        return True
    try:
        fd = _try_lock(path, create=False)
    except FileNotFoundError:
        return False
    except (OSError, UnsafeFileError):  # cannot open the lock (read-only storage, not a regular
        return True  # file): assume it is alive, and keep what it may own
    if fd is None:
        return True
    _unlock(fd, path, unlink=not folder.exists())  # a lock whose folder is gone is stray
    return False


def remove_abandoned(
    parent: Path, prefix: str = "", max_age_s: float | None = None, pattern: re.Pattern[str] | None = None
) -> list[Path]:
    """Remove the staging folders (and files) under ``parent`` whose names start with ``prefix``
    (and match all of ``pattern``, when given: in folders shared with other files) and whose
    owner is gone: their lock is free. ``max_age_s`` is an extra condition, never a reason on its
    own: with it, a folder whose lock is free is removed only once nothing was written in it for
    longer than that (where locks do not reach every host, a free lock is not proof); a folder
    whose lock is held is never removed, however old. Returns what was removed. Lock files whose
    folder is gone are removed too. Storage this process cannot write (a read-only cache) is left
    as it is, and so is anything at a lock path that is not a regular file (a planted symlink:
    one warning naming it; it is never followed)."""
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix) or name.endswith(LOCK_SUFFIX):
            continue
        if pattern is not None and not pattern.fullmatch(name):
            continue
        path = parent / name
        lock = lock_path(path)
        if str(lock) in _held:
            continue  # ours
        try:
            fd = _try_lock(lock)
        except UnsafeFileError as exc:
            log.warning("keeping %s: %s", path, exc)
            continue
        except OSError as exc:
            log.debug("cannot check %s: %s", path, exc)
            continue
        if fd is None:
            continue  # its owner is alive, on this host or another: whatever its age
        young = max_age_s is not None and time.time() - newest_mtime(path) <= max_age_s
        try:
            if not young and (path.exists() or path.is_symlink()):
                _remove(path)
                removed.append(path)
        finally:
            _unlock(fd, lock, unlink=not young)
    for stray in parent.glob(f"{prefix}*{LOCK_SUFFIX}"):  # a lock whose folder is gone
        folder = stray.with_name(stray.name[: -len(LOCK_SUFFIX)])
        if pattern is not None and not pattern.fullmatch(folder.name):
            continue
        if str(stray) in _held or folder.exists() or folder.is_symlink():
            continue
        try:
            fd = _try_lock(stray)
        except UnsafeFileError as exc:
            log.warning("%s", exc)
            continue
        except OSError:
            continue
        if fd is None:
            continue
        # Its owner makes the folder only once it holds the lock, which we now hold.
        _unlock(fd, stray, unlink=not folder.exists())
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def storage_error(exc: OSError, doing: str, setting: str = "") -> StorageError | None:
    """A one-line :class:`StorageError` for ``exc`` raised while ``doing`` (e.g. "writing the
    cache entry of pass 'export'"), naming the file and the fix (``setting``: the config knob
    that moves the folder, like ``pipeline.cache_dir``); None for other OS errors."""
    fix = OS_ERROR_FIXES.get(exc.errno or 0)
    if fix is None:
        return None
    where = f"{exc.filename}: " if exc.filename is not None else ""  # a write() names no file
    if setting:
        fix = f"{fix} ({setting}=...)"
    context = "".join(f" ({one_line(note)})" for note in getattr(exc, "__notes__", []) if str(note).strip())
    return StorageError(f"{doing}: {where}{exc.strerror or exc}{context}: {fix}")


def write_json_staged(path: Path, data: Any, staging: Path, doing: str, setting: str) -> None:
    """Write JSON at ``path`` by atomic rename, its temporary file in a lock-owned folder made
    under ``staging`` (so what a SIGKILL leaves is removed by the next run); an OS error the user
    fixes (disk full, read-only, permission) becomes one :class:`StorageError` line saying
    ``doing`` and naming ``setting``, the knob that moves the folder."""
    from pipeline.core.artifacts import write_json

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with owned_folder(staging / unique_name(f".{path.name}")) as folder:
            write_json(path, data, staging=folder)
    except OSError as exc:
        error = storage_error(exc, doing, setting)
        if error is None:
            raise
        raise error from None
