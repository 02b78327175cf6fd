"""Serving benchmark (``bench=serving``): an engine under load, as users judge it.

A fixed, seeded trace of requests (prompt and output lengths drawn uniformly from
``bench.serving.prompt_lengths`` / ``output_lengths``, random token ids, every output decoded to
its length) arrives at once and is served at each concurrency of ``bench.serving.concurrency``:

- **continuous**: :class:`pipeline.runtime.serving.Server` with ``max_sequences`` = concurrency
  (requests join and leave the running batch at every step);
- **static**: the trace in arrival order, in batches of that many requests, each batch decoded
  until its longest request is done (``Engine.generate_ids`` on a padded batch: on the left, or
  on the right for GroupQueryAttention engines), as a server without iteration-level
  scheduling does.

Concurrency 1 is the engine serving requests one by one. Per run: throughput (output tokens
per second of wall time), TTFT p50/p95 (from arrival, queueing included) and TPOT p50/p95 (per
request, after its first token); medians over ``repeats`` runs, modes interleaved run by run.

**Prefix caching**: TTFT of a request whose ``prefix_tokens``-token prefix (a long system prompt)
is already in the prefix cache, then ``suffix_tokens`` new tokens, vs the same request with no
cache; medians over ``prefix_repeats`` distinct suffixes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from pipeline.config import ServingBenchConfig
from pipeline.core.errors import EngineError


def make_trace(config: ServingBenchConfig, vocab: int, max_length: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request, seeded."""
    rng = np.random.default_rng(config.seed)
    low_prompt, high_prompt = config.prompt_lengths
    low_out, high_out = config.output_lengths
    if high_prompt + high_out > max_length:
        raise EngineError(
            f"bench.serving: prompts up to {high_prompt} plus outputs up to {high_out} tokens exceed the "
            f"engine's max_length {max_length}"
        )
    first = min(100, vocab // 4)  # past the special tokens
    return [
        (
            rng.integers(first, vocab, size=int(rng.integers(low_prompt, high_prompt + 1))).tolist(),
            int(rng.integers(low_out, high_out + 1)),
        )
        for _ in range(config.requests)
    ]


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    array = np.asarray(values, dtype=np.float64) * 1000
    return {
        "p50_ms": round(float(np.percentile(array, 50)), 2),
        "p95_ms": round(float(np.percentile(array, 95)), 2),
    }


def run_continuous(
    engine: Any, trace: list[tuple[list[int], int]], concurrency: int, max_kv_tokens: int = 0
) -> dict[str, Any]:
    from pipeline.runtime.serving import Request, Server, ServingLimits

    limits = ServingLimits(
        max_sequences=concurrency, max_kv_tokens=max_kv_tokens or concurrency * engine.max_length
    )
    server = Server(engine, limits)
    start = time.perf_counter()
    streams = [server.submit(Request(prompt, n, stop_at_eos=False)) for prompt, n in trace]
    server.run()
    wall = time.perf_counter() - start
    done = [stream.result() for stream in streams]
    tokens = sum(len(c.tokens) for c in done)
    return {
        "tokens_per_s": tokens / wall,
        "ttft": [c.first_token - start for c in done],
        "tpot": [c.tpot for c in done if c.tpot is not None],
        "mean_batch": statistics.mean(server.batch_sizes) if server.batch_sizes else 1.0,
        "outputs": [c.tokens for c in done],
    }


def run_static(engine: Any, trace: list[tuple[list[int], int]], concurrency: int) -> dict[str, Any]:
    from pipeline.runtime import GenerationConfig

    start = time.perf_counter()
    ttft, tpot, tokens = [], [], 0
    for first in range(0, len(trace), concurrency):
        group = trace[first : first + concurrency]
        longest = max(n for _, n in group)
        stamps: list[float] = []
        config = GenerationConfig(max_new_tokens=longest, stop_at_eos=False)

        def stamp(_: np.ndarray, stamps: list[float] = stamps) -> None:
            stamps.append(time.perf_counter())

        engine.generate_ids([p for p, _ in group], config, stamp, use_draft=False)
        for _, n in group:  # a request is done at its own last token; its row ran on to the longest
            ttft.append(stamps[0] - start)
            if n > 1:
                tpot.append((stamps[n - 1] - stamps[0]) / (n - 1))
            tokens += n
    wall = time.perf_counter() - start
    return {"tokens_per_s": tokens / wall, "ttft": ttft, "tpot": tpot, "mean_batch": None}


def prefix_ttft(engine: Any, config: ServingBenchConfig) -> dict[str, Any] | None:
    """TTFT with the shared prefix cached vs not (None when the engine is too short)."""
    from pipeline.runtime.serving import Request, Server, ServingLimits

    need = config.prefix_tokens + config.suffix_tokens + 1
    if need > engine.max_length:
        return None
    rng = np.random.default_rng(config.seed + 1)
    vocab = engine.io.vocab_size
    first = min(100, vocab // 4)
    prefix = rng.integers(first, vocab, size=config.prefix_tokens).tolist()
    suffixes = [
        rng.integers(first, vocab, size=config.suffix_tokens).tolist()
        for _ in range(config.prefix_repeats + 1)
    ]
    block = config.prefix_block
    limits = ServingLimits(max_sequences=1, prefix_cache_tokens=4 * need, prefix_block=block)
    cold, warm, hits = [], [], []
    for suffix in suffixes[1:]:
        plain = Server(engine, ServingLimits(max_sequences=1))
        stream = plain.submit(Request(prefix + suffix, 1))
        plain.run()
        cold.append(stream.result().ttft)
        cached = Server(engine, limits)
        cached.submit(Request(prefix + suffixes[0], 1))  # another request with the same prefix
        cached.run()
        stream = cached.submit(Request(prefix + suffix, 1))
        cached.run()
        warm.append(stream.result().ttft)
        hits.append(stream.result().prefix_hit)
    cold_ms, warm_ms = statistics.median(cold) * 1000, statistics.median(warm) * 1000
    return {
        "prefix_tokens": config.prefix_tokens,
        "suffix_tokens": config.suffix_tokens,
        "block": block,
        "cached_tokens": statistics.median(hits),
        "ttft_uncached_ms": round(cold_ms, 2),
        "ttft_cached_ms": round(warm_ms, 2),
        "ratio": round(warm_ms / cold_ms, 4),
        "repeats": config.prefix_repeats,
    }


def serving_benchmark(engine: Any, config: ServingBenchConfig) -> dict[str, Any]:
    """The serving record of one engine (see the module docstring); an engine the server cannot
    batch (a sliding-window buffer) gets ``{"skipped": why}`` rather than failing the run."""
    from pipeline.runtime.serving import Server, ServingError

    try:
        Server(engine)
    except ServingError as exc:
        return {"config": asdict(config), "skipped": str(exc)}
    trace = make_trace(config, engine.io.vocab_size, engine.max_length)
    modes = [("continuous", c) for c in config.concurrency] + [
        ("static", c) for c in config.concurrency if c > 1
    ]
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {mode: [] for mode in modes}
    bar = tqdm(total=len(modes) * (config.warmup + config.repeats), desc="serving", unit="run")
    for run in range(config.warmup + config.repeats):
        for mode, concurrency in modes:  # interleaved, so drifting load hits every mode alike
            if mode == "continuous":
                result = run_continuous(engine, trace, concurrency, config.max_kv_tokens)
            else:
                result = run_static(engine, trace, concurrency)
            if run >= config.warmup:
                samples[(mode, concurrency)].append(result)
            bar.update()
    bar.close()
    rows = []
    for (mode, concurrency), runs in samples.items():
        ttft = [_percentiles(r["ttft"]) for r in runs]
        tpot = [_percentiles(r["tpot"]) for r in runs if r["tpot"]]
        rows.append(
            {
                "mode": mode,
                "concurrency": concurrency,
                "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 2),
                "ttft_p50_ms": statistics.median(t["p50_ms"] for t in ttft),
                "ttft_p95_ms": statistics.median(t["p95_ms"] for t in ttft),
                "tpot_p50_ms": statistics.median(t["p50_ms"] for t in tpot) if tpot else None,
                "tpot_p95_ms": statistics.median(t["p95_ms"] for t in tpot) if tpot else None,
                "mean_batch": runs[0]["mean_batch"]
                and round(statistics.median(r["mean_batch"] for r in runs), 2),
            }
        )
    # greedy: every continuous run must give each request the tokens it got one by one
    alone = samples[modes[0]][0]["outputs"] if modes[0] == ("continuous", 1) else None
    identical = alone is not None and all(
        run["outputs"] == alone for (mode, _), runs in samples.items() if mode == "continuous" for run in runs
    )
    by = {(r["mode"], r["concurrency"]): r["tokens_per_s"] for r in rows}
    one_by_one = by.get(("continuous", 1))
    ratios = {
        str(c): {
            "vs_one_by_one": round(by[("continuous", c)] / one_by_one, 3) if one_by_one else None,
            "vs_static": round(by[("continuous", c)] / by[("static", c)], 3) if ("static", c) in by else None,
        }
        for c in config.concurrency
    }
    return {
        "config": asdict(config),
        "trace": {
            "requests": len(trace),
            "prompt_tokens": sum(len(p) for p, _ in trace),
            "output_tokens": sum(n for _, n in trace),
        },
        "rows": rows,
        "continuous_ratios": ratios,
        "identical_to_one_by_one": identical if alone is not None else None,
        "prefix_cache": prefix_ttft(engine, config),
    }


def plot_serving(record: dict[str, Any], path: Path) -> Path | None:
    """Throughput vs concurrency, static vs continuous, as a PNG at ``path`` (written atomically;
    None when matplotlib is not installed: ``pip install ".[nightly]"``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axis = plt.subplots(figsize=(6, 4))
    rows = record["rows"]
    single = ("continuous", 1)
    one = [(r["concurrency"], r["tokens_per_s"]) for r in rows if (r["mode"], r["concurrency"]) == single]
    for mode, style in (("continuous", "o-"), ("static", "s--")):
        points = [(r["concurrency"], r["tokens_per_s"]) for r in rows if r["mode"] == mode]
        points = sorted(set(points + one))  # at concurrency 1 both serve one request at a time
        axis.plot([c for c, _ in points], [t for _, t in points], style, label=f"{mode} batching")
    axis.set_xlabel("concurrent requests")
    axis.set_ylabel("output tokens / s")
    axis.set_xscale("log", base=2)
    ticks = sorted({r["concurrency"] for r in rows})
    axis.set_xticks(ticks, [str(t) for t in ticks])
    axis.set_title(f"Serving throughput ({record['trace']['requests']} requests, seeded trace)")
    axis.grid(alpha=0.3)
    axis.legend()
    staging = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(staging, dpi=110, bbox_inches="tight")
    plt.close(figure)
    staging.replace(path)
    return path
