"""Giving freed memory back to the operating system (glibc), for passes whose peak must stay
bounded as they stream a model block by block or trace it without weights.

glibc raises its mmap threshold to the size of the largest buffer freed (up to 32 MiB), so after
the first block-sized buffer is freed, later ones come from the heap, whose freed pages stay
resident: the process' RSS then grows with depth although the live tensors do not. Measured:
SmoothQuant streamed on the default model peaked at 1.3 GiB without :func:`return_freed_memory`
and 0.6 GiB with it; the export of the 362M shape at 2.05 GiB without
:func:`large_allocations_unmapped` and 1.06 GiB with it. Off glibc (macOS, musl) both do nothing.
No library offers these (each is one libc call through ctypes).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from collections.abc import Iterator
from typing import Any

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
SMALL_MMAP_THRESHOLD = 1 << 20  # serve 1 MiB and more by mmap while inside large_allocations_unmapped
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # the ceiling of glibc's dynamic threshold on 64-bit


@functools.cache
def _glibc() -> Any:
    """The C library when it is glibc, else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def return_freed_memory() -> None:
    """Hand the heap memory freed so far back to the OS (``malloc_trim(0)``); call it after
    releasing a block."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def large_allocations_unmapped() -> Iterator[None]:
    """Meanwhile serve allocations of 1 MiB and more by ``mmap`` so each returns to the system
    when freed (short-lived weight-sized copies then never raise the heap's high-water mark).
    Afterwards the threshold is set to 32 MiB, where glibc's dynamic one settles in a torch
    process. Process-wide while inside: use it around one phase, not around a whole run."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, SMALL_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX)
