"""The int8 KV cache's prefill, measured: TTFT and TPOT of an int8-KV engine with its prefill
graph (``passes/fusion/int8_prefill.py``), of the same engine on the int8 kernel alone
(``Engine(prefill_graph=False)``), and of the same recipe with an fp32 cache (the peer), in one
run.

The int8 engine is loaded once and runs with and without its prefill session (two loads of one
engine decode at different speeds); its memory without it comes from a load of its own.
For each ``--tokens`` prompt length, a random prompt is decoded ``--new-tokens`` tokens greedily
by each engine in turn, ``--repeats`` times interleaved in a rotating order (after one warm-up
round); the table
gives the median TTFT and TPOT and their ratios to the fp32-cache engine, the resident memory
each engine added when it loaded, and the load average before and after (the machine is shared:
compare ratios).

    python -m benchmarks.kv_int8_prefill --int8 <engine> --fp32 <engine> [--tokens 512 2048]
        [--new-tokens 32] [--repeats 5] [--json out.json]

Engines as ``python -m benchmarks.fusion`` builds them: ``artifacts/benchmarks/fusion/
int4_awq-fused-shared-int8-KV/engine`` and ``.../int4_awq-fused-shared/engine``.

The command and the recorded results: ``benchmarks/README.md`` (kv_int8_prefill).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import UsageError, load_line, make_parser, measure_and_report, ort_model


def rss_mib() -> float:
    """This process's resident memory now (Linux ``/proc``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


KERNEL_ONLY = "int8 cache, int8 kernel only"


def load_engines(int8: Path, fp32: Path) -> tuple[dict[str, Any], dict[str, float]]:
    """The contestants, and the resident memory each adds when it loads. The int8 engine runs
    twice, with its prefill session and without (``KERNEL_ONLY``): one engine object, because
    two loads of the same engine decode at different speeds (how far apart:
    ``benchmarks/README.md``); its memory without the prefill session is measured by a load of
    its own, first, and released."""
    import gc

    from pipeline.runtime import Engine

    before = rss_mib()
    kernel_only = Engine(int8, prefill_graph=False)
    added = {KERNEL_ONLY: rss_mib() - before}
    del kernel_only
    gc.collect()
    engines = {}
    for name, folder in (("fp32 cache", fp32), ("int8 cache, prefill graph", int8)):
        before = rss_mib()
        engines[name] = Engine(folder)
        added[name] = rss_mib() - before
    if ort_model(engines["int8 cache, prefill graph"]).prefill_session is None:
        raise UsageError(
            f"--int8 {int8}: the engine has no prefill graph; rebuild it (target ort-cpu, int8 cache)"
        )
    engines[KERNEL_ONLY] = engines["int8 cache, prefill graph"]
    return engines, added


def run_once(name: str, engine: Any, prompt: list[list[int]], config: Any) -> Any:
    """One generation; ``KERNEL_ONLY`` with the prefill session detached for it (what
    ``Engine(prefill_graph=False)`` runs: prompts on the int8 kernel)."""
    if name != KERNEL_ONLY:
        return engine.generate_ids(prompt, config)
    prefill_session, engine.model.prefill_session = engine.model.prefill_session, None
    try:
        return engine.generate_ids(prompt, config)
    finally:
        engine.model.prefill_session = prefill_session


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from tqdm.auto import tqdm

    from pipeline.runtime import GenerationConfig

    engines, added = load_engines(args.int8, args.fp32)
    config = GenerationConfig(max_new_tokens=args.new_tokens, stop_at_eos=False)
    rng = np.random.default_rng(0)
    vocab = next(iter(engines.values())).io.vocab_size
    rows = []
    bar = tqdm(
        total=len(args.tokens) * (args.repeats + 1) * len(engines),
        desc="measure",
        unit="run",
        file=sys.stderr,
    )
    for length in args.tokens:
        prompt = [rng.integers(4, vocab, size=length).tolist()]
        ttft: dict[str, list[float]] = {name: [] for name in engines}
        tpot: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[int]] = {}
        names = list(engines)
        for repeat in range(args.repeats + 1):  # round 0 warms up
            # rotated each round, so no engine always runs right after the same other one
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                result = run_once(name, engines[name], prompt, config)
                bar.update()
                tokens[name] = result.tokens[0]
                if repeat:
                    ttft[name].append(result.prefill_seconds)
                    tpot[name].append(statistics.median(result.step_seconds))
        peer = "fp32 cache"
        for name in engines:
            row_ttft, row_tpot = statistics.median(ttft[name]), statistics.median(tpot[name])
            rows.append(
                {
                    "tokens": length,
                    "engine": name,
                    "ttft_s": row_ttft,
                    "tpot_s": row_tpot,
                    "ttft_vs_fp32": row_ttft / statistics.median(ttft[peer]),
                    "tpot_vs_fp32": row_tpot / statistics.median(tpot[peer]),
                    "same_tokens_as_fp32": tokens[name] == tokens[peer],
                    "rss_added_mib": added[name],
                }
            )
    bar.close()
    return {
        "int8": str(args.int8),
        "fp32": str(args.fp32),
        "repeats": args.repeats,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }


def print_table(record: dict[str, Any]) -> None:
    header = (
        f"{'tokens':>6}  {'engine':<30} {'TTFT ms':>8} {'vs fp32':>8} {'TPOT ms':>8} {'vs fp32':>8} "
        f"{'RSS +MiB':>9}  tokens = fp32's"
    )
    print(header)
    for row in record["rows"]:
        print(
            f"{row['tokens']:>6}  {row['engine']:<30} "
            f"{row['ttft_s'] * 1e3:>8.0f} {row['ttft_vs_fp32']:>7.2f}x "
            f"{row['tpot_s'] * 1e3:>8.2f} {row['tpot_vs_fp32']:>7.2f}x {row['rss_added_mib']:>9.0f}  "
            f"{'yes' if row['same_tokens_as_fp32'] else 'no'}"
        )
    load = load_line(record["load_before"], record["load_after"])
    print(
        f"{load}; medians of {record['repeats']} interleaved runs, "
        f"TPOT over {record['new_tokens']} new tokens"
    )


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__file__, __doc__)
    parser.add_argument("--int8", type=Path, required=True, help="engine folder with an int8 KV cache")
    parser.add_argument(
        "--fp32", type=Path, required=True, help="the same recipe's engine with an fp32 cache"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the record here")
    args = parser.parse_args(argv)
    for flag, folder in (("--int8", args.int8), ("--fp32", args.fp32)):
        if not (folder / "engine.json").is_file():
            parser.error(f"{flag} {folder}: no engine.json there (an engine folder of a pipeline run)")
    if args.repeats < 1 or min(args.tokens) < 1 or args.new_tokens < 2:
        parser.error("--repeats and --tokens must be at least 1, --new-tokens at least 2")
    return measure_and_report(args, measure, print_table)


if __name__ == "__main__":
    sys.exit(main())
