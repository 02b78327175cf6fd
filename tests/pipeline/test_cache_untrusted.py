"""Cache entries, records, checkpoints and staging locks are untrusted input (issue 37, classes 1,
5, 9 and 10): nothing in the cache can hang a run (a FIFO, a link to ``/dev/zero``), make the
pipeline read outside it (external data at ``../``, a symlinked output) or write outside it (a
planted lock symlink); a crafted entry is evicted with one warning and recomputed."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.core.artifacts import Artifact, Kind, folder_digest, link_tree
from pipeline.core.cache import Cache, load_record, write_record
from pipeline.core.errors import PipelineError
from pipeline.core.files import UnsafeFileError
from pipeline.core.manager import PassManager
from pipeline.core.staging import is_owned, key_lock, lock_path, owned_folder, remove_abandoned
from tests.pipeline.passes_for_tests import recipe
from tests.pipeline.test_staging import FOREIGN_PID, kill_owner, owner_process

REPO = Path(__file__).resolve().parents[2]
HANG_S = 30  # a case that blocks (a FIFO opened, /dev/zero hashed) fails the test after this


# Set in every process a hang case runs in: an endless read of /dev/zero into memory or onto disk
# then fails there, in a second, rather than filling this machine before the timeout.
LIMITS = """
import resource
def _limit():
    size = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize")) << 10
    resource.setrlimit(resource.RLIMIT_AS, (size + (2 << 30), resource.RLIM_INFINITY))
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 20, resource.RLIM_INFINITY))
"""
exec(LIMITS)  # defines _limit() here too


def bounded(fn: Callable[[], None], seconds: int = HANG_S) -> None:
    """Run ``fn`` (its asserts included) in a forked child bounded in memory and file size, and
    fail the test when it runs longer than ``seconds``: a FIFO opened or ``/dev/zero`` read by
    the code under test can neither hang the suite nor exhaust this machine."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            _limit()  # noqa: F821 - defined by exec(LIMITS)
            fn()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, "the check failed in its child: see stderr"
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"hung: still running after {seconds} s")


def make_socket(path: Path) -> None:
    """A UNIX socket at ``path`` (bound from its folder: a socket path is limited to 108 bytes)."""
    cwd = os.getcwd()
    os.chdir(path.parent)
    try:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(path.name)
    finally:
        os.chdir(cwd)


def cache_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings (and worse) our own code logged."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("pipeline") and r.levelno >= 30]


def one_eviction(caplog: pytest.LogCaptureFixture, *named: str) -> str:
    """The single eviction warning the rerun logged: one line, naming ``named``."""
    warnings = cache_warnings(caplog)
    assert len(warnings) == 1, warnings
    (line,) = warnings
    assert "discarding it and recomputing" in line and "\n" not in line and "Traceback" not in line
    for part in named:
        assert part in line, line
    return line


def rewrite_digest(entry: Path) -> None:
    """Make ``entry.json`` agree with the (tampered) output, as a crafted entry would."""
    record = json.loads((entry / "entry.json").read_text())
    record["output_digest"] = folder_digest(entry / "output")
    (entry / "entry.json").write_text(json.dumps(record))


# --------------------------------------------------------------------------------------------
# Class 1: nothing in an entry can hang a run (the test passes: a cheap three-pass recipe)


def _output_file_to_dev_zero(entry: Path) -> str:
    (entry / "output" / "data.txt").unlink()
    (entry / "output" / "data.txt").symlink_to("/dev/zero")
    return "data.txt"


def _output_fifo(entry: Path) -> str:
    os.mkfifo(entry / "output" / "pipe.bin")
    return "pipe.bin"


def _entry_json_fifo(entry: Path) -> str:
    (entry / "entry.json").unlink()
    os.mkfifo(entry / "entry.json")
    return "entry.json"


def _entry_json_to_dev_zero(entry: Path) -> str:
    (entry / "entry.json").unlink()
    (entry / "entry.json").symlink_to("/dev/zero")
    return "entry.json"


def _output_socket(entry: Path) -> str:
    make_socket(entry / "output" / "s.sock")
    return "s.sock"


HANGS = {
    "output file -> /dev/zero": _output_file_to_dev_zero,
    "FIFO in output": _output_fifo,
    "entry.json is a FIFO": _entry_json_fifo,
    "entry.json -> /dev/zero": _entry_json_to_dev_zero,
    "socket in output": _output_socket,
}


HANG_SCRIPT = (
    LIMITS
    + """
import logging, sys
from pathlib import Path
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.cache import Cache
from pipeline.core.manager import PassManager
from tests.pipeline.passes_for_tests import recipe
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
source = Artifact.from_dir(Kind.TORCH, Path(sys.argv[2]))
_limit()
_, records = PassManager(recipe("a"), Cache(Path(sys.argv[1]))).run(source)
print([r.cache_hit for r in records])
"""
)


def rerun(cache_dir: Path, source: Artifact) -> subprocess.CompletedProcess[str]:
    """The recipe run again in a fresh process, as a nightly job runs it: a hang fails the test."""
    try:
        return subprocess.run(
            [sys.executable, "-c", HANG_SCRIPT, str(cache_dir), str(source.path)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=HANG_S * 2,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung: the rerun on {cache_dir} still ran after {HANG_S * 2} s")


def warning_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]


@pytest.mark.parametrize("case", sorted(HANGS))
def test_a_fifo_or_device_link_in_an_entry_never_hangs_and_is_recomputed(
    source: Artifact, tmp_path: Path, case: str
) -> None:
    cache_dir = tmp_path / "cache"
    first, records = PassManager(recipe("a"), Cache(cache_dir)).run(source)
    named = HANGS[case](cache_dir / records[0].cache_key)
    done = rerun(cache_dir, source)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.strip() == "[False, True, True]"
    (line,) = warning_lines(done.stderr)
    assert "discarding it and recomputing" in line and records[0].cache_key[:12] in line and named in line
    _, third = PassManager(recipe("a"), Cache(cache_dir)).run(source)
    assert all(r.cache_hit for r in third) and third[-1].output_digest == first.digest
    assert sorted(p.name for p in (cache_dir / ".staging").iterdir()) == []


def test_two_hanging_entries_in_one_run(source: Artifact, tmp_path: Path) -> None:
    """Both broken entries of a chain are evicted, each with its one warning line; exit 0."""
    cache_dir = tmp_path / "cache"
    _, records = PassManager(recipe("a"), Cache(cache_dir)).run(source)
    _entry_json_fifo(cache_dir / records[1].cache_key)
    _output_file_to_dev_zero(cache_dir / records[0].cache_key)
    done = rerun(cache_dir, source)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.strip() == "[False, False, True]"
    assert len(warning_lines(done.stderr)) == 2, done.stderr


@pytest.mark.parametrize("case", ["entry.json is a FIFO", "entry.json -> /dev/zero"])
def test_the_cached_prefix_prediction_never_hangs(source: Artifact, tmp_path: Path, case: str) -> None:
    """The memory preflight's prediction (``recorded_output``, which hashes nothing) reads
    ``entry.json`` too: a FIFO or a device there is no entry, at once."""
    cache_dir = tmp_path / "cache"
    manager = PassManager(recipe("a"), Cache(cache_dir))
    _, records = manager.run(source)
    HANGS[case](cache_dir / records[1].cache_key)

    def predict() -> None:
        assert manager.cached_prefix(source) == 1
        assert Cache(cache_dir).recorded_output(records[1].cache_key) is None

    bounded(predict)


def test_records_that_are_fifos_or_links_are_discarded_without_hanging(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    cache = Cache(cache_dir)
    stored = cache_dir / "quality" / "k.json"
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"perplexity": 1.0}))
    for plant in (
        lambda: os.mkfifo(stored),
        lambda: stored.symlink_to("/dev/zero"),
        lambda: stored.symlink_to(outside),  # a valid record, but not one in the cache
    ):
        stored.parent.mkdir(exist_ok=True)
        plant()

        def read() -> None:
            assert cache.read_record(stored) is None
            assert not os.path.lexists(stored)  # removed (the link, never its target)

        bounded(read)
        with contextlib.suppress(FileNotFoundError):
            stored.unlink()  # what the child removed is gone here too; this is for a failure
    assert json.loads(outside.read_text()) == {"perplexity": 1.0}
    huge = cache_dir / "bench" / "k.json"
    huge.parent.mkdir()
    with open(huge, "wb") as handle:
        handle.truncate(65 << 20)  # sparse: over the 64 MiB a record may be, nothing is read
    bounded(lambda: None if load_record(huge) is None and not huge.exists() else pytest.fail("kept"))
    cache.write_record(stored, {"perplexity": 2.0})
    assert cache.read_record(stored) == {"perplexity": 2.0}


def test_link_tree_refuses_links_and_fifos_without_hanging(tmp_path: Path) -> None:
    source = tmp_path / "source"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "a.bin").write_bytes(b"a")
    target = tmp_path / "target"
    target.mkdir()
    link_tree(source, target)
    assert (target / "sub" / "a.bin").read_bytes() == b"a"
    for name, plant in (
        ("zero", lambda p: p.symlink_to("/dev/zero")),
        ("pipe", os.mkfifo),
        ("linked-folder", lambda p: p.symlink_to(tmp_path)),
    ):
        plant(source / name)
        fresh = tmp_path / f"target-{name}"
        fresh.mkdir()

        def refused(name: str = name, fresh: Path = fresh) -> None:
            with pytest.raises(UnsafeFileError) as caught:
                link_tree(source, fresh)
            assert str(source / name) in str(caught.value) and "\n" not in str(caught.value)

        bounded(refused)
        (source / name).unlink()


# --------------------------------------------------------------------------------------------
# Class 5: a crafted entry of a real pass (the ONNX export of the tiny model) is evicted with
# one warning and recomputed


@pytest.fixture(scope="module")
def exported(tiny_source: Artifact, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """A cache holding the tiny model's export: (cache folder, entry key, output digest)."""
    from passes.export import ExportPass

    cache_dir = tmp_path_factory.mktemp("export-cache") / "cache"
    artifact, (record,) = PassManager([ExportPass()], Cache(cache_dir), final_kind=None).run(tiny_source)
    return cache_dir, record.cache_key, artifact.digest


def _set_location(entry: Path, location: str, offset: int | None = None) -> None:
    import onnx

    path = entry / "output" / "model.onnx"
    proto = onnx.load(str(path), load_external_data=False)
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for item in tensor.external_data:
                if item.key == "location":
                    item.value = location
                if item.key == "offset" and offset is not None:
                    item.value = str(offset)
            break
    onnx.save(proto, str(path))


def _data_outside_parent(entry: Path) -> str:
    shutil.copy(entry / "output" / "model.onnx.data", entry.parent / "outside.data")
    _set_location(entry, "../../outside.data")  # a readable copy: a naive loader succeeds
    rewrite_digest(entry)
    return "'../../outside.data'"


def _data_absolute(entry: Path) -> str:
    outside = entry.parent / "absolute.data"
    shutil.copy(entry / "output" / "model.onnx.data", outside)
    _set_location(entry, str(outside))
    rewrite_digest(entry)
    return str(outside)


def _data_offset_past_end(entry: Path) -> str:
    _set_location(entry, "model.onnx.data", offset=1 << 40)
    rewrite_digest(entry)
    return "model.onnx.data"


def _data_missing(entry: Path) -> str:
    _set_location(entry, "nowhere.data")
    rewrite_digest(entry)
    return "nowhere.data"


def _model_file_outside(entry: Path) -> str:
    record = json.loads((entry / "output" / "artifact.json").read_text())
    shutil.copy(entry / "output" / "model.onnx", entry.parent / "evil.onnx")
    record["metadata"]["model_file"] = "../../evil.onnx"
    (entry / "output" / "artifact.json").write_text(json.dumps(record))
    rewrite_digest(entry)
    return "model_file"


def _artifact_json_not_an_object(entry: Path) -> str:
    (entry / "output" / "artifact.json").write_text("[1, 2]")
    rewrite_digest(entry)
    return "artifact.json"


def _graph_not_onnx(entry: Path) -> str:
    (entry / "output" / "model.onnx").write_bytes(b"\xff" * 64)
    rewrite_digest(entry)
    return "cannot be read"


def _wrong_digest(entry: Path) -> str:
    with open(entry / "output" / "model.onnx.data", "r+b") as handle:
        handle.write(b"\x7f")
    return "modified on disk"


def _symlinked_output(entry: Path) -> str:
    elsewhere = entry.parent / "elsewhere"
    shutil.move(entry / "output", elsewhere)  # the same content: its digest matches
    (entry / "output").symlink_to(elsewhere)
    return "output"


def _symlinked_file(entry: Path) -> str:
    elsewhere = entry.parent / "tokenizer.json"
    shutil.move(entry / "output" / "tokenizer.json", elsewhere)
    (entry / "output" / "tokenizer.json").symlink_to(elsewhere)
    return "tokenizer.json"


def _symlinked_subfolder(entry: Path) -> str:
    elsewhere = entry.parent / "extras"
    elsewhere.mkdir()
    (elsewhere / "x.txt").write_text("x")
    (entry / "output" / "extras").symlink_to(elsewhere)
    return "extras"


def _symlinked_entry(entry: Path) -> str:
    elsewhere = entry.parent / "elsewhere-entry"
    shutil.move(entry, elsewhere)
    entry.symlink_to(elsewhere)
    return "not a folder"


def _entry_json_symlink(entry: Path) -> str:
    elsewhere = entry.parent / "entry-elsewhere.json"
    shutil.move(entry / "entry.json", elsewhere)  # a valid record, read through a link
    (entry / "entry.json").symlink_to(elsewhere)
    return "symlink"


def _entry_json_huge(entry: Path) -> str:
    with open(entry / "entry.json", "ab") as handle:
        handle.truncate(17 << 20)
    return "bytes"


def _field(name: str, value: object) -> Callable[[Path], str]:
    def plant(entry: Path) -> str:
        record = json.loads((entry / "entry.json").read_text())
        record[name] = value
        (entry / "entry.json").write_text(json.dumps(record))
        return "entry.json"

    return plant


CRAFTED: dict[str, Callable[[Path], str]] = {
    "external data at ../": _data_outside_parent,
    "external data at an absolute path": _data_absolute,
    "external data offset past its end": _data_offset_past_end,
    "external data missing": _data_missing,
    "model_file outside": _model_file_outside,
    "artifact.json not an object": _artifact_json_not_an_object,
    "model.onnx not ONNX": _graph_not_onnx,
    "wrong digest": _wrong_digest,
    "symlinked output folder": _symlinked_output,
    "symlinked output file": _symlinked_file,
    "symlinked subfolder": _symlinked_subfolder,
    "symlinked entry folder": _symlinked_entry,
    "entry.json a symlink": _entry_json_symlink,
    "entry.json huge": _entry_json_huge,
    "seconds a string": _field("seconds", "abc"),
    "resources a list": _field("resources", [1]),
    "resources values strings": _field("resources", {"peak_rss_bytes": "abc"}),
    "placement values numbers": _field("placement", {"device": 3}),
    "metrics a string": _field("metrics", "x"),
    "version a string": _field("version", "1"),
    "output_digest not hex": _field("output_digest", "../../etc"),
    "config a list": _field("config", []),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_entry_is_evicted_with_one_warning_and_recomputed(
    exported: tuple[Path, str, str],
    tiny_source: Artifact,
    tmp_path: Path,
    case: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from passes.export import ExportPass

    pristine, key, digest = exported
    cache_dir = tmp_path / "cache"
    shutil.copytree(pristine, cache_dir, symlinks=True)
    named = CRAFTED[case](cache_dir / key)
    planted = sorted(p.name for p in cache_dir.iterdir() if p.name not in (key, ".staging"))
    with caplog.at_level(logging.WARNING):
        artifact, (record,) = PassManager([ExportPass()], Cache(cache_dir), final_kind=None).run(tiny_source)
    assert not record.cache_hit and artifact.digest == digest
    one_eviction(caplog, key[:12], named)
    assert artifact.path == cache_dir / key / "output" and not (cache_dir / key).is_symlink()
    # What the crafted entry pointed at outside the entry is untouched (evicted, never followed).
    assert sorted(p.name for p in cache_dir.iterdir() if p.name not in (key, ".staging")) == planted
    for name in planted:
        assert (cache_dir / name).is_file() or any((cache_dir / name).iterdir())
    assert sorted(p.name for p in (cache_dir / ".staging").iterdir()) == []
    caplog.clear()
    _, (again,) = PassManager([ExportPass()], Cache(cache_dir), final_kind=None).run(tiny_source)
    assert again.cache_hit and cache_warnings(caplog) == []


def test_a_crafted_graph_entry_recomputed_then_builds(
    exported: tuple[Path, str, str], tiny_source: Artifact, tmp_path: Path
) -> None:
    """The rerun after an eviction succeeds end to end: the next pass builds an engine from the
    recomputed graph (whose data lies inside the entry)."""
    from passes.export import ExportPass
    from passes.ort_build import OrtCpuBuildPass

    pristine, key, _ = exported
    cache_dir = tmp_path / "cache"
    shutil.copytree(pristine, cache_dir, symlinks=True)
    _data_outside_parent(cache_dir / key)
    (cache_dir / "outside.data").write_bytes(b"")  # what a naive loader would read: now empty
    engine, records = PassManager([ExportPass(), OrtCpuBuildPass()], Cache(cache_dir)).run(tiny_source)
    assert [r.cache_hit for r in records] == [False, False]
    assert (engine.path / "engine.json").is_file()


def test_a_commit_racing_a_crafted_entry_replaces_it(source: Artifact, tmp_path: Path) -> None:
    """A crafted entry planted at our key while we compute (a symlink to a valid-looking copy) is
    not taken as another job's result: ours replaces it."""
    cache_dir = tmp_path / "cache"
    cache = Cache(cache_dir)
    _, records = PassManager(recipe("a"), cache).run(source)
    key = records[0].cache_key
    record = json.loads((cache_dir / key / "entry.json").read_text())
    elsewhere = tmp_path / "elsewhere"
    shutil.move(cache_dir / key, elsewhere)
    with cache.stage(key) as staging:
        shutil.rmtree(staging / "output")
        shutil.copytree(elsewhere / "output", staging / "output")
        (cache_dir / key).symlink_to(elsewhere)  # planted meanwhile
        entry = cache.commit(key, staging, Kind.TORCH, record)
    assert entry.artifact.path == cache_dir / key / "output"
    assert (cache_dir / key).is_dir() and not (cache_dir / key).is_symlink()
    assert (elsewhere / "entry.json").is_file()  # the link's target was never touched


# --------------------------------------------------------------------------------------------
# Class 9: locks and staging never follow links


def test_a_symlinked_lock_is_refused_in_one_line_and_creates_nothing(tmp_path: Path) -> None:
    target = tmp_path / "outside" / "created"
    target.parent.mkdir()
    lock = tmp_path / "staging" / "x.lock"
    lock.parent.mkdir()
    lock.symlink_to(target)  # dangling: O_CREAT through it would create ``created``
    with pytest.raises(UnsafeFileError) as caught, key_lock(lock, "x"):
        pass
    message = str(caught.value)
    assert str(lock) in message and "symlink" in message and "\n" not in message
    assert not target.exists() and lock.is_symlink()
    folder = lock.with_name("x")
    with pytest.raises(UnsafeFileError, match="symlink"), owned_folder(folder):
        pass
    assert not target.exists() and not folder.exists()
    if not lock.is_symlink():  # the refused owner removed the name it meant to lock (never its target)
        lock.symlink_to(target)
    assert is_owned(folder)  # unknowable: kept, never broken
    assert remove_abandoned(lock.parent) == [] and not target.exists() and lock.is_symlink()


@pytest.mark.parametrize("kind", ["fifo", "directory", "socket", "link to /dev/null"])
def test_a_non_regular_lock_is_refused_without_hanging(tmp_path: Path, kind: str) -> None:
    lock = tmp_path / "x.lock"
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "directory":
        lock.mkdir()
    elif kind == "socket":
        make_socket(lock)
    else:
        lock.symlink_to("/dev/null")

    def refused() -> None:
        with pytest.raises(UnsafeFileError) as caught, key_lock(lock, "x"):
            pass
        assert str(lock) in str(caught.value) and "\n" not in str(caught.value)
        assert is_owned(lock.with_name("x")) is True  # unknowable: kept, never broken
        assert remove_abandoned(tmp_path) == []

    bounded(refused)
    assert os.path.lexists(lock)


PLANTED_RUN = """
import logging, sys
from pathlib import Path
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.cache import Cache
from pipeline.core.errors import PipelineError
from pipeline.core.manager import PassManager
from tests.pipeline.passes_for_tests import recipe
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
source = Artifact.from_dir(Kind.TORCH, Path(sys.argv[2]))
try:
    _, records = PassManager(recipe("a"), Cache(Path(sys.argv[1]))).run(source)
except PipelineError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(exc.exit_code)
print([r.cache_hit for r in records])
"""


def _run(cache_dir: Path, source: Artifact) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PLANTED_RUN, str(cache_dir), str(source.path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_planted_compute_lock_symlink_stops_the_run_in_one_line(source: Artifact, tmp_path: Path) -> None:
    """A symlinked ``.staging/<key>.compute.lock`` (today: a file created at its target, outside
    the cache) gives one ``error:`` line naming it, exit 2, and nothing at the target; once it is
    removed, the run succeeds."""
    cache_dir = tmp_path / "cache"
    _, records = PassManager(recipe("a"), Cache(cache_dir)).run(source)
    key = records[0].cache_key
    shutil.rmtree(cache_dir / key)
    target = tmp_path / "outside" / "created-by-lock"
    target.parent.mkdir()
    planted = cache_dir / ".staging" / f"{key}.compute.lock"
    planted.symlink_to(target)
    (cache_dir / ".staging" / "x.lock").symlink_to(target)  # a stray one: warned about, kept
    done = _run(cache_dir, source)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert str(planted) in errors[0] and not target.exists()
    planted.unlink()
    done = _run(cache_dir, source)
    assert done.returncode == 0 and done.stdout.strip() == "[False, True, True]", done.stderr
    assert not target.exists() and (cache_dir / ".staging" / "x.lock").is_symlink()


def test_a_symlinked_staging_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / ".staging").symlink_to(elsewhere)
    with pytest.raises(UnsafeFileError) as caught:
        Cache(cache_dir)
    assert str(cache_dir / ".staging") in str(caught.value) and "\n" not in str(caught.value)
    assert isinstance(caught.value, PipelineError) and list(elsewhere.iterdir()) == []


def test_symlinked_record_folders_are_never_written_or_read_through(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    Cache(cache_dir)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "k.json").write_text(json.dumps({"perplexity": 1.0}))
    (cache_dir / "quality").symlink_to(elsewhere)
    stored = cache_dir / "quality" / "k.json"
    assert load_record(stored) is None
    with pytest.raises(UnsafeFileError, match="symlink"):
        write_record(cache_dir, stored, {"perplexity": 2.0})
    assert json.loads((elsewhere / "k.json").read_text()) == {"perplexity": 1.0}  # untouched


def test_symlinked_checkpoints_are_discarded_never_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``.checkpoints`` (resumable state) lives in the cache: a symlink there, or at a key's
    checkpoint folder, is removed with one warning (the pass starts fresh), its target kept."""
    cache_dir = tmp_path / "cache"
    Cache(cache_dir)
    victim = tmp_path / "victim"
    (victim / "k").mkdir(parents=True)
    (victim / "k" / "keep.txt").write_text("keep")
    (cache_dir / ".checkpoints").symlink_to(victim)
    (cache_dir / "k").mkdir()
    (cache_dir / "k" / "entry.json").write_text("{}")  # "cached": its checkpoints would be removed
    with caplog.at_level(logging.WARNING):
        cache = Cache(cache_dir)
    assert not os.path.lexists(cache_dir / ".checkpoints") and (victim / "k" / "keep.txt").is_file()
    assert len(cache_warnings(caplog)) == 1
    (cache_dir / ".checkpoints").mkdir()
    (cache_dir / ".checkpoints" / "j").symlink_to(victim / "k")
    folder = cache.checkpoint_dir("j")
    assert folder == cache_dir / ".checkpoints" / "j" and not os.path.lexists(folder)
    assert (victim / "k" / "keep.txt").is_file()


# --------------------------------------------------------------------------------------------
# Class 10: age never deletes live work (also tests/pipeline/test_staging.py, test_cache.py)


def test_a_run_with_a_tiny_max_age_keeps_a_live_jobs_staging(source: Artifact, tmp_path: Path) -> None:
    """``staging_max_age_h=0.0002`` (0.72 s) while another job stages an entry: the run succeeds
    and the live job's staging is untouched; once that job is gone, it is cleaned up."""
    cache_dir = tmp_path / "cache"
    Cache(cache_dir)
    live = cache_dir / ".staging" / f"{'e' * 64}.{FOREIGN_PID}.0123456789ab"
    with owner_process(live) as owner:
        old = os.stat(live).st_mtime - 3600
        for path in (live / "work.bin", live):
            os.utime(path, (old, old))
        _, records = PassManager(recipe("a"), Cache(cache_dir, max_age_s=0.0002 * 3600)).run(source)
        assert [r.cache_hit for r in records] == [False, False, False]
        assert (live / "work.bin").read_bytes() == b"half" and lock_path(live).is_file()
        kill_owner(owner, live)
    Cache(cache_dir, max_age_s=0.0002 * 3600)
    assert not live.exists() and not lock_path(live).exists()
