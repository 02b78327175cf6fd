"""SIGTERM handled like Ctrl-C, so that every ``finally`` that removes a staging folder runs.

Python turns SIGINT into :class:`KeyboardInterrupt` but lets SIGTERM (what ``kill``, Slurm's
time limit, Ray and container runtimes send) end the process at once, leaving staging folders
and temporary files behind. Entry points call :func:`interrupt_on_sigterm` once; the signal then
raises :class:`Terminated`, a ``KeyboardInterrupt``, in the main thread, and the entry point exits
with ``128 + signal`` after its cleanup. SIGKILL cannot be caught: what it leaves is removed by
the next run (``pipeline/core/staging.py``).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class Terminated(KeyboardInterrupt):
    """SIGTERM (or another terminating signal) arrived; ``exit_code`` is 128 + its number."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise_terminated(signum: int, _frame: FrameType | None) -> None:
    raise Terminated(signum)


def interrupt_on_sigterm() -> bool:
    """Make SIGTERM raise :class:`Terminated` in the main thread; False (nothing changed) when
    called from another thread, where Python cannot install signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _raise_terminated)
    return True


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """The exit code for an interrupt: 128 + the signal (130 for Ctrl-C, 143 for SIGTERM)."""
    return interrupt.exit_code if isinstance(interrupt, Terminated) else 130
