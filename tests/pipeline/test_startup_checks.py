"""What a run can know at start-up it says at start-up, in one line with the right exit code
(issue 50, "Also"): a path or key too long for the file system is bad input (exit 2, not 1); a
folder the run writes that loops, dangles or is not writable is refused before any pass; the
promotion reason is bounded; a failed write names no ``?`` placeholder."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import MAX_FORCE_REASON, RegistryConfig, check_folder
from pipeline.core.errors import ConfigError, describe_os_error, os_error_exit_code, shown_path
from pipeline.core.staging import storage_error

ROOT = Path(__file__).resolve().parents[2]


def pipeline_cli(*overrides: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.parametrize(
    "override",
    [
        "model.path=/" + "a" * 300,  # one component past NAME_MAX
        "model.path=" + "/b" * 2100,  # past PATH_MAX
        "+" + "k" * 300 + "=1",  # a key Hydra looks up as a config file
    ],
)
def test_a_name_too_long_for_the_file_system_is_bad_input(override: str, tmp_path: Path) -> None:
    result = pipeline_cli(override, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: bad path "), result.stderr
    assert "shorten it" in lines[0] and len(lines[0]) < 400  # the path is cut, not echoed whole
    assert not (tmp_path / "artifacts" / "cache").exists()  # no pass ran
    assert not list(tmp_path.rglob("manifest.json"))


def test_os_errors_of_the_input_and_of_the_machine_have_their_codes() -> None:
    too_long = OSError(errno.ENAMETOOLONG, "File name too long", "/x" * 3000)
    full = OSError(errno.ENOSPC, "No space left on device", "/data/cache")
    assert (os_error_exit_code(too_long), os_error_exit_code(full)) == (2, 1)
    assert describe_os_error(too_long).startswith("bad path /x/x")
    assert "(6,000 characters)" in describe_os_error(too_long)
    assert describe_os_error(full) == (
        "cannot write /data/cache: No space left on device (disk full: free space there or write elsewhere)"
    )
    assert shown_path("short") == "short"


def test_a_full_disk_without_a_file_name_shows_no_placeholder(tmp_path: Path) -> None:
    """A write() that fails names no file (ENOSPC from write); the line says what was written."""
    error = storage_error(
        OSError(errno.ENOSPC, "No space left on device"), "cannot write the run record in r", "s"
    )
    assert error is not None
    assert str(error) == (
        "cannot write the run record in r: No space left on device: disk full: free space there or "
        "write elsewhere (s=...)"
    )
    assert "?" not in str(error)


@pytest.fixture
def loop(tmp_path: Path) -> Path:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    return tmp_path / "a"


@pytest.mark.parametrize("name", ["pipeline.cache_dir", "registry.root", "pipeline.models_dir"])
def test_a_folder_through_a_symlink_loop_is_refused(name: str, loop: Path) -> None:
    for value in (loop, loop / "sub" / "deeper"):
        with pytest.raises(ConfigError, match=rf"^{name}=.*: the path runs through a symlink loop"):
            check_folder(name, str(value), writable=True)


def test_a_folder_under_a_dangling_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"gone is a symlink to nothing .*; fix the link or choose another"):
        check_folder("registry.root", str(tmp_path / "gone" / "registry"), writable=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only mode folder")
def test_an_unwritable_folder_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match=r"locked is not writable by this user"):
            check_folder("pipeline.cache_dir", str(locked / "cache"), writable=True)
    finally:
        locked.chmod(0o755)


def test_an_unwritable_folder_is_refused_as_the_os_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As root (CI) no mode bit stops a write, only a read-only file system, which a test cannot
    mount: access(2)'s answer is taken from a stand-in for the folder it is asked about."""
    locked = tmp_path / "ro"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))
    with pytest.raises(ConfigError, match=r"^registry.root=.*ro/registry: .*ro is not writable by this user"):
        check_folder("registry.root", str(locked / "registry"), writable=True)
    check_folder("pipeline.models_dir", str(locked / "models"))  # read only: a shared models folder
    check_folder("pipeline.cache_dir", str(tmp_path / "ok" / "cache"), writable=True)


def test_the_folders_are_checked_before_any_pass(loop: Path, tmp_path: Path) -> None:
    result = pipeline_cli(f"pipeline.cache_dir={loop}/cache", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "pipeline.cache_dir=" in result.stderr and "symlink loop" in result.stderr
    assert not (tmp_path / "run" / "manifest.json").exists()


@pytest.mark.parametrize(
    ("reason", "says"),
    [
        ("r" * (MAX_FORCE_REASON + 1), "501 characters"),
        ("hotfix\n#42", "control characters"),
        ("x\x1b[31m", "control characters"),
    ],
)
def test_the_promotion_reason_is_one_bounded_line(reason: str, says: str) -> None:
    with pytest.raises(ConfigError, match=rf"^registry.force: the reason is .*{says}"):
        RegistryConfig(force=reason).validate()
    RegistryConfig(force="hotfix #42: tokenizer fix, gate rerun tomorrow").validate()
    RegistryConfig(force="r" * MAX_FORCE_REASON).validate()


def test_every_entry_point_reports_a_name_too_long_as_bad_input(
    tiny_engine: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench, gate and report say an output name too long for the file system in one line with
    exit 2, as python -m pipeline does (pipeline.core.errors.print_error)."""
    from pipeline import bench, gate, report

    long_name = str(tmp_path / ("o" * 300))
    calls = {
        "bench": lambda: bench.main([str(tiny_engine.path), "--json", long_name]),
        "gate": lambda: gate.main(
            ["--baseline", str(tiny_engine.path), "--candidate", str(tiny_engine.path), "--json", long_name]
        ),
        "report": lambda: report.main(["nightly", "--root", str(tmp_path / "none"), "--out", long_name]),
    }
    for name, call in calls.items():
        assert call() == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: bad path ") and "shorten it" in err[0], (name, err)
