"""``python -m benchmarks.prefill_chunks`` on the tiny engine: every length x chunk is measured, the
one-step row is the reference of its ratios, and a folder without an engine is a usage error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """The benchmark as its users run it: ``python -m benchmarks.prefill_chunks`` from the repository root."""
    command = [sys.executable, "-m", "benchmarks.prefill_chunks", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_table_measures_every_chunk_against_one_step(tiny_engine: Any, tmp_path: Path) -> None:
    out = tmp_path / "prefill.json"
    engine = str(tiny_engine.path)
    result = run(
        "--engine", engine, "--tokens", "40", "--chunks", "0", "16", "--repeats", "1", "--json", str(out)
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tokens"], r["chunk"]) for r in rows] == [(40, 0), (40, 16)]
    assert rows[0]["vs_one_step"] == 1.0 and rows[1]["vs_one_step"] > 0 and rows[1]["seconds"] > 0
    assert "speed-up vs one step" in result.stdout and "load average" in result.stdout


def test_a_folder_without_an_engine_is_one_usage_line(tmp_path: Path) -> None:
    result = run("--engine", str(tmp_path))
    assert result.returncode == 2 and "no engine.json there" in result.stderr
    assert "Traceback" not in result.stderr
