"""Errors a user can cause. The entry point prints them as one line and exits with code 2
(OS errors: one line and code 1)."""

from __future__ import annotations

import errno


class PipelineError(Exception):
    """A user-facing error: the message names the bad input and the fix."""

    exit_code = 2  # a user mistake


class StorageError(PipelineError):
    """The operating system refused a write (disk full, read-only folder, permission denied): the
    message names the path and what was being written; exit code 1, not the user's input."""

    exit_code = 1


class ConfigError(PipelineError):
    """The recipe is inconsistent (bad pass order, unknown pass target, ...)."""


class SourceError(PipelineError):
    """The model source is missing, corrupt, unverifiable or unsupported."""


class PassError(PipelineError):
    """A pass's precondition (`requires`) or postcondition (`ensures`) failed."""


class EngineError(PipelineError):
    """An engine folder cannot be loaded or run."""


class CalibrationError(PipelineError):
    """Calibration data or collected statistics are unusable (too little text, NaN/inf, ...)."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (library messages can span many lines)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def one_line(text: str) -> str:
    """A message as one line: its non-blank lines joined with "; " (for ``error:`` lines and
    the ``job_status.json`` of a multirun job)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    joined = lines[0] if lines else ""
    for line in lines[1:]:
        joined += (" " if joined.endswith((".", ":", ";", ",", "?", "!")) else "; ") + line
    return joined


# errno -> the fix, for the OS errors a user fixes (not a bug in the pipeline).
OS_ERROR_FIXES = {
    errno.ENOSPC: "disk full: free space there or write elsewhere",
    errno.EDQUOT: "quota exceeded: free space there or write elsewhere",
    errno.EROFS: "the file system is read-only: choose a writable folder",
    errno.EACCES: "choose a folder you may write to, or make it writable for this user",
    errno.EPERM: "choose a folder you may write to, or make it writable for this user",
    errno.EFBIG: "the file size limit (ulimit -f) is too low",
}


# OS errors that are the input's fault, not the machine's: a name a user gave past the file
# system's limits (a long model.path or override key), or a path through a symlink loop.
BAD_INPUT_ERRNOS = {
    errno.ENAMETOOLONG: "a file name is at most 255 bytes and a path 4096: shorten it",
    errno.ELOOP: "the path runs through a symlink loop: remove or fix the link",
}
MAX_SHOWN_PATH = 160  # characters of a path shown in an error line


def shown_path(path: object) -> str:
    """``path`` for an error line: a long one cut in the middle, with its length."""
    text = str(path)
    if len(text) <= MAX_SHOWN_PATH:
        return text
    half = MAX_SHOWN_PATH // 2
    return f"{text[:half]}...{text[-half // 2 :]} ({len(text):,} characters)"


def os_error_exit_code(exc: OSError) -> int:
    """2 for an OS error the input caused (:data:`BAD_INPUT_ERRNOS`), else 1 (the machine's)."""
    return PipelineError.exit_code if exc.errno in BAD_INPUT_ERRNOS else StorageError.exit_code


def describe_os_error(exc: OSError) -> str:
    """``cannot write <path>: <reason>`` for an OS error (disk full, read-only or missing folder,
    permission denied), with what was being done when the raiser added a note (``add_note``)."""
    reason = exc.strerror or type(exc).__name__
    if exc.errno in OS_ERROR_FIXES:
        reason = f"{reason} ({OS_ERROR_FIXES[exc.errno]})"
    if exc.errno in BAD_INPUT_ERRNOS:  # a name we were given, not a write that failed
        reason = f"{reason} ({BAD_INPUT_ERRNOS[exc.errno]})"
        target = "bad path" if exc.filename is None else f"bad path {shown_path(exc.filename)}"
    else:
        target = "cannot write" if exc.filename is None else f"cannot write {shown_path(exc.filename)}"
    if exc.filename2 is not None:
        target += f" (to {shown_path(exc.filename2)})"
    context = "; ".join(one_line(note) for note in getattr(exc, "__notes__", []) if str(note).strip())
    return one_line(f"{target}: {reason}" + (f" ({context})" if context else ""))


def print_error(exc: PipelineError | OSError, suffix: str = "") -> int:
    """Print ``exc`` as one ``error:`` line on stderr (an OS error as :func:`describe_os_error`
    says it, ``suffix`` after it) and return the exit code a command line ends with: a
    :class:`PipelineError`'s own (2: the input; 1: storage), 2 for an OS error the input caused
    (:data:`BAD_INPUT_ERRNOS`), else 1. The one way every ``python -m`` entry point reports."""
    import sys

    if isinstance(exc, OSError):
        print(one_line(f"error: {describe_os_error(exc)}{suffix}"), file=sys.stderr)
        return os_error_exit_code(exc)
    print(one_line(f"error: {exc}{suffix}"), file=sys.stderr)
    return exc.exit_code
