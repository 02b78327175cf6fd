"""Helpers of the tests that feed the pipeline untrusted input (issue 37): a deadline that fails a
call that would hang, a small tmpfs that fills, and the JSON values and paths that property-based
tests damage."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hypothesis import strategies as st


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (not hang) when the body takes longer than ``seconds`` (SIGALRM: the main thread)."""

    def expired(*_: Any) -> None:
        raise TimeoutError(f"hung for over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def json_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and list indices) to a node below the JSON value ``value``."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += json_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for number, item in enumerate(value):
            found += json_paths(item, (*prefix, number))
    return found


@contextmanager
def tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``64k``) mounted at the new folder ``mount``: a real ENOSPC once it
    fills (needs root and mount; the test is skipped elsewhere)."""
    import pytest

    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)


# Any JSON value (NaN and infinities included, which Python's json writes): what a damaged field holds.
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    _containers,
    max_leaves=6,
)
