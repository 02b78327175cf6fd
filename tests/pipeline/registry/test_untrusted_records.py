"""Registry records and blobs are untrusted input (issue 37, classes 1, 6 and 7): a record whose
files collide (``a`` and ``a/sub``), leave the folder, repeat or are no plain file name is one
line naming the record, not an OS error; blobs and records are read as regular files only (a
FIFO or device never hangs a command); a pulled engine whose ``engine.json`` or graph cannot
load is refused with nothing left behind. Real registries, real FIFOs and symlinks, the real CLI
in a subprocess; a property-based test over malformed records.
"""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.core.artifacts import write_json
from pipeline.core.subprocesses import child_environment
from pipeline.registry import LocalRegistry, Ref, RegistryError
from pipeline.registry.records import check_files
from tests.untrusted import JSON_VALUES, json_paths

REPO = Path(__file__).resolve().parents[3]
ENV = {**child_environment(), "PYTHONPATH": str(REPO)}
RECORD = Path("versions/llama/int8/ort-cpu/1.json")


def _cli(*argv: str, timeout: int = 60) -> subprocess.CompletedProcess[str]:
    """``python -m pipeline.registry`` in a subprocess, failing (not hanging) past ``timeout``."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline.registry", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        cwd=REPO,
    )


def _one_line(result: subprocess.CompletedProcess[str], code: int = 2) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.fixture
def published(tmp_path: Path, run_factory: Callable[..., Path]) -> Path:
    root = tmp_path / "reg"
    LocalRegistry(root).publish(run_factory(seed=1), model="llama", recipe="int8")
    return root


def _rewrite(path: Path, data: Any) -> None:
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def _with_files(root: Path, change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> None:
    record = json.loads((root / RECORD).read_text())
    record["engine"]["files"] = change(record["engine"]["files"])
    _rewrite(root / RECORD, record)


def _first_as(path: str) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
    return lambda files: [*files, {**files[0], "path": path}]


COLLISIONS = [
    ("file and folder", lambda f: [*f, {**f[0], "path": "model.onnx/sub"}], "collides with model.onnx"),
    ("folder and file", lambda f: [{**f[0], "path": "sub"}, *f], "collides with sub"),
    ("parent", _first_as("../x"), "'../x' leaves the engine folder"),
    ("absolute", _first_as("/etc/passwd"), "'/etc/passwd' leaves the engine folder"),
    ("duplicate", lambda f: [*f, f[0]], "is listed twice"),
    ("double slash", _first_as("sub//x"), "is not a plain relative file name"),
    ("dot part", _first_as("./x"), "is not a plain relative file name"),
    ("trailing slash", _first_as("x/"), "is not a plain relative file name"),
    ("newline", _first_as("a\nb"), "is not a plain relative file name"),
    ("long name", _first_as("n" * 300), "is not a plain relative file name"),
    ("not a string", _first_as(5), "is not a string"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("case", "change", "needle"), COLLISIONS, ids=[c[0] for c in COLLISIONS])
def test_a_record_whose_files_collide_is_one_line_naming_it(
    published: Path, tmp_path: Path, case: str, change: Callable[..., Any], needle: str
) -> None:
    _with_files(published, change)
    to = tmp_path / "pulled"
    for argv in (["show", "llama/int8@1"], ["pull", "llama/int8@1", "--to", str(to)]):
        line = _one_line(_cli("--root", str(published), *argv))
        assert needle in line and str(published / RECORD) in line, line
    assert not to.exists() and not list(tmp_path.glob(".pulled.pull*"))


def test_check_files_refuses_a_collision_whichever_comes_first() -> None:
    entry = {"sha256": "0" * 64, "bytes": 1}
    for paths in (["a", "a/sub"], ["a/sub", "a"], ["x/a/b", "x/a"], ["x/a", "x/a/b/c"]):
        with pytest.raises(RegistryError, match="collides with"):
            check_files([{**entry, "path": p} for p in paths], "record.json")
    assert len(check_files([{**entry, "path": p} for p in ("a/b", "a/c", "ab")], "record.json")) == 3


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_a_blob_that_is_no_regular_file_stops_pull_without_hanging(
    published: Path, tmp_path: Path, kind: str
) -> None:
    record = json.loads((published / RECORD).read_text())
    sha = next(f["sha256"] for f in record["engine"]["files"] if f["path"] == "model.onnx")
    blob = published / "blobs" / "sha256" / sha[:2] / sha
    blob.unlink()
    if kind == "fifo":
        os.mkfifo(blob)
    elif kind == "dev-zero":
        blob.symlink_to("/dev/zero")
    else:
        blob.mkdir()
    to = tmp_path / "pulled"
    line = _one_line(_cli("--root", str(published), "pull", "llama/int8", "--to", str(to)), code=2)
    assert sha in line or str(blob) in line, line
    assert not to.exists() and not [p for p in tmp_path.iterdir() if ".pull." in p.name]


def test_a_record_or_index_that_is_a_fifo_never_hangs(published: Path) -> None:
    (published / "index.json").unlink()
    os.mkfifo(published / "index.json")
    second = published / RECORD.with_name("2.json")
    os.mkfifo(second)
    result = _cli("--root", str(published), "list")
    assert result.returncode == 0, result.stderr
    assert "FIFO" in result.stderr and "2.json" in result.stderr and "Traceback" not in result.stderr
    line = _one_line(_cli("--root", str(published), "show", "llama/int8@2"))
    assert "FIFO" in line, line
    result = _cli("--root", str(published), "verify")
    assert result.returncode == 1 and "FIFO" in result.stdout + result.stderr, result


def _store_blob(root: Path, data: bytes) -> tuple[str, int]:
    import hashlib

    sha = hashlib.sha256(data).hexdigest()
    blob = root / "blobs" / "sha256" / sha[:2] / sha
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    return sha, len(data)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda spec: spec.update(model_file="../../../../etc/hosts"), "leaves the engine folder"),
        (lambda spec: spec["io"].update(num_layers=-1), "io.num_layers=-1"),
        (lambda spec: spec.update(providers=["EvilExecutionProvider"]), "EvilExecutionProvider"),
    ],
)
def test_a_pulled_engine_that_cannot_load_is_refused_and_nothing_is_left(
    published: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], Any], needle: str
) -> None:
    """A record (consistent sha256 and sizes) whose engine.json the registry holds is bad: the
    pull checks the engine it assembled before it renames it into place."""
    record = json.loads((published / RECORD).read_text())
    entry = next(f for f in record["engine"]["files"] if f["path"] == "engine.json")
    blob = published / "blobs" / "sha256" / entry["sha256"][:2] / entry["sha256"]
    spec = json.loads(blob.read_text())
    edit(spec)
    entry["sha256"], entry["bytes"] = _store_blob(published, json.dumps(spec).encode())
    _rewrite(published / RECORD, record)
    to = tmp_path / "pulled"
    line = _one_line(_cli("--root", str(published), "pull", "llama/int8", "--to", str(to)))
    assert needle in line and "nothing was pulled" in line, line
    assert not to.exists() and not [p for p in tmp_path.iterdir() if ".pull." in p.name]


def test_publish_refuses_a_garbage_graph_even_when_forced(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    from pipeline.manifest import engine_files

    run = run_factory(seed=2, verdict="FAIL")
    (run / "engine" / "model.onnx").write_bytes(b"\xff" * 5000)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["engine"]["files"] = engine_files(run / "engine")
    write_json(run / "manifest.json", manifest)
    root = tmp_path / "reg"
    argv = [
        "--root",
        str(root),
        "publish",
        str(run),
        "--model",
        "llama",
        "--recipe",
        "int8",
        "--force",
        "why",
    ]
    line = _one_line(_cli(*argv))
    assert "model.onnx is not a readable ONNX graph" in line, line
    assert not list(root.glob("versions/**/*.json")) and not list(root.glob("blobs/*/*/*"))


# -- property-based: malformed version records -------------------------------------------------


FILE_PATHS = st.sampled_from(
    ["a", "a/sub", "../x", "/abs", "", ".", "a//b", "x/", "sub", "model.onnx/x"]
) | st.text(max_size=10)


@st.composite
def malformed_records(draw: st.DrawFn, good: dict[str, Any]) -> str:
    """A version record: the good one with a field replaced or removed, files renamed to
    colliding or escaping paths, or text that is not JSON."""
    how = draw(st.sampled_from(["replace", "remove", "paths", "text"]))
    if how == "text":
        return draw(st.text(max_size=40))
    record = copy.deepcopy(good)
    if how == "paths":
        for entry in record["engine"]["files"]:
            if draw(st.booleans()):
                entry["path"] = draw(FILE_PATHS)
        return json.dumps(record)
    path = draw(st.sampled_from([p for p in json_paths(record) if p[0] != "manifest"]))
    node = record
    for key in path[:-1]:
        node = node[key]
    if how == "replace":
        node[path[-1]] = draw(JSON_VALUES)
    else:
        del node[path[-1]]
    return json.dumps(record, allow_nan=True)


@pytest.fixture(scope="module")
def fuzz_registry(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    from tests.pipeline.registry.conftest import make_run

    base = tmp_path_factory.mktemp("fuzz-registry")
    root = base / "reg"
    LocalRegistry(root).publish(make_run(base / "run", size=1000), model="llama", recipe="int8")
    os.chmod(root / RECORD, stat.S_IRUSR | stat.S_IWUSR)
    return root, json.loads((root / RECORD).read_text())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_malformed_record_is_one_line_or_pulls_whole(
    data: st.DataObject, fuzz_registry: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    root, good = fuzz_registry
    (root / RECORD).write_text(data.draw(malformed_records(good)))
    to = tmp_path_factory.mktemp("pull") / "pulled"
    try:
        LocalRegistry(root).pull(Ref.parse("llama/int8@1"), to)
    except RegistryError as exc:
        assert "\n" not in str(exc), str(exc)
        assert not to.exists() and not [p for p in to.parent.iterdir() if ".pull." in p.name]
        return
    assert (to / "manifest.json").is_file() and (to / "engine" / "engine.json").is_file()


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_malformed_record_through_the_cli(
    data: st.DataObject, fuzz_registry: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    from hypothesis import assume

    root, good = fuzz_registry
    text = data.draw(malformed_records(good))
    (root / RECORD).write_text(text)
    try:
        LocalRegistry(root).resolve(Ref.parse("llama/int8@1"))
    except RegistryError:
        pass
    else:
        assume(False)  # a record that still reads: not this test's case
    to = tmp_path_factory.mktemp("pull") / "pulled"
    for argv in (["show", "llama/int8@1"], ["pull", "llama/int8@1", "--to", str(to)]):
        result = _cli("--root", str(root), *argv)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not to.exists()


def test_a_symlink_planted_at_the_registry_lock_is_refused_and_never_followed(
    published: Path, tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    from pipeline.core.files import UnsafeFileError

    target = tmp_path / "outside" / "created-through-the-lock"
    target.parent.mkdir()
    (published / ".lock").unlink(missing_ok=True)
    (published / ".lock").symlink_to(target)
    with pytest.raises(UnsafeFileError, match=r"\.lock is a symlink"):
        LocalRegistry(published).publish(run_factory(seed=3), model="llama", recipe="int8")
    assert not target.exists()
