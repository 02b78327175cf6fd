"""Pass manager: stage typing, cache hits, invalidation, crash and SIGKILL resume."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.core import cache as cache_module
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.cache import Cache
from pipeline.core.errors import ConfigError, PassError
from pipeline.core.manager import PassManager, validate
from tests.pipeline.passes_for_tests import AppendPass, ToEnginePass, ToGraphPass, recipe

REPO = Path(__file__).resolve().parents[2]


def test_validate_accepts_a_well_typed_recipe() -> None:
    validate(recipe("a", "b"), Kind.TORCH)


def test_torch_pass_after_export_is_a_config_error() -> None:
    with pytest.raises(
        ConfigError, match=r"pass #2 'append' consumes a torch model but receives an ONNX graph"
    ):
        validate([ToGraphPass(), AppendPass(), ToEnginePass()], Kind.TORCH)


def test_recipe_without_engine_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="ends with an ONNX graph"):
        validate([AppendPass(), ToGraphPass()], Kind.TORCH)


def test_validation_happens_before_any_pass_runs(source: Artifact, tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    with pytest.raises(ConfigError):
        PassManager([AppendPass(), ToEnginePass()], cache).run(source)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".staging"]


def test_second_run_is_served_from_cache(source: Artifact, tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    first, records1 = PassManager(recipe("a"), cache).run(source)
    second, records2 = PassManager(recipe("a"), Cache(tmp_path / "cache")).run(source)
    assert [r.cache_hit for r in records1] == [False, False, False]
    assert [r.cache_hit for r in records2] == [True, True, True]
    assert first.digest == second.digest
    assert (second.path / "engine.txt").read_text() == "sa"
    assert records2[0].metrics == {"length": 2, "checked": True}


def test_config_change_invalidates_that_pass_and_later_ones(source: Artifact, tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    PassManager(recipe("a", "b"), cache).run(source)
    _, records = PassManager(recipe("a", "c"), cache).run(source)
    assert [r.cache_hit for r in records] == [True, False, False, False]


def test_library_version_change_invalidates(
    source: Artifact, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = Cache(tmp_path / "cache")
    PassManager(recipe("a"), cache).run(source)
    real = cache_module.library_versions()
    monkeypatch.setattr(cache_module, "library_versions", lambda: {**real, "onnxruntime": "9.9.9"})
    _, records = PassManager(recipe("a"), cache).run(source)
    assert not any(r.cache_hit for r in records)


def test_pass_version_change_invalidates(source: Artifact, tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    PassManager(recipe("a"), cache).run(source)

    class AppendV2(AppendPass):
        version = 2

    _, records = PassManager([AppendV2(text="a"), ToGraphPass(), ToEnginePass()], cache).run(source)
    # The new version reruns; its output has the same content, so later passes hit by content.
    assert [r.cache_hit for r in records] == [False, True, True]


def test_modified_cache_entry_is_discarded_and_recomputed(source: Artifact, tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    _, records = PassManager(recipe("a"), cache).run(source)
    tampered = tmp_path / "cache" / records[0].cache_key / "output" / "data.txt"
    tampered.write_text("tampered")
    engine, again = PassManager(recipe("a"), cache).run(source)
    assert [r.cache_hit for r in again] == [False, True, True]
    assert (engine.path / "engine.txt").read_text() == "sa"


def test_failed_ensures_caches_nothing(source: Artifact, tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    with pytest.raises(PassError, match="contains '!'"):
        PassManager(recipe("!"), cache).run(source)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".staging"]
    assert list((tmp_path / "cache" / ".staging").iterdir()) == []


def test_crash_resumes_from_last_finished_pass(
    source: Artifact, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = Cache(tmp_path / "cache")
    monkeypatch.setenv("TEST_RAISE_IN_PASS", "b")
    with pytest.raises(RuntimeError, match="simulated crash"):
        PassManager(recipe("a", "b"), cache).run(source)
    assert list((tmp_path / "cache" / ".staging").iterdir()) == []
    monkeypatch.delenv("TEST_RAISE_IN_PASS")
    _, records = PassManager(recipe("a", "b"), cache).run(source)
    assert [r.cache_hit for r in records] == [True, False, False, False]


def test_sigkill_mid_pass_leaves_no_entry_and_resumes(source: Artifact, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from pipeline.core.artifacts import Artifact, Kind
        from pipeline.core.cache import Cache
        from pipeline.core.manager import PassManager
        from tests.pipeline.passes_for_tests import AppendPass, ToEnginePass, ToGraphPass, recipe
        source = Artifact.from_dir(Kind.TORCH, Path({str(source.path)!r}))
        passes = [AppendPass(text="a"), AppendPass(text="b"), ToGraphPass(), ToEnginePass()]
        PassManager(passes, Cache(Path({str(cache_dir)!r}))).run(source)
        """
    )
    killed = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env={**_env(), "TEST_KILL_IN_PASS": "b"}, check=False
    )
    assert killed.returncode == -9
    leftovers = [p for p in (cache_dir / ".staging").iterdir() if not p.name.endswith(".lock")]
    assert len(leftovers) == 1 and (leftovers[0] / "output" / "half-written.bin").exists()
    assert (cache_dir / ".staging" / f"{leftovers[0].name}.lock").is_file()  # its owner's lock, now free
    finished = [p for p in cache_dir.iterdir() if p.name != ".staging"]
    assert len(finished) == 1  # only pass "a" was committed

    cache = Cache(cache_dir)  # opening the cache removes the dead run's staging folder
    assert list((cache_dir / ".staging").iterdir()) == []
    _, records = PassManager(recipe("a", "b"), cache).run(source)
    assert [r.cache_hit for r in records] == [True, False, False, False]


def test_disabled_cache_never_reads(source: Artifact, tmp_path: Path) -> None:
    PassManager(recipe("a"), Cache(tmp_path / "cache")).run(source)
    _, records = PassManager(recipe("a"), Cache(tmp_path / "cache", enabled=False)).run(source)
    assert not any(r.cache_hit for r in records)


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO)}
