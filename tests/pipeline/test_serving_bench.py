"""The serving benchmark (pipeline/serving_bench.py) on the tiny random Llama's engine, and
``bench=serving`` through the CLI: record, summary table, plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from pipeline.config import ServingBenchConfig
from pipeline.core.artifacts import Artifact
from pipeline.core.errors import EngineError
from pipeline.runtime import Engine
from pipeline.serving_bench import make_trace, plot_serving, serving_benchmark
from pipeline.summary import serving_table
from tests.pipeline.test_main import run_pipeline

SMALL = {"requests": 6, "prompt_lengths": [4, 40], "output_lengths": [2, 12], "repeats": 1}


def test_trace_is_seeded_and_checked_against_the_engine() -> None:
    config = ServingBenchConfig(**SMALL)
    trace = make_trace(config, vocab=320, max_length=256)
    assert trace == make_trace(config, vocab=320, max_length=256)
    assert trace != make_trace(ServingBenchConfig(**{**SMALL, "seed": 1}), vocab=320, max_length=256)
    assert all(4 <= len(p) <= 40 and 2 <= n <= 12 for p, n in trace)
    with pytest.raises(EngineError, match="exceed the engine's max_length 32"):
        make_trace(config, vocab=320, max_length=32)


def test_record_has_every_mode_and_the_prefix_cache(tiny_engine: Artifact, tmp_path: Path) -> None:
    config = ServingBenchConfig(
        **SMALL, concurrency=[1, 2, 4], prefix_tokens=150, suffix_tokens=20, prefix_repeats=2
    )
    record = serving_benchmark(Engine(tiny_engine.path), config)
    modes = [(r["mode"], r["concurrency"]) for r in record["rows"]]
    assert modes == [("continuous", 1), ("continuous", 2), ("continuous", 4), ("static", 2), ("static", 4)]
    assert record["trace"]["requests"] == 6
    for row in record["rows"]:
        assert row["tokens_per_s"] > 0 and row["ttft_p50_ms"] <= row["ttft_p95_ms"]
    assert record["continuous_ratios"]["1"]["vs_one_by_one"] == 1.0
    assert record["identical_to_one_by_one"] is True
    assert record["continuous_ratios"]["2"]["vs_static"] is not None
    prefix = record["prefix_cache"]
    assert prefix["cached_tokens"] == 128 and prefix["ttft_cached_ms"] > 0
    assert plot_serving(record, tmp_path / "serving.png") == tmp_path / "serving.png"
    assert (tmp_path / "serving.png").stat().st_size > 1000
    console = Console(record=True, width=160)
    console.print(serving_table(record))
    text = console.export_text()
    assert "continuous" in text and "static" in text and "prefix cache" in text
    assert "outputs identical to one by one" in text


def test_prefix_part_is_skipped_when_the_engine_is_too_short(tiny_engine: Artifact) -> None:
    config = ServingBenchConfig(**{**SMALL, "requests": 2}, concurrency=[1], prefix_tokens=1500)
    assert serving_benchmark(Engine(tiny_engine.path), config)["prefix_cache"] is None


def test_bench_serving_from_the_cli(tiny_llama: Path, tmp_path: Path) -> None:
    result = run_pipeline(
        tiny_llama,
        tmp_path,
        "run",
        "bench=serving",
        "bench.prompt_lengths=[16]",
        "bench.decode_tokens=4",
        "bench.decode_prompt_length=8",
        "bench.repeats=1",
        "bench.serving.requests=4",
        "bench.serving.concurrency=[1,2]",
        "bench.serving.prompt_lengths=[4,30]",
        "bench.serving.output_lengths=[2,8]",
        "bench.serving.repeats=1",
        "bench.serving.prefix_tokens=100",
        "bench.serving.suffix_tokens=10",
        "bench.serving.prefix_repeats=1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    serving = manifest["benchmark"]["serving"]
    assert [r["mode"] for r in serving["rows"]] == ["continuous", "continuous", "static"]
    assert serving["plot"] == "serving.png" and (tmp_path / "run" / "serving.png").is_file()
    assert "Serving (4 requests" in result.stdout and "prefix cache" in result.stdout


def test_an_engine_that_cannot_batch_is_skipped_with_the_reason(tiny_graph: Artifact, tmp_path: Path) -> None:
    from tests.passes.test_kv_cache import build, layout

    window = build(layout(tiny_graph, tmp_path, layout="shared", window=8), tmp_path / "engine")
    record = serving_benchmark(Engine(window.path), ServingBenchConfig(**SMALL))
    assert "sliding-window KV buffer" in record["skipped"] and "rows" not in record


def test_a_fused_engine_with_an_int8_slot_pool_is_served(tiny_graph: Artifact, tmp_path: Path) -> None:
    """fusion=ort kv_cache=shared kv_cache.dtype=int8: continuous and static rows, every
    continuous run token for token the one-by-one outputs."""
    from tests.pipeline.runtime.test_serving import KINDS, build_engine

    engine = build_engine(tiny_graph, tmp_path, KINDS["fused-shared-int8"])
    record = serving_benchmark(engine, ServingBenchConfig(**SMALL))
    assert "skipped" not in record and record["identical_to_one_by_one"] is True
    modes = {(row["mode"], row["concurrency"]) for row in record["rows"]}
    assert ("static", 2) in modes and ("continuous", 2) in modes
