"""One ``artifacts/`` shared by jobs on several hosts or containers: two pipelines at once, the
cleanup of one run from another PID namespace, what killed runs leave in run folders, and the
code revision in the run record."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core.artifacts import Artifact, Kind, folder_digest
from pipeline.core.staging import lock_path, owned_folder, unique_name
from pipeline.manifest import REPO_ROOT, code_revision, write_manifest
from pipeline.run import place_engine, remove_abandoned_runs
from tests.pipeline.test_staging import FOREIGN_PID, kill_owner, owner_process, pid_namespaces_work

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
SHORT = ["bench=none", "eval=none", "registry=none", "quality.enabled=false"]
RUN_FILES = [".hydra", "__main__.log", "engine", "manifest.json"]


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


# --- the code revision in the run record ----------------------------------------------------------


def test_code_revision_of_this_checkout() -> None:
    code = code_revision()
    assert code["version"] and re.fullmatch(r"\d+\.\d+.*", code["version"])
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not run from a git checkout")
    assert code["git_commit"] == git(REPO_ROOT, "rev-parse", "HEAD").strip()
    assert code["git_dirty"] is bool(git(REPO_ROOT, "status", "--porcelain").strip())


def test_code_revision_commit_and_dirty_flag(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", "a.py")
    git(tmp_path, "commit", "-q", "-m", "one")
    head = git(tmp_path, "rev-parse", "HEAD").strip()
    assert code_revision(tmp_path)["git_commit"] == head
    assert code_revision(tmp_path)["git_dirty"] is False
    (tmp_path / "a.py").write_text("x = 2\n")
    code = code_revision(tmp_path)
    assert code["git_commit"] == head and code["git_dirty"] is True


def test_code_revision_is_null_without_a_checkout_or_git(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = tmp_path / "installed"
    plain.mkdir()
    assert code_revision(plain)["git_commit"] is None and code_revision(plain)["git_dirty"] is None
    # A package folder inside some other repository is not a checkout of this package.
    git(tmp_path, "init", "-q")
    (tmp_path / "f").write_text("f")
    git(tmp_path, "add", "f")
    git(tmp_path, "commit", "-q", "-m", "other")
    assert code_revision(plain)["git_commit"] is None
    assert code_revision(tmp_path)["git_commit"] is not None
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # git is not installed
    code = code_revision(tmp_path)
    assert code["git_commit"] is None and code["git_dirty"] is None and code["version"]


# --- run folders: the engine copy, the record, what killed runs leave ----------------------------


def make_engine(folder: Path) -> Artifact:
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"\1" * 4096)
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    return Artifact.from_dir(Kind.ENGINE, folder)


def test_place_engine_links_atomically_and_leaves_no_staging(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "cache" / "entry")
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    placed = place_engine(engine, run)
    assert folder_digest(placed) == engine.digest
    assert os.stat(placed / "model.onnx").st_ino == os.stat(engine.path / "model.onnx").st_ino  # linked
    other = make_engine(tmp_path / "cache" / "other")
    (other.path / "model.onnx").unlink()
    (other.path / "model.onnx").write_bytes(b"\2" * 10)
    placed = place_engine(Artifact.from_dir(Kind.ENGINE, other.path), run)  # a rerun: swapped whole
    assert (placed / "model.onnx").read_bytes() == b"\2" * 10
    assert [p.name for p in run.iterdir()] == ["engine"]
    assert (engine.path / "model.onnx").read_bytes() == b"\1" * 4096  # the cache's file untouched


def test_write_manifest_leaves_only_the_record(tmp_path: Path) -> None:
    path = write_manifest(tmp_path, {"schema_version": 1})
    assert json.loads(path.read_text()) == {"schema_version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_next_run_removes_what_killed_runs_left_in_sibling_folders(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    killed = runs / "killed" / f".engine.{FOREIGN_PID}.0123456789ab"
    killed_record = runs / "killed" / f".manifest.json.{FOREIGN_PID}.0123456789ab"
    live = runs / "live" / f".engine.{FOREIGN_PID}.ba9876543210"
    mine = runs / "mine"
    mine.mkdir(parents=True)
    (runs / "killed").mkdir()
    (runs / "killed" / ".engine-notes").mkdir()  # not ours: a similar name
    (runs / "killed" / ".hydra").mkdir()
    with owner_process(live), owner_process(killed) as first, owner_process(killed_record) as second:
        kill_owner(first, killed)
        kill_owner(second, killed_record)
        with owned_folder(mine / unique_name(".engine")) as own:
            remove_abandoned_runs(mine)
            assert own.is_dir()  # this run's own
        assert not killed.exists() and not lock_path(killed).exists() and not killed_record.exists()
        assert sorted(p.name for p in (runs / "killed").iterdir()) == [".engine-notes", ".hydra"]
        assert (live / "work.bin").is_file()  # a live job's, whichever host it runs on
    remove_abandoned_runs(mine)
    assert list((runs / "live").iterdir()) == []


# --- two pipelines at once on one artifacts/ ------------------------------------------------------


def pipeline_job(tiny_llama: Path, workdir: Path, run: str) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        "-m",
        "pipeline",
        f"model.path={tiny_llama}",
        f"pipeline.cache_dir={workdir / 'artifacts' / 'cache'}",
        f"pipeline.models_dir={workdir / 'artifacts' / 'models'}",
        f"hydra.run.dir={workdir / 'artifacts' / 'runs' / run}",
        *SHORT,
    ]
    return subprocess.Popen(
        command, cwd=workdir, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_for_staging(staging_root: Path, known: set[str], timeout: float = 90) -> Path:
    """A new, lock-owned staging folder under ``staging_root`` (a job's pass at work)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in staging_root.glob("*"):
            if path.name not in known and not path.name.endswith(".lock") and lock_path(path).exists():
                return path
        time.sleep(0.02)
    raise AssertionError(f"no job started a pass under {staging_root} in {timeout} s")


CLEANUP = """
import sys
from pathlib import Path
from pipeline.core.cache import Cache
from pipeline.core.staging import remove_abandoned
root = Path(sys.argv[1])
removed = remove_abandoned(root / ".staging")  # what a job opening the cache removes...
Cache(root)  # ...and the open itself
print(" ".join(p.name for p in removed))
"""


def test_two_pipelines_at_once_on_one_artifacts_folder(tiny_llama: Path, tmp_path: Path) -> None:
    """Jobs A and B share ``artifacts/`` (cache, models, runs). While A is mid-pass, the cleanup
    runs from another PID namespace (another container: A's PID means nothing there), and B
    opens the cache; a foreign job's staging (a PID of no local process, its lock held) is
    there throughout. A's and the foreign staging survive, both jobs succeed with intact entries,
    each pass output is computed once (one job waits on the other's compute lock and reuses
    it), and what a SIGKILLed owner left (a cache staging folder, an engine copy) is removed."""
    cache_dir = tmp_path / "artifacts" / "cache"
    staging_root = cache_dir / ".staging"
    runs = tmp_path / "artifacts" / "runs"
    namespace = pid_namespaces_work()
    foreign = staging_root / f"{'f' * 64}.{FOREIGN_PID}.0123456789ab"
    abandoned = staging_root / f"{'a' * 64}.{FOREIGN_PID}.ba9876543210"
    abandoned_engine = runs / "killed" / f".engine.{FOREIGN_PID}.0123456789ab"
    (runs / "killed").mkdir(parents=True)

    with owner_process(foreign, new_pid_namespace=namespace), owner_process(abandoned) as doomed:
        with owner_process(abandoned_engine) as doomed_engine:
            kill_owner(doomed, abandoned)
            kill_owner(doomed_engine, abandoned_engine)
        known = {p.name for p in staging_root.iterdir()}
        job_a = pipeline_job(tiny_llama, tmp_path, "a")
        try:
            a_staging = wait_for_staging(staging_root, known)
            cleanup = [sys.executable, "-c", CLEANUP, str(cache_dir)]
            if namespace:
                cleanup = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", *cleanup]
            swept = subprocess.run(cleanup, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
            job_b = pipeline_job(tiny_llama, tmp_path, "b")
            assert swept.returncode == 0, swept.stderr
            assert a_staging.name not in swept.stdout.split()  # A's live staging was not touched
            assert abandoned.name in swept.stdout.split() or not abandoned.exists()
            out_b, _ = job_b.communicate(timeout=150)
            out_a, _ = job_a.communicate(timeout=150)
        finally:
            for job in [job_a, *([job_b] if "job_b" in locals() else [])]:
                if job.poll() is None:
                    job.kill()
                    job.wait()
        assert job_a.returncode == 0, out_a[-3000:]
        assert job_b.returncode == 0, out_b[-3000:]

        manifests = [json.loads((runs / run / "manifest.json").read_text()) for run in ("a", "b")]
        assert manifests[0]["engine"]["digest"] == manifests[1]["engine"]["digest"]
        keys = {p["cache_key"] for m in manifests for p in m["passes"]}
        # Each pass output computed once, by one job; the other waited for it and reused it.
        computed = [p["cache_key"] for m in manifests for p in m["passes"] if not p["cache_hit"]]
        assert sorted(computed) == sorted(keys)
        for key in keys:  # every entry whole: its files match the digest it recorded
            record = json.loads((cache_dir / key / "entry.json").read_text())
            assert folder_digest(cache_dir / key / "output") == record["output_digest"]
        for run in ("a", "b"):
            assert sorted(p.name for p in (runs / run).iterdir()) == RUN_FILES
            assert folder_digest(runs / run / "engine") == manifests[0]["engine"]["digest"]
        # The foreign job's staging survived both jobs' cache opens and the sweep; the killed
        # owners' leftovers did not.
        assert (foreign / "work.bin").read_bytes() == b"half"
        left = sorted(p.name for p in staging_root.iterdir())
        assert left == sorted([foreign.name, f"{foreign.name}.lock"])
        assert list((runs / "killed").iterdir()) == []
