"""What the benchmarks share (``benchmarks.common``): each one runs as ``python -m benchmarks.<name>``
and answers ``--help``, a user mistake is one line and exit 2, the record comes back as JSON with
the load average beside it, and a child's output is logged."""

from __future__ import annotations

import argparse
import json
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import benchmarks
from benchmarks import common

REPO = Path(__file__).resolve().parents[2]
LIBRARIES = {"common", "llamacpp_peer"}  # modules the benchmarks import, without a command line
ENTRY_POINTS = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name not in LIBRARIES)


def test_every_benchmark_answers_help_as_a_module() -> None:
    """``python -m benchmarks.<name> --help`` from the repository root, as the README runs them: exit 0,
    a usage line naming that form, no traceback (every import of the module works)."""
    assert {"fusion", "quantization", "scaling", "gpu_check", "torch_vs_engine"} <= set(ENTRY_POINTS)
    for name in ENTRY_POINTS:
        command = [sys.executable, "-m", f"benchmarks.{name}", "--help"]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
        output = done.stdout + done.stderr
        assert done.returncode == 0 and "Traceback" not in output, f"{name}: {output[-2000:]}"
        assert done.stdout.startswith(f"usage: python -m benchmarks.{name} "), f"{name}: {done.stdout[:200]}"


def test_no_benchmark_edits_sys_path() -> None:
    """A package: the benchmarks import each other as ``benchmarks.<name>``, never by a path they add."""
    for script in sorted(REPO.joinpath("benchmarks").glob("*.py")):
        assert "sys.path" not in script.read_text(), script.name


def test_a_user_mistake_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(args: argparse.Namespace) -> dict[str, Any]:
        raise common.UsageError("--engine /x: no engine.json there")

    assert common.run_and_report(argparse.Namespace(json=None), refuse, print) == 2
    assert capsys.readouterr().err == "error: --engine /x: no engine.json there\n"
    parser = common.make_parser("benchmarks/fusion.py", "Doc of the\nbenchmark.\n\nMore.")
    assert parser.prog == "python -m benchmarks.fusion" and parser.description == "Doc of the benchmark."
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--nope"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and err.startswith("error: unrecognized")


def test_a_measurement_comes_back_as_json_with_the_load_around_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "record.json"
    shown: list[dict[str, Any]] = []
    code = common.measure_and_report(
        argparse.Namespace(json=out, size=3),
        lambda args: {"rows": [args.size], "where": tmp_path},
        shown.append,
    )
    record = json.loads(out.read_text())
    assert code == 0 and shown[0]["rows"] == [3] and record["where"] == str(tmp_path)  # a path as text
    assert len(record["load_before"]) == len(record["load_after"]) == 3
    assert f"wrote {out}" in capsys.readouterr().out
    assert common.format_load([1.04, 0.5, 0.25], [2.0, 1.0, 0.5]) == "1.0/0.5/0.2 -> 2.0/1.0/0.5"
    assert common.load_line([1.0, 0.5, 0.25]) == "load average (1/5/15 min) 1.0/0.5/0.2"


def test_a_child_is_logged_and_a_slow_one_is_none(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import sys; print('out'); print('error: bad input', file=sys.stderr)"]
    result = common.run_logged(command, tmp_path / "child.log")
    assert result is not None and result.returncode == 0
    log = (tmp_path / "child.log").read_text()
    assert log.startswith(f"$ {sys.executable} -c") and "out" in log and "error: bad input" in log
    assert common.error_line(result.stderr + "Traceback: the last line\n") == "error: bad input"
    assert common.last_line("a\n\nb\n  \n") == "b"
    slow = [sys.executable, "-c", "import time; time.sleep(5)"]
    assert common.run_logged(slow, tmp_path / "slow.log", timeout_s=0.2) is None
    assert common.pipeline_command("pipeline.gate", "--eval", "quick")[1:] == [
        "-m",
        "pipeline.gate",
        "--eval",
        "quick",
    ]


def test_the_peak_rss_children_read_their_engine_from_the_callers_line() -> None:
    from benchmarks import fusion, llamacpp_peer

    for script in (fusion.PEAK_RSS_CHILD, llamacpp_peer.PEAK_RSS_CHILD):
        compile(script, "peak_rss_child", "exec")  # the child's text is valid Python
        assert script.index("engine = ") < script.index('status("VmRSS")')
        assert "sys.path" not in script  # the project root comes from isolated_script
    assert "from benchmarks.llamacpp_peer import LlamaCppEngine" in llamacpp_peer.PEAK_RSS_CHILD


def test_the_peak_rss_child_runs_isolated_and_can_import_the_benchmarks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -I -c`` with a clean environment, from a folder outside the project: the project root
    that ``isolated_script`` puts on its path is enough to import ``benchmarks.*``; PYTHONPATH is not
    passed on."""
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "planted"))
    script = (
        "import os, sys\n"
        "import benchmarks.llamacpp_peer\n"
        "assert 'PYTHONPATH' not in os.environ and sys.flags.isolated\n"
        "print(sys.argv[1], 7)\n"
    )
    assert common.child_rss(script, ["5"], tmp_path) == {"after_load": 5, "peak_decoding": 7}


def test_the_fusion_benchmarks_memory_child_measures_a_tiny_engine(tiny_engine: Any) -> None:
    """The fresh process ``python -m benchmarks.fusion`` measures each engine's memory in: it loads
    the engine, prefills and decodes, and reports RSS after loading and the peak while decoding."""
    from benchmarks import fusion

    memory = fusion.peak_rss(tiny_engine.path, 16, 1)
    assert set(memory) == {"after_load", "peak_decoding"} and min(memory.values()) > 0
