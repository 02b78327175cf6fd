"""The nightly matrix through the schedulers our users run, on localhost: Slurm's stand-in
(submitit's local executor, ``hydra/launcher=submitit_local``) runs a real sweep of the tiny
Llama, and ``configs/hydra/launcher/slurm.yaml`` is checked against submitit's own parameters
(no Slurm here: a real cluster was not run)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.pipeline.test_main import REPO
from tests.pipeline.test_nightly import GATE, INT8, hydra, tiny_sweep

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")


def test_slurm_launcher_config_fits_submitits_parameters(tmp_path: Path) -> None:
    """What hydra-submitit-launcher hands submitit for ``hydra/launcher=slurm`` (generic keys as
    they are, the others prefixed ``slurm_``, as the plugin maps them) passes submitit's own
    parameter check; a misspelt key would not."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    result = hydra(tmp_path, "hydra/launcher=slurm", "--cfg", "hydra")
    assert result.returncode == 0, result.stderr[-2000:]
    launcher = OmegaConf.to_container(OmegaConf.create(result.stdout).hydra.launcher)
    assert isinstance(launcher, dict)
    generic = set(OmegaConf.structured(BaseQueueConf).keys())
    params = {
        key if key in generic else f"slurm_{key}": value
        for key, value in launcher.items()
        if key not in ("_target_", "submitit_folder", "max_num_timeout")
    }
    assert {"timeout_min", "cpus_per_task", "slurm_partition", "slurm_array_parallelism"} <= set(params)
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="debug")  # no srun needed
    executor.update_parameters(**params)  # raises on a parameter submitit does not have
    with pytest.raises(NameError, match="slurm_partitions"):
        executor.update_parameters(slurm_partitions="gpu")


def test_a_submitit_local_sweep_runs_every_job_and_publishes_them(tiny_llama: Path, tmp_path: Path) -> None:
    """Two jobs (int8 with calibration seeds 0 and 1) through submitit's local executor, Slurm's
    stand-in: each is a separate process submitit starts and collects; both leave a run record
    and a job status, both PASS and are published to the shared registry, and the sweep exits 0."""
    sweep = tmp_path / "sweep"
    result = hydra(
        tmp_path,
        *tiny_sweep(tiny_llama, tmp_path, sweep),
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=20",
        "hydra.launcher.cpus_per_task=1",
        "+nightly=true",
        "bench=none",
        *INT8,
        *GATE,
        "eval.thresholds.reasoning.min_recovery=0.5",
        "quant.calibration.seed=0,1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (sweep / ".submitit").is_dir()  # submitit ran them: its own job folders
    for job in ("0", "1"):
        status = json.loads((sweep / job / "job_status.json").read_text())
        assert status["exit_code"] == 0 and status["message"].startswith("published llama/int8/ort-cpu@")
        assert json.loads((sweep / job / "manifest.json").read_text())["gate"]["verdict"] == "PASS"
    from pipeline.registry import LocalRegistry

    store = LocalRegistry(tmp_path / "artifacts" / "registry")
    assert sorted(v["version"] for v in store.index()["versions"]) == [1, 2]


@pytest.fixture
def ray_head() -> Iterator[str]:
    """A real Ray head on localhost (``ray start --head --port 0``: a free port), its address;
    stopped at teardown. Its temporary folder is short: Ray's sockets live there."""
    pytest.importorskip("ray")
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    start = [*ray, "start", "--head", "--port=0", "--num-cpus=2", "--include-dashboard=false"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the workers import our packages, as jobs do
    started = subprocess.run(
        [*start, f"--temp-dir={temp}", "--disable-usage-stats"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        address = re.search(r"--address='([^']+)'", started.stdout + started.stderr)
        assert address, started.stdout[-2000:]
        yield address[1]
    finally:
        subprocess.run([*ray, "stop", "--force"], capture_output=True, text=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def test_a_sweep_on_a_running_ray_cluster_runs_every_job_and_publishes_them(
    ray_head: str, tiny_llama: Path, tmp_path: Path
) -> None:
    """``hydra/launcher=ray_cluster`` attached to the running head: each job is a Ray task (one
    CPU) in a worker whose working folder is not the launch folder; with the default, relative
    store paths both jobs still leave their run record and job status under the sweep folder,
    PASS, are published to the one registry, and the sweep exits 0."""
    result = hydra(
        tmp_path,
        "-m",
        f"model.path={tiny_llama}",
        "hydra/launcher=ray_cluster",
        f"hydra.launcher.ray.init.address={ray_head}",
        "hydra.launcher.ray.remote.num_cpus=1",
        "+nightly=true",
        "bench=none",
        *INT8,
        *GATE,
        "eval.thresholds.reasoning.min_recovery=0.5",
        "quant.calibration.seed=0,1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Ray Launcher is launching 2 jobs" in result.stdout + result.stderr
    (sweep,) = (tmp_path / "artifacts" / "multirun").iterdir()  # the default, under the launch folder
    assert {"cache", "multirun", "registry"} <= {p.name for p in (tmp_path / "artifacts").iterdir()}
    for job in ("0", "1"):
        status = json.loads((sweep / job / "job_status.json").read_text())
        assert status["exit_code"] == 0 and status["message"].startswith("published llama/int8/ort-cpu@")
    from pipeline.registry import LocalRegistry

    store = LocalRegistry(tmp_path / "artifacts" / "registry")
    assert sorted(v["version"] for v in store.index()["versions"]) == [1, 2]


def test_a_ray_address_must_answer_and_the_store_must_be_writable(tmp_path: Path) -> None:
    """Checked once when the sweep starts (pipeline/cluster.py), one line each: an address where
    nothing listens (ray.init would retry it for minutes), a malformed one, a store under a file."""
    from pipeline.cluster import check_ray_address, check_writable
    from pipeline.core.errors import ConfigError

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        check_ray_address(f"127.0.0.1:{port}")  # something answers
    with pytest.raises(ConfigError, match=rf"address=127.0.0.1:{port}: no Ray cluster answers there"):
        check_ray_address(f"127.0.0.1:{port}", timeout_s=2)
    with pytest.raises(ConfigError, match="give HOST:PORT"):
        check_ray_address("head-node")
    check_ray_address("auto")
    (tmp_path / "file").write_text("")
    check_writable("pipeline.cache_dir", str(tmp_path / "new" / "cache"))  # made when needed
    with pytest.raises(
        ConfigError, match=r"pipeline.cache_dir=.*/file/cache: .*/file is not a writable folder"
    ):
        check_writable("pipeline.cache_dir", str(tmp_path / "file" / "cache"))


def test_a_sweep_with_an_unwritable_store_stops_before_any_job(tiny_llama: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = hydra(
        tmp_path,
        "-m",
        f"model.path={tiny_llama}",
        f"pipeline.cache_dir={tmp_path / 'file' / 'cache'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "quant=none,fp16",
        "bench=none",
        "eval=none",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: pipeline.cache_dir=") and "every job" in lines[0]
    assert not (tmp_path / "sweep").exists() or not any((tmp_path / "sweep").glob("*/manifest.json"))


def test_a_ray_address_nobody_answers_is_one_line_not_a_hang(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    with socket.socket() as closed:  # a port nobody listens on once closed
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    started = time.monotonic()
    result = hydra(
        tmp_path,
        "-m",
        "quant=none,fp16",
        "hydra/launcher=ray_cluster",
        f"hydra.launcher.ray.init.address=127.0.0.1:{port}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no Ray cluster answers there" in lines[0], lines
    assert time.monotonic() - started < 60
