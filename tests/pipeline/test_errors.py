"""Every user mistake is one ``error:`` line (exit 2), an OS error one line (exit 1), before any pass
runs: Hydra's own errors, ``*_schema`` entries chosen as options, numbers out of range, folders that
are files, OS errors (a real full disk, a read-only mount, a path under a file), run folders that
never collide, and one-line job statuses of a multirun."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.bench import load_config
from pipeline.config import (
    BenchConfig,
    EvalConfig,
    QualityConfig,
    ServingBenchConfig,
    SpeculativeConfig,
    check_group_choices,
    group_options,
    run_suffix,
    validate_config,
)
from pipeline.core.config import build_config, validate_tree
from pipeline.core.errors import ConfigError, PipelineError, describe_os_error, one_line
from pipeline.nightly import JOB_STATUS, write_job_status
from tests.pipeline.recipe import compose_recipe
from tests.pipeline.test_main import REPO
from tests.untrusted import tmpfs


def cli(workdir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HYDRA_FULL_ERROR", None)
    command = [sys.executable, "-m", "pipeline", *args]
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)


def assert_one_error_line(result: subprocess.CompletedProcess[str], code: int, needle: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert needle in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr and "HYDRA_FULL_ERROR" not in result.stderr
    return lines[0]


# --------------------------------------------------------------------------------------------
# Numbers out of range: refused by the dataclasses, at start-up


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("bench.repeats=0", "bench.repeats=0: must be at least 1"),
        ("bench.warmup=-1", "bench.warmup=-1: must be at least 0"),
        ("bench.batch_size=0", "bench.batch_size=0: must be at least 1"),
        ("bench.decode_tokens=0", "bench.decode_tokens=0: must be at least 1"),
        ("bench.prompt_lengths=[16,0]", "bench.prompt_lengths=[16,0]: each must be"),
        ("bench.timeout_s=0", "bench.timeout_s=0: must be at least 1"),
        ("bench.serving.concurrency=[0]", "bench.serving.concurrency=[0]"),
        ("bench.serving.prompt_lengths=[64,8]", "low <= high"),
        ("quality.window=1", "quality.window=1: must be at least 2"),
        ("quality.max_tokens=0", "quality.max_tokens=0"),
        ("quality.chunk=-1", "quality.chunk=-1"),
        ("eval.confidence=1", "eval.confidence=1.0: must be a number more than 0 and less than 1"),
        ("eval.confidence=0", "eval.confidence=0.0"),
        ("eval.resamples=0", "eval.resamples=0: must be at least 1"),
        ("eval.limit=0", "eval.limit=0: must be at least 1"),
        ("eval.thresholds.reasoning.max_drop=-0.1", "eval.thresholds.reasoning.max_drop=-0.1"),
        ("speculative.k=0", "speculative.k=0: the draft proposes at least 1 token a round"),
        ("pipeline.staging_max_age_h=0", "pipeline.staging_max_age_h=0.0"),
        # upper bounds: a value past them is a typo, and would fail (or never end) much later
        ("bench.repeats=100000", "bench.repeats=100000: must be at most 1000"),
        ("bench.warmup=5000", "bench.warmup=5000: must be at most 1000"),
        ("bench.batch_size=100000", "bench.batch_size=100000: must be at most 1024"),
        ("bench.decode_tokens=100000000", "bench.decode_tokens=100000000: must be at most 1048576"),
        ("bench.prompt_lengths=[16,100000000]", "each must be a whole number from 1 to 1048576"),
        ("bench.timeout_s=100000000", "bench.timeout_s=100000000: must be at most 604800"),
        ("bench.seed=99999999999", "bench.seed=99999999999: must be at most 4294967295"),
        ("bench.serving.concurrency=[1,100000]", "bench.serving.concurrency=[1,100000]: each must be"),
        ("bench.serving.requests=10000000", "bench.serving.requests=10000000: must be at most 65536"),
        ("bench.serving.prefix_repeats=5000", "bench.serving.prefix_repeats=5000: must be at most 1000"),
        ("quality.window=100000000", "quality.window=100000000: must be at most 1048576"),
        ("quality.max_tokens=1000000000", "quality.max_tokens=1000000000: must be at most 16777216"),
        ("eval.resamples=1000000000", "eval.resamples=1000000000: must be at most 1000000"),
        ("eval.threads=100000", "eval.threads=100000: must be at most 1024"),
        ("eval.limit=10000000", "eval.limit=10000000: must be at most 65536"),
        ("eval.thresholds.reasoning.max_drop=2", "eval.thresholds.reasoning.max_drop=2.0"),
        ("speculative.k=1000", "speculative.k=1000: at most 32 draft tokens a round"),
        ("pipeline.staging_max_age_h=1e9", "pipeline.staging_max_age_h=1000000000.0"),
        ("pipeline.max_memory_gib=1e12", "pipeline.max_memory_gib=1000000000000.0"),
    ],
)
def test_numbers_out_of_range_are_refused_at_start_up(override: str, needle: str) -> None:
    cfg = compose_recipe([override])  # Hydra accepts the type; the range is ours
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    assert needle in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["quant=int8", "quant.calibration.seq_len=100000000"],
            "quant.calibration.seq_len=100000000: must be",
        ),
        (["quant=int8", "quant.calibration.num_samples=10000000"], "quant.calibration.num_samples=10000000"),
        (["quant=fp8", "quant.calibration.seed=-1"], "quant.calibration.seed=-1"),
        (["quant=fp8", "quant.calibration.num_processes=100000"], "quant.calibration.num_processes=100000"),
        (
            ["quant=fp8", "quant.calibration.collective_timeout_s=1e9"],
            "quant.calibration.collective_timeout_s=",
        ),
        (
            ["quant=fp8", "quant.percentile=0"],
            "quant.percentile=0.0: must be a number more than 0 and at most 100",
        ),
        (["quant=fp8", "quant.num_bins=100000000"], "quant.num_bins=100000000: must be at most 1048576"),
        (["quant=fp8", "quant.min_top1_agreement=2"], "quant.min_top1_agreement=2.0"),
        (["quant=int4_awq", "quant.grid=100000"], "quant.grid=100000: must be at most 1000"),
        (["quant=int4_awq", "quant.sketch_rows=10000000"], "quant.sketch_rows=10000000"),
        (["quant=int4_gptq", "quant.damp_percent=5"], "quant.damp_percent=5.0"),
        (["quant=int8", "quant.batch_size=100000"], "quant.batch_size=100000: must be from 1 to 1024"),
        (["quant=int8", "quant.sensitivity.seq_len=100000000"], "quant.sensitivity.seq_len=100000000"),
        (["quant=int8", "quant.max_fallback_layers=10000000"], "quant.max_fallback_layers=10000000"),
        (["prune=depth25", "prune.batch_size=100000"], "prune.batch_size=100000: must be from 1 to 1024"),
        (
            ["prune=depth25", "prune.calibration.num_samples=0"],
            "prune.calibration.num_samples=0: at least one",
        ),
        (["kv_cache=shared", "kv_cache.window=100000000"], "kv_cache.window=100000000: use 0 (unbounded)"),
        (["kv_cache=shared", "kv_cache.paged_block_size=100000"], "kv_cache.paged_block_size=100000"),
        (
            ["kv_cache=shared", "kv_cache.dtype=int8", "kv_cache.calibration.num_samples=0"],
            "kv_cache.calibration",
        ),
        (["quant=fp16", "quant.min_top1_agreement=-1"], "quant.min_top1_agreement=-1.0"),
    ],
)
def test_pass_knobs_out_of_range_are_refused_when_the_passes_are_built(
    overrides: list[str], needle: str
) -> None:
    """Each names the knob as the command line writes it (``quant.calibration.seq_len``, not
    ``num_samples``), before anything runs."""
    from pipeline.core.plugins import build_passes

    with pytest.raises(PipelineError) as error:
        build_passes(compose_recipe(overrides))
    assert needle in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_the_defaults_and_every_bench_option_pass() -> None:
    for option in group_options("bench"):
        validate_config(compose_recipe([f"bench={option}"]))
    validate_config(compose_recipe(["eval=full", "speculative=draft", "+nightly=true"]))


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda: build_config(BenchConfig, {"repeats": 0}), "bench.repeats=0"),
        (lambda: build_config(BenchConfig, {"repeats": "3"}), "bench.repeats=3: must be a whole number"),
        (lambda: build_config(BenchConfig, {"serving": {"requests": 0}}), "bench.serving.requests=0"),
        (
            lambda: build_config(ServingBenchConfig, {"output_lengths": [4]}),
            "bench.serving.output_lengths=[4]",
        ),
        (lambda: build_config(QualityConfig, {"window": 1}), "quality.window=1"),
        (lambda: build_config(EvalConfig, {"confidence": 1.5}), "eval.confidence=1.5"),
        (
            lambda: build_config(EvalConfig, {"drift": {"bits4": {"max_kl": -0.1}}}),
            "eval.drift.bits4.max_kl=-0.1",
        ),
        (lambda: validate_tree(SpeculativeConfig(k=0)), "speculative.k=0"),
    ],
)
def test_dataclasses_check_ranges_when_validated(build: object, needle: str) -> None:
    """Built from plain data (python -m pipeline.bench --config's JSON) or in code, an application
    config's ``validate()`` runs on it and each dataclass nested in it (the serving settings)."""
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace(".", r"\.")):
        build()  # type: ignore[operator]


def test_the_gate_cli_eval_settings_are_checked_when_built() -> None:
    from pipeline.gate import load_eval_config

    with pytest.raises(PipelineError, match=r"eval\.resamples=0: must be at least 1"):
        load_eval_config("quick", ["resamples=0"])  # the gate CLI may add where it came from
    assert load_eval_config("quick", ["confidence=0.9"]).confidence == 0.9


def test_bench_cli_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="not JSON"):
        load_config("{")
    with pytest.raises(ConfigError, match="no BenchConfig field 'repeatz'"):
        load_config('{"repeatz": 3}')
    with pytest.raises(ConfigError, match=r"no bench\.serving field 'x'"):
        load_config('{"serving": {"x": 1}}')
    with pytest.raises(ConfigError, match=r"bench\.warmup=-1"):
        load_config('{"warmup": -1}')
    assert load_config('{"repeats": 2, "serving": {"requests": 4}}').serving.requests == 4


def test_bench_cli_mistakes_are_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args, needle in [
        ([str(tmp_path)], "not an engine folder"),
        ([str(tmp_path), "--config", '{"repeats": 0}'], "bench.repeats=0"),
        (["--bogus"], "the following arguments are required: engine"),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "pipeline.bench", *args], env=env, capture_output=True, text=True
        )
        assert_one_error_line(result, 2, needle)


CHILD = """
import os, time
from pipeline.bench import _end_with_parent
_end_with_parent(os.getppid())
print("armed", flush=True)
time.sleep(120)
"""
PARENT = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}])
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_benchmark_process_ends_when_its_parent_is_killed() -> None:
    """SIGKILL of the pipeline (no cleanup can run) does not leave the benchmark running."""
    import psutil

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=env, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    assert parent.stdout.readline().strip() == "armed"
    parent.kill()
    parent.wait(timeout=30)
    try:
        child.wait(timeout=30)
    except psutil.TimeoutExpired:
        assert child.status() == psutil.STATUS_ZOMBIE  # ended, not yet reaped by its new parent


# --------------------------------------------------------------------------------------------
# Keys added with +, folders that are files, *_schema entries


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("+bench.foo=1", "+bench.foo: BenchConfig has no setting 'foo'"),
        ("+bench.serving.bar=1", "+bench.serving.bar"),
        ("+eval.thresholds.reasoning.x=1", "+eval.thresholds.reasoning.x"),
        ("+foo=1", "+foo: PipelineConfig has no setting 'foo'"),
        ("+registry.rooot=/x", "+registry.rooot"),
    ],
)
def test_keys_no_dataclass_declares_are_refused(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("+", r"\+").replace(".", r"\.")):
        validate_config(compose_recipe([override]))


def test_folders_that_are_files_are_refused(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for key in ("pipeline.cache_dir", "pipeline.models_dir", "registry.root"):
        with pytest.raises(ConfigError, match=f"{key}={a_file}: is a file, not a folder; choose another"):
            validate_config(compose_recipe([f"{key}={a_file}"]))
        with pytest.raises(ConfigError, match=f"{a_file} is a file; choose another {key}"):
            validate_config(compose_recipe([f"{key}={a_file / 'sub'}"]))
    validate_config(compose_recipe([f"pipeline.cache_dir={tmp_path / 'new' / 'cache'}"]))
    assert not (tmp_path / "new").exists()  # checking makes nothing


def test_an_interpolation_that_does_not_resolve_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"pipeline\.cache_dir: .*NO_SUCH_VARIABLE_X"):
        validate_config(compose_recipe(["pipeline.cache_dir=${oc.env:NO_SUCH_VARIABLE_X}"]))


def test_schema_entries_are_not_options() -> None:
    assert "int8" in group_options("quant") and not [o for o in group_options("quant") if "schema" in o]
    refused = ["quant=int8_schema", "quant=int8,int8_schema", "bench=bench_schema"]
    for override in refused:
        with pytest.raises(ConfigError, match=r"type schema of the '(quant|bench)' group, not an") as error:
            check_group_choices([override])
        assert "_schema" not in str(error.value).split("choose one of")[1]
    accepted = ["quant=int8", "quant=glob(*)", "registry.recipe=x_schema", "~quant"]
    check_group_choices(accepted)


# --------------------------------------------------------------------------------------------
# Hydra's own errors through the command line: one line, exit 2


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["quantt=int8"], "quantt: the recipe has no setting or group 'quantt'; did you mean quant?"),
        (["quant=int9"], "quant=int9: no such option; did you mean int8? choose one of fp16, fp8,"),
        (["quant=int8_schema"], "quant=int8_schema: int8_schema is the type schema"),
        (["bench.repeatz=3"], "bench.repeatz: 'bench' has no setting or group 'repeatz'; did you mean"),
        (["bench.repeats=abc"], "bench.repeats=abc: Value 'abc' of type 'str' could not be converted"),
        (["bench.repeats=[1"], "bench.repeats=[1: bad override syntax"),
        (["-m", "quant=int9,int8"], "quant=int9: no such option"),
        (
            ["-m", "quant=int8,int4_awq", "quant.exclude=[lm_head]"],
            "quant.exclude: in a multirun, Hydra checks it against the default 'quant' option, which "
            "has no 'exclude', before sweeping 'quant'; write it as ++quant.exclude=[lm_head]",
        ),
        (["--cfg", "jobs"], "argument --cfg/-c: invalid choice: 'jobs'"),
        (["-m", "quant=int8", "--cfg", "job"], "Only one of --run, --multirun, --cfg"),
    ],
)
def test_hydra_errors_are_one_line_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    hydra_cfg = ["--cfg", "job"] if "--cfg" not in args and "-m" not in args else []
    line = assert_one_error_line(cli(tmp_path, *args, *hydra_cfg), 2, needle)
    assert "_schema," not in line and "_schema " not in line.split("choose one of")[-1]
    if "-m" not in args:  # (a multirun's sweep folder is made before each job's config is composed)
        assert not (tmp_path / "artifacts").exists()


def test_help_offers_no_schema_entries(tmp_path: Path) -> None:
    result = cli(tmp_path, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "quant: fp16, fp8, int4_awq, int4_gptq, int8, none\n" in result.stdout
    assert "_schema" not in result.stdout.split("== Config ==")[0]


def test_a_range_error_stops_the_run_before_the_model_is_fetched(tmp_path: Path) -> None:
    """The default model (fetched from PyPI) is never fetched: the check runs first."""
    result = cli(tmp_path, "bench.repeats=0", f"pipeline.models_dir={tmp_path / 'models'}")
    assert_one_error_line(result, 2, "bench.repeats=0: must be at least 1")
    assert not (tmp_path / "models").exists()


def test_a_run_folder_under_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    result = cli(tmp_path, f"hydra.run.dir={tmp_path / 'file' / 'run'}")
    assert_one_error_line(result, 2, f"{tmp_path / 'file'} is a file; choose another hydra.run.dir")


# --------------------------------------------------------------------------------------------
# OS errors: one line naming the path, exit 1


def test_an_os_error_reaching_the_entry_point_is_one_line_exit_1(tmp_path: Path) -> None:
    """sysfs refuses the models folder (EPERM, also as root) before anything is fetched."""
    result = cli(
        tmp_path, "pipeline.models_dir=/sys/llm-pipeline-models", f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert_one_error_line(result, 1, "cannot write /sys/llm-pipeline-models: Operation not permitted")


def test_a_cache_that_cannot_be_written_is_one_line_exit_1(tmp_path: Path, tiny_llama: Path) -> None:
    """The cache's own OS errors (a StorageError naming the folder and its knob) exit 1 too."""
    result = cli(
        tmp_path,
        f"model.path={tiny_llama}",
        "pipeline.cache_dir=/sys/llm-pipeline-cache",
        f"pipeline.models_dir={tmp_path / 'models'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    line = assert_one_error_line(result, 1, "cannot create the cache: /sys/llm-pipeline-cache")
    assert "pipeline.cache_dir" in line
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".hydra", "__main__.log"]


def test_os_errors_name_the_path_and_the_reason(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError) as error:
        (tmp_path / "file" / "out.json").write_text("{}")
    assert describe_os_error(error.value) == f"cannot write {tmp_path / 'file' / 'out.json'}: Not a directory"
    renamed = OSError(errno.EXDEV, os.strerror(errno.EXDEV), "/a", None, "/b")
    renamed.add_note("while placing the engine\n(second line)")
    assert describe_os_error(renamed) == (
        "cannot write /a (to /b): Invalid cross-device link (while placing the engine; (second line))"
    )


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: a real ENOSPC (needs root and mount; skipped elsewhere)."""
    with tmpfs(tmp_path / "disk", "64k") as mount:
        yield mount


def test_a_full_disk_says_disk_full(tiny_disk: Path) -> None:
    with pytest.raises(OSError) as error, open(tiny_disk / "big", "wb") as handle:
        handle.write(b"x" * 200_000)
        handle.flush()
    assert error.value.errno == errno.ENOSPC
    assert "No space left on device (disk full: free space there" in describe_os_error(error.value)


def test_a_read_only_models_folder_is_one_line_exit_1(tiny_disk: Path, tmp_path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], check=True)
    result = cli(tmp_path, f"pipeline.models_dir={tiny_disk / 'models'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_error_line(result, 1, f"cannot write {tiny_disk / 'models'}: Read-only file system")
    assert list(tiny_disk.iterdir()) == []


# --------------------------------------------------------------------------------------------
# Run folders never collide; one-line job statuses


def test_run_suffix_is_stable_within_a_process() -> None:
    first = OmegaConf.create({"dir": "runs/${run_suffix:}", "again": "${run_suffix:}"})
    second = OmegaConf.create({"dir": "runs/${run_suffix:}"})
    assert first.dir == first.dir == second.dir == f"runs/{run_suffix()}" and first.again == run_suffix()
    assert len(run_suffix()) == 6


def test_two_runs_started_in_the_same_second_get_two_folders(tmp_path: Path) -> None:
    """Both stop at a user error after Hydra made their folders (the default hydra.run.dir)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "pipeline", "bench.repeats=0", f"pipeline.models_dir={tmp_path / 'm'}"]
    runs = [subprocess.Popen(command, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True) for _ in "ab"]
    for process in runs:
        assert process.wait(timeout=300) == 2
    folders = sorted((tmp_path / "artifacts" / "runs").iterdir())
    assert len(folders) == 2
    for folder in folders:
        stamp, suffix = folder.name.rsplit("_", 1)
        assert len(stamp) == len("2026-01-01_00-00-00") and len(suffix) == 6
        hydra_yaml = OmegaConf.load(folder / ".hydra" / "hydra.yaml")
        assert hydra_yaml.hydra.runtime.output_dir == str(folder)  # the folder used is the one recorded


def test_job_status_is_one_line(tmp_path: Path) -> None:
    write_job_status(tmp_path, 2, "error: first line\n  detail: second\n\nthird")
    status = json.loads((tmp_path / JOB_STATUS).read_text())
    assert status == {"exit_code": 2, "message": "error: first line; detail: second; third"}
    assert one_line("Could not override 'x'.\nDid you mean y?") == "Could not override 'x'. Did you mean y?"


def test_every_error_of_ours_is_a_pipeline_error() -> None:
    """One error tree: every public exception class our packages define is a PipelineError, so
    every entry point reports it the same way (one line, its exit code). Private ones
    (``_StopForward``) are control flow that never leaves its module."""
    import importlib
    import inspect
    import pkgutil

    from pipeline.core.errors import PipelineError

    ours = []
    for package in ("pipeline", "evals", "passes", "calibration"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                public = cls.__module__ == info.name and not cls.__name__.startswith("_")
                if public and issubclass(cls, Exception):
                    ours.append(cls)
    names = {cls.__qualname__ for cls in ours}
    assert {"GateError", "SuiteError", "LintError", "RegistryError", "EngineError"} <= names
    assert [cls.__qualname__ for cls in ours if not issubclass(cls, PipelineError)] == []


# --------------------------------------------------------------------------------------------
# Knobs bounded by the model's context (max_position_embeddings: 256 for the tiny model)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["quant=int8", "quant.calibration.seq_len=300"],
            "quant.calibration.seq_len=300: longer than the model's context of 256 tokens",
        ),
        (
            ["prune=depth25", "prune.calibration.seq_len=1000"],
            "prune.calibration.seq_len=1000: longer than the model's context of 256 tokens",
        ),
        (
            ["quant=int8", "quant.sensitivity.enabled=true", "quant.sensitivity.seq_len=512"],
            "quant.sensitivity.seq_len=512: longer than the model's context of 256 tokens",
        ),
        (
            ["kv_cache=shared", "kv_cache.window=512"],
            "kv_cache.window=512: more positions than the model's context of 256 tokens",
        ),
        (
            ["kv_cache=concat", "kv_cache.dtype=int8", "kv_cache.calibration.seq_len=257"],
            "kv_cache.calibration.seq_len=257: longer than the model's context of 256 tokens",
        ),
    ],
)
def test_knobs_past_the_model_context_stop_the_run_before_any_pass(
    tmp_path: Path, tiny_llama: Path, overrides: list[str], needle: str
) -> None:
    result = cli(
        tmp_path,
        f"model.path={tiny_llama}",
        f"pipeline.cache_dir={tmp_path / 'cache'}",
        f"pipeline.models_dir={tmp_path / 'models'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        "bench=none",
        *overrides,
    )
    assert_one_error_line(result, 2, needle)
    cache = tmp_path / "cache"
    entries = [p.name for p in cache.iterdir() if not p.name.startswith(".")] if cache.is_dir() else []
    assert entries == [], entries  # no pass ran, nothing was cached
