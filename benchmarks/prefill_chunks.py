"""Prefill in chunks, measured: the time to put a long context in an engine's KV cache in one
step versus in steps of ``--chunks`` tokens (``pipeline.runtime.generate.prefill``, what the eval
gate's scoring does before it ranks each item's candidate answers).

One step over T tokens makes [T, vocab] logits (8k tokens of the default model: 1.6 GB, read by
nothing when only the cache is wanted) and, in an unfused graph, every layer's [heads, T, T]
attention scores; chunks bound both. For each ``--tokens`` length, random token ids are
prefilled ``--repeats`` times per chunk size; the table gives the median seconds, tokens per
second and the ratio to one step (chunk 0) measured in the same run, with the load average
before and after (the machine is shared: compare ratios).

    python -m benchmarks.prefill_chunks --engine artifacts/runs/<run>/engine [--tokens 2000 8000]
        [--chunks 0 512 1024] [--repeats 3] [--json out.json]

The command and the recorded results: ``benchmarks/README.md`` (prefill_chunks).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import load_line, make_parser, measure_and_report


def measure(engine: Path, tokens: list[int], chunks: list[int], repeats: int) -> dict[str, Any]:
    import numpy as np

    from pipeline.runtime import Engine
    from pipeline.runtime.generate import prefill

    model = Engine(engine).model
    rng = np.random.default_rng(0)
    rows = []
    for length in tokens:
        ids = rng.integers(0, model.io.vocab_size, size=length).tolist()
        seconds: dict[int, float] = {}
        for chunk in chunks:
            runs = []
            for _ in range(repeats):
                started = time.perf_counter()
                prefill(model, ids, model.empty_cache(1), chunk=chunk)
                runs.append(time.perf_counter() - started)
            seconds[chunk] = statistics.median(runs)
        one_step = seconds.get(0)
        for chunk, median in seconds.items():
            rows.append(
                {
                    "tokens": length,
                    "chunk": chunk,
                    "seconds": median,
                    "tokens_per_s": length / median,
                    "vs_one_step": one_step / median if one_step else None,
                }
            )
    return {"engine": str(engine), "repeats": repeats, "rows": rows}


def print_table(record: dict[str, Any]) -> None:
    print(f"{'tokens':>7} {'chunk':>6} {'median s':>9} {'tokens/s':>9} {'speed-up vs one step':>21}")
    for row in record["rows"]:
        ratio = f"x{row['vs_one_step']:.2f}" if row["vs_one_step"] else "-"
        chunk = row["chunk"] or "one"
        print(f"{row['tokens']:>7} {chunk:>6} {row['seconds']:>9.2f} {row['tokens_per_s']:>9.0f} {ratio:>21}")
    load = load_line(record["load_before"], record["load_after"])
    print(f"{load}; median of {record['repeats']} runs each")


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__file__, __doc__)
    parser.add_argument("--engine", type=Path, required=True, help="an engine folder (engine.json)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2000, 8000])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 1024], help="0: one step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the record here")
    args = parser.parse_args(argv)
    if not (args.engine / "engine.json").is_file():
        parser.error(f"--engine {args.engine}: no engine.json there (an engine folder of a pipeline run)")
    if args.repeats < 1 or min(args.tokens) < 1 or min(args.chunks) < 0:
        parser.error("--repeats and --tokens must be at least 1, --chunks at least 0")
    return measure_and_report(
        args, lambda args: measure(args.engine, args.tokens, args.chunks, args.repeats), print_table
    )


if __name__ == "__main__":
    sys.exit(main())
