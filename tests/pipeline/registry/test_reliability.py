"""The registry under the failures a nightly job meets: a publisher killed with SIGKILL at every
step (and at random moments mid-copy), and eight publishers at once through the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.core.artifacts import file_digests
from pipeline.registry import LocalRegistry, Ref
from tests.pipeline.registry.conftest import make_run

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

KILLED_PUBLISHER = """
import os, signal, sys
from pipeline.registry import LocalRegistry
root, run, stop = sys.argv[1:4]
def hook(stage):
    if stage == stop:
        os.kill(os.getpid(), signal.SIGKILL)
LocalRegistry(root).publish(run, model="llama", recipe="int8", channel="nightly", on_stage=hook)
"""


def _consistent(store: LocalRegistry, run: Path, tmp_path: Path) -> bool:
    """The registry verifies clean; returns whether the version exists (then complete)."""
    assert store.verify() == []
    index = store.index()
    assert index == json.loads((store.root / "index.json").read_text())
    if not index["versions"]:
        return False
    pulled = store.pull(Ref.parse("llama/int8@1"), tmp_path / f"pulled-{time.monotonic_ns()}")
    assert file_digests(pulled / "engine") == file_digests(run / "engine")
    return True


@pytest.mark.parametrize(
    ("stop", "committed"),
    [
        ("blob config.json", False),
        ("blob model.onnx", False),
        ("blobs", False),
        ("record", True),
        ("index", True),
        ("channel", True),
    ],
)
def test_a_publisher_killed_at_any_step_leaves_all_or_nothing(
    tmp_path: Path, stop: str, committed: bool
) -> None:
    run = make_run(tmp_path / "run", size=2_000_000)
    root = tmp_path / "reg"
    result = subprocess.run(
        [sys.executable, "-c", KILLED_PUBLISHER, str(root), str(run), stop], env=ENV, capture_output=True
    )
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    store = LocalRegistry(root)
    assert _consistent(store, run, tmp_path) is committed
    store.gc()
    record = store.resolve(Ref.parse("llama/int8@1")) if committed else {"engine": {"files": []}}
    used = {f["sha256"] for f in record["engine"]["files"]}
    assert {b.name for b in (root / "blobs" / "sha256").glob("*/*")} == used
    # The next publisher of the same engine carries on: version 1 when the killed one committed it
    # (no second version of one engine; the channel it did not get to move is moved now), else a
    # fresh version 1.
    again = store.publish(run, model="llama", recipe="int8", channel="nightly")
    assert again["version"] == 1 and ("reused" in again) is committed
    assert [v["version"] for v in store.index()["versions"]] == [1]
    assert store.resolve(Ref.parse("llama/int8@nightly"))["version"] == 1
    assert store.verify() == []


def test_publishers_killed_at_random_moments_leave_only_garbage_gc_removes(tmp_path: Path) -> None:
    """SIGKILL while the CLI starts, copies a 60 MB file or commits, wherever the moment falls."""
    run = make_run(tmp_path / "run", size=60_000_000, seed=-1)
    for attempt, delay in enumerate((0.3, 0.6, 0.9)):
        root = tmp_path / f"reg{attempt}"
        command = [sys.executable, "-m", "pipeline.registry", "--root", str(root), "publish", str(run)]
        process = subprocess.Popen([*command, "--model", "llama", "--recipe", "int8"], env=ENV)
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait()
        if not root.exists():  # killed before its first write: the registry is made in one rename
            continue
        assert (root / "registry.json").is_file()
        store = LocalRegistry(root)
        _consistent(store, run, tmp_path)
        store.gc()
        assert not [p for p in root.glob(".staging/*")]
        assert store.verify() == []


def test_eight_concurrent_publishers_get_distinct_versions(
    tmp_path: Path, run_factory: Callable[..., Path]
) -> None:
    root = tmp_path / "reg"
    jobs = [("int8", seed) for seed in range(4)] + [
        (recipe, 9) for recipe in ("fp8", "int4_awq", "none", "int4_gptq")
    ]
    processes = []
    for recipe, seed in jobs:
        run = run_factory(seed=seed, size=3_000_000)
        command = [sys.executable, "-m", "pipeline.registry", "--root", str(root), "publish", str(run)]
        processes.append(
            subprocess.Popen(
                [*command, "--model", "llama", "--recipe", recipe, "--channel", "nightly"],
                env=ENV,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=300) for p in processes]
    assert [p.returncode for p in processes] == [0] * 8, outputs
    store = LocalRegistry(root)
    versions = store.index()["versions"]
    assert sorted(v["version"] for v in versions if v["recipe"] == "int8") == [1, 2, 3, 4]
    assert sorted(v["recipe"] for v in versions if v["version"] == 1) == [
        "fp8",
        "int4_awq",
        "int4_gptq",
        "int8",
        "none",
    ]
    assert store.verify() == []
    history = store.channel_history(Ref.parse("llama/int8"), "nightly")
    assert sorted(h["version"] for h in history) == [1, 2, 3, 4]
    assert store.resolve(Ref.parse("llama/int8@nightly"))["version"] == history[-1]["version"]
