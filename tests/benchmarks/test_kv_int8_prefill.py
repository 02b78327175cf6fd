"""``python -m benchmarks.kv_int8_prefill`` and ``python -m benchmarks.decode_floor`` on tiny engines with an
int8 and an fp32 KV cache: every engine is measured at every length with ratios against the
fp32-cache engine, the floor comes from measured bytes and bandwidth, and bad folders are one
usage line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from passes.fusion.fuse import FusionPass
from passes.kv_cache import KvCachePass
from passes.ort_build import OrtCpuBuildPass
from pipeline.core.artifacts import Artifact
from tests.conftest import run_pass

REPO = Path(__file__).resolve().parents[2]


def run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The benchmark as its users run it: ``python -m benchmarks.<module>`` from the repository root."""
    command = [sys.executable, "-m", f"benchmarks.{module}", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def engines(tiny_graph: Artifact, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    built = {}
    for dtype in ("int8", "fp32"):
        cache = tmp_path_factory.mktemp(dtype)
        graph = run_pass(
            KvCachePass(layout="shared", dtype=dtype, calibration={"num_samples": 4, "seq_len": 64}),
            tiny_graph,
            cache,
        )[0]
        graph = run_pass(FusionPass(), graph, cache)[0]
        built[dtype] = run_pass(OrtCpuBuildPass(max_length=128), graph, cache)[0].path
    return built


def test_the_prefill_table_compares_each_engine_with_the_fp32_cache(
    engines: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "prefill.json"
    args = ["--int8", str(engines["int8"]), "--fp32", str(engines["fp32"]), "--tokens", "20", "40"]
    result = run("kv_int8_prefill", *args, "--new-tokens", "4", "--repeats", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    names = ["fp32 cache", "int8 cache, prefill graph", "int8 cache, int8 kernel only"]
    assert [(r["tokens"], r["engine"]) for r in rows] == [(n, name) for n in (20, 40) for name in names]
    assert all(r["ttft_s"] > 0 and r["tpot_s"] > 0 for r in rows)
    assert [r["ttft_vs_fp32"] for r in rows if r["engine"] == "fp32 cache"] == [1.0, 1.0]
    assert "load average" in result.stdout and "TTFT ms" in result.stdout


def test_the_floor_is_bytes_over_measured_bandwidth(engines: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    args = ["--engine", str(engines["int8"]), "--contexts", "16", "48", "--new-tokens", "4", "--repeats", "1"]
    result = run("decode_floor", *args, "--bandwidth-mib", "64", "--json", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads(out.read_text())
    best = max(record["read_bandwidth_gb_s"].values()) * 1e9
    short, long = record["rows"]
    assert (
        record["kv_dtype"] == "int8"
        and long["bytes_per_step"] > short["bytes_per_step"] > record["weights"]["read"]
    )
    assert short["floor_ms"] == pytest.approx(short["bytes_per_step"] / best * 1e3)
    assert "GroupQueryAttention" in short["profile_ms_per_step"] and short["tpot_ms"] > 0


def test_folders_without_an_engine_are_one_usage_line(tmp_path: Path) -> None:
    for module, args in (
        ("kv_int8_prefill", ["--int8", str(tmp_path), "--fp32", str(tmp_path)]),
        ("decode_floor", ["--engine", str(tmp_path)]),
    ):
        result = run(module, *args)
        assert result.returncode == 2 and "no engine.json there" in result.stderr
        assert "Traceback" not in result.stderr
