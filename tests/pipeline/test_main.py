"""``python -m pipeline`` end to end on a tiny Llama: engine, run record, cache reuse,
exit code 2 with one line for user mistakes, Ctrl-C and SIGTERM leave nothing half-written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.artifacts import file_digests

REPO = Path(__file__).resolve().parents[2]
QUICK_BENCH = [
    "bench=quick",
    "bench.prompt_lengths=[16,32]",
    "bench.decode_tokens=8",
    "bench.decode_prompt_length=16",
    "bench.repeats=2",
]


def pipeline_command(model: Path, workdir: Path, run: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pipeline",
        f"model.path={model}",
        f"pipeline.cache_dir={workdir / 'cache'}",
        f"pipeline.models_dir={workdir / 'models'}",
        f"hydra.run.dir={workdir / run}",
        *extra,
    ]


def run_pipeline(model: Path, workdir: Path, run: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        pipeline_command(model, workdir, run, *extra), cwd=workdir, env=env, capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def first_run(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    workdir = tmp_path_factory.mktemp("cli")
    result = run_pipeline(tiny_llama, workdir, "run1", *QUICK_BENCH)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "not published: no gate verdict (not-run)" in result.stdout  # eval=none: nothing to trust
    return workdir, json.loads((workdir / "run1" / "manifest.json").read_text())


def test_run_writes_engine_and_record(first_run: tuple[Path, dict]) -> None:
    workdir, manifest = first_run
    assert manifest["schema_version"] == 1
    assert [p["name"] for p in manifest["passes"]] == ["export", "ort_build"]
    assert not any(p["cache_hit"] for p in manifest["passes"])
    assert manifest["passes"][0]["metrics"]["parity"]["top1_agreement"] == 1.0
    assert manifest["passes"][1]["input_digest"] == manifest["passes"][0]["output_digest"]
    assert manifest["source"]["origin"]["kind"] == "local"
    assert manifest["libraries"]["onnxruntime"] and manifest["host"]["logical_cores"] >= 1
    engine_dir = workdir / "run1" / "engine"
    on_disk = file_digests(engine_dir)
    assert {f["path"]: f["sha256"] for f in manifest["engine"]["files"]} == on_disk
    assert manifest["recipe"]["export"]["_target_"] == "passes.export.ExportPass"


def test_run_records_resources_per_pass(first_run: tuple[Path, dict]) -> None:
    for record in first_run[1]["passes"]:
        resources = record["resources"]
        assert set(resources) == {"cpu_seconds", "peak_rss_bytes", "gpu_peak_bytes", "estimate_bytes"}
        assert resources["peak_rss_bytes"] > 0 and resources["cpu_seconds"] >= 0
        assert resources["estimate_bytes"] > 0  # the memory preflight's, from the tiny config.json


def test_run_records_quality_on_held_out_text(first_run: tuple[Path, dict]) -> None:
    quality, engine_digest = first_run[1]["quality"], first_run[1]["engine"]["digest"]
    assert quality["same_engine"] and quality["engine"] == quality["reference"] == engine_digest
    assert quality["perplexity"] > 1 and quality["tokens_scored"] > 1000
    assert quality["kl_mean"] == 0.0 and quality["top1_agreement"] == 1.0 and not quality["cache_hit"]


def test_run_benchmarks_the_engine(first_run: tuple[Path, dict]) -> None:
    bench = first_run[1]["benchmark"]
    assert set(bench["ttft"]) == {"16", "32"}
    assert all(v["runs"] == 2 and v["median_ms"] > 0 for v in bench["ttft"].values())
    assert bench["tpot"]["tokens"] == 8 and bench["tpot"]["median_ms"] > 0
    assert bench["peak_rss_mib"] > 0 and len(bench["load_average"]["before"]) == 3


def test_second_run_is_served_from_cache(first_run: tuple[Path, dict], tiny_llama: Path) -> None:
    workdir, manifest = first_run
    result = run_pipeline(tiny_llama, workdir, "run2", *QUICK_BENCH)
    assert result.returncode == 0, result.stderr[-3000:]
    again = json.loads((workdir / "run2" / "manifest.json").read_text())
    assert [p["cache_hit"] for p in again["passes"]] == [True, True]
    assert again["engine"]["digest"] == manifest["engine"]["digest"]
    # The identical engine on the same host is not re-measured; the record says so.
    assert manifest["benchmark"]["cache_hit"] is False and again["benchmark"]["cache_hit"] is True
    assert again["benchmark"]["ttft"] == manifest["benchmark"]["ttft"]
    assert again["benchmark"]["measured_at"] == manifest["benchmark"]["measured_at"]
    assert again["quality"]["cache_hit"]
    assert again["quality"]["perplexity"] == manifest["quality"]["perplexity"]
    assert "hit" in result.stdout and "(cached)" in result.stdout


def test_benchmark_reuse_false_measures_again(first_run: tuple[Path, dict], tiny_llama: Path) -> None:
    workdir, manifest = first_run
    result = run_pipeline(tiny_llama, workdir, "run4", *QUICK_BENCH, "bench.reuse=false")
    assert result.returncode == 0, result.stderr[-3000:]
    bench = json.loads((workdir / "run4" / "manifest.json").read_text())["benchmark"]
    assert bench["cache_hit"] is False and bench["measured_at"] >= manifest["benchmark"]["measured_at"]


def test_a_broken_benchmark_record_is_measured_again(first_run: tuple[Path, dict], tiny_llama: Path) -> None:
    workdir, _ = first_run
    records = sorted((workdir / "cache" / "bench").glob("*.json"))
    assert records
    for record in records:
        record.write_text("{half a rec")  # what a disk-full or a bug could leave
    result = run_pipeline(tiny_llama, workdir, "run5", *QUICK_BENCH)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    bench = json.loads((workdir / "run5" / "manifest.json").read_text())["benchmark"]
    assert bench["cache_hit"] is False and bench["ttft"]
    assert any(json.loads(record.read_text()).get("ttft") for record in records)  # stored whole again


def test_benchmark_can_be_skipped(first_run: tuple[Path, dict], tiny_llama: Path) -> None:
    workdir, _ = first_run
    result = run_pipeline(tiny_llama, workdir, "run3", "bench=none")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((workdir / "run3" / "manifest.json").read_text())["benchmark"] is None


def test_cache_disabled_leaves_no_cache(tiny_llama: Path, tmp_path: Path) -> None:
    result = run_pipeline(tiny_llama, tmp_path, "run", "bench=none", "pipeline.cache=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "engine" / "engine.json").is_file()
    assert not (tmp_path / "cache").exists()
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".") and p.name != ".hydra"]


@pytest.mark.parametrize(
    ("model_override", "needle"),
    [
        ("model.path=/nonexistent/llama", "/nonexistent/llama does not exist"),
        ("model.path=/etc", "config.json is missing"),
        ("kv_cache=shared kv_cache.dtype=fp8", "fp8 needs layout=concat"),  # refused by the pass
    ],
)
def test_user_mistake_is_one_line_and_exit_code_2(tmp_path: Path, model_override: str, needle: str) -> None:
    command = [sys.executable, "-m", "pipeline", *model_override.split(), f"hydra.run.dir={tmp_path / 'run'}"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in result.stdout + result.stderr


def test_bad_order_fails_before_touching_the_model(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "pipeline", "pipeline.order=[export]",
               f"pipeline.models_dir={tmp_path / 'models'}", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2 and "ends with an ONNX graph" in result.stderr
    assert not (tmp_path / "models").exists()  # nothing downloaded


@pytest.mark.parametrize("when", ["export: running", "build: running", "benchmark: running"])
def test_ctrl_c_leaves_no_partial_output(tiny_llama: Path, tmp_path: Path, when: str) -> None:
    interrupt_and_check(tiny_llama, tmp_path, when, signal.SIGINT, 130)


@pytest.mark.parametrize("when", ["build: running", "benchmark: running"])
def test_sigterm_leaves_no_partial_output(tiny_llama: Path, tmp_path: Path, when: str) -> None:
    """``kill``, Slurm's time limit, container runtimes: SIGTERM cleans up like Ctrl-C, exits with
    143, and leaves no benchmark process behind (it runs in a child process)."""
    interrupt_and_check(tiny_llama, tmp_path, when, signal.SIGTERM, 143)
    import psutil

    def ours(process: psutil.Process) -> bool:
        try:
            return any(str(tmp_path) in part for part in process.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return False

    assert not [process for process in psutil.process_iter() if ours(process)]


def interrupt_and_check(tiny_llama: Path, tmp_path: Path, when: str, signum: int, code: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = pipeline_command(tiny_llama, tmp_path, "run", *QUICK_BENCH, "export.opset=18")
    # Restore SIGINT's default in the child: under a non-interactive shell's background job (a
    # CI runner, nohup) it is inherited as ignored, and Python then installs no Ctrl-C handler.
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert process.stdout is not None
    for line in process.stdout:
        if when in line:
            process.send_signal(signum)
            break
    output = process.stdout.read()
    assert process.wait(timeout=120) == code, output
    assert "interrupted" in output
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".hydra", "__main__.log"]
    assert list((tmp_path / "cache" / ".staging").iterdir()) == []
    for entry in (tmp_path / "cache").iterdir():
        if entry.name in ("bench", "quality"):  # records written whole by rename
            assert all(json.loads(record.read_text()) for record in entry.iterdir())
        else:
            assert entry.name == ".staging" or (entry / "entry.json").is_file()
