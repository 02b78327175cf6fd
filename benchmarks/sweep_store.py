"""One store for a sweep, counted: the nightly matrix as a real joblib multirun on a fresh cache,
and how many times each pass output and each engine's suite scores were computed versus reused.

Jobs of one sweep share ``artifacts/`` (here a fresh ``--out``/cache). Outputs several jobs need
(the export of the same checkpoint, the reference engine's passes, the reference's gate scores)
must be computed once: the job that takes a key's compute lock computes it, the others wait and
reuse it (``pipeline/core/staging.py: key_lock``). The counts come from each job's log: the pass
manager's ``pass i/n NAME: running (KEY)`` and ``cache hit (KEY)`` lines, and the gate's
``eval: scoring SUITE of DIGEST`` and ``eval: SUITE scores of DIGEST from the cache`` lines.

    python -m benchmarks.sweep_store [--recipes none int8 fp8 int4_awq] [--jobs 4] [--limit 8]

``--limit`` items a suite keeps the gates short (the counts do not depend on it). The table: each
output (pass and key, or suite and engine), how many jobs computed it and how many reused it;
"once" is yes when exactly one job computed it.

The command and the recorded results: ``benchmarks/README.md`` (sweep_store).
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, load_average, make_parser, pipeline_command, run_logged, write_record

DEFAULT_OUT = REPO / "artifacts" / "benchmarks" / "sweep_store"
COMPUTED = re.compile(r"pass \d+/\d+ (\S+): running \((\w{12})\)")
REUSED = re.compile(r"pass \d+/\d+ (\S+): cache hit \((\w{12})\)")
SCORED = re.compile(r"eval: scoring (\S+) of (\w{12})")
SCORES_REUSED = re.compile(r"eval: (\S+) scores of (\w{12}) from the cache")


def count(logs: list[str]) -> dict[str, dict[tuple[str, str], Counter[str]]]:
    """Per output, how many jobs computed and reused it: ``passes`` keyed by (pass, key),
    ``scores`` by (suite, engine digest); ``logs`` is each job's log text."""
    found: dict[str, dict[tuple[str, str], Counter[str]]] = {"passes": {}, "scores": {}}
    patterns: list[tuple[str, re.Pattern[str], str]] = [
        ("passes", COMPUTED, "computed"),
        ("passes", REUSED, "reused"),
        ("scores", SCORED, "computed"),
        ("scores", SCORES_REUSED, "reused"),
    ]
    for text in logs:
        for kind, pattern, what in patterns:
            for match in pattern.finditer(text):
                found[kind].setdefault((match[1], match[2]), Counter())[what] += 1
    return found


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__file__, __doc__)
    parser.add_argument("--recipes", nargs="*", default=["none", "int8", "fp8", "int4_awq"])
    parser.add_argument("--jobs", type=int, default=4, help="joblib workers")
    parser.add_argument("--limit", type=int, default=8, help="items a suite")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds for the whole sweep")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    cache, sweep = args.out / "cache", args.out / "sweep"
    for folder in (cache, sweep):  # a fresh store: everything is computed by this sweep
        shutil.rmtree(folder, ignore_errors=True)
    command = pipeline_command(
        "pipeline", "-m", "model=llama", f"quant={','.join(args.recipes)}",
        "hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.jobs}", f"pipeline.cache_dir={cache}",
        f"hydra.sweep.dir={sweep}", "bench=none", "registry=none", "eval=quick", f"eval.limit={args.limit}",
    )  # fmt: skip
    print("$", " ".join(command), flush=True)
    load = load_average()
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    result = run_logged(command, args.out / "sweep.log", args.timeout)
    if result is None:
        print(f"error: the sweep took over {args.timeout} s (--timeout)", file=sys.stderr)
        return 1
    seconds = round(time.perf_counter() - started, 1)
    logs = [path.read_text() for path in sorted(sweep.glob("*/__main__.log"))]
    found = count(logs)
    record: dict[str, Any] = {
        "command": command,
        "exit_code": result.returncode,
        "jobs": len(logs),
        "seconds": seconds,
        "load_before": load,
        "load_after": load_average(),
        **{
            kind: [{"output": list(output), **counts} for output, counts in sorted(rows.items())]
            for kind, rows in found.items()
        },
    }
    print_table(record)
    if args.json:
        write_record(args.json, record)
    return 0 if result.returncode == 0 else 1


def print_table(record: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"One store for a sweep: {record['jobs']} jobs, exit {record['exit_code']}, {record['seconds']} s "
        f"(load {record['load_before'][0]:.1f} -> {record['load_after'][0]:.1f})"
    )
    table = Table(title=title)
    for column in ("output", "of", "computed", "reused", "once"):
        table.add_column(column)
    for kind in ("passes", "scores"):
        for row in record[kind]:
            computed, reused = row.get("computed", 0), row.get("reused", 0)
            table.add_row(
                row["output"][0],
                row["output"][1],
                str(computed),
                str(reused),
                "yes" if computed == 1 else "NO",
            )
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
