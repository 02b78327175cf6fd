"""The local registry: publish and pull round trip, versions never overwritten, channels with
history, and every refusal the consumers rely on (failed gate, bad names, corrupt blobs,
another target or TensorRT build)."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline import registry
from pipeline.core.artifacts import file_digests
from pipeline.registry import LocalRegistry, Ref, RegistryError


def test_publish_then_pull_gives_the_same_files_and_manifest(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    store = LocalRegistry(tmp_path / "reg")
    run = run_factory(seed=1)
    record = store.publish(run, model="llama", recipe="int8")
    assert (record["version"], record["target"], record["forced"]) == (1, "ort-cpu", None)
    pulled = store.pull(Ref.parse("llama/int8@1"), tmp_path / "pulled")
    assert file_digests(pulled / "engine") == file_digests(run / "engine")
    manifest = json.loads((pulled / "manifest.json").read_text())
    assert manifest["overrides"] == ["seed=1"] and manifest["registry"]["version"] == 1
    assert not list((tmp_path / "reg" / ".staging").iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".pulled")]  # no staging left


def test_versions_count_up_and_are_never_overwritten(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    store = LocalRegistry(tmp_path / "reg")
    published = [store.publish(run_factory(seed=seed), model="llama", recipe="int8") for seed in (1, 2, 1)]
    index = store.index()
    # The engine of seed 1 again is no new version: version 1 holds it (test_republish.py).
    assert [v["version"] for v in index["versions"]] == [1, 2]
    assert [r["version"] for r in published] == [1, 2, 1] and "reused" in published[2]
    # Versions 1 and 2 share files: each stored once.
    blobs = list((tmp_path / "reg" / "blobs" / "sha256").glob("*/*"))
    assert len(blobs) == 2 * 2 + 2  # model.onnx and config.json per distinct seed, one tokenizer, engine.json
    record_file = tmp_path / "reg" / "versions" / "llama" / "int8" / "ort-cpu" / "1.json"
    assert not record_file.stat().st_mode & stat.S_IWUSR
    first = store.resolve(Ref.parse("llama/int8@1"))
    with pytest.raises(RegistryError, match="exists already; versions are never overwritten"):
        store._commit_record(Ref("llama", "int8", "ort-cpu", 1), {"version": 1}, tmp_path)
    assert store.resolve(Ref.parse("llama/int8@1")) == first
    store.publish(run_factory(seed=3), model="llama", recipe="int8")
    assert store.resolve(Ref.parse("llama/int8"))["version"] == 3  # no selector: the latest


@pytest.mark.parametrize("verdict", ["FAIL", "not-run"])
def test_only_a_pass_is_published_unless_forced_with_a_reason(
    tmp_path: Path, run_factory: Callable[..., Path], verdict: str
) -> None:
    store = LocalRegistry(tmp_path / "reg")
    run = run_factory(verdict=verdict)
    with pytest.raises(RegistryError, match=f"the gate verdict is {verdict}.*only a PASS is published"):
        store.publish(run, model="llama", recipe="int8")
    with pytest.raises(RegistryError, match="needs a reason"):
        store.publish(run, model="llama", recipe="int8", force="  ")
    assert store.index()["versions"] == []
    record = store.publish(run, model="llama", recipe="int8", force="hotfix for ticket 42")
    assert record["forced"] == "hotfix for ticket 42" and record["gate"]["verdict"] == verdict
    assert store.index()["versions"][0]["forced"] == "hotfix for ticket 42"


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", "", "x..y", "-lead", "a b", "a\\b"])
def test_names_that_could_leave_the_registry_are_refused(
    tmp_path: Path, run_factory: Callable[..., Path], name: str
) -> None:
    store = LocalRegistry(tmp_path / "reg")
    with pytest.raises(RegistryError, match="is not a registry name"):
        store.publish(run_factory(), model=name or "", recipe="int8")
    with pytest.raises(RegistryError, match="is not a registry name"):
        store.publish(run_factory(), model="llama", recipe=name or "")
    assert not (tmp_path / "reg" / "versions").exists()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("llama", "is not a reference"),
        ("llama/int8@", "is not a reference"),
        ("llama/int8/ort-cpu/x", "is not a reference"),
        ("llama/int8@beta", "unknown channel 'beta'"),
        ("llama/int8@0", "versions count from 1"),
        ("llama/../int8", "is not a registry name"),
    ],
)
def test_bad_references_are_one_clear_error(text: str, needle: str) -> None:
    with pytest.raises(RegistryError, match=needle):
        Ref.parse(text)


def test_a_manifest_path_leaving_the_engine_folder_is_refused(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    run = run_factory()
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["engine"]["files"][0]["path"] = "../../etc/passwd"
    (run / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RegistryError, match="leaves the engine folder"):
        LocalRegistry(tmp_path / "reg").publish(run, model="llama", recipe="int8")


def test_an_engine_changed_after_its_run_is_refused(tmp_path: Path, run_factory: Callable[..., Path]) -> None:
    run = run_factory()
    (run / "engine" / "config.json").write_text('{"edited": true}\n')
    with pytest.raises(RegistryError, match="changed since the run recorded it"):
        LocalRegistry(tmp_path / "reg").publish(run, model="llama", recipe="int8")


def _flip_one_byte(blob: Path) -> None:
    os.chmod(blob, stat.S_IRUSR | stat.S_IWUSR)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))


def test_a_flipped_byte_is_named_by_verify_and_stops_pull(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    store = LocalRegistry(tmp_path / "reg")
    record = store.publish(run_factory(seed=7), model="llama", recipe="int8")
    assert store.verify() == []
    model_file = next(f for f in record["engine"]["files"] if f["path"] == "model.onnx")
    blob = tmp_path / "reg" / "blobs" / "sha256" / model_file["sha256"][:2] / model_file["sha256"]
    _flip_one_byte(blob)
    problems = store.verify()
    assert len(problems) == 1
    assert model_file["sha256"] in problems[0] and "llama/int8/ort-cpu@1 (model.onnx)" in problems[0]
    with pytest.raises(RegistryError, match=f"llama/int8/ort-cpu@1: blob {model_file['sha256']} .*corrupt"):
        store.pull(Ref.parse("llama/int8@1"), tmp_path / "pulled")
    assert not (tmp_path / "pulled").exists()
    assert [p.name for p in tmp_path.iterdir() if ".pull" in p.name] == []


def test_another_target_or_tensorrt_build_is_refused(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    store = LocalRegistry(tmp_path / "reg")
    trt = {"version": "11.0.0", "compute_capability": "9.0"}
    store.publish(run_factory(target="tensorrt", tensorrt=trt), model="llama", recipe="fp8")
    with pytest.raises(
        RegistryError, match="nothing is published as llama/fp8/ort-cpu; published targets: tensorrt"
    ):
        store.resolve(Ref.parse("llama/fp8"))
    ref = Ref.parse("llama/fp8", target="tensorrt")
    with pytest.raises(RegistryError, match=re.escape("built for TensorRT 11.0.0, not 10.13")):
        store.pull(ref, tmp_path / "a", tensorrt_version="10.13")
    with pytest.raises(RegistryError, match=re.escape("built for GPU compute capability 9.0, not 8.9")):
        store.pull(ref, tmp_path / "b", tensorrt_version="11.0.0", gpu_arch="8.9")
    assert store.pull(ref, tmp_path / "c", tensorrt_version="11.0.0", gpu_arch="9.0").is_dir()
    with pytest.raises(RegistryError, match="names target 'tensorrt' but 'ort-cpu' was asked for"):
        Ref.parse("llama/fp8/tensorrt@1", target="ort-cpu")


def test_channels_move_and_keep_their_history(tmp_path: Path, run_factory: Callable[..., Path]) -> None:
    store = LocalRegistry(tmp_path / "reg")
    store.publish(run_factory(seed=1), model="llama", recipe="int8", channel="nightly")
    store.publish(run_factory(seed=2), model="llama", recipe="int8", channel="nightly")
    with pytest.raises(RegistryError, match="channel stable of llama/int8/ort-cpu points at no version"):
        store.resolve(Ref.parse("llama/int8@stable"))
    store.promote(Ref.parse("llama/int8@1"), "stable", reason="week 48 release")
    store.promote(Ref.parse("llama/int8@nightly"), "stable")
    assert store.resolve(Ref.parse("llama/int8@stable"))["version"] == 2
    history = store.channel_history(Ref.parse("llama/int8"), "stable")
    assert [(h["version"], h["reason"]) for h in history] == [(1, "week 48 release"), (2, "promoted")]
    assert store.index()["channels"] == {"llama/int8/ort-cpu": {"nightly": 2, "stable": 2}}
    with pytest.raises(RegistryError, match="unknown channel 'prod'"):
        store.promote(Ref.parse("llama/int8@1"), "prod")
    with pytest.raises(RegistryError, match="llama/int8/ort-cpu@9 does not exist"):
        store.promote(Ref.parse("llama/int8@9"), "stable")


def test_gc_removes_only_what_no_version_references(tmp_path: Path, run_factory: Callable[..., Path]) -> None:
    store = LocalRegistry(tmp_path / "reg")
    store.publish(run_factory(seed=1), model="llama", recipe="int8")
    orphan = tmp_path / "reg" / "blobs" / "sha256" / "ab" / ("ab" + "0" * 62)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"left by a publisher killed before its record")
    (tmp_path / "reg" / ".staging" / "123.partial").write_bytes(b"half a blob")
    freed = store.gc()
    assert (freed["orphan_blobs"], freed["staging_files"]) == (1, 1)
    assert not orphan.exists() and store.verify() == []
    assert store.pull(Ref.parse("llama/int8"), tmp_path / "pulled").is_dir()


def test_python_pull_by_channel_reuses_a_verified_folder(
    tmp_path: Path, run_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    LocalRegistry(registry.DEFAULT_ROOT).publish(
        run_factory(seed=3), model="llama", recipe="fp8", channel="stable"
    )
    folder = registry.pull(model="llama", quant="fp8", target="ort-cpu", channel="stable")
    assert folder == Path("artifacts/pulled/llama/fp8/ort-cpu/1")
    assert registry.pull(model="llama", quant="fp8", channel="stable") == folder  # reused, checked
    (folder / "engine" / "config.json").write_text("{}")
    with pytest.raises(RegistryError, match="differs from the registry's copy"):
        registry.pull(model="llama", quant="fp8", channel="stable")
    with pytest.raises(RegistryError, match="a version or a channel, not both"):
        registry.pull(model="llama", quant="fp8", channel="stable", version=1)
