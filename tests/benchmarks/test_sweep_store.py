"""``python -m benchmarks.sweep_store`` counts what it claims: its patterns read the log lines the pass
manager and the gate's score cache really write (a run that computes, then one that reuses)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from benchmarks import sweep_store
from evals.gate import ItemScore, cached_scores
from pipeline.core.artifacts import Artifact
from pipeline.core.cache import Cache
from pipeline.core.manager import PassManager
from tests.pipeline.passes_for_tests import make_source, recipe


def test_counts_of_computed_and_reused_outputs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source: Artifact = make_source(tmp_path)

    def score(engine: Path, suite: str) -> list[ItemScore]:
        return [ItemScore("i", "h", 1.0)]

    logs = []
    for _ in range(2):  # two jobs in turn: the first computes, the second reuses
        caplog.clear()
        with caplog.at_level(logging.INFO):
            PassManager(recipe("a"), Cache(tmp_path / "cache")).run(source)
            cached_scores(score, tmp_path, "e" * 64, "reasoning", {}, tmp_path)
        logs.append(caplog.text)
    found = sweep_store.count(logs)
    assert len(found["passes"]) == len(recipe("a"))
    assert all(counts == {"computed": 1, "reused": 1} for counts in found["passes"].values())
    assert found["scores"] == {("reasoning", "e" * 12): {"computed": 1, "reused": 1}}
