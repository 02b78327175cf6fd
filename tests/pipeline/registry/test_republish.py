"""Publishing an engine the registry already holds makes no new version: the same engine (one
digest: the same files, byte for byte) published again under the same model/recipe/target returns
the version holding it, moves the channel asked for there, and stores no record and no blob; the
CLI and the pipeline's publish step say so in one line. A different engine, or the same one under
another recipe, is a new version as before. Concurrent publishers of one engine make one version.
(The MLflow backend's cases are in test_mlflow.py, beside its server.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.config import RegistryConfig
from pipeline.core.artifacts import folder_digest
from pipeline.manifest import engine_files
from pipeline.publish import publish_run
from pipeline.registry import LocalRegistry, Ref
from pipeline.registry.__main__ import main
from pipeline.registry.records import REUSED

REPO = Path(__file__).resolve().parents[3]


def _snapshot(root: Path) -> dict[str, list[str]]:
    """The blobs and version records a registry holds (names only)."""
    return {
        "blobs": sorted(p.name for p in (root / "blobs" / "sha256").glob("*/*")),
        "records": sorted(str(p.relative_to(root)) for p in (root / "versions").glob("*/*/*/*.json")),
    }


def test_the_same_engine_published_twice_is_one_version(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    root = tmp_path / "reg"
    store = LocalRegistry(root)
    first = store.publish(run_factory(seed=1), model="llama", recipe="int8")
    before = _snapshot(root)
    run = run_factory(seed=1)  # another run folder, the same engine bytes (a nightly built it again)
    again = store.publish(run, model="llama", recipe="int8")
    digest = folder_digest(run / "engine")
    assert again["version"] == 1 and again["engine"] == first["engine"]
    assert again[REUSED] == (
        f"llama/int8/ort-cpu@1 already holds this engine (sha256 {digest[:12]}); nothing published"
    )
    assert {k: v for k, v in again.items() if k != REUSED} == store.resolve(Ref.parse("llama/int8@1"))
    assert [v["version"] for v in store.index()["versions"]] == [1]
    assert _snapshot(root) == before  # no record, no blob
    assert json.loads((root / "index.json").read_text()) == store.index()
    assert not list((root / ".staging").iterdir()) and store.verify() == []
    assert store.channel_history(Ref.parse("llama/int8"), "nightly") == []  # none asked for: none moved


def test_a_channel_asked_for_moves_to_the_version_holding_the_engine(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    store = LocalRegistry(tmp_path / "reg")
    store.publish(run_factory(seed=1), model="llama", recipe="int8", channel="nightly")
    store.publish(run_factory(seed=2), model="llama", recipe="int8", channel="nightly")
    assert store.resolve(Ref.parse("llama/int8@nightly"))["version"] == 2
    back = store.publish(run_factory(seed=1), model="llama", recipe="int8", channel="nightly")
    assert back["version"] == 1 and back[REUSED].endswith("; channel nightly moved to @1")
    assert back[REUSED].startswith("llama/int8/ort-cpu@1 already holds this engine (sha256 ")
    assert store.resolve(Ref.parse("llama/int8@nightly"))["version"] == 1
    history = store.channel_history(Ref.parse("llama/int8"), "nightly")
    assert [(h["version"], h["reason"]) for h in history] == [
        (1, "published 1"),
        (2, "published 2"),
        (1, "published 1 again"),
    ]
    # Where the channel points already, it is left (its history too).
    same = store.publish(run_factory(seed=1), model="llama", recipe="int8", channel="nightly")
    assert same["version"] == 1 and same[REUSED].endswith("; channel nightly already points at @1")
    assert len(store.channel_history(Ref.parse("llama/int8"), "nightly")) == 3
    # Another channel is moved the same way.
    stable = store.publish(run_factory(seed=2), model="llama", recipe="int8", channel="stable")
    assert stable["version"] == 2 and stable[REUSED].endswith("; channel stable moved to @2")
    assert store.index()["channels"] == {"llama/int8/ort-cpu": {"nightly": 1, "stable": 2}}
    assert [v["version"] for v in store.index()["versions"]] == [1, 2]
    assert store.verify() == []


def test_a_different_engine_or_another_recipe_is_a_new_version(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    store = LocalRegistry(tmp_path / "reg")
    assert store.publish(run_factory(seed=1), model="llama", recipe="int8")["version"] == 1
    changed = run_factory(seed=1)  # the same engine but one file: a different digest
    (changed / "engine" / "config.json").write_text('{"seed": 1, "changed": true}\n')
    manifest = json.loads((changed / "manifest.json").read_text())
    manifest["engine"].update(
        files=engine_files(changed / "engine"), digest=folder_digest(changed / "engine")
    )
    (changed / "manifest.json").write_text(json.dumps(manifest))
    second = store.publish(changed, model="llama", recipe="int8")
    assert second["version"] == 2 and REUSED not in second
    other = store.publish(run_factory(seed=1), model="llama", recipe="fp8")  # same bytes, another recipe
    assert other["version"] == 1 and REUSED not in other
    assert [(v["recipe"], v["version"]) for v in store.index()["versions"]] == [
        ("fp8", 1),
        ("int8", 1),
        ("int8", 2),
    ]


def test_a_forced_publish_of_an_engine_held_returns_that_version_unchanged(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    store = LocalRegistry(tmp_path / "reg")
    store.publish(run_factory(seed=1), model="llama", recipe="int8")
    again = store.publish(run_factory(seed=1, verdict="FAIL"), model="llama", recipe="int8", force="bisect")
    assert again["version"] == 1 and again["forced"] is None and REUSED in again  # its record as stored
    assert [v["version"] for v in store.index()["versions"]] == [1]


def test_a_malformed_record_of_the_entry_does_not_stop_a_republish(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    root = tmp_path / "reg"
    store = LocalRegistry(root)
    store.publish(run_factory(seed=1), model="llama", recipe="int8")
    store.publish(run_factory(seed=2), model="llama", recipe="int8")
    bad = root / "versions" / "llama" / "int8" / "ort-cpu" / "1.json"
    os.chmod(bad, 0o600)
    bad.write_text("{oops")
    # Version 1 cannot be read: its engine is published again as version 3; version 2 is found.
    assert store.publish(run_factory(seed=1), model="llama", recipe="int8")["version"] == 3
    assert store.publish(run_factory(seed=2), model="llama", recipe="int8")["version"] == 2


def test_the_cli_and_the_pipeline_say_which_version_holds_the_engine(
    tmp_path: Path, run_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "reg"
    run = run_factory(seed=4)
    publish = ["--root", str(root), "publish", str(run), "--model", "llama", "--recipe", "int8"]
    assert main(publish) == 0
    assert capsys.readouterr().out.strip() == "published llama/int8/ort-cpu@1"
    assert main([*publish, "--channel", "candidate"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("llama/int8/ort-cpu@1 already holds this engine (sha256 ")
    assert out[0].endswith("; channel candidate moved to @1")
    assert main(publish) == 0
    assert capsys.readouterr().out.strip().endswith("; nothing published")
    # python -m pipeline ... registry.channel=nightly: the publish step's line
    config = RegistryConfig(root=str(root), channel="nightly")
    manifest = json.loads((run / "manifest.json").read_text())
    line = publish_run(config, run, manifest, {"model": "llama", "quant": "int8"})
    assert line.startswith("llama/int8/ort-cpu@1 already holds this engine (sha256 ")
    assert line.endswith(f"; channel nightly moved to @1 (registry {root})")
    other = run_factory(seed=5)
    fresh = publish_run(config, other, json.loads((other / "manifest.json").read_text()), {"model": "llama"})
    assert fresh == f"published llama/none/ort-cpu@1 (channel nightly) to {root}"
    assert [v["version"] for v in LocalRegistry(root).index()["versions"]] == [1, 1]


def test_concurrent_publishers_of_one_engine_make_one_version(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    """The check for a version holding the engine is made under the lock that allocates versions:
    three publishers of the same engine (separate processes) make version 1 once."""
    root = tmp_path / "reg"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    processes = []
    for _ in range(3):
        command = [sys.executable, "-m", "pipeline.registry", "--root", str(root), "publish"]
        command += [str(run_factory(seed=6, size=2_000_000)), "--model", "llama", "--recipe", "int8"]
        processes.append(
            subprocess.Popen(
                [*command, "--channel", "nightly"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=300) for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0], outputs
    lines = sorted(out.strip() for out, _ in outputs)
    assert lines[2] == "published llama/int8/ort-cpu@1", lines
    assert all("llama/int8/ort-cpu@1 already holds this engine" in line for line in lines[:2]), lines
    store = LocalRegistry(root)
    assert [v["version"] for v in store.index()["versions"]] == [1]
    assert [h["version"] for h in store.channel_history(Ref.parse("llama/int8"), "nightly")] == [1]
    assert store.verify() == []
