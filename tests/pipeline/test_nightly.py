"""Nightly builds: a real Hydra multirun with the joblib launcher (two jobs in parallel on the
tiny Llama), the nightly defaults, and the cluster launcher configs validated by Hydra."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.nightly import exit_severity
from tests.pipeline.test_main import REPO

pytest.importorskip("hydra_plugins.hydra_joblib_launcher")

GATE = ["eval=quick", "eval.suites=[reasoning]", "eval.limit=12", "eval.resamples=2000"]
INT8 = [
    "quant=int8",
    "quant.calibration.num_samples=4",
    "quant.calibration.seq_len=32",
    "quant.sensitivity.enabled=false",
]


def tiny_sweep(tiny_llama: Path, tmp_path: Path, sweep: Path) -> list[str]:
    """The arguments of a multirun of the tiny Llama on a store under ``tmp_path``."""
    return [
        "-m",
        f"model.path={tiny_llama}",
        f"pipeline.cache_dir={tmp_path / 'cache'}",
        f"pipeline.models_dir={tmp_path / 'models'}",
        f"hydra.sweep.dir={sweep}",
    ]


def hydra(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "pipeline", *args]
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=1200)


def test_a_joblib_multirun_runs_the_matrix_and_publishes_only_passing_jobs(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Two jobs at once (the same int8 build; one gate asking for more than 12 items can show):
    the PASS is published to the nightly channel, the INCONCLUSIVE is not, and the sweep exits
    with the INCONCLUSIVE's 4."""
    sweep = tmp_path / "sweep"
    result = hydra(
        tmp_path,
        *tiny_sweep(tiny_llama, tmp_path, sweep),
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "+nightly=true",
        "bench=none",
        *INT8,
        *GATE,
        "eval.thresholds.reasoning.min_recovery=0.5,1.5",
    )
    assert result.returncode == 4, result.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in result.stdout + result.stderr  # the launcher ran them
    status = {job: json.loads((sweep / job / "job_status.json").read_text()) for job in ("0", "1")}
    assert status["0"]["exit_code"] == 0 and status["0"]["message"].startswith(
        "published llama/int8/ort-cpu@1 (channel nightly)"
    )
    assert status["1"]["exit_code"] == 4 and status["1"]["message"].startswith("gate INCONCLUSIVE: reasoning")
    assert "job 1 [eval.thresholds.reasoning.min_recovery=1.5]: exit 4" in result.stderr
    # One table for the sweep, printed once at its end; each job's own summary in its folder, and
    # one line of it on the shared stdout (two jobs' tables would interleave there).
    assert result.stdout.count("Sweep: 2 job(s)") == 1
    assert "Passes" not in result.stdout and "Eval gate (" not in result.stdout
    table = result.stdout[result.stdout.index("Sweep: 2 job(s)") :].splitlines()
    rows = {line.split()[1]: line for line in table if line.split()[1:2] in (["0"], ["1"])}
    assert "min_recovery=0.5" in rows["0"] and "PASS" in rows["0"] and "reasoning (Δ)" in table[2]
    assert "min_recovery=1.5" in rows["1"] and "INCONCLUSIVE" in rows["1"] and " 4 " in rows["1"]
    for job in ("0", "1"):
        summary = (sweep / job / "summary.txt").read_text()
        assert "Eval gate (quick suites, rank scoring)" in summary and "…" not in summary
        assert (
            f"job {job}: gate " in result.stdout
            and f"summary in {sweep / job / 'summary.txt'}" in result.stdout
        )
    from pipeline.registry import LocalRegistry, Ref

    store = LocalRegistry(tmp_path / "artifacts" / "registry")
    assert [v["version"] for v in store.index()["versions"]] == [1]
    assert store.resolve(Ref.parse("llama/int8@nightly"))["manifest"]["gate"]["verdict"] == "PASS"


@pytest.mark.parametrize(
    ("codes", "worst"),
    [([0, 4], 4), ([0, 4, 3], 3), ([4, 2, 0], 2), ([3, 1], 3), ([0, 0], 0), ([130, 3, 4], 130)],
)
def test_a_sweep_exits_with_its_worst_job_and_inconclusive_ranks_below_every_failure(
    codes: list[int], worst: int
) -> None:
    assert max(codes, key=exit_severity) == worst


def test_nightly_means_the_full_gate_and_the_nightly_channel() -> None:
    from hydra import compose, initialize_config_dir

    from pipeline.config import register_pipeline_schemas
    from pipeline.core.plugins import discover_passes
    from pipeline.nightly import apply_nightly

    register_pipeline_schemas()
    discover_passes()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        overrides = ["+nightly=true", "eval.limit=40"]
        cfg = compose(config_name="pipeline", overrides=overrides)
        apply_nightly(cfg, overrides)
        assert (cfg.eval.enabled, cfg.eval.size, cfg.eval.limit) == (True, "full", 40)
        assert cfg.registry.channel == "nightly"
        chosen = ["+nightly=true", "eval=quick", "registry.channel=candidate"]
        cfg = compose(config_name="pipeline", overrides=chosen)
        apply_nightly(cfg, chosen)
        assert (cfg.eval.size, cfg.registry.channel) == ("quick", "candidate")  # what the user chose


@pytest.mark.parametrize(
    ("launcher", "plugin", "target", "setting"),
    [
        ("joblib", "hydra_joblib_launcher", "JoblibLauncher", "n_jobs"),
        ("slurm", "hydra_submitit_launcher", "SlurmLauncher", "cpus_per_task"),  # configs/hydra/launcher/
        ("ray_cluster", "hydra_ray_launcher", "RayLauncher", "ray"),  # configs/hydra/launcher/
    ],
)
def test_launcher_configs_are_validated_by_hydra(
    tmp_path: Path, launcher: str, plugin: str, target: str, setting: str
) -> None:
    """``--cfg hydra`` composes each launcher config the README documents for the nightly matrix,
    checked against the plugin's own schema (a misspelt key fails here)."""
    pytest.importorskip(f"hydra_plugins.{plugin}")
    result = hydra(tmp_path, f"hydra/launcher={launcher}", "+nightly=true", "--cfg", "hydra")
    assert result.returncode == 0, result.stderr[-2000:]
    composed = OmegaConf.create(result.stdout).hydra.launcher
    assert composed._target_.endswith(target) and setting in composed
