"""Live progress for work done in a few long steps (a spinner, step count and elapsed time that
keeps ticking while a single library call runs, e.g. an ONNX export)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)


@contextlib.contextmanager
def phases(title: str, total: int) -> Iterator[Callable[[str], None]]:
    """Yield ``start(name)``: call it as each of ``total`` phases begins."""
    columns = (
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[phase]}"),
    )
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task(title, total=total, phase="")
        started = 0

        def start(name: str) -> None:
            nonlocal started
            if started:
                progress.advance(task)
            started += 1
            progress.update(task, phase=name)

        yield start
        progress.update(task, completed=total, phase="done")
