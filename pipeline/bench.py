"""Benchmark stage: TTFT (prefill) per prompt length and TPOT (per decoded token) of an engine.

Runs in its own process (``python -m pipeline.bench ENGINE``) so that peak RSS is the engine's,
not the pipeline's (which held a torch model). Prompts are seeded random token ids, so every
engine of a model sees the same input. Each figure is the median over ``repeats`` runs after
``warmup`` runs; the machine's load average is recorded before and after, since this machine
is shared and noisy.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from tqdm.auto import tqdm

from pipeline.artifacts import write_json
from pipeline.cache import library_versions
from pipeline.config import BenchConfig
from pipeline.errors import EngineError

log = logging.getLogger(__name__)

BENCH_SCHEMA_VERSION = 1


def host_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def summarize(seconds: list[float]) -> dict[str, Any]:
    """Median, min, max and the raw samples of timings given in seconds, in milliseconds."""
    return {
        "median_ms": round(statistics.median(seconds) * 1e3, 3),
        "min_ms": round(min(seconds) * 1e3, 3),
        "max_ms": round(max(seconds) * 1e3, 3),
        "runs": len(seconds),
        "samples_ms": [round(s * 1e3, 3) for s in seconds],
    }


def _prompt(rng: np.random.Generator, vocab: int, batch: int, length: int) -> list[list[int]]:
    low = min(100, vocab // 4)  # skip the special tokens at the start of the vocabulary
    return rng.integers(low, vocab, size=(batch, length)).tolist()


def run_benchmark(engine_dir: Path, config: BenchConfig) -> dict[str, Any]:
    """Measure one engine in this process; return the benchmark record."""
    from pipeline.runtime import Engine, GenerationConfig

    engine = Engine(engine_dir)
    max_length = engine.max_length
    rng = np.random.default_rng(config.seed)
    vocab = engine.io.vocab_size
    lengths = [n for n in config.prompt_lengths if n + 1 <= max_length]
    skipped = [n for n in config.prompt_lengths if n + 1 > max_length]
    decode_prompt = min(config.decode_prompt_length, max_length - config.decode_tokens - 1)
    if decode_prompt < 1:
        raise EngineError(f"bench.decode_tokens={config.decode_tokens} does not fit max_length {max_length}")
    runs = config.warmup + config.repeats
    load_before = os.getloadavg()
    bar = tqdm(total=runs * (len(lengths) + 1), desc="benchmark", unit="run")

    ttft: dict[str, Any] = {}
    for length in lengths:
        prompts = _prompt(rng, vocab, config.batch_size, length)
        samples = []
        for run in range(runs):
            result = engine.generate_ids(prompts, GenerationConfig(max_new_tokens=1, stop_at_eos=False))
            if run >= config.warmup:
                samples.append(result.prefill_seconds)
            bar.update()
        ttft[str(length)] = summarize(samples)

    prompts = _prompt(rng, vocab, config.batch_size, decode_prompt)
    per_run_tpot = []
    for run in range(runs):
        gen = GenerationConfig(max_new_tokens=config.decode_tokens, stop_at_eos=False)
        result = engine.generate_ids(prompts, gen)
        if run >= config.warmup:
            per_run_tpot.append(statistics.mean(result.step_seconds))
        bar.update()
    bar.close()
    return {
        "schema_version": BENCH_SCHEMA_VERSION,
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "config": asdict(config),
        "ttft": ttft,
        "skipped_prompt_lengths": skipped,
        "tpot": {**summarize(per_run_tpot), "prompt_length": decode_prompt, "tokens": config.decode_tokens},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "load_average": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in os.getloadavg()],
        },
        "threads": engine.model.session.get_session_options().intra_op_num_threads,
        "host": host_info(),
    }


def benchmark_in_subprocess(engine_dir: Path, config: BenchConfig, out_json: Path) -> dict[str, Any]:
    """Run :func:`run_benchmark` in a fresh interpreter; raise EngineError if it fails."""
    command = [
        sys.executable,
        "-m",
        "pipeline.bench",
        str(engine_dir),
        "--json",
        str(out_json),
        "--config",
        json.dumps(asdict(config)),
    ]
    start = time.perf_counter()
    try:
        result = subprocess.run(command, stderr=subprocess.PIPE, text=True, timeout=config.timeout_s)
    except subprocess.TimeoutExpired:
        raise EngineError(
            f"benchmark of {engine_dir} took over {config.timeout_s} s: raise bench.timeout_s"
        ) from None
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or ["no output"]
        raise EngineError(f"benchmark of {engine_dir} failed: {lines[-1]}")
    record = json.loads(out_json.read_text())
    record["wall_seconds"] = round(time.perf_counter() - start, 1)
    return record


def bench_key(engine_digest: str, config: BenchConfig) -> str:
    """Same engine, benchmark settings, host and libraries: the same measurement."""
    settings = {k: v for k, v in asdict(config).items() if k not in ("reuse", "timeout_s")}
    payload = {
        "engine": engine_digest,
        "config": settings,
        "host": host_info(),
        "libs": library_versions(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def measure(
    engine_dir: Path, engine_digest: str, config: BenchConfig, cache_dir: Path | None
) -> dict[str, Any]:
    """Benchmark an engine. With ``cache_dir`` and ``config.reuse``, an earlier measurement of the
    identical engine with the same settings on this host is reused (the record then says
    ``cache_hit: true`` and when it was measured); a new measurement is stored there."""
    cached = cache_dir / "bench" / f"{bench_key(engine_digest, config)}.json" if cache_dir else None
    if cached is not None and cached.is_file() and config.reuse:
        return {**json.loads(cached.read_text()), "cache_hit": True}
    log.info("benchmark: running (%s)", ", ".join(f"TTFT@{n}" for n in config.prompt_lengths) + ", TPOT")
    handle, name = tempfile.mkstemp(prefix="bench-", suffix=".json")
    os.close(handle)
    scratch = Path(name)
    try:
        record = {**benchmark_in_subprocess(engine_dir, config, scratch), "cache_hit": False}
    finally:
        scratch.unlink(missing_ok=True)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_json(cached, record)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench", description=__doc__.splitlines()[0])
    parser.add_argument("engine", type=Path, help="engine folder (engine.json inside)")
    parser.add_argument("--json", type=Path, help="write the record here (default: print it)")
    parser.add_argument("--config", default="{}", help="BenchConfig fields as JSON")
    args = parser.parse_args(argv)
    try:
        record = run_benchmark(args.engine, BenchConfig(**json.loads(args.config)))
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(record, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
