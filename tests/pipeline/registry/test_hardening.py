"""The registry trusts nothing it reads: run folders whose manifest points outside them or no
longer matches their engine, malformed sha256/sizes, corrupt blobs, malformed version records,
channels and indexes, folders that are not registries, read-only registries, OS errors and
SIGTERM. Every refusal is one line; nothing half-written is left."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import RegistryConfig
from pipeline.core.artifacts import file_digests, sha256_file
from pipeline.manifest import engine_files
from pipeline.publish import publish_run
from pipeline.registry import LocalRegistry, Ref, RegistryError
from pipeline.registry.__main__ import main
from pipeline.registry.refs import RegistryIOError

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture(autouse=True)
def _keep_sigterm() -> Iterator[None]:
    """``main`` makes SIGTERM raise in this process; put pytest's handler back afterwards."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


def _edit_manifest(run: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    manifest = json.loads((run / "manifest.json").read_text())
    edit(manifest)
    (run / "manifest.json").write_text(json.dumps(manifest))


def _file(manifest: dict[str, Any], path: str) -> dict[str, Any]:
    return next(f for f in manifest["engine"]["files"] if f["path"] == path)


def _nothing_published(root: Path) -> None:
    assert not list(root.glob("versions/*/*/*/*.json"))
    assert not list(root.glob("blobs/sha256/*/*"))
    assert not list(root.glob(".staging/*"))


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, list[str]]:
    """(exit code, stdout, stderr lines) of ``python -m pipeline.registry`` run in-process."""
    capsys.readouterr()  # what came before
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


# -- item 4: publishing reads only files inside the run folder --------------------------------


@pytest.mark.parametrize("engine_path", ["../../etc", "/etc", ".", "", 5, "engine/../../x", "a\\b"])
def test_an_engine_path_outside_the_run_folder_is_refused(
    tmp_path: Path, run_factory: Callable[..., Path], engine_path: Any
) -> None:
    run = run_factory()
    _edit_manifest(run, lambda m: m["engine"].update(path=engine_path))
    with pytest.raises(RegistryError, match=r"engine\.path .* refusing it"):
        LocalRegistry(tmp_path / "reg").publish(run, model="llama", recipe="int8")
    _nothing_published(tmp_path / "reg")


def test_an_engine_folder_that_is_a_symlink_out_of_the_run_is_refused(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    run = run_factory()
    outside = tmp_path / "elsewhere"
    shutil.move(run / "engine", outside)
    (run / "engine").symlink_to(outside)
    with pytest.raises(RegistryError, match=r"engine\.path 'engine' leads out of"):
        LocalRegistry(tmp_path / "reg").publish(run, model="llama", recipe="int8")
    _nothing_published(tmp_path / "reg")


def test_a_symlink_inside_the_engine_leading_out_is_refused(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    """The manifest even records the outside file's sha256: still refused, nothing read."""
    secret = tmp_path / "secret.txt"
    secret.write_text("not an engine file\n")
    run = run_factory()
    (run / "engine" / "config.json").unlink()
    (run / "engine" / "config.json").symlink_to(secret)
    _edit_manifest(run, lambda m: m["engine"].update(files=engine_files(run / "engine")))
    with pytest.raises(RegistryError, match=r"config.json leads out of the engine folder"):
        LocalRegistry(tmp_path / "reg").publish(run, model="llama", recipe="int8")
    _nothing_published(tmp_path / "reg")
    # a symlinked sub-folder leading out: the same
    run = run_factory(seed=2)
    shutil.move(run / "engine" / "sub", tmp_path / "outsub")
    (run / "engine" / "sub").symlink_to(tmp_path / "outsub")
    with pytest.raises(RegistryError, match=r"sub/tokenizer.json leads out of the engine folder"):
        LocalRegistry(tmp_path / "reg").publish(run, model="llama", recipe="int8")
    _nothing_published(tmp_path / "reg")


def test_a_symlink_inside_the_engine_to_a_file_inside_it_is_published(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    run = run_factory()
    (run / "engine" / "alias.json").symlink_to("config.json")
    _edit_manifest(run, lambda m: m["engine"].update(files=engine_files(run / "engine")))
    store = LocalRegistry(tmp_path / "reg")
    store.publish(run, model="llama", recipe="int8")
    pulled = store.pull(Ref.parse("llama/int8"), tmp_path / "pulled")
    assert (pulled / "engine" / "alias.json").read_bytes() == (run / "engine" / "config.json").read_bytes()


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("sha256", "AB" * 32, "is not 64 lowercase hex"),
        ("sha256", "ab" * 31, "is not 64 lowercase hex"),
        ("sha256", "../../../../etc/passwd", "is not 64 lowercase hex"),
        ("sha256", 7, "is not 64 lowercase hex"),
        ("sha256", None, "is not 64 lowercase hex"),
        ("bytes", True, "is not a non-negative integer"),
        ("bytes", -1, "is not a non-negative integer"),
        ("bytes", "12", "is not a non-negative integer"),
        ("bytes", 12.0, "is not a non-negative integer"),
        ("path", None, "is not a string"),
        ("path", "/etc/passwd", "leaves the engine folder"),
        ("path", "a/../../b", "leaves the engine folder"),
    ],
)
def test_malformed_file_entries_are_refused(
    tmp_path: Path, run_factory: Callable[..., Path], field: str, value: Any, needle: str
) -> None:
    run = run_factory()
    _edit_manifest(run, lambda m: _file(m, "config.json").update({field: value}))
    with pytest.raises(RegistryError, match=needle):
        LocalRegistry(tmp_path / "reg").publish(run, model="llama", recipe="int8")
    _nothing_published(tmp_path / "reg")


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda m: m["engine"].update(files="model.onnx"), "lists no engine files"),
        (lambda m: m["engine"].update(files=[]), "lists no engine files"),
        (lambda m: m["engine"]["files"].__setitem__(0, "model.onnx"), "is not an object"),
        (lambda m: m["engine"]["files"].append(dict(m["engine"]["files"][0])), "is listed twice"),
        (lambda m: m.update(gate="PASS"), "gate 'PASS' is not an object"),
        (lambda m: m.update(engine=["x"]), r"engine \['x'\] is not an object"),
        (lambda m: m.update(engine={}), "names no engine target"),
        (lambda m: m["engine"].update(target="../x"), "is not a registry name"),
        (lambda m: m["engine"].update(tensorrt="10.0"), "engine.tensorrt '10.0' is not an object"),
    ],
)
def test_malformed_manifests_are_one_clear_error(
    tmp_path: Path, run_factory: Callable[..., Path], edit: Callable[[dict[str, Any]], None], needle: str
) -> None:
    run = run_factory()
    _edit_manifest(run, edit)
    with pytest.raises(RegistryError, match=needle):
        LocalRegistry(tmp_path / "reg").publish(run, model="llama", recipe="int8")
    _nothing_published(tmp_path / "reg")


# -- item 8: the engine folder still matches its manifest --------------------------------------


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda e: (e / "extra.bin").write_bytes(b"x"), "extra.bin is not listed in"),
        (lambda e: (e / "sub" / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (lambda e: (e / "config.json").write_text('{"seed": 9}\n'), "config.json changed since the run"),
        (lambda e: (e / "empty").mkdir() or (e / "empty" / "x").write_text(""), "empty/x is not listed"),
    ],
)
def test_an_engine_folder_that_no_longer_matches_its_manifest_publishes_nothing(
    tmp_path: Path, run_factory: Callable[..., Path], change: Callable[[Path], Any], needle: str
) -> None:
    store = LocalRegistry(tmp_path / "reg")
    store.publish(run_factory(seed=1), model="llama", recipe="int8")
    before = sorted(p.name for p in (tmp_path / "reg" / "blobs" / "sha256").glob("*/*"))
    run = run_factory(seed=2)
    change(run / "engine")
    with pytest.raises(RegistryError, match=needle):
        store.publish(run, model="llama", recipe="int8")
    assert [v["version"] for v in store.index()["versions"]] == [1]
    # the files checked before the changed one were not stored either
    assert sorted(p.name for p in (tmp_path / "reg" / "blobs" / "sha256").glob("*/*")) == before
    assert not list((tmp_path / "reg" / ".staging").iterdir())


def test_a_size_that_differs_from_the_manifest_is_refused(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    run = run_factory()
    _edit_manifest(run, lambda m: _file(m, "config.json").update(bytes=_file(m, "config.json")["bytes"] + 1))
    with pytest.raises(RegistryError, match=r"config\.json holds 12 bytes, its manifest says 13"):
        LocalRegistry(tmp_path / "reg").publish(run, model="llama", recipe="int8")
    _nothing_published(tmp_path / "reg")


def test_the_cli_names_a_modified_engine_file_on_one_line(
    tmp_path: Path, run_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run = run_factory()
    (run / "engine" / "model.onnx").write_bytes(b"tampered")
    root = tmp_path / "reg"
    code, _, err = _cli(capsys, "--root", str(root), "publish", str(run), "--model", "llama", "--recipe", "x")
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "model.onnx" in err[0], err
    _nothing_published(root)


# -- item 9: publish stores the run's own record -----------------------------------------------


def test_publish_run_uses_the_runs_record_not_the_manifest_on_disk(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    run = run_factory(seed=4)
    record = json.loads((run / "manifest.json").read_text())
    tampered = {**record, "gate": {"verdict": "FAIL", "reason": "edited later"}, "overrides": ["evil"]}
    (run / "manifest.json").write_text(json.dumps(tampered))
    config = RegistryConfig(root=str(tmp_path / "reg"))
    line = publish_run(config, run, record, {"model": "llama", "quant": "int8"})
    assert line.startswith("published llama/int8/ort-cpu@1")
    stored = LocalRegistry(tmp_path / "reg").resolve(Ref.parse("llama/int8@1"))
    assert stored["manifest"] == record and stored["gate"]["verdict"] == "PASS"
    # ... and the engine folder is still checked against that record
    (run / "engine" / "config.json").write_text("{}")
    with pytest.raises(RegistryError, match=r"config\.json changed since the run recorded it"):
        publish_run(config, run, record, {"model": "llama", "quant": "int8"})
    # without the record, the CLI reads manifest.json from disk (and refuses its FAIL)
    with pytest.raises(RegistryError, match="the gate verdict is FAIL"):
        LocalRegistry(tmp_path / "reg").publish(run, model="llama", recipe="int8")


# -- item 5: every publish hashes the blobs it would reuse -------------------------------------


def test_a_corrupt_blob_is_replaced_on_publish_never_reused(
    tmp_path: Path, run_factory: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalRegistry(tmp_path / "reg")
    run = run_factory(seed=6)
    record = store.publish(run, model="llama", recipe="int8")
    sha = _file(record, "model.onnx")["sha256"]
    blob = tmp_path / "reg" / "blobs" / "sha256" / sha[:2] / sha
    os.chmod(blob, stat.S_IRUSR | stat.S_IWUSR)
    blob.write_bytes(b"bit rot")
    with caplog.at_level(logging.WARNING, logger="pipeline.registry"):
        store.publish(run, model="llama", recipe="int8")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and sha in warnings[0] and "was corrupt" in warnings[0]
    assert sha256_file(blob) == sha and not blob.stat().st_mode & stat.S_IWUSR
    assert store.verify() == []
    # a symlink where the blob belongs: replaced too
    blob.unlink()
    blob.symlink_to(run / "engine" / "model.onnx")
    store.publish(run, model="llama", recipe="int8")
    assert not blob.is_symlink() and sha256_file(blob) == sha
    # each publish of the same engine was version 1 again: its blobs repaired, no version made
    assert [v["version"] for v in store.index()["versions"]] == [1]


# -- item 6: one malformed record does not break the others ------------------------------------


def _files(record: dict[str, Any], files: list[dict[str, Any]]) -> dict[str, Any]:
    return {**record, "engine": {**record["engine"], "files": files}}


BAD_RECORDS: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("bad json", lambda r: "{oops"),
    ("not an object", lambda r: [1, 2]),
    ("missing key", lambda r: {k: v for k, v in r.items() if k != "engine"}),
    ("wrong type", lambda r: {**r, "version": "2"}),
    ("bool version", lambda r: {**r, "version": True}),
    ("files not a list", lambda r: {**r, "engine": {**r["engine"], "files": {"a": 1}}}),
    ("bad sha", lambda r: _files(r, [{"path": "x", "sha256": "..", "bytes": 1}])),
    ("path out", lambda r: _files(r, [{**r["engine"]["files"][0], "path": "../x"}])),
    ("stored elsewhere", lambda r: {**r, "recipe": "fp8"}),
]  # fmt: skip


def _write_record(path: Path, data: Any) -> None:
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


@pytest.mark.parametrize(("case", "damage"), BAD_RECORDS, ids=[c for c, _ in BAD_RECORDS])
def test_a_malformed_version_record_is_named_and_skipped(
    tmp_path: Path,
    run_factory: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
    case: str,
    damage: Callable[[dict[str, Any]], Any],
) -> None:
    root = tmp_path / "reg"
    store = LocalRegistry(root)
    for seed in (1, 2, 3):
        store.publish(run_factory(seed=seed), model="llama", recipe="int8", channel="nightly")
    bad = root / "versions" / "llama" / "int8" / "ort-cpu" / "2.json"
    _write_record(bad, damage(json.loads(bad.read_text())))
    blobs = sorted(p.name for p in (root / "blobs" / "sha256").glob("*/*"))

    assert [v["version"] for v in store.index()["versions"]] == [1, 3]
    code, out, err = _cli(capsys, "--root", str(root), "list")
    assert code == 0 and len(err) == 1, "\n".join(err)
    assert err[0].startswith("warning: ") and str(bad) in err[0]
    code, out, err = _cli(capsys, "--root", str(root), "verify")
    assert code == 1 and str(bad) in out and "2 versions, 1 problems" in out, out
    problems = store.verify()
    assert len(problems) == 1 and str(bad) in problems[0]
    with pytest.raises(RegistryError, match=f"{bad}.*malformed version record"):
        store.resolve(Ref.parse("llama/int8@2"))
    code, _, err = _cli(capsys, "--root", str(root), "show", "llama/int8@2")
    assert code == 2 and len(err) == 1 and str(bad) in err[0]
    # gc cannot tell what the broken record uses: it removes no blob
    assert store.gc()["orphan_blobs"] == 0
    assert sorted(p.name for p in (root / "blobs" / "sha256").glob("*/*")) == blobs
    # publish, pull and promote of the others carry on; version 2's number is never reused
    assert store.publish(run_factory(seed=4), model="llama", recipe="int8")["version"] == 4
    assert store.pull(Ref.parse("llama/int8@3"), tmp_path / "pulled").is_dir()
    store.promote(Ref.parse("llama/int8@1"), "stable")
    assert json.loads((root / "index.json").read_text())["channels"]["llama/int8/ort-cpu"]["stable"] == 1


@pytest.mark.parametrize(
    "content",
    [
        "{oops",
        "[]",
        '{"history": []}',
        '{"version": true, "history": []}',
        '{"version": 2, "history": "x"}',
        '{"version": 2, "history": [{"version": "2", "at": "x"}]}',
        '{"version": 2, "history": [5]}',
    ],
)
def test_a_malformed_channel_is_named_and_skipped(
    tmp_path: Path, run_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str], content: str
) -> None:
    root = tmp_path / "reg"
    store = LocalRegistry(root)
    store.publish(run_factory(seed=1), model="llama", recipe="int8", channel="nightly")
    store.publish(run_factory(seed=2), model="llama", recipe="fp8", channel="nightly")
    bad = root / "channels" / "llama" / "int8" / "ort-cpu" / "nightly.json"
    bad.write_text(content)
    assert store.index()["channels"] == {"llama/fp8/ort-cpu": {"nightly": 1}}
    code, out, _ = _cli(capsys, "--root", str(root), "verify")
    assert code == 1 and str(bad) in out and "1 problems" in out
    for act in (
        lambda: store.resolve(Ref.parse("llama/int8@nightly")),
        lambda: store.channel_history(Ref.parse("llama/int8"), "nightly"),
        lambda: store.promote(Ref.parse("llama/int8@1"), "nightly"),
        lambda: store.publish(run_factory(seed=3), model="llama", recipe="int8", channel="nightly"),
    ):
        with pytest.raises(RegistryError, match=f"{bad}.*malformed channel"):
            act()
    assert bad.read_text() == content  # refused before anything was written
    assert [v["version"] for v in store.index()["versions"] if v["recipe"] == "int8"] == [1]
    # the other recipe's channel moves on
    store.publish(run_factory(seed=4), model="llama", recipe="fp8", channel="nightly")
    assert store.resolve(Ref.parse("llama/fp8@nightly"))["version"] == 2


@pytest.mark.parametrize("content", ["garbage", "[]", '{"versions": 5}', ""])
def test_a_malformed_index_is_rebuilt_not_trusted(
    tmp_path: Path, run_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str], content: str
) -> None:
    root = tmp_path / "reg"
    store = LocalRegistry(root)
    store.publish(run_factory(seed=1), model="llama", recipe="int8")
    good = json.loads((root / "index.json").read_text())
    (root / "index.json").write_text(content)
    code, out, err = _cli(capsys, "--root", str(root), "list", "--json")
    assert code == 0 and json.loads(out) == good and not err
    assert (root / "index.json").read_text() == content  # list does not write
    code, out, _ = _cli(capsys, "--root", str(root), "verify")
    assert code == 0 and "1 versions, 0 problems" in out
    assert json.loads((root / "index.json").read_text()) == good


# -- item 7: what is a registry; read-only consumers -------------------------------------------


def test_a_folder_that_is_not_a_registry_is_refused_by_every_command(
    tmp_path: Path, run_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run = run_factory()
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine\n")
    for argv in (
        ["list"],
        ["verify"],
        ["gc"],
        ["show", "llama/int8"],
        ["pull", "llama/int8", "--to", str(tmp_path / "p")],
        ["promote", "llama/int8@1", "--channel", "stable"],
        ["publish", str(run), "--model", "llama", "--recipe", "int8"],
    ):
        code, _, err = _cli(capsys, "--root", str(foreign), *argv)
        assert code == 2 and len(err) == 1 and f"{foreign} is not a registry" in err[0], (argv, err)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    code, _, err = _cli(capsys, "--root", str(foreign / "notes.txt"), "list")
    assert code == 2 and len(err) == 1 and "is a file, not a registry folder" in err[0]


@pytest.mark.parametrize("make", [False, True], ids=["missing", "empty"])
def test_a_missing_or_empty_root_lists_as_empty_but_verify_and_gc_refuse(
    tmp_path: Path, run_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str], make: bool
) -> None:
    root = tmp_path / "reg"
    if make:
        root.mkdir()
    code, out, err = _cli(capsys, "--root", str(root), "list")
    assert code == 0 and "nothing published yet" in " ".join(out.split()) and not err
    for command in ("verify", "gc"):
        code, out, err = _cli(capsys, "--root", str(root), command)
        assert (
            code == 2 and len(err) == 1 and "no registry there to check" in err[0] and "problems" not in out
        )
    code, _, err = _cli(capsys, "--root", str(root), "show", "llama/int8")
    assert code == 2 and len(err) == 1 and "nothing is published as llama/int8/ort-cpu" in err[0]
    assert root.exists() is make and (not make or not any(root.iterdir()))  # nothing was written
    LocalRegistry(root).publish(run_factory(), model="llama", recipe="int8")
    assert (root / "registry.json").is_file() and LocalRegistry(root).verify() == []


def test_an_older_registry_without_the_marker_still_counts(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    store = LocalRegistry(tmp_path / "reg")
    store.publish(run_factory(seed=1), model="llama", recipe="int8")
    (tmp_path / "reg" / "registry.json").unlink()
    assert store.verify() == [] and len(store.index()["versions"]) == 1
    store.publish(run_factory(seed=2), model="llama", recipe="int8")
    assert (tmp_path / "reg" / "registry.json").is_file()


def _tree(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every path under root: (mode, mtime_ns, sha256 of a file's content)."""
    tree = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        content = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        tree[str(path.relative_to(root))] = (info.st_mode, info.st_mtime_ns, content)
    return tree


def test_list_show_and_pull_never_write_under_the_root(
    tmp_path: Path, run_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Even with a stale index, a missing lock file and no staging folder: readers write nothing
    (so a read-only registry serves them; as root, chmod cannot show it, the tree can)."""
    root = tmp_path / "reg"
    store = LocalRegistry(root)
    store.publish(run_factory(seed=1), model="llama", recipe="int8", channel="stable")
    store.publish(run_factory(seed=2), model="llama", recipe="int8")
    (root / "index.json").write_text("{}")  # stale
    (root / ".lock").unlink()
    shutil.rmtree(root / ".staging")
    os.utime(root, ns=(1, 1))
    before = _tree(root)
    before_root = root.stat().st_mtime_ns
    for argv in (
        ["list"],
        ["list", "--json"],
        ["show", "llama/int8@stable"],
        ["show", "llama/int8", "--json"],
        ["pull", "llama/int8@stable", "--to", str(tmp_path / "pulled")],
    ):
        code, _, err = _cli(capsys, "--root", str(root), *argv)
        assert code == 0 and not err, (argv, err)
    assert _tree(root) == before and root.stat().st_mtime_ns == before_root
    assert file_digests(tmp_path / "pulled" / "engine") == file_digests(tmp_path / "runs" / "0" / "engine")


@pytest.fixture
def read_only_root(tmp_path: Path, run_factory: Callable[..., Path]) -> Iterator[Path]:
    """A registry seen through a read-only bind mount (skipped where mounting is not allowed)."""
    root = tmp_path / "reg"
    LocalRegistry(root).publish(run_factory(seed=1), model="llama", recipe="int8", channel="stable")
    view = tmp_path / "ro"
    view.mkdir()
    mount = subprocess.run(["mount", "--bind", str(root), str(view)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"no bind mount here ({mount.stderr.decode().strip()})")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True).returncode:
            pytest.skip("no read-only remount here")
        yield view
    finally:
        subprocess.run(["umount", str(view)], check=True)


def test_a_read_only_registry_serves_readers_and_refuses_writers_in_one_line(
    tmp_path: Path,
    run_factory: Callable[..., Path],
    read_only_root: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = str(read_only_root)
    for argv in (
        ["list"],
        ["show", "llama/int8@stable"],
        ["pull", "llama/int8", "--to", str(tmp_path / "p")],
    ):
        code, _, err = _cli(capsys, "--root", root, *argv)
        assert code == 0 and not err, (argv, err)
    code, out, _ = _cli(capsys, "--root", root, "verify")
    assert code == 0 and "1 versions, 0 problems" in out
    run = run_factory(seed=2)
    for argv in (
        ["publish", str(run), "--model", "llama", "--recipe", "int8"],
        ["promote", "llama/int8@1", "--channel", "nightly"],
        ["gc"],
    ):
        code, _, err = _cli(capsys, "--root", root, *argv)
        assert code == 1 and len(err) == 1 and "Read-only file system" in err[0] and root in err[0], err
    with pytest.raises(RegistryIOError):
        LocalRegistry(read_only_root).publish(run, model="llama", recipe="int8")


def test_a_full_disk_on_publish_is_one_line_and_leaves_no_staging(
    tmp_path: Path, run_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(tiny)]).returncode:
        pytest.skip("no tmpfs mount here")
    try:
        run = run_factory(size=400_000)
        code, _, err = _cli(
            capsys, "--root", str(tiny / "reg"), "publish", str(run), "--model", "llama", "--recipe", "x"
        )
        assert code == 1 and len(err) == 1 and "No space left on device" in err[0], err
        assert not list((tiny / "reg" / ".staging").iterdir())
        assert not list((tiny / "reg").glob("versions/*/*/*/*")) and not list(
            (tiny / "reg").glob("blobs/*/*/*")
        )
        code, _, err = _cli(capsys, "--root", str(tiny / "reg"), "verify")
        assert code == 0
    finally:
        subprocess.run(["umount", str(tiny)], check=True)


# -- SIGTERM: nothing half-written -------------------------------------------------------------

TERMINATED = """
import os, signal, sys
import pipeline.registry.local as local
import pipeline.registry.records as records
from pipeline.registry.__main__ import main
real = records.copy_hashed
def slow(source, target, **options):  # SIGTERM arrives in the middle of a copy
    with open(target, "wb") as handle:
        handle.write(b"partial")
    os.kill(os.getpid(), signal.SIGTERM)
    return real(source, target, **options)
local.copy_hashed = records.copy_hashed = slow
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_during_publish_or_pull_leaves_nothing_partial(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    root = tmp_path / "reg"
    run = run_factory(seed=1)
    publish = ["--root", str(root), "publish", str(run), "--model", "llama", "--recipe", "int8"]
    result = subprocess.run(
        [sys.executable, "-c", TERMINATED, *publish], env=ENV, capture_output=True, text=True
    )
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted: "), lines
    assert not list((root / ".staging").iterdir()) and not list(root.glob("blobs/*/*/*"))
    assert not list(root.glob("versions/*/*/*/*"))

    LocalRegistry(root).publish(run, model="llama", recipe="int8")
    pull = ["--root", str(root), "pull", "llama/int8", "--to", str(tmp_path / "out" / "pulled")]
    result = subprocess.run(
        [sys.executable, "-c", TERMINATED, *pull], env=ENV, capture_output=True, text=True
    )
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert result.stderr.strip().startswith("interrupted: ")
    assert list((tmp_path / "out").iterdir()) == []  # no pulled folder, no staging, no lock file


def test_a_pull_killed_with_sigkill_is_cleaned_up_by_the_next_pull(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    root = tmp_path / "reg"
    LocalRegistry(root).publish(run_factory(seed=1), model="llama", recipe="int8")
    killed = TERMINATED.replace("signal.SIGTERM", "signal.SIGKILL")
    pull = ["--root", str(root), "pull", "llama/int8", "--to", str(tmp_path / "out" / "pulled")]
    result = subprocess.run([sys.executable, "-c", killed, *pull], env=ENV, capture_output=True)
    assert result.returncode == -signal.SIGKILL
    assert [p.name for p in (tmp_path / "out").iterdir() if ".pull." in p.name]  # its staging is left
    LocalRegistry(root).pull(Ref.parse("llama/int8"), tmp_path / "out" / "pulled")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["pulled"]
