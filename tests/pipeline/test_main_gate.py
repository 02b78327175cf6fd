"""The eval gate at the end of ``python -m pipeline``: verdict in the record and the summary,
exit code 3 on FAIL and 4 on INCONCLUSIVE, one-line errors for bad eval settings (tiny engines:
reasoning suite only, whose prompts fit their 256 positions)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.manifest import engine_files
from tests.pipeline.test_main import QUICK_BENCH, REPO, run_pipeline

GATE = ["eval=quick", "eval.suites=[reasoning]", "eval.limit=12", "eval.resamples=2000"]


@pytest.fixture(scope="module")
def int8_run(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    workdir = tmp_path_factory.mktemp("gate")
    quant = ["quant=int8", "quant.calibration.num_samples=4", "quant.calibration.seq_len=32"]
    result = run_pipeline(
        tiny_llama, workdir, "run", "bench=none", *quant, "quant.sensitivity.enabled=false", *GATE
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "published llama/int8/ort-cpu@1 to artifacts/registry" in result.stdout
    return workdir, json.loads((workdir / "run" / "manifest.json").read_text())


def test_a_passing_run_is_published_and_pulls_back_intact(
    int8_run: tuple[Path, dict], tmp_path: Path
) -> None:
    from pipeline.core.artifacts import file_digests
    from pipeline.registry import LocalRegistry, Ref

    workdir, manifest = int8_run
    store = LocalRegistry(workdir / "artifacts" / "registry")
    record = store.resolve(Ref.parse("llama/int8@1"))
    assert record["engine"]["digest"] == manifest["engine"]["digest"] and record["forced"] is None
    pulled = store.pull(Ref.parse("llama/int8"), tmp_path / "pulled")
    assert file_digests(pulled / "engine") == file_digests(workdir / "run" / "engine")


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
    assert gate["settings"]["chat"] is False  # resolved and recorded: the tiny tokenizer has no template


def test_a_failing_gate_exits_3_with_the_record_written(
    tiny_llama: Path, int8_run: tuple[Path, dict]
) -> None:
    workdir, first = int8_run
    quant = ["quant=int8", "quant.calibration.num_samples=4", "quant.calibration.seq_len=32"]
    strict = "eval.drift.bits8.max_kl=0"  # every int8 engine moves the distribution a little
    result = run_pipeline(
        tiny_llama, workdir, "strict", "bench=none", *quant, "quant.sensitivity.enabled=false", *GATE, strict
    )
    assert result.returncode == 3, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("gate FAIL: token drift: KL ")
    assert "breaks max_kl=0 (family bits8)" in result.stderr.strip().splitlines()[-1]
    manifest = json.loads((workdir / "strict" / "manifest.json").read_text())
    assert manifest["gate"]["verdict"] == "FAIL" and "Eval gate" in result.stdout
    assert manifest["gate"]["suites"]["reasoning"]["verdict"] == "PASS"
    assert manifest["drift_family"] == "bits8" and manifest["gate"]["drift"]["verdict"] == "FAIL"
    assert "not published: the gate FAILed" in result.stdout
    # Both engines' scores came from the cache of the first run: same items, same numbers.
    assert (
        manifest["gate"]["suites"]["reasoning"]["difference"]
        == first["gate"]["suites"]["reasoning"]["difference"]
    )


def test_an_inconclusive_gate_exits_4_and_publishes_to_no_channel(
    tiny_llama: Path, int8_run: tuple[Path, dict]
) -> None:
    workdir, _ = int8_run
    quant = ["quant=int8", "quant.calibration.num_samples=4", "quant.calibration.seq_len=32"]
    # No engine recovers 150% of its baseline, and 12 items show no regression either.
    unsure = "eval.thresholds.reasoning.min_recovery=1.5"
    result = run_pipeline(
        tiny_llama, workdir, "unsure", "bench=none", *quant, "quant.sensitivity.enabled=false", *GATE, unsure
    )
    assert result.returncode == 4, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("gate INCONCLUSIVE: reasoning: recovery") and "below min_recovery=1.5" in last
    manifest = json.loads((workdir / "unsure" / "manifest.json").read_text())
    row = manifest["gate"]["suites"]["reasoning"]
    assert row["verdict"] == "INCONCLUSIVE" and row["resolution"]["items_needed"] >= 1
    assert "items would settle max_drop=0.15 (it has 12)" in row["reasons"][-1]
    assert "not published to any channel: the gate was INCONCLUSIVE" in result.stdout


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["eval.suites=[reasonin]"], "error: eval.suites: unknown suite 'reasonin'; choose from"),
        (["eval.suites=[]"], "error: eval.suites is empty"),
        (["eval.rank_metric=f1"], "error: eval.rank_metric='f1': choose one of acc, acc_norm"),
        (["registry.channel=prod"], "error: unknown channel 'prod': use one of nightly, candidate, stable"),
        (["registry.recipe=../x"], "error: registry.recipe '../x' is not a registry name"),
        (["registry=mlflow"], "error: registry=mlflow needs registry.uri (e.g. http://127.0.0.1:5000)"),
    ],
)
def test_bad_eval_settings_are_one_line(
    tiny_llama: Path, tmp_path: Path, overrides: list[str], needle: str
) -> None:
    result = run_pipeline(tiny_llama, tmp_path, "run", *QUICK_BENCH, "eval=quick", *overrides)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(needle), result.stderr[-2000:]


# --------------------------------------------------------------------------------------------
# python -m pipeline.gate: any two engine folders


def gate_cli(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "pipeline.gate",
        "--eval",
        "quick",
        "--cache-dir",
        str(workdir / "cache"),
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def none_run(tiny_llama: Path, int8_run: tuple[Path, dict]) -> Path:
    workdir, _ = int8_run
    result = run_pipeline(tiny_llama, workdir, "none", "bench=none", "quality.enabled=false")
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir / "none"


def test_standalone_gate_judges_two_engine_folders(int8_run: tuple[Path, dict], none_run: Path) -> None:
    workdir, manifest = int8_run
    sets = ["--set", "suites=[reasoning]", "limit=12", "resamples=2000"]
    result = gate_cli(
        workdir, "--baseline", str(none_run / "engine"), "--candidate", str(workdir / "run"), *sets
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Eval gate (quick suites, rank scoring): PASS" in result.stdout and "gate PASS" in result.stdout
    strict = gate_cli(
        workdir, "--baseline", str(none_run), "--candidate", str(workdir / "run"), *sets,
        "drift.bits8.max_kl=0", "--json", str(workdir / "gate.json"),
    )  # fmt: skip
    assert strict.returncode == 3 and strict.stderr.strip().splitlines()[-1].startswith(
        "gate FAIL: token drift: KL"
    )
    record = json.loads((workdir / "gate.json").read_text())
    assert (
        record["suites"]["reasoning"]["difference"] == manifest["gate"]["suites"]["reasoning"]["difference"]
    )
    assert record["kl"] > 0 and record["drift"]["family"] == "bits8"  # measured here, held-out text
    assert record["kl"] == pytest.approx(manifest["quality"]["kl_mean"], rel=1e-4)
    unmeasured = gate_cli(
        workdir, "--baseline", str(none_run), "--candidate", str(workdir / "run"), *sets, "--no-kl"
    )
    assert unmeasured.returncode == 4 and "gate INCONCLUSIVE: token drift" in unmeasured.stderr
    # an engine whose manifest records no family is judged by the family named, or refused
    recorded = json.loads((workdir / "run" / "manifest.json").read_text())
    old = workdir / "old-run"
    shutil.copytree(workdir / "run", old)
    (old / "manifest.json").write_text(json.dumps({**recorded, "drift_family": None}))
    refused = gate_cli(workdir, "--baseline", str(none_run), "--candidate", str(old), *sets, "--no-kl")
    assert refused.returncode == 2 and "records no recipe family" in refused.stderr
    assert "--set family=<fp32|bits16|bits8|bits4|pruned>" in refused.stderr
    named = gate_cli(
        workdir, "--baseline", str(none_run), "--candidate", str(old), *sets, "family=bits8", "--no-kl"
    )
    assert named.returncode == 4 and "family bits8 bounds the token-level drift" in named.stderr


def test_standalone_gate_bad_inputs_are_one_line(int8_run: tuple[Path, dict], none_run: Path) -> None:
    workdir, _ = int8_run
    lone = workdir / "lone" / "engine"
    shutil.copytree(workdir / "run" / "engine", lone)
    other = workdir / "other"
    shutil.copytree(none_run, other)
    tokenizer = other / "engine" / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + "\n")  # same tokens, other bytes: still refused
    changed = workdir / "changed"
    shutil.copytree(other, changed)  # the edit not recorded: the engine no longer matches its run
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["engine"]["files"] = engine_files(other / "engine")  # the edit recorded: a tokenizer check
    (other / "manifest.json").write_text(json.dumps(manifest))
    cases = {
        "no manifest.json beside it": ("--baseline", str(none_run), "--candidate", str(lone)),
        "the candidate's tokenizer.json differs": ("--baseline", str(none_run), "--candidate", str(other)),
        "tokenizer.json changed since the run recorded it": (
            "--baseline",
            str(none_run),
            "--candidate",
            str(changed),
        ),
        "unknown suite 'math'": (
            "--baseline",
            str(none_run),
            "--candidate",
            str(none_run),
            "--set",
            "suites=[math]",
        ),
    }
    for needle, args in cases.items():
        result = gate_cli(workdir, *args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], (
            needle,
            result.stderr[-2000:],
        )
