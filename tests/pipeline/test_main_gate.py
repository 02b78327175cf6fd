"""The eval gate at the end of ``python -m pipeline``: verdict in the record and the summary,
exit code 3 on FAIL, one-line errors for bad eval settings (tiny engines: reasoning suite only,
whose prompts fit their 256 positions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.pipeline.test_main import QUICK_BENCH, run_pipeline

GATE = ["eval=quick", "eval.suites=[reasoning]", "eval.limit=12", "eval.resamples=2000"]


@pytest.fixture(scope="module")
def int8_run(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    workdir = tmp_path_factory.mktemp("gate")
    quant = ["quant=int8", "quant.calibration.num_samples=4", "quant.calibration.seq_len=32"]
    result = run_pipeline(
        tiny_llama, workdir, "run", "bench=none", *quant, "quant.sensitivity.enabled=false", *GATE
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, json.loads((workdir / "run" / "manifest.json").read_text())


def test_gate_pairs_the_engine_with_the_reference(int8_run: tuple[Path, dict]) -> None:
    _, manifest = int8_run
    gate = manifest["gate"]
    assert gate["verdict"] == "PASS" and not gate["same_engine"]
    row = gate["suites"]["reasoning"]
    assert (
        row["n"] == 12
        and 0 <= row["baseline_mean"] <= 1
        and row["ci_low"] <= row["difference"] <= row["ci_high"]
    )
    assert gate["kl"] == manifest["quality"]["kl_mean"] and gate["settings"]["rank_metric"] == "acc_norm"


def test_a_failing_gate_exits_3_with_the_record_written(
    tiny_llama: Path, int8_run: tuple[Path, dict]
) -> None:
    workdir, first = int8_run
    quant = ["quant=int8", "quant.calibration.num_samples=4", "quant.calibration.seq_len=32"]
    strict = "eval.thresholds.reasoning.min_recovery=1.5"  # no engine recovers 150% of its baseline
    result = run_pipeline(
        tiny_llama, workdir, "strict", "bench=none", *quant, "quant.sensitivity.enabled=false", *GATE, strict
    )
    assert result.returncode == 3, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("gate FAIL: reasoning: recovery")
    manifest = json.loads((workdir / "strict" / "manifest.json").read_text())
    assert manifest["gate"]["verdict"] == "FAIL" and "Eval gate" in result.stdout
    # Both engines' scores came from the cache of the first run: same items, same numbers.
    assert (
        manifest["gate"]["suites"]["reasoning"]["difference"]
        == first["gate"]["suites"]["reasoning"]["difference"]
    )


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["eval.suites=[reasonin]"], "error: eval.suites: unknown suite 'reasonin'; choose from"),
        (["eval.suites=[]"], "error: eval.suites is empty"),
        (["eval.rank_metric=f1"], "error: eval.rank_metric='f1': choose one of acc, acc_norm"),
    ],
)
def test_bad_eval_settings_are_one_line(
    tiny_llama: Path, tmp_path: Path, overrides: list[str], needle: str
) -> None:
    result = run_pipeline(tiny_llama, tmp_path, "run", *QUICK_BENCH, "eval=quick", *overrides)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(needle), result.stderr[-2000:]
