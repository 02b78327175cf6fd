"""The cache on shared or damaged storage: broken entries and records are evicted and recomputed,
live jobs' staging and checkpoints survive other jobs' cleanup, and a full disk or a read-only
cache is one error line with nothing half-written left."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.cache import Cache, load_record, write_record
from pipeline.core.manager import PassManager
from pipeline.core.staging import lock_path, owned_folder, unique_name
from tests.pipeline.passes_for_tests import recipe
from tests.pipeline.test_staging import (
    FOREIGN_PID,
    NEEDS_PID_NAMESPACE,
    kill_owner,
    owner_process,
)

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def staging_names(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in (cache_dir / ".staging").iterdir())


def break_entry_json(entry: Path, how: str) -> None:
    target = entry / "entry.json"
    if how == "directory":  # unreadable as a file
        target.unlink()
        target.mkdir()
        return
    target.write_text(
        {
            "bad json": '{"output_digest": ',
            "not an object": "[1, 2, 3]",
            "no output_digest": '{"config": {}, "input_digest": "x"}',
            "digest not a string": '{"output_digest": 7, "config": {}, "input_digest": "x"}',
            "binary": "\udcff",
        }[how],
        errors="surrogateescape",
    )


@pytest.mark.parametrize(
    "how", ["bad json", "not an object", "no output_digest", "digest not a string", "binary", "directory"]
)
def test_malformed_entry_json_is_evicted_and_recomputed(
    source: Artifact, tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache_dir = tmp_path / "cache"
    first, records = PassManager(recipe("a"), Cache(cache_dir)).run(source)
    break_entry_json(cache_dir / records[0].cache_key, how)
    with caplog.at_level(logging.WARNING, logger="pipeline.core.cache"):
        engine, again = PassManager(recipe("a"), Cache(cache_dir)).run(source)
    assert [r.cache_hit for r in again] == [False, True, True]
    assert engine.digest == first.digest and (engine.path / "engine.txt").read_text() == "sa"
    if how != "directory":  # a directory is no entry file: a plain miss, replaced at commit
        assert any("discarding it and recomputing" in r.message for r in caplog.records)
    # The entry is whole again and served from the cache; nothing was left in staging.
    _, third = PassManager(recipe("a"), Cache(cache_dir)).run(source)
    assert all(r.cache_hit for r in third)
    assert json.loads((cache_dir / records[0].cache_key / "entry.json").read_text())["output_digest"]
    assert staging_names(cache_dir) == []


def test_missing_output_folder_is_evicted(source: Artifact, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    _, records = PassManager(recipe("a"), Cache(cache_dir)).run(source)
    shutil.rmtree(cache_dir / records[1].cache_key / "output")
    _, again = PassManager(recipe("a"), Cache(cache_dir)).run(source)
    assert [r.cache_hit for r in again] == [True, False, True]


def test_unreadable_entry_json_is_evicted_not_a_traceback(source: Artifact, tmp_path: Path) -> None:
    """Permission denied reading ``entry.json`` (root reads anything, so the check runs without
    the capabilities that let it)."""
    cache_dir = tmp_path / "cache"
    _, records = PassManager(recipe("a"), Cache(cache_dir)).run(source)
    os.chmod(cache_dir / records[0].cache_key / "entry.json", 0)
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root reads unreadable files; setpriv is needed to drop that")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    script = textwrap.dedent(
        f"""
        import logging
        from pathlib import Path
        from pipeline.core.artifacts import Artifact, Kind
        from pipeline.core.cache import Cache
        from pipeline.core.manager import PassManager
        from tests.pipeline.passes_for_tests import AppendPass, ToEnginePass, ToGraphPass, recipe
        logging.basicConfig(level=logging.WARNING)
        try:
            open({str(cache_dir / records[0].cache_key / "entry.json")!r}).read()
            print("readable")
        except PermissionError:
            pass
        source = Artifact.from_dir(Kind.TORCH, Path({str(source.path)!r}))
        passes = [AppendPass(text="a"), ToGraphPass(), ToEnginePass()]
        _, records = PassManager(passes, Cache(Path({str(cache_dir)!r}))).run(source)
        print([r.cache_hit for r in records])
        """
    )
    done = subprocess.run(
        [*prefix, sys.executable, "-c", script], cwd=REPO, env=ENV, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[False, True, True]"  # not "readable": the check is real
    assert "cannot read it (Permission denied)" in done.stderr and "Traceback" not in done.stderr
    assert json.loads((cache_dir / records[0].cache_key / "entry.json").read_text())["pass"] == "append"


def test_evict_keeps_an_entry_another_job_committed_since(source: Artifact, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    cache = Cache(cache_dir)
    _, records = PassManager(recipe("a"), cache).run(source)
    key = records[0].cache_key
    entry_json = cache_dir / key / "entry.json"
    seen = (entry_json.stat().st_ino, entry_json.stat().st_mtime_ns)
    # Another job evicts and recommits the entry meanwhile (a new entry.json).
    cache.evict(key)
    _, again = PassManager(recipe("a"), cache).run(source)
    assert not again[0].cache_hit
    fresh = entry_json.stat()
    assert (fresh.st_ino, fresh.st_mtime_ns) != seen
    cache.evict(key, seen)  # the job that judged the old entry acts late: the new one stays
    assert entry_json.is_file()
    assert cache.lookup(key, Kind.TORCH) is not None
    assert staging_names(cache_dir) == []


def test_records_are_written_whole_and_broken_ones_recomputed(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    cache = Cache(cache_dir)
    stored = cache_dir / "quality" / "k.json"
    assert cache.read_record(stored) is None
    cache.write_record(stored, {"perplexity": 3.5})
    assert cache.read_record(stored) == {"perplexity": 3.5}
    assert [p.name for p in stored.parent.iterdir()] == ["k.json"] and staging_names(cache_dir) == []
    for broken in ("{", "[]", "\udcff"):
        stored.write_text(broken, errors="surrogateescape")
        assert load_record(stored) is None and not stored.exists()  # removed: recomputed next
    circular: dict = {}
    circular["self"] = circular
    with pytest.raises(ValueError, match="Circular reference"):  # nothing half-written stays
        write_record(cache_dir, stored, circular)
    assert not stored.exists() and staging_names(cache_dir) == []


def test_checkpoints_of_a_key_another_job_works_on_are_kept(source: Artifact, tmp_path: Path) -> None:
    """Two jobs run the same pass; the first to commit must not remove the checkpoints the other
    is writing. The last one done removes them; a later cache open removes leftovers."""
    cache_dir = tmp_path / "cache"
    cache = Cache(cache_dir)
    key = "k" * 64
    checkpoints = cache.checkpoint_dir(key)
    out = tmp_path / "out"
    out.mkdir()
    (out / "data.txt").write_text("x")
    with owner_process(cache.staging_root / f"{key}.{FOREIGN_PID}.0123456789ab") as other:
        checkpoints.mkdir(parents=True)
        (checkpoints / "step.pt").write_bytes(b"state")
        with cache.stage(key) as staging:
            shutil.copytree(out, staging / "output", dirs_exist_ok=True)
            digest = Artifact.from_dir(Kind.TORCH, staging / "output").digest
            record = {"config": {}, "input_digest": "i", "output_digest": digest, "metrics": {}}
            cache.commit(key, staging, Kind.TORCH, record)
        assert (checkpoints / "step.pt").read_bytes() == b"state"  # the other job's
        Cache(cache_dir)  # opening the cache elsewhere leaves them too
        assert checkpoints.is_dir()
        kill_owner(other, cache.staging_root / f"{key}.{FOREIGN_PID}.0123456789ab")
    Cache(cache_dir)  # the other job is gone and the key is cached: removed
    assert not checkpoints.exists() and staging_names(cache_dir) == []


def test_checkpoints_of_a_failed_pass_are_kept_for_resume(source: Artifact, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    cache = Cache(cache_dir)
    key = "f" * 64
    cache.checkpoint_dir(key).mkdir(parents=True)
    (cache.checkpoint_dir(key) / "step.pt").write_bytes(b"state")
    with pytest.raises(RuntimeError), cache.stage(key):
        raise RuntimeError("the pass crashed")
    Cache(cache_dir)
    assert (cache.checkpoint_dir(key) / "step.pt").is_file()  # resumed by the next run


def test_cache_open_keeps_a_live_foreign_jobs_staging_and_removes_killed_ones(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    Cache(cache_dir)
    live = cache_dir / ".staging" / f"{'a' * 64}.{FOREIGN_PID}.0123456789ab"
    dead = cache_dir / ".staging" / f"{'b' * 64}.{FOREIGN_PID}.ba9876543210"
    with owner_process(live), owner_process(dead) as killed:
        kill_owner(killed, dead)
        Cache(cache_dir)
        assert (live / "work.bin").is_file() and lock_path(live).is_file()
        assert not dead.exists() and not lock_path(dead).exists()
    assert staging_names(cache_dir) == []


@NEEDS_PID_NAMESPACE
def test_cache_open_spares_staging_of_a_job_in_another_pid_namespace(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    Cache(cache_dir)
    live = cache_dir / ".staging" / f"{'c' * 64}.1.0123456789ab"
    with owner_process(live, new_pid_namespace=True) as owner:
        Cache(cache_dir)
        assert (live / "work.bin").is_file()
        kill_owner(owner, live)
        Cache(cache_dir)
        assert staging_names(cache_dir) == []


def test_trash_of_a_killed_eviction_is_removed(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    Cache(cache_dir)
    trash = cache_dir / ".staging" / unique_name(f"{'d' * 64}.trash")
    (trash.with_name(trash.name + ".lock")).write_text("")  # a killed job's: its lock is free
    (trash / "entry" / "output").mkdir(parents=True)
    Cache(cache_dir)
    assert staging_names(cache_dir) == []
    with owned_folder(cache_dir / ".staging" / unique_name(f"{'d' * 64}.trash")) as live:
        Cache(cache_dir)  # this process's own live trash stays
        assert live.is_dir()


STORAGE_SCRIPT = """
import json, os, subprocess, sys
from pathlib import Path
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.cache import Cache, write_record
from pipeline.core.errors import PipelineError
from pipeline.core.manager import PassManager
from pipeline.run import place_engine
from tests.pipeline.passes_for_tests import AppendPass, ToEnginePass, ToGraphPass, recipe

small, source_dir, big_engine = (Path(a) for a in sys.argv[1:4])
source = Artifact.from_dir(Kind.TORCH, source_dir)
cache_dir = small / "cache"
out = {}

def attempt(name, call):
    try:
        call()
        out[name] = {"ok": True}
    except PipelineError as exc:
        out[name] = {"error": str(exc), "type": type(exc).__name__}
    out[name]["staging"] = sorted(os.listdir(cache_dir / ".staging"))
    out[name]["cache"] = sorted(os.listdir(cache_dir))

def run(*texts):
    passes = [*(AppendPass(text=t) for t in texts), ToGraphPass(), ToEnginePass()]
    return PassManager(passes, Cache(cache_dir)).run(source)

attempt("fits", lambda: run("a"))
attempt("disk full", lambda: run("x" * 400_000))
run_dir = small / "run"
run_dir.mkdir()
record = cache_dir / "quality" / "k.json"
attempt("record too big", lambda: write_record(cache_dir, record, {"x": "y" * 400_000}))
out["record too big"]["quality"] = sorted(os.listdir(cache_dir / "quality"))
attempt("engine too big", lambda: place_engine(Artifact.from_dir(Kind.ENGINE, big_engine), run_dir))
out["engine too big"]["run"] = sorted(os.listdir(run_dir))
subprocess.run(["mount", "-o", "remount,ro", str(small)], check=True)
attempt("read-only hit", lambda: run("a"))
attempt("read-only miss", lambda: run("b"))
print(json.dumps(out))
"""


def mount_namespaces_work(folder: Path) -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    folder.mkdir(exist_ok=True)
    probe = subprocess.run(
        ["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {folder}"],
        capture_output=True,
        timeout=20,
    )
    return probe.returncode == 0


def test_full_disk_and_read_only_cache_are_one_line_and_leave_nothing(
    source: Artifact, tmp_path: Path
) -> None:
    """On a 256 KiB tmpfs (in a private mount namespace): a pass that fills the disk, an engine
    copy that does not fit, then the same file system read-only: cache hits still work, a miss
    is one error naming the file; no staging is left at any point."""
    small = tmp_path / "small"
    if not mount_namespaces_work(small):
        pytest.skip("needs root and unshare --mount to make a small file system")
    big_engine = tmp_path / "engine"
    big_engine.mkdir()
    (big_engine / "model.onnx").write_bytes(os.urandom(400_000))
    done = subprocess.run(
        [
            "unshare",
            "--mount",
            "sh",
            "-c",
            f'mount -t tmpfs -o size=256k tmpfs {small} && exec {sys.executable} -c "$0" "$@"',
            STORAGE_SCRIPT,
            str(small),
            str(source.path),
            str(big_engine),
        ],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["fits"]["ok"] and len(out["fits"]["cache"]) == 4  # .staging + three entries
    full = out["disk full"]
    assert full["type"] == "StorageError" and "\n" not in full["error"]
    assert full["error"].startswith("cannot write the output of pass 'append': ")
    assert f"the cache folder {small}/cache: No space left on device: disk full: free space" in full["error"]
    assert full["staging"] == [] and full["cache"] == out["fits"]["cache"]
    record = out["record too big"]
    assert record["type"] == "StorageError" and "cannot write the record k.json" in record["error"]
    assert record["quality"] == [] and record["staging"] == []
    engine = out["engine too big"]
    assert engine["type"] == "StorageError" and "No space left on device" in engine["error"]
    assert "cannot place the engine in" in engine["error"] and engine["run"] == []
    assert out["read-only hit"]["ok"]
    miss = out["read-only miss"]
    assert miss["type"] == "StorageError" and "Read-only file system" in miss["error"]
    assert "pipeline.cache_dir" in miss["error"] and miss["staging"] == []


def test_max_age_never_removes_a_live_jobs_staging(tmp_path: Path) -> None:
    """``pipeline.staging_max_age_h`` (issue 37, class 10): a staging folder whose owner holds its
    lock survives a cache open with any maximum age (``0.0002`` h deleted it before); once its
    owner is gone, it is removed only when nobody wrote it for longer than that."""
    from omegaconf import OmegaConf

    from pipeline.run import staging_max_age_s

    assert staging_max_age_s(OmegaConf.create({"pipeline": {"staging_max_age_h": 2}})) == 7200.0
    assert staging_max_age_s(OmegaConf.create({"pipeline": {"staging_max_age_h": None}})) is None
    cache_dir = tmp_path / "cache"
    Cache(cache_dir)
    stale = cache_dir / ".staging" / f"{'e' * 64}.{FOREIGN_PID}.0123456789ab"
    with owner_process(stale) as owner:
        old = os.stat(stale).st_mtime - 3 * 3600
        for path in (stale / "work.bin", stale):
            os.utime(path, (old, old))
        for max_age_s in (None, 7200, 0.0002 * 3600):
            Cache(cache_dir, max_age_s=max_age_s)
            assert (stale / "work.bin").read_bytes() == b"half"
        kill_owner(owner, stale)
    Cache(cache_dir, max_age_s=4 * 3600)  # free, but written less than 4 h ago: kept
    assert stale.is_dir()
    Cache(cache_dir, max_age_s=7200)
    assert not stale.exists() and staging_names(cache_dir) == []
