"""Helpers of the tests that feed the pipeline untrusted input (issue 37): a deadline that fails a
call that would hang, and the paths into a JSON value that property-based tests damage."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


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
