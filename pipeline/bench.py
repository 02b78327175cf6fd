"""Benchmark stage: TTFT (prefill) per prompt length and TPOT (per decoded token) of an engine.

Runs in its own process (``python -m pipeline.bench ENGINE``) so that peak RSS is the engine's,
not the pipeline's (which held a torch model). Prompts are seeded random token ids, so every
engine of a model sees the same input. Each figure is the median over ``repeats`` runs after
``warmup`` runs; the machine's load average is recorded before and after, since this machine
is shared and noisy. TTFT and TPOT are the target's alone, also for an engine with a draft.

Two optional sections follow, each measured alternately so that load drift hits both sides:
``speculative`` (an engine with a draft: greedy decoding after held-out text windows with and
without the draft, acceptance rate, identical output) and ``vs_reference`` (``--reference``:
TTFT and TPOT of this engine and of the reference engine, e.g. a pruned student and its teacher,
and their ratio). Peak RSS is read before the reference engine loads.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from typing import Any, NoReturn

import numpy as np
import psutil
from tqdm.auto import tqdm

from pipeline.config import BenchConfig, ServingBenchConfig
from pipeline.core.artifacts import write_json
from pipeline.core.cache import library_versions, load_record, read_record, write_record
from pipeline.core.config import build_config
from pipeline.core.engine import read_engine_spec
from pipeline.core.errors import (
    ConfigError,
    EngineError,
    PipelineError,
    print_error,
)
from pipeline.core.files import check_output_file, loads_bounded
from pipeline.core.signals import exit_code, interrupt_on_sigterm
from pipeline.core.subprocesses import child_environment, isolated_python

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


def run_benchmark(engine_dir: Path, config: BenchConfig, reference_dir: Path | None = None) -> dict[str, Any]:
    """Measure one engine in this process; return the benchmark record. With ``reference_dir``,
    then also that engine and this one again, alternately (``vs_reference``)."""
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
            gen = GenerationConfig(max_new_tokens=1, stop_at_eos=False)
            result = engine.generate_ids(prompts, gen, use_draft=False)
            if run >= config.warmup:
                samples.append(result.prefill_seconds)
            bar.update()
        ttft[str(length)] = summarize(samples)

    prompts = _prompt(rng, vocab, config.batch_size, decode_prompt)
    per_run_tpot = []
    for run in range(runs):
        gen = GenerationConfig(max_new_tokens=config.decode_tokens, stop_at_eos=False)
        result = engine.generate_ids(prompts, gen, use_draft=False)
        if run >= config.warmup:
            per_run_tpot.append(statistics.mean(result.step_seconds))
        bar.update()
    bar.close()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before a reference loads
    speculative = speculative_benchmark(engine, config) if engine.draft is not None else None
    serving = None
    if config.serving.enabled:
        from pipeline.serving_bench import serving_benchmark

        serving = serving_benchmark(engine, config.serving)
    versus = None
    if reference_dir is not None:
        versus = versus_reference(
            engine, Engine(reference_dir, speculative=False), config, lengths, decode_prompt
        )
    return {
        "schema_version": BENCH_SCHEMA_VERSION,
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "config": asdict(config),
        "ttft": ttft,
        "skipped_prompt_lengths": skipped,
        "tpot": {**summarize(per_run_tpot), "prompt_length": decode_prompt, "tokens": config.decode_tokens},
        "speculative": speculative,
        "serving": serving,
        "vs_reference": versus,
        "peak_rss_mib": round(peak_rss, 1),
        "load_average": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in os.getloadavg()],
        },
        "threads": (
            session.get_session_options().intra_op_num_threads
            if (session := getattr(engine.model, "session", None))
            else None  # a TensorRT engine
        ),
        "host": host_info(),
    }


def versus_reference(
    engine: Any, reference: Any, config: BenchConfig, lengths: list[int], decode_prompt: int
) -> dict[str, Any]:
    """TTFT at each length and TPOT of the engine and the reference engine, measured alternately
    on the same prompts, and engine / reference (below 1: the engine is faster)."""
    from pipeline.runtime import GenerationConfig

    rng = np.random.default_rng(config.seed + 1)
    vocab = engine.io.vocab_size
    runs = config.warmup + config.repeats
    pair = {"engine": engine, "reference": reference}
    bar = tqdm(total=runs * (len(lengths) + 1) * 2, desc="vs reference", unit="run")

    def alternate(prompts: list[list[int]], tokens: int) -> dict[str, list[float]]:
        samples: dict[str, list[float]] = {name: [] for name in pair}
        gen = GenerationConfig(max_new_tokens=tokens, stop_at_eos=False)
        for run in range(runs):
            for name, model in pair.items():
                result = model.generate_ids(prompts, gen, use_draft=False)
                if run >= config.warmup:
                    seconds = result.prefill_seconds if tokens == 1 else statistics.mean(result.step_seconds)
                    samples[name].append(seconds)
                bar.update()
        return samples

    def compared(samples: dict[str, list[float]]) -> dict[str, Any]:
        ratio = statistics.median(samples["engine"]) / statistics.median(samples["reference"])
        return {
            "engine_ms": round(statistics.median(samples["engine"]) * 1e3, 3),
            "reference_ms": round(statistics.median(samples["reference"]) * 1e3, 3),
            "ratio": round(ratio, 3),
        }

    ttft = {str(n): compared(alternate(_prompt(rng, vocab, config.batch_size, n), 1)) for n in lengths}
    tpot = compared(alternate(_prompt(rng, vocab, config.batch_size, decode_prompt), config.decode_tokens))
    bar.close()
    return {"ttft": ttft, "tpot": tpot}


def speculative_benchmark(engine: Any, config: BenchConfig) -> dict[str, Any]:
    """TPOT of greedy decoding with the draft and with the target alone, measured alternately on
    the same held-out text prompts, with the draft's acceptance rate (``decode_tokens`` each)."""
    from evals.agreement import held_out_windows
    from pipeline.config import QualityConfig
    from pipeline.runtime import GenerationConfig

    room = engine.max_length - config.decode_tokens - engine.speculative_k
    length = min(config.speculative_prompt_length, room)
    text = QualityConfig(window=length, max_tokens=length * config.speculative_prompts)
    windows = held_out_windows(engine, text)[: config.speculative_prompts]
    gen = GenerationConfig(max_new_tokens=config.decode_tokens, stop_at_eos=False)
    alone: list[float] = []
    drafted: list[float] = []
    prefill: dict[str, list[float]] = {"target": [], "speculative": []}
    totals = {"proposed": 0, "accepted": 0, "rounds": 0}
    identical = True
    bar = tqdm(total=len(windows) * (config.warmup + config.repeats), desc="speculative", unit="run")
    for window in windows:
        prompt = [window.tolist()]
        for run in range(config.warmup + config.repeats):
            plain = engine.generate_ids(prompt, gen, use_draft=False)
            fast = engine.generate_ids(prompt, gen)
            identical &= plain.tokens == fast.tokens
            if run >= config.warmup:
                alone.append(statistics.mean(plain.step_seconds))
                drafted.append(statistics.mean(fast.step_seconds))
                prefill["target"].append(plain.prefill_seconds)
                prefill["speculative"].append(fast.prefill_seconds)  # + the draft's prefill
            bar.update()
        stats = engine.last_draft_stats  # greedy: the same every run of a prompt
        for name in totals:
            totals[name] += getattr(stats, name)
    bar.close()
    ratio = statistics.median(drafted) / statistics.median(alone)
    return {
        "k": engine.speculative_k,
        "prompts": len(windows),
        "prompt_length": length,
        "tokens": config.decode_tokens,
        "tpot_target": summarize(alone),
        "tpot_speculative": summarize(drafted),
        "tpot_ratio": round(ratio, 3),
        "ttft_target": summarize(prefill["target"]),
        "ttft_speculative": summarize(prefill["speculative"]),
        "acceptance_rate": round(totals["accepted"] / max(totals["proposed"], 1), 4),
        "tokens_per_round": round((totals["accepted"] + totals["rounds"]) / max(totals["rounds"], 1), 3),
        "identical_to_target": identical,
    }


def benchmark_in_subprocess(
    engine_dir: Path, config: BenchConfig, out_json: Path, reference_dir: Path | None = None
) -> dict[str, Any]:
    """Run :func:`run_benchmark` in a fresh interpreter; raise EngineError if it fails."""
    command = isolated_python(
        "pipeline.bench",
        str(engine_dir),
        "--json",
        str(out_json),
        "--config",
        json.dumps(asdict(config)),
        *(["--reference", str(reference_dir)] if reference_dir is not None else []),
        "--parent-pid",
        str(os.getpid()),
    )
    start = time.perf_counter()
    try:
        # Ctrl-C or SIGTERM here (KeyboardInterrupt, pipeline/core/signals.py): subprocess.run kills the
        # child and waits for it before the interrupt goes on; if this process is killed outright,
        # the child ends itself (--parent-pid: the kernel's parent-death signal).
        result = subprocess.run(
            command, stderr=subprocess.PIPE, text=True, timeout=config.timeout_s, env=child_environment()
        )
    except subprocess.TimeoutExpired:
        raise EngineError(
            f"benchmark of {engine_dir} took over {config.timeout_s} s: raise bench.timeout_s"
        ) from None
    if result.returncode < 0:  # killed by a signal: no message of its own
        raise EngineError(f"benchmark of {engine_dir} crashed (signal {-result.returncode})")
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if "%|" not in line]  # not progress bars
        errors = [line for line in lines if line.startswith("error:")]
        raise EngineError(f"benchmark of {engine_dir} failed: {(errors or lines or ['no output'])[-1]}")
    record, problem = read_record(out_json)
    problem = problem or check_bench_record(record)
    if record is None or problem is not None:
        raise EngineError(f"benchmark of {engine_dir} wrote a broken record {out_json}: {problem}")
    record["wall_seconds"] = round(time.perf_counter() - start, 1)
    return record


# Fields of a benchmark record that hold a count or a duration: a non-negative, finite number.
_NON_NEGATIVE = ("_ms", "_s", "_seconds", "_mib", "_rate", "_ratio", "_length", "_tokens")
_NON_NEGATIVE_NAMES = ("ratio", "runs", "tokens", "prompts", "k")


def check_bench_record(record: dict[str, Any]) -> str | None:
    """What is wrong with a benchmark record read back (a cached one, the child's), or None:
    the schema, TTFT and TPOT summaries of finite non-negative times, and no NaN, infinity, or a
    string or negative value where a count or a duration is, anywhere in it."""
    if record.get("schema_version") != BENCH_SCHEMA_VERSION:
        return f"schema_version {record.get('schema_version')!r} is not {BENCH_SCHEMA_VERSION}"
    for key in ("ttft", "tpot"):
        if not isinstance(record.get(key), dict):
            return f"{key} is not an object"
    for key, summary in [*record["ttft"].items(), ("tpot", record["tpot"])]:
        if not isinstance(summary, dict):
            return f"ttft.{key} is not an object"
        for field in ("median_ms", "min_ms", "max_ms", "runs", "samples_ms"):
            if summary.get(field) is None:
                return f"{key}: {field} is missing"
    return _number_problem(record, "")


def _number_problem(value: Any, where: str) -> str | None:
    name = where.rsplit(".", 1)[-1].split("[", 1)[0]
    timed = name.endswith(_NON_NEGATIVE) or name in _NON_NEGATIVE_NAMES
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "config":  # the settings measured with, checked when the key was made
                continue
            if (problem := _number_problem(item, f"{where}.{key}" if where else str(key))) is not None:
                return problem
        return None
    if isinstance(value, list):
        for number, item in enumerate(value):
            if (problem := _number_problem(item, f"{where}[{number}]")) is not None:
                return problem
        return None
    if isinstance(value, float) and not np.isfinite(value):
        return f"{where} is {value}"
    if timed and value is not None:  # None: not measured (a TPOT of 1-token outputs)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{where} {value!r} is not a number"
        if value < 0:
            return f"{where} {value!r} is negative"
    return None


def bench_key(engine_digest: str, config: BenchConfig, reference_digest: str | None = None) -> str:
    """Same engine (and reference), benchmark settings, host and libraries: the same measurement."""
    settings = {k: v for k, v in asdict(config).items() if k not in ("reuse", "timeout_s")}
    payload = {
        "engine": engine_digest,
        **({"reference": reference_digest} if reference_digest else {}),
        "config": settings,
        "host": host_info(),
        "libs": library_versions(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def measure(
    engine_dir: Path,
    engine_digest: str,
    config: BenchConfig,
    cache_dir: Path | None,
    reference: tuple[Path, str] | None = None,
) -> dict[str, Any]:
    """Benchmark an engine, and against ``reference`` (folder, digest) when given. With
    ``cache_dir`` and ``config.reuse``, an earlier measurement of the identical engine with the
    same settings on this host is reused (the record then says ``cache_hit: true`` and when it
    was measured); a new measurement is stored there."""
    key = bench_key(engine_digest, config, reference[1] if reference else None)
    cached = cache_dir / "bench" / f"{key}.json" if cache_dir else None
    stored = load_record(cached, check=check_bench_record) if cached is not None and config.reuse else None
    if stored is not None:  # (a broken record is removed and measured again)
        return {**stored, "cache_hit": True}
    log.info("benchmark: running (%s)", ", ".join(f"TTFT@{n}" for n in config.prompt_lengths) + ", TPOT")
    handle, name = tempfile.mkstemp(prefix="bench-", suffix=".json")
    os.close(handle)
    scratch = Path(name)
    try:
        reference_dir = reference[0] if reference else None
        record = {**benchmark_in_subprocess(engine_dir, config, scratch, reference_dir), "cache_hit": False}
    finally:
        scratch.unlink(missing_ok=True)
    if cached is not None and cache_dir is not None:
        write_record(cache_dir, cached, record)
    return record


def _end_with_parent(parent_pid: int) -> None:
    """Have the kernel send SIGTERM to this process when the process that started it ends (Linux;
    elsewhere nothing), so that a benchmark never outlives a killed pipeline."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent ended before the signal was armed
        raise SystemExit(143)


def load_config(text: str) -> BenchConfig:
    """``--config`` (BenchConfig fields as JSON), checked: one-line ConfigError when bad."""
    try:
        fields = loads_bounded(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--config {text!r}: not JSON ({exc.msg}); pass BenchConfig fields as a JSON object"
        ) from None
    if not isinstance(fields, dict):
        raise ConfigError(f"--config {text!r}: pass BenchConfig fields as a JSON object")
    known = {f.name for f in dataclasses.fields(BenchConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(
            f"--config: no BenchConfig field {unknown[0]!r}; fields: {', '.join(sorted(known))}"
        )
    if isinstance(fields.get("serving"), dict):
        serving_known = {f.name for f in dataclasses.fields(ServingBenchConfig)}
        unknown = sorted(set(fields["serving"]) - serving_known)
        if unknown:
            raise ConfigError(
                f"--config: no bench.serving field {unknown[0]!r}; fields: {', '.join(sorted(serving_known))}"
            )
    return build_config(BenchConfig, fields)  # nested serving settings too, validated


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the usage
        print(f"error: {message}; see python -m pipeline.bench --help", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m pipeline.bench", description=__doc__.splitlines()[0])
    parser.add_argument("engine", type=Path, help="engine folder (engine.json inside)")
    parser.add_argument("--json", type=Path, help="write the record here (default: print it)")
    parser.add_argument("--config", default="{}", help="BenchConfig fields as JSON")
    parser.add_argument("--reference", type=Path, help="also measure against this engine, alternately")
    parser.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # benchmark_in_subprocess
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        _end_with_parent(args.parent_pid)
    interrupt_on_sigterm()
    try:
        if args.json:  # before the benchmark: a FIFO, a link or a device there is never replaced
            check_output_file(args.json, "the benchmark record, --json")
        config = load_config(args.config)
        for name, folder in (("engine", args.engine), ("--reference", args.reference)):
            if folder is not None and not os.path.lexists(folder / "engine.json"):
                raise EngineError(
                    f"{name} {folder}: not an engine folder (no engine.json); pass a run's engine/"
                )
            if folder is not None:
                read_engine_spec(folder)  # checked before the benchmark loads anything
        record = run_benchmark(args.engine, config, args.reference)
        text = json.dumps(record, indent=2)
        if args.json:
            write_json(check_output_file(args.json, "the benchmark record, --json"), record)
        else:
            print(text)
    except (PipelineError, OSError) as exc:
        return print_error(exc)
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc or 'Ctrl-C'})", file=sys.stderr)
        return exit_code(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
