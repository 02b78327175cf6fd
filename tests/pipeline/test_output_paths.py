"""An output path a user names is never replaced unless it is a regular file (issue 50, item 3).

``--json`` of ``pipeline.bench`` and ``pipeline.gate``, ``--out`` of ``pipeline.report`` and
``--to`` of ``pipeline.registry pull`` are written by an atomic rename, which would replace a
symlink (silently: its target untouched, the link gone), a FIFO or a device (``/dev/full``) by a
regular file. Each is refused in one ``error:`` line (exit 2, no traceback) naming the path and
what it is, before the work and again just before the write; a victim file behind a link keeps
its content, the link stays a link, a FIFO stays a FIFO and nothing blocks on it (the CLIs run
with a timeout). A ``hydra.run.dir`` that holds a run record is refused before Hydra writes there.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.core.files import UnsafeFileError, check_output_file, check_output_folder
from tests.pipeline.registry.conftest import make_run
from tests.pipeline.test_gate_cli import make_engine_run

REPO = Path(__file__).resolve().parents[2]
VICTIM = "precious: must never be overwritten\n"
TIMEOUT_S = 120  # a CLI blocked on a FIFO fails the test (TimeoutExpired), never hangs it


@pytest.fixture(autouse=True)
def _keep_sigterm() -> Iterator[None]:
    """The CLIs' ``main`` makes SIGTERM raise in this process; put pytest's handler back afterwards."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


def victim_link(tmp_path: Path, name: str = "out.json") -> tuple[Path, Path]:
    """(a symlink named ``name``, the victim file it points to)."""
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)
    link = tmp_path / name
    link.symlink_to(victim)
    return link, victim


def assert_link_kept(link: Path, victim: Path) -> None:
    assert link.is_symlink() and os.readlink(link) == str(victim)
    assert victim.read_text() == VICTIM


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def one_error_line(err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def cli(module: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


# --------------------------------------------------------------------------------------------
# The helpers, in-process


def test_an_absent_path_in_a_folder_and_a_regular_file_are_accepted(tmp_path: Path) -> None:
    assert check_output_file(tmp_path / "new.json", "a test") == tmp_path / "new.json"
    (tmp_path / "old.json").write_text("{}")
    assert check_output_file(tmp_path / "old.json", "a test") == tmp_path / "old.json"
    assert (tmp_path / "old.json").read_text() == "{}"  # checked, not touched


def _socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p, v: p.symlink_to(v), "is a symlink (to "),
        (lambda p, v: p.symlink_to(v.parent / "nothing"), "is a symlink (to "),  # dangling
        (lambda p, v: p.symlink_to("/dev/full"), "is a symlink (to /dev/full)"),
        (lambda p, v: p.symlink_to(v.parent), "is a symlink (to "),  # to a folder
        (lambda p, v: os.mkfifo(p), "is a FIFO"),
        (lambda p, v: p.mkdir(), "is a directory"),
        (lambda p, v: _socket(p), "is a socket"),
    ],
    ids=["symlink", "dangling-symlink", "dev-full-link", "folder-link", "fifo", "folder", "socket"],
)
def test_anything_but_a_regular_file_is_refused_in_one_line(tmp_path: Path, make: Any, needle: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)
    path = tmp_path / "out.json"
    make(path, victim)
    mode = os.lstat(path).st_mode
    with pytest.raises(UnsafeFileError) as caught:
        check_output_file(path, "the test record, --json")
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and needle in message, message
    assert "(the test record, --json)" in message and "remove it or name another path" in message
    assert os.lstat(path).st_mode == mode and victim.read_text() == VICTIM  # nothing replaced


def test_a_character_device_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsafeFileError, match=r"^/dev/full is a character device, not a regular file"):
        check_output_file(Path("/dev/full"), "a test")


@pytest.mark.parametrize("parent", ["missing", "file"])
def test_a_path_whose_folder_is_missing_or_a_file_is_refused(tmp_path: Path, parent: str) -> None:
    if parent == "file":
        (tmp_path / "missing").write_text(VICTIM)
    path = tmp_path / "missing" / "out.json"
    with pytest.raises(UnsafeFileError) as caught:
        check_output_file(path, "a test")
    assert str(path) in str(caught.value) and "name another path" in str(caught.value)
    if parent == "file":
        assert (tmp_path / "missing").read_text() == VICTIM


def test_an_output_folder_may_be_absent_or_a_real_folder(tmp_path: Path) -> None:
    assert check_output_folder(tmp_path / "a" / "b", "a test") == tmp_path / "a" / "b"
    (tmp_path / "real").mkdir()
    assert check_output_folder(tmp_path / "real", "a test") == tmp_path / "real"


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p, t: p.symlink_to(t), "is a symlink (to "),
        (lambda p, t: p.write_text(VICTIM), "is not a regular file"),
        (lambda p, t: os.mkfifo(p), "is a FIFO"),
    ],
    ids=["symlink-to-folder", "file", "fifo"],
)
def test_an_output_folder_that_is_a_link_or_not_a_folder_is_refused(
    tmp_path: Path, make: Any, needle: str
) -> None:
    target = tmp_path / "target"
    target.mkdir()
    path = tmp_path / "pulled"
    make(path, target)
    with pytest.raises(UnsafeFileError) as caught:
        check_output_folder(path, "the pulled folder, --to")
    message = str(caught.value)
    assert str(path) in message and "not a folder (the pulled folder, --to)" in message, message
    assert needle in message or (needle == "is not a regular file" and "not a folder" in message)
    assert list(target.iterdir()) == []


# --------------------------------------------------------------------------------------------
# python -m pipeline.bench --json


@pytest.fixture
def engine(tmp_path: Path) -> Path:
    return make_engine_run(tmp_path / "run") / "engine"  # a valid engine.json; never run here


def _bench_record(*_: Any) -> dict[str, Any]:
    return {"ttft": {}, "tpot": None}


def test_bench_refuses_a_symlinked_json_before_measuring(
    tmp_path: Path, engine: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline import bench

    ran: list[Path] = []
    monkeypatch.setattr(bench, "run_benchmark", lambda folder, *_: ran.append(folder) or _bench_record())
    link, victim = victim_link(tmp_path)
    assert bench.main([str(engine), "--json", str(link)]) == 2
    one_error_line(capsys.readouterr().err, str(link), "is a symlink (to ", "--json")
    assert ran == []  # refused before the benchmark
    assert_link_kept(link, victim)
    assert bench.main([str(engine), "--json", str(tmp_path / "fresh.json")]) == 0  # still writes
    assert (tmp_path / "fresh.json").is_file() and ran == [engine]


def test_bench_refuses_a_link_made_while_it_measured(
    tmp_path: Path, engine: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline import bench

    out = tmp_path / "out.json"
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)

    def benchmark(*_: Any) -> dict[str, Any]:
        out.symlink_to(victim)
        return _bench_record()

    monkeypatch.setattr(bench, "run_benchmark", benchmark)
    assert bench.main([str(engine), "--json", str(out)]) == 2
    one_error_line(capsys.readouterr().err, str(out), "is a symlink (to ")
    assert_link_kept(out, victim)


@pytest.mark.parametrize("kind", ["fifo", "dev-full-link"])
def test_bench_cli_refuses_a_fifo_or_a_device_link_without_blocking(
    tmp_path: Path, engine: Path, kind: str
) -> None:
    out = tmp_path / "out.json"
    if kind == "fifo":
        fifo(out)
    else:
        out.symlink_to("/dev/full")
    result = cli("pipeline.bench", str(engine), "--json", str(out))
    assert result.returncode == 2, result.stderr[-3000:]
    what = "is a FIFO" if kind == "fifo" else "is a symlink (to /dev/full)"
    one_error_line(result.stderr, str(out), what, "remove it or name another path")
    if kind == "fifo":
        assert stat.S_ISFIFO(os.lstat(out).st_mode)
    else:
        assert out.is_symlink() and os.readlink(out) == "/dev/full"


# --------------------------------------------------------------------------------------------
# python -m pipeline.gate --json


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    return make_engine_run(tmp_path / "base"), make_engine_run(tmp_path / "cand", seed=1)


def _gate_argv(runs: tuple[Path, Path], out: Path) -> list[str]:
    base, cand = runs
    return [
        "--baseline", str(base), "--candidate", str(cand), "--eval", "quick", "--no-kl",
        "--set", "family=bits8", "--cache-dir", str(base.parent / "cache"), "--json", str(out),
    ]  # fmt: skip


@pytest.fixture
def fake_gate(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The gate's scoring and table replaced: a PASS record, and what each call was given."""
    import pipeline.summary
    from pipeline import gate

    calls: list[Any] = []

    def gate_fn(*args: Any) -> dict[str, Any]:
        calls.append(args)
        return {"verdict": "PASS", "reason": "faked"}

    monkeypatch.setattr(gate, "gate_fn", gate_fn)
    monkeypatch.setattr(pipeline.summary, "gate_table", lambda record: "")
    return calls


def test_gate_refuses_a_symlinked_json_before_scoring(
    tmp_path: Path, runs: tuple[Path, Path], fake_gate: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.gate import main

    link, victim = victim_link(tmp_path)
    assert main(_gate_argv(runs, link)) == 2
    one_error_line(capsys.readouterr().err, str(link), "is a symlink (to ", "the gate record, --json")
    assert fake_gate == []  # nothing scored
    assert_link_kept(link, victim)
    assert main(_gate_argv(runs, tmp_path / "fresh.json")) == 0  # a fresh path still works
    assert (tmp_path / "fresh.json").is_file()


def test_gate_refuses_a_link_made_while_it_scored(
    tmp_path: Path,
    runs: tuple[Path, Path],
    fake_gate: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pipeline import gate

    out = tmp_path / "out.json"
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)

    def gate_fn(*args: Any) -> dict[str, Any]:
        out.symlink_to(victim)
        return {"verdict": "PASS", "reason": "faked"}

    monkeypatch.setattr(gate, "gate_fn", gate_fn)
    assert gate.main(_gate_argv(runs, out)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and str(out) in err[0] and "is a symlink (to " in err[0], err
    assert_link_kept(out, victim)


def test_gate_cli_refuses_a_fifo_without_blocking(tmp_path: Path, runs: tuple[Path, Path]) -> None:
    out = fifo(tmp_path / "out.json")
    result = cli("pipeline.gate", *_gate_argv(runs, out))
    assert result.returncode == 2, result.stderr[-3000:]
    one_error_line(result.stderr, str(out), "is a FIFO")
    assert stat.S_ISFIFO(os.lstat(out).st_mode)


# --------------------------------------------------------------------------------------------
# python -m pipeline.registry pull --to


@pytest.fixture
def registry(tmp_path: Path) -> Path:
    from pipeline.registry import LocalRegistry

    root = tmp_path / "reg"
    LocalRegistry(root).publish(make_run(tmp_path / "runs" / "0", seed=1), model="llama", recipe="int8")
    return root


def _pull(registry: Path, to: Path) -> list[str]:
    return ["--root", str(registry), "pull", "llama/int8@1", "--to", str(to)]


def test_pull_refuses_a_symlink_to_an_empty_folder(
    tmp_path: Path, registry: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.registry.__main__ import main

    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "pulled"
    link.symlink_to(target)
    assert main(_pull(registry, link)) == 2
    one_error_line(capsys.readouterr().err, str(link), "is a symlink (to ", "not a folder")
    assert link.is_symlink() and list(target.iterdir()) == []
    assert not [p for p in tmp_path.iterdir() if ".pull" in p.name]  # no staging left


def test_pull_refuses_a_fifo_and_keeps_what_it_did_with_folders(
    tmp_path: Path, registry: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.registry.__main__ import main

    out = fifo(tmp_path / "pulled")
    assert main(_pull(registry, out)) == 2
    one_error_line(capsys.readouterr().err, str(out), "is a FIFO")
    assert stat.S_ISFIFO(os.lstat(out).st_mode)
    full = tmp_path / "full"  # a folder holding anything: refused, as before
    full.mkdir()
    (full / "keep.txt").write_text(VICTIM)
    assert main(_pull(registry, full)) == 2
    one_error_line(capsys.readouterr().err, "exists and is not empty")
    assert [p.name for p in full.iterdir()] == ["keep.txt"] and (full / "keep.txt").read_text() == VICTIM
    empty = tmp_path / "empty"  # an empty folder: pulled into, as before
    empty.mkdir()
    assert main(_pull(registry, empty)) == 0
    assert (empty / "manifest.json").is_file() and (empty / "engine" / "engine.json").is_file()


# --------------------------------------------------------------------------------------------
# python -m pipeline.report --out


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_report_refuses_an_out_that_is_not_a_regular_file(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.report import main

    if kind == "symlink":
        out, victim = victim_link(tmp_path, "nightly.html")
    else:
        out = fifo(tmp_path / "nightly.html")
    assert main(["nightly", "--root", str(tmp_path / "none"), "--out", str(out)]) == 2
    what = "is a symlink (to " if kind == "symlink" else "is a FIFO"
    one_error_line(capsys.readouterr().err, str(out), what, "the report, --out")
    if kind == "symlink":
        assert_link_kept(out, victim)
    else:
        assert stat.S_ISFIFO(os.lstat(out).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left


def test_report_still_replaces_its_regular_file(tmp_path: Path) -> None:
    from pipeline.report import main

    out = tmp_path / "reports" / "nightly.html"
    assert main(["nightly", "--root", str(tmp_path / "none"), "--out", str(out)]) == 0  # folder made
    out.write_text("yesterday")
    assert main(["nightly", "--root", str(tmp_path / "none"), "--out", str(out)]) == 0
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert [p.name for p in out.parent.iterdir()] == ["nightly.html"]


# --------------------------------------------------------------------------------------------
# python -m pipeline hydra.run.dir=...


def test_a_run_folder_holding_a_run_record_is_refused_before_hydra_writes(
    tmp_path: Path, tiny_llama: Path
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "manifest.json").write_text(VICTIM)
    result = cli(
        "pipeline",
        f"model.path={tiny_llama}",
        f"pipeline.cache_dir={tmp_path / 'cache'}",
        f"pipeline.models_dir={tmp_path / 'models'}",
        "bench=none",
        "eval=none",
        "quality.enabled=false",
        "registry=none",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    one_error_line(result.stderr, f"hydra.run.dir={run_dir} already holds a run", "name a new folder")
    assert sorted(p.name for p in run_dir.iterdir()) == ["manifest.json"]  # no .hydra/, no log, no engine
    assert (run_dir / "manifest.json").read_text() == VICTIM
    assert not (tmp_path / "cache").exists()  # nothing ran


def test_a_new_empty_or_unfinished_run_folder_is_used(tmp_path: Path) -> None:
    from pipeline.__main__ import check_run_dir
    from pipeline.core.errors import ConfigError

    check_run_dir(tmp_path / "new")  # Hydra makes it
    (tmp_path / "empty").mkdir()
    check_run_dir(tmp_path / "empty")
    (tmp_path / "failed" / ".hydra").mkdir(parents=True)  # a run that stopped before its record
    (tmp_path / "failed" / "pipeline.log").write_text("error: ...\n")
    check_run_dir(tmp_path / "failed")
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "manifest.json").symlink_to(tmp_path / "nothing")  # even a dangling link
    with pytest.raises(ConfigError, match="already holds a run"):
        check_run_dir(tmp_path / "linked")


def test_a_folder_inside_another_runs_folder_is_refused(tmp_path: Path) -> None:
    """hydra.run.dir=<old run>/engine would add files to that run's engine, which its record
    lists: the old run could no longer be published."""
    from pipeline.__main__ import check_run_dir
    from pipeline.core.errors import ConfigError

    old = tmp_path / "old"
    (old / "engine").mkdir(parents=True)
    (old / "manifest.json").write_text(VICTIM)
    for inside in (old / "engine", old / "engine" / "deeper", old / "new"):
        with pytest.raises(ConfigError, match=rf"lies inside the run {old} .*name a folder outside it"):
            check_run_dir(inside)
    assert sorted(p.name for p in old.iterdir()) == ["engine", "manifest.json"]
    check_run_dir(tmp_path / "beside")
