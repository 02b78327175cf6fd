"""Small real passes for exercising the manager and cache (they write real folders)."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.artifacts import Artifact, Kind, write_metadata
from pipeline.core.base import Pass
from pipeline.core.errors import PassError


@dataclass
class AppendConfig:
    _target_: str = "tests.pipeline.passes_for_tests.AppendPass"
    text: str = "x"


class AppendPass(Pass):
    """torch -> torch: copies ``data.txt`` and appends ``config.text``."""

    Config = AppendConfig
    name = "append"
    consumes = Kind.TORCH
    produces = Kind.TORCH

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        previous = (source.path / "data.txt").read_text() if (source.path / "data.txt").exists() else ""
        (out_dir / "data.txt").write_text(previous + self.config.text)
        if os.environ.get("TEST_KILL_IN_PASS") == self.config.text:
            (out_dir / "half-written.bin").write_bytes(b"\0" * 1024)
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get("TEST_RAISE_IN_PASS") == self.config.text:
            raise RuntimeError("simulated crash")
        write_metadata(out_dir, Kind.TORCH, {"text": self.config.text})
        return {"length": len(previous) + len(self.config.text)}

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        if "!" in (result.path / "data.txt").read_text():
            raise PassError("append: output contains '!'")
        return {"checked": True}


@dataclass
class ToGraphConfig:
    _target_: str = "tests.pipeline.passes_for_tests.ToGraphPass"


class ToGraphPass(Pass):
    Config = ToGraphConfig
    name = "to-graph"
    consumes = Kind.TORCH
    produces = Kind.GRAPH

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        (out_dir / "graph.txt").write_text((source.path / "data.txt").read_text())
        return {}


@dataclass
class ToEngineConfig:
    _target_: str = "tests.pipeline.passes_for_tests.ToEnginePass"


class ToEnginePass(Pass):
    Config = ToEngineConfig
    name = "to-engine"
    consumes = Kind.GRAPH
    produces = Kind.ENGINE

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        (out_dir / "engine.txt").write_text((source.path / "graph.txt").read_text())
        return {}


def recipe(*texts: str) -> list[Pass]:
    """Torch passes appending ``texts``, then to a graph and to an engine."""
    return [*(AppendPass(text=t) for t in texts), ToGraphPass(), ToEnginePass()]


def make_source(tmp_path: Path) -> Artifact:
    """A torch-kind source folder for the test passes: one ``data.txt``."""
    folder = tmp_path / "source"
    folder.mkdir()
    (folder / "data.txt").write_text("s")
    return Artifact.from_dir(Kind.TORCH, folder)
