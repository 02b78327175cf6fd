"""Pruning, distillation and speculative decoding on one model, in one run: the teacher (the
unpruned model), ``prune=width25`` without and with ``distill=kd``, ``prune=depth25 distill=kd``,
and the teacher decoding with a ``speculative=draft`` draft.

What one run does:

1. **Build** every row with the real CLI, one subprocess each (``benchmarks.common.build_recipe``:
   ``python -m pipeline model=llama quant=none <overrides> bench=none``). The pipeline cache keeps
   pruned, distilled and draft checkpoints, so only the first run trains (every ``distill=kd``:
   its time is in ``benchmarks/README.md``); ``--steps N`` sets every distillation's
   steps (the students' and the draft's). Each run scores its engine against the reference
   engine (the same recipe without prune/distill: the teacher's engine) on the held-out text:
   perplexity of both, mean KL(teacher || student) per token and top-1 agreement
   (``evals.agreement``; the quality record of the run manifest).
2. **Measure** every engine in this one process, batch 1, greedy, interleaved across engines
   (``benchmarks.common.measure_speed``): TTFT@512 and TPOT over 64 tokens after
   a 128-token random prompt, medians over ``--repeats``; the ``+draft`` row decodes
   speculatively there.
3. **Speculative decoding** on text: the ``+draft`` engine decodes 64 tokens after each of
   ``--prompts`` 512-token windows of the held-out text, with the draft and with the target
   alone alternately (``pipeline.bench.speculative_benchmark``): acceptance rate, tokens per
   target forward, TPOT of each and their ratio, and whether the outputs were identical.

Size is the parameter count (from the prune pass's record; the teacher's is its ``before``) and
the engine's bytes. Recovery is the share of the perplexity lost to pruning that distillation won
back: ``(ppl_pruned - ppl_distilled) / (ppl_pruned - ppl_teacher)``, from the ``width25`` pair.

Run from the repository root::

    python -m benchmarks.compression --repeats 3

The command and the recorded results: ``benchmarks/README.md`` (compression).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    Contestant,
    UsageError,
    add_run_arguments,
    build_recipe,
    cpu_line,
    format_load,
    load_average,
    load_line,
    make_parser,
    measure_speed,
    print_lines,
    quality_config,
    run_and_report,
    score,
)
from pipeline.bench import host_info, speculative_benchmark, summarize
from pipeline.config import BenchConfig
from pipeline.runtime import Engine

DEFAULT_OUT = Path("artifacts/benchmarks/compression")
TEACHER = "teacher"
DRAFTED = "teacher+draft"
ROWS: list[tuple[str, tuple[str, ...]]] = [
    (TEACHER, ()),
    ("width25", ("prune=width25",)),
    ("width25+kd", ("prune=width25", "distill=kd")),
    ("depth25+kd", ("prune=depth25", "distill=kd")),
    (DRAFTED, ("speculative=draft",)),
]


def overrides_for(label: str, base: tuple[str, ...], args: argparse.Namespace) -> tuple[str, ...]:
    extra = []
    if args.steps is not None and "distill=kd" in base:
        extra.append(f"distill.steps={args.steps}")
    if label == DRAFTED:
        extra.append(f"speculative.k={args.k}")
        if args.steps is not None:
            extra.append(f"speculative.draft.distill.steps={args.steps}")
    return (*base, *extra)


def parameters(row: Contestant) -> dict[str, int | None]:
    """The teacher's, this engine's and its draft's parameter counts, from the prune records."""
    manifest = row.manifest or {}

    def pruned(records: list[dict[str, Any]]) -> dict[str, int]:
        return next((r["metrics"]["parameters"] for r in records if r["name"] == "prune"), {})

    own = pruned(manifest.get("passes", []))
    draft = pruned((manifest.get("speculative") or {}).get("draft_passes", []))
    return {"teacher": (own or draft).get("before"), "this": own.get("after"), "draft": draft.get("after")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = (REPO / args.out).resolve() if not args.out.is_absolute() else args.out
    out.mkdir(parents=True, exist_ok=True)
    load_at_start = load_average()
    started = time.perf_counter()
    rows = [
        build_recipe("none", out, args.build_timeout, label, overrides_for(label, base, args))
        for label, base in ROWS
    ]
    teacher, drafted = rows[0], rows[-1]
    if not teacher.ok:
        raise UsageError(f"the teacher did not build: {teacher.note}")
    for row in rows:
        if row.ok and row.folder is not None:
            row.engine = Engine(row.folder, threads=args.threads)
    timing = measure_speed(rows, args)
    config = quality_config(teacher)
    for row in rows:
        if row.ok and row is not drafted:  # the draft changes no logit: its engine is the teacher's
            row.quality = score(row, teacher, config)

    speculative = None
    if drafted.ok and drafted.engine is not None and drafted.engine.draft is not None:
        bench = BenchConfig(
            decode_tokens=64,
            warmup=args.warmup,
            repeats=args.repeats,
            speculative_prompts=args.prompts,
            speculative_prompt_length=512,
        )
        speculative = speculative_benchmark(drafted.engine, bench)

    counts = {row.name: parameters(row) for row in rows}
    teacher_params = next((c["teacher"] for c in counts.values() if c["teacher"]), None)
    ref_tpot = statistics.median(teacher.samples["tpot"])
    ref_ttft = statistics.median(teacher.samples["ttft"])
    records = []
    for row in rows:
        record: dict[str, Any] = {
            "name": row.name,
            "status": row.status,
            "note": row.note,
            "engine": str(row.folder) if row.folder else None,
            "build": row.build,
            "engine_mib": round(row.size_bytes / 2**20, 1) if row.size_bytes else None,
            "parameters": counts[row.name]["this"] or (teacher_params if row.ok else None),
            "quality": row.quality,
        }
        if row.samples:
            record["ttft"] = summarize(row.samples["ttft"])
            record["tpot"] = summarize(row.samples["tpot"])
            record["ttft_ratio_to_teacher"] = round(statistics.median(row.samples["ttft"]) / ref_ttft, 3)
            record["tpot_ratio_to_teacher"] = round(statistics.median(row.samples["tpot"]) / ref_tpot, 3)
        records.append(record)
    by_name = {r["name"]: r for r in records}
    recovery = None
    pruned, distilled = by_name["width25"].get("quality"), by_name["width25+kd"].get("quality")
    if pruned and distilled:
        lost = pruned["perplexity"] - pruned["reference_perplexity"]
        recovery = round((pruned["perplexity"] - distilled["perplexity"]) / lost, 3) if lost > 0 else None
    distill_records = [
        p for row in rows for p in (row.manifest or {}).get("passes", []) if p["name"] == "distill"
    ]
    return {
        "config": {
            "rows": {label: list(overrides_for(label, base, args)) for label, base in ROWS},
            "repeats": args.repeats,
            "warmup": args.warmup,
            "threads": args.threads,
            "seed": args.seed,
            "quality": asdict(config),
        },
        "rows": records,
        "recovery_width25": recovery,
        "distill_seconds": [p["seconds"] for p in distill_records],
        "draft": {
            "parameters": counts[DRAFTED]["draft"],
            "manifest": (drafted.manifest or {}).get("speculative"),
        },
        "speculative": speculative,
        "load_average": {"at_start": load_at_start, **timing["load_average"]},
        "measure_seconds": timing["seconds"],
        "total_seconds": round(time.perf_counter() - started, 1),
        "host": host_info(),
    }


def print_report(record: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console.width = 150
    table = Table(title="Pruning and distillation vs the teacher (ORT CPU, fp32, batch 1, greedy; medians)")
    for name in ("engine", "params M", "MiB", "perplexity", "KL vs teacher", "top-1", "TTFT@512 ms"):
        table.add_column(name, justify="left" if name == "engine" else "right")
    for name in ("TPOT ms", "TPOT / teacher", "notes"):
        table.add_column(name, justify="left" if name == "notes" else "right")
    for row in record["rows"]:
        quality = row.get("quality") or {}
        table.add_row(
            row["name"],
            f"{row['parameters'] / 1e6:.1f}" if row.get("parameters") else "-",
            f"{row['engine_mib']:.0f}" if row.get("engine_mib") else "-",
            f"{quality['perplexity']:.2f}" if quality else "-",
            f"{quality['kl_mean']:.4f}" if quality else "-",
            f"{quality['top1_agreement']:.1%}" if quality else "-",
            f"{row['ttft']['median_ms']:.1f}" if "ttft" in row else "-",
            f"{row['tpot']['median_ms']:.2f}" if "tpot" in row else "-",
            f"{row['tpot_ratio_to_teacher']:.2f}x" if "tpot" in row else "-",
            row["note"] if row["status"] != "ok" else "",
        )
    console.print(table)
    lines = []
    if record["recovery_width25"] is not None:
        lines.append(
            f"width25: distillation won back {record['recovery_width25']:.0%} of the perplexity pruning lost"
        )
    if record["distill_seconds"]:
        lines.append(
            "distillation seconds (0 when cached): "
            + ", ".join(f"{s:.0f}" for s in record["distill_seconds"])
        )
    spec = record["speculative"]
    if spec:
        draft = record["draft"]
        lines.append(
            f"speculative decoding, k={spec['k']}, draft {draft['parameters'] / 1e6:.1f}M parameters "
            f"({draft['manifest']['draft_layers']} layers), {spec['prompts']} x "
            f"{spec['prompt_length']}-token prompts of held-out text, {spec['tokens']} tokens each: TPOT "
            f"{spec['tpot_speculative']['median_ms']:.2f} ms vs {spec['tpot_target']['median_ms']:.2f} ms "
            f"alone = {spec['tpot_ratio']:.2f}x (TTFT {spec['ttft_speculative']['median_ms']:.0f} vs "
            f"{spec['ttft_target']['median_ms']:.0f} ms: the draft reads the prompt too); acceptance "
            f"{spec['acceptance_rate']:.1%}, "
            f"{spec['tokens_per_round']:.2f} tokens per target forward; output identical to the target's: "
            f"{spec['identical_to_target']}"
        )
    load, host = record["load_average"], record["host"]
    lines.append(
        f"{load_line(load['before'], load['after'])} while measuring "
        f"(at start, before builds: {format_load(load['at_start'])}); "
        f"ORT threads {record['config']['threads']}"
    )
    lines.append(cpu_line(host))
    print_lines(console, lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__file__, __doc__)
    parser.add_argument("--steps", type=int, help="distillation steps of every distilled row and the draft")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round (speculative.k)")
    parser.add_argument(
        "--prompts", type=int, default=3, help="held-out text prompts for speculative decoding"
    )
    add_run_arguments(parser, DEFAULT_OUT, build_timeout=4 * 3600)
    args = parser.parse_args(argv)
    if min(args.repeats, args.threads, args.k, args.prompts, args.build_timeout) < 1 or args.warmup < 0:
        parser.error("--repeats, --threads, --k, --prompts and --build-timeout must be >= 1, --warmup >= 0")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: distillation needs at least 1 step")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_and_report(parse_args(argv), run, print_report)


if __name__ == "__main__":
    sys.exit(main())
