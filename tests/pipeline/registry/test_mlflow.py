"""The MLflow backend against a real ``mlflow server`` (SQLite backend store, local artifact
store) started on loopback by the fixture: the local registry's round trip, refusals, channels
as aliases, a corrupted artifact caught, concurrent publishers. Skipped only when MLflow is not
installed (``pip install -e ".[mlflow]"``)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.core.artifacts import file_digests
from pipeline.registry import Ref, RegistryError, open_registry

pytest.importorskip("mlflow")

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    folder = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination", str(folder / "artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    log = open(folder / "server.log", "w")  # noqa: SIM115 (open for the server's lifetime)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}"
                )
            time.sleep(0.5)
        yield uri, folder / "artifacts"
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_publish_resolve_pull_round_trip(
    mlflow_uri: tuple[str, Path], run_factory: Callable[..., Path], tmp_path: Path
) -> None:
    uri, _ = mlflow_uri
    store = open_registry(uri=uri)
    run = run_factory(seed=1)
    first = store.publish(run, model="round", recipe="int8", channel="nightly")
    second = store.publish(run_factory(seed=2), model="round", recipe="int8")
    assert (first["version"], second["version"]) == (1, 2)
    record = store.resolve(Ref.parse("round/int8@nightly"))
    assert record["version"] == 1 and record["manifest"]["overrides"] == ["seed=1"]
    assert store.resolve(Ref.parse("round/int8"))["version"] == 2  # the latest
    pulled = store.pull(Ref.parse("round/int8@1"), tmp_path / "pulled")
    assert file_digests(pulled / "engine") == file_digests(run / "engine")
    index = store.index()
    assert [(v["recipe"], v["version"]) for v in index["versions"] if v["model"] == "round"] == [
        ("int8", 1),
        ("int8", 2),
    ]
    assert index["channels"]["round/int8/ort-cpu"] == {"nightly": 1}
    from mlflow import MlflowClient

    registered = MlflowClient(uri).get_registered_model("round~int8~ort-cpu")
    version = MlflowClient(uri).get_model_version("round~int8~ort-cpu", "1")
    assert registered.tags["llm_pipeline.recipe"] == "int8"
    assert version.tags["llm_pipeline.gate.verdict"] == "PASS"  # manifest fields as tags


def test_refusals_are_the_local_registrys(
    mlflow_uri: tuple[str, Path], run_factory: Callable[..., Path]
) -> None:
    uri, _ = mlflow_uri
    store = open_registry(uri=uri)
    with pytest.raises(RegistryError, match="the gate verdict is FAIL"):
        store.publish(run_factory(verdict="FAIL"), model="refuse", recipe="int8")
    with pytest.raises(RegistryError, match="is not a registry name"):
        store.publish(run_factory(), model="a/b", recipe="int8")
    forced = store.publish(run_factory(verdict="FAIL"), model="refuse", recipe="int8", force="bisecting #7")
    assert forced["forced"] == "bisecting #7"
    trt = {"version": "11.0.0", "compute_capability": "9.0"}
    store.publish(run_factory(target="tensorrt", tensorrt=trt), model="refuse", recipe="fp8")
    with pytest.raises(RegistryError, match=r"built for GPU compute capability 9\.0, not 8\.6"):
        store.pull(Ref.parse("refuse/fp8/tensorrt"), Path("unused"), gpu_arch="8.6")
    with pytest.raises(RegistryError, match="refuse/fp8/ort-cpu"):
        store.resolve(Ref.parse("refuse/fp8"))


def test_channels_are_aliases_with_history(
    mlflow_uri: tuple[str, Path], run_factory: Callable[..., Path]
) -> None:
    uri, _ = mlflow_uri
    store = open_registry(uri=uri)
    for seed in (1, 2):
        store.publish(run_factory(seed=seed), model="chan", recipe="int4_awq", channel="nightly")
    store.promote(Ref.parse("chan/int4_awq@1"), "stable", reason="release")
    store.promote(Ref.parse("chan/int4_awq@nightly"), "stable")
    assert store.resolve(Ref.parse("chan/int4_awq@stable"))["version"] == 2
    history = store.channel_history(Ref.parse("chan/int4_awq"), "stable")
    assert [(h["version"], h["reason"]) for h in history] == [(1, "release"), (2, "promoted")]
    with pytest.raises(
        RegistryError, match="channel candidate of chan/int4_awq/ort-cpu points at no version"
    ):
        store.resolve(Ref.parse("chan/int4_awq@candidate"))


def test_a_corrupted_artifact_is_caught(
    mlflow_uri: tuple[str, Path], run_factory: Callable[..., Path], tmp_path: Path
) -> None:
    uri, artifacts = mlflow_uri
    store = open_registry(uri=uri)
    store.publish(run_factory(seed=5), model="corrupt", recipe="int8")
    run_id = store.resolve(Ref.parse("corrupt/int8@1"))["run_id"]
    stored = next(artifacts.rglob(f"{run_id}/artifacts/engine/model.onnx"))  # the server's copy
    os.chmod(stored, stat.S_IRUSR | stat.S_IWUSR)
    data = bytearray(stored.read_bytes())
    data[10] ^= 0xFF
    stored.write_bytes(bytes(data))
    with pytest.raises(
        RegistryError, match=r"corrupt/int8/ort-cpu@1: blob [0-9a-f]{64} \(model.onnx\) is corrupt"
    ):
        store.pull(Ref.parse("corrupt/int8@1"), tmp_path / "pulled")
    assert not (tmp_path / "pulled").exists()
    assert any("corrupt/int8/ort-cpu@1" in problem for problem in store.verify())


def test_four_concurrent_publishers_get_distinct_versions(
    mlflow_uri: tuple[str, Path], run_factory: Callable[..., Path]
) -> None:
    uri, _ = mlflow_uri
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    processes = []
    for seed in range(4):
        command = [
            sys.executable,
            "-m",
            "pipeline.registry",
            "--uri",
            uri,
            "publish",
            str(run_factory(seed=seed)),
        ]
        processes.append(
            subprocess.Popen(
                [*command, "--model", "busy", "--recipe", "int8"], env=env, stderr=subprocess.PIPE, text=True
            )
        )
    errors = [p.communicate(timeout=300)[1] for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0, 0], errors
    versions = [v["version"] for v in open_registry(uri=uri).index()["versions"] if v["model"] == "busy"]
    assert sorted(versions) == [1, 2, 3, 4]


def test_the_same_engine_published_twice_is_one_version(
    mlflow_uri: tuple[str, Path], run_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the local registry (test_republish.py): no second version, no second upload; the channel
    asked for moves to the version holding the engine; another engine is a new version."""
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    from pipeline.registry.mlflow import EXPERIMENT, MlflowRegistry

    uri, _ = mlflow_uri
    store = open_registry(uri=uri)
    client = MlflowClient(uri)
    first = store.publish(run_factory(seed=1), model="again", recipe="int8", channel="nightly")
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id

    def runs(deleted: bool = False) -> list[Any]:  # this test's publish runs, by the ref tag
        found = client.search_runs(
            [experiment], "tags.`llm_pipeline.ref` = 'again/int8/ort-cpu'", run_view_type=ViewType.ALL
        )
        return [r for r in found if (r.info.lifecycle_stage == "deleted") is deleted]

    assert len(runs()) == 1
    same = store.publish(run_factory(seed=1), model="again", recipe="int8")
    assert same["version"] == first["version"] == 1 and len(runs()) == 1  # nothing uploaded
    assert same["reused"].startswith("again/int8/ort-cpu@1 already holds this engine (sha256 ")
    assert same["reused"].endswith("; nothing published")
    assert same["manifest"]["overrides"] == ["seed=1"]
    other = store.publish(run_factory(seed=2), model="again", recipe="int8", channel="nightly")
    assert other["version"] == 2 and "reused" not in other
    back = store.publish(run_factory(seed=1), model="again", recipe="int8", channel="nightly")
    assert back["version"] == 1 and back["reused"].endswith("; channel nightly moved to @1")
    assert store.resolve(Ref.parse("again/int8@nightly"))["version"] == 1
    assert [h["version"] for h in store.channel_history(Ref.parse("again/int8"), "nightly")] == [1, 2, 1]
    still = store.publish(run_factory(seed=1), model="again", recipe="int8", channel="nightly")
    assert still["reused"].endswith("; channel nightly already points at @1")
    assert len(runs()) == 2  # only the other engine was uploaded
    # A publisher that raced another with the same engine (both saw no version holding it) makes
    # its version, then finds the earlier one, deletes its own and moves the channel there.
    real = MlflowRegistry._holder
    calls = iter(range(100))
    monkeypatch.setattr(
        MlflowRegistry, "_holder", lambda self, pub: None if next(calls) == 0 else real(self, pub)
    )
    raced = store.publish(run_factory(seed=2), model="again", recipe="int8", channel="stable")
    assert raced["version"] == 2 and raced["reused"].endswith("; channel stable moved to @2")
    versions = [v["version"] for v in store.index()["versions"] if v["model"] == "again"]
    assert versions == [1, 2]
    assert store.resolve(Ref.parse("again/int8@stable"))["version"] == 2
    assert not [problem for problem in store.verify() if "again/" in problem]  # (others: other tests)
    assert len(runs(deleted=True)) == 1 and len(runs()) == 2  # the duplicate's run is deleted
    monkeypatch.undo()
    assert store.publish(run_factory(seed=3), model="again", recipe="int8")["version"] == 4  # 3 stays unused


def test_gc_deletes_the_run_of_a_publisher_that_never_made_its_version(mlflow_uri: tuple[str, Path]) -> None:
    from mlflow import MlflowClient

    from pipeline.registry.mlflow import EXPERIMENT

    uri, _ = mlflow_uri
    store = open_registry(uri=uri)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT) or client.get_experiment(
        client.create_experiment(EXPERIMENT)
    )
    orphan = client.create_run(experiment.experiment_id)  # uploaded, then killed before the version
    assert store.gc(grace_seconds=3600)["orphan_blobs"] == 0  # too recent: maybe still uploading
    assert store.gc(grace_seconds=0)["orphan_blobs"] >= 1
    assert client.get_run(orphan.info.run_id).info.lifecycle_stage == "deleted"


def test_a_pipeline_run_publishes_to_mlflow(
    mlflow_uri: tuple[str, Path], tiny_llama: Path, tmp_path: Path
) -> None:
    """``python -m pipeline ... registry=mlflow registry.uri=...`` on the tiny Llama (no gate, so
    forced with a reason), then pulled back through the Python API by channel."""
    from pipeline import registry
    from tests.pipeline.test_main import run_pipeline

    uri, _ = mlflow_uri
    settings = ["bench=none", "registry=mlflow", f"registry.uri={uri}", "registry.channel=candidate"]
    result = run_pipeline(tiny_llama, tmp_path, "run", *settings, "registry.force=smoke test")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"published llama/none/ort-cpu@1 (channel candidate) [forced: smoke test] to {uri}" in result.stdout
    )
    folder = registry.pull(model="llama", quant="none", channel="candidate", uri=uri, to=tmp_path / "pulled")
    assert file_digests(folder / "engine") == file_digests(tmp_path / "run" / "engine")
