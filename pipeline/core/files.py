"""Reading files nobody vouches for: model folders, cache entries, engine folders, registry blobs
and records all lie on storage other jobs and other people write to.

Every read here opens a *regular* file only, and never blocks on what it opens:

- ``O_NONBLOCK`` on open, so a FIFO (which would wait for a writer forever) opens at once, and
  ``fstat`` on the open descriptor then refuses it, like a device (``/dev/zero`` would feed a hash
  forever), a socket or a directory;
- ``O_NOFOLLOW`` where a symlink is not allowed (our own cache entries and staging files); where it
  is (a model folder in the Hugging Face hub cache is a folder of symlinks into its blobs), the
  link is resolved and, with ``within``, confined to a folder before anything is opened;
- the size comes from ``fstat`` before anything is read, and no read goes past it (a file that
  grows while it is hashed cannot make the read unbounded; ``max_bytes`` bounds it further).

A refusal is :class:`UnsafeFileError`, a one-line :class:`PipelineError` naming the path, what it
is and the fix; callers that own the folder (the cache) catch it and evict instead.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from pipeline.core.errors import PipelineError

_CHUNK = 1 << 20
# The deepest JSON nesting (arrays and objects) read from storage: every file this pipeline reads
# (config.json, tokenizer.json, manifests, engine.json, entry.json, records) nests a few levels;
# Python's parser recurses once per level and overflows its stack (RecursionError) near 1000.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class UnsafeFileError(PipelineError):
    """A path that should be a regular file (inside a given folder) is not."""


def describe_mode(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words ("a FIFO", "a character device", ...)."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "not a regular file"


def confined(path: Path, within: Path) -> Path:
    """``path`` with every symlink resolved, refused unless it lies inside ``within`` (resolved)."""
    resolved = Path(os.path.realpath(path))
    root = Path(os.path.realpath(within))
    if resolved != root and root not in resolved.parents:
        shown = f" (a symlink to {resolved})" if Path(path).is_symlink() else ""
        raise UnsafeFileError(
            f"{path}{shown} lies outside {within}: every file it names must be inside that folder"
        )
    return resolved


def link_root(folder: Path) -> Path:
    """The folder every symlink of the checkpoint ``folder`` must resolve into: the folder itself
    (resolved), or, for a Hugging Face hub snapshot (``.../models--org--name/snapshots/<rev>``),
    its repo folder ``models--org--name``, which holds the ``blobs`` its links point to."""
    real = Path(os.path.realpath(folder))
    for above in real.parents:
        if above.name == "snapshots" and above.parent.name.startswith("models--"):
            return above.parent
    return real


def copy_regular(source: Path, target: Path, *, within: Path, what: str) -> None:
    """Copy the regular file ``source`` to the new file ``target``, reading what ``source``
    resolves to at the moment it is opened: a symlink must resolve inside ``within`` (a model
    folder's :func:`link_root`), the resolved file is opened without following a link again
    (``O_NOFOLLOW``) and checked with ``fstat``, and ``target`` is created or replaced, never
    written through a link (``O_NOFOLLOW``). A link swapped to a host file after the folder was
    checked is refused in one line instead of copied into an engine that gets published."""
    resolved = confined(source, within)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(resolved, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # swapped for a link since it was resolved
            raise UnsafeFileError(
                f"{source} changed while it was copied ({what}): check the folder"
            ) from None
        raise
    with os.fdopen(fd, "rb") as src:
        mode = os.fstat(src.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(source, mode, what)
        os.set_blocking(src.fileno(), True)
        out = os.open(
            target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644
        )
        with os.fdopen(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)


def _refuse(path: Path, mode: int, what: str) -> UnsafeFileError:
    return UnsafeFileError(
        f"{path} is {describe_mode(mode)}, not a regular file ({what}): replace it with the file itself"
    )


def open_regular(
    path: Path, *, follow_symlinks: bool = True, within: Path | None = None, what: str = "a file read"
) -> BinaryIO:
    """Open ``path`` for binary reading if (after resolving a symlink, where allowed, and confining
    it to ``within``) it is a regular file; never blocks on a FIFO or device. The caller closes it.
    ``what`` says in the error what the file was read for."""
    path = Path(path)
    target = confined(path, within) if within is not None else path
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(target, flags)
    except OSError as exc:
        if not follow_symlinks and os.path.islink(target):
            raise UnsafeFileError(
                f"{path} is a symlink, where only regular files are allowed ({what}): "
                "replace it with the file itself"
            ) from None
        raise exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode, what)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def regular_size(
    path: Path, *, follow_symlinks: bool = True, within: Path | None = None, what: str = "a file read"
) -> int:
    """The size of ``path`` in bytes, refused unless it is a regular file (as :func:`open_regular`);
    nothing is opened, so nothing can block."""
    path = Path(path)
    target = confined(path, within) if within is not None else path
    info = os.stat(target) if follow_symlinks else os.lstat(target)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeFileError(
            f"{path} is a symlink, where only regular files are allowed ({what}): "
            "replace it with the file itself"
        )
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(path, info.st_mode, what)
    return info.st_size


def read_regular(
    path: Path,
    *,
    max_bytes: int | None = None,
    follow_symlinks: bool = True,
    within: Path | None = None,
    what: str = "a file read",
) -> bytes:
    """The bytes of a regular file, refused (one line) when larger than ``max_bytes``."""
    with open_regular(path, follow_symlinks=follow_symlinks, within=within, what=what) as handle:
        size = os.fstat(handle.fileno()).st_size
        if max_bytes is not None and size > max_bytes:
            raise UnsafeFileError(
                f"{path} is {size} bytes, more than the {max_bytes} bytes allowed for {what}: "
                "it is not such a file"
            )
        return handle.read(size)


def read_regular_text(
    path: Path,
    *,
    max_bytes: int | None = 64 << 20,
    follow_symlinks: bool = True,
    within: Path | None = None,
    what: str = "a file read",
) -> str:
    """:func:`read_regular` decoded as UTF-8 (a JSON record, a config), bounded by default to 64 MiB."""
    data = read_regular(path, max_bytes=max_bytes, follow_symlinks=follow_symlinks, within=within, what=what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnsafeFileError(
            f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}): it is not {what}"
        ) from None


def sha256_regular(
    path: Path, *, follow_symlinks: bool = True, within: Path | None = None, what: str = "a file hashed"
) -> str:
    """sha256 of a regular file's content, reading exactly the size ``fstat`` gave at open."""
    digest = hashlib.sha256()
    with open_regular(path, follow_symlinks=follow_symlinks, within=within, what=what) as handle:
        left = os.fstat(handle.fileno()).st_size
        while left > 0 and (chunk := handle.read(min(_CHUNK, left))):
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def walk_regular(
    folder: Path, *, follow_symlinks: bool = True, what: str = "a folder hashed"
) -> Iterator[tuple[str, Path]]:
    """(POSIX relative path, path) of every file under ``folder``, sorted, refusing (one line) any
    entry that is not a regular file or a folder: a FIFO, a device, a socket, a symlink to one of
    those, a symlinked folder, or (``follow_symlinks=False``) any symlink at all. Entries are
    checked with ``lstat``/``stat`` only, so the walk itself opens nothing and cannot block."""
    folder = Path(folder)
    for root, dirs, files in os.walk(folder, followlinks=False):
        dirs.sort()
        for name in list(dirs):
            path = Path(root) / name
            if path.is_symlink():
                raise UnsafeFileError(
                    f"{path} is a symlinked folder ({what}): only regular files and real folders are allowed"
                )
        for name in sorted(files):
            path = Path(root) / name
            regular_size(path, follow_symlinks=follow_symlinks, what=what)
            yield path.relative_to(folder).as_posix(), path


class JsonTooDeepError(json.JSONDecodeError, PipelineError):
    """JSON nested deeper than allowed. A :class:`json.JSONDecodeError` (so a ``ValueError``): a
    caller that turns invalid JSON into its own one-line error does so for this one too; and a
    :class:`PipelineError` (bad input, exit code 2) where none does."""


def json_too_deep(text: str, max_depth: int = MAX_JSON_DEPTH) -> int | None:
    """The offset of the first ``[`` or ``{`` of ``text`` nested deeper than ``max_depth``, or None.
    A scan without recursion: brackets inside JSON strings (escapes included) do not count. Up to
    the first syntax error it reads ``text`` as :func:`json.loads` does, so whatever the parser
    would reach nested deeper than ``max_depth`` is found (an unterminated string counts its
    brackets: such text is no JSON anyway)."""
    if text.count("[") + text.count("{") <= max_depth:  # the common case: nothing to scan
        return None
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    if max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0) <= max_depth:
        return None
    depth = 0  # too deep: find where, for the message (stops at that bracket)
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > max_depth:
                return match.start()
        elif token in "]}":
            depth -= 1
    return None  # unreachable: the scans agree


def loads_bounded(text: str | bytes | bytearray, max_depth: int = MAX_JSON_DEPTH, **kwargs: Any) -> Any:
    """:func:`json.loads` of untrusted text (``kwargs`` passed on), refusing JSON nested deeper than
    ``max_depth`` with :class:`JsonTooDeepError` before parsing, so that no crafted file can
    overflow the parser's stack (a ``RecursionError`` traceback). Bytes are decoded as
    :func:`json.loads` decodes them (a ``UnicodeDecodeError`` as there)."""
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode(json.detect_encoding(text), "surrogatepass")
    where = json_too_deep(text, max_depth)
    if where is not None:
        raise JsonTooDeepError(f"nested deeper than {max_depth} levels", text, where)
    return json.loads(text, **kwargs)


def read_json(
    path: Path,
    *,
    what: str,
    max_bytes: int | None = 64 << 20,
    max_depth: int = MAX_JSON_DEPTH,
    follow_symlinks: bool = True,
    within: Path | None = None,
) -> Any:
    """The JSON value of a regular file, read bounded (:func:`read_regular_text`) and parsed bounded
    (:func:`loads_bounded`). Anything wrong (not a regular file, too large, not UTF-8, not JSON,
    nested too deeply) is one :class:`UnsafeFileError` line naming ``path`` and ``what`` it was
    read as; a missing or unreadable file is the ``OSError`` itself."""
    text = read_regular_text(
        path, max_bytes=max_bytes, follow_symlinks=follow_symlinks, within=within, what=what
    )
    try:
        return loads_bounded(text, max_depth)
    except json.JSONDecodeError as exc:
        raise UnsafeFileError(f"{path} is not valid JSON ({exc}): it is not {what}") from None


def _what_is(path: Path, mode: int) -> str:
    """``describe_mode``, with a symlink's target ("a symlink (to /dev/full)")."""
    if stat.S_ISLNK(mode):
        try:
            return f"a symlink (to {os.readlink(path)})"
        except OSError:
            return "a symlink"
    return describe_mode(mode)


def check_output_file(path: Path, what: str) -> Path:
    """Refuse (one :class:`UnsafeFileError` line naming ``path``, what it is, ``what`` it was
    named for, and the fix) an output file a user names unless it is absent, in an existing
    folder, or a regular file: a symlink (to anything: it is never replaced, nor its target
    written), a FIFO, a device (``/dev/full``), a socket or a folder is never replaced by the
    atomic rename that writes the file. Nothing is opened (``lstat`` only), so nothing blocks.
    A caller checks before its work (a mistake costs nothing) and again just before writing."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except NotADirectoryError:
        raise UnsafeFileError(
            f"{path}: a part of its folder is not a folder ({what}): name another path"
        ) from None
    if mode is None:
        folder = path.parent
        try:
            folder_mode = os.stat(folder).st_mode
        except (FileNotFoundError, NotADirectoryError):
            raise UnsafeFileError(
                f"{path}: its folder {folder} does not exist ({what}): make it or name another path"
            ) from None
        if not stat.S_ISDIR(folder_mode):
            raise UnsafeFileError(
                f"{path}: {folder} is {describe_mode(folder_mode)}, not a folder ({what}): name another path"
            )
        return path
    if stat.S_ISREG(mode):
        return path
    raise UnsafeFileError(
        f"{path} is {_what_is(path, mode)}, not a regular file ({what}): it is never replaced; "
        "remove it or name another path"
    )


def check_output_folder(path: Path, what: str) -> Path:
    """As :func:`check_output_file` for an output folder a user names: absent (its parents may be
    missing: the caller makes them) or a real folder (the caller decides whether it may hold
    anything) is accepted; a symlink (even to a folder: it is never replaced or written through),
    a regular file, a FIFO, a device or a socket is refused in one line."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    except NotADirectoryError:
        raise UnsafeFileError(
            f"{path}: a part of its path is not a folder ({what}): name another path"
        ) from None
    if stat.S_ISDIR(mode):
        return path
    raise UnsafeFileError(
        f"{path} is {_what_is(path, mode)}, not a folder ({what}): it is never replaced; "
        "remove it or name another path"
    )
