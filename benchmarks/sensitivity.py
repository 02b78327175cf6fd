"""Sensitivity in linear time, validated: the Fisher estimate (``quant.sensitivity.method=fisher``,
the default) against the exact scan (``method=exact``) on the default model.

For each format in ``--formats`` the recipe's own scan is composed with Hydra as the CLI does
(``int4``: ``quant=int4_awq``, group-wise 128 asymmetric RTN; ``fp8``: ``quant=fp8``, E4M3 weights
and static activations; ``int8``: ``quant=int8``, INT8 weights and static activations with
minmax ranges on the *unsmoothed* checkpoint: the SmoothQuant pass does not run here, so the
int8 row ranks plain W8A8), one probe is built (the fp32 reference forward on the scan windows,
``quant.sensitivity.num_samples`` x ``seq_len``), and then:

- ``exact``: each layer's KL with only it quantized (``calibration.sensitivity.layer_sensitivity``);
- ``fisher-N``: the Fisher estimate with N labels sampled per token (``--samples``, one backward
  each); ``fisher-N`` sums the Fisher term token by token (the default method's score),
  ``fisher-N-seq`` sums it over the window first (unbiased, noisier; both from the same run).

Each ranking is compared with the exact one: Spearman rank correlation of the full ranking
(``scipy.stats.spearmanr``), overlap of the top 10, and the fallback set ``quant.fallback=auto``
would choose from it at ``--kl-budget`` (default 0.01, the README's budget) with the recipe's
``quant.max_fallback_layers`` (``calibration.sensitivity.fallback_search``: its KL is always
measured exactly), with whether it meets the budget. Wall time of each scan and each search.
The load average before and after is printed: the machine is shared, so compare ratios of one run.

Run from the repository root (the minutes a format takes: ``benchmarks/README.md``)::

    python -m benchmarks.sensitivity --formats int4 fp8 int8 --samples 4 16 [--json out.json]

The command and the recorded results: ``benchmarks/README.md`` (sensitivity).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    DEFAULT_MODEL,
    REPO,
    load_average,
    load_line,
    make_parser,
    run_and_report,
    write_record,
)

SOURCE = DEFAULT_MODEL  # `python -m pipeline model=llama` makes it
RECIPES = {"int4": "int4_awq", "fp8": "fp8", "int8": "int8"}
TOP = 10


def scan_pass(recipe: str, overrides: list[str]) -> Any:
    """The recipe's SensitivityPass, composed from configs/ as the CLI composes it."""
    from hydra import compose, initialize_config_dir

    from pipeline.config import register_pipeline_schemas
    from pipeline.core.plugins import build_passes, discover_passes

    register_pipeline_schemas()
    discover_passes()
    from pipeline.core.errors import ConfigError

    with initialize_config_dir(str(REPO / "configs"), version_base="1.3"):
        try:
            config = compose("pipeline", overrides=[f"quant={recipe}", *overrides])
        except Exception as exc:  # Hydra's composition errors: one line, as the CLI prints them
            reason = str(exc).splitlines()[0]
            raise ConfigError(f"quant={recipe} with --override {' '.join(overrides)}: {reason}") from None
    return next(p for p in build_passes(config) if p.name == "sensitivity")


def compare(exact: dict[str, float], other: dict[str, float]) -> dict[str, Any]:
    from scipy.stats import spearmanr

    names = list(exact)
    rho = spearmanr([exact[n] for n in names], [other[n] for n in names]).statistic
    return {"spearman": float(rho), "top10_overlap": len(set(list(exact)[:TOP]) & set(list(other)[:TOP]))}


def measure_format(fmt: str, args: argparse.Namespace) -> dict[str, Any]:
    from calibration.sensitivity import fallback_search, fisher_scores, layer_sensitivity

    scan = scan_pass(RECIPES[fmt], args.override)
    config = scan.config
    started = time.perf_counter()
    probe, quantizers = scan.probe(args.model, calibrated_ranges=False)
    probe_seconds = time.perf_counter() - started
    rankings: dict[str, dict[str, float]] = {}
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    rankings["exact"] = layer_sensitivity(probe, quantizers, progress=False)
    seconds["exact"] = time.perf_counter() - started
    for samples in args.samples:
        started = time.perf_counter()
        scores = fisher_scores(
            probe, quantizers, samples=samples, seed=config.calibration.seed, progress=False
        )
        seconds[f"fisher-{samples}"] = seconds[f"fisher-{samples}-seq"] = time.perf_counter() - started
        rankings[f"fisher-{samples}"], rankings[f"fisher-{samples}-seq"] = scores.tokenwise, scores.sequence
    max_layers = args.max_fallback_layers or config.max_fallback_layers
    rows = []
    for method, ranking in rankings.items():
        started = time.perf_counter()
        result = fallback_search(probe, quantizers, list(ranking), args.kl_budget, max_layers)
        rows.append(
            {
                "method": method,
                "scan_seconds": seconds[method],
                **compare(rankings["exact"], ranking),
                "fallback": result.modules,
                "fallback_kl": result.kl,
                "budget_met": result.budget_met,
                "search_seconds": time.perf_counter() - started,
                "trials": {str(k): v for k, v in sorted(result.trials.items())},
                "top10": list(ranking)[:TOP],
                "scores": ranking,
            }
        )
    return {
        "format": fmt,
        "recipe": RECIPES[fmt],
        "layers": len(quantizers),
        "tokens": probe.tokens,
        "probe_seconds": probe_seconds,
        "kl_all_quantized": rows[0]["trials"]["0"],
        "max_fallback_layers": max_layers,
        "rows": rows,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pipeline.core.errors import ConfigError

    if not (args.model / "config.json").is_file():
        raise ConfigError(
            f"--model {args.model}: no HF checkpoint there: run `python -m pipeline model=llama`"
        )
    torch.set_num_threads(args.threads)
    record: dict[str, Any] = {
        "load_before": load_average(),
        "threads": args.threads,
        "kl_budget": args.kl_budget,
    }
    record["formats"] = []
    for fmt in args.formats:  # each format's table as soon as it is measured: a run takes minutes
        record["formats"].append(measure_format(fmt, args))
        print_format(record, record["formats"][-1])
        if args.json:
            write_record(args.json, record)  # so far: the last format's numbers are kept if a later one fails
    record["load_after"] = load_average()
    return record


HEADER = "".join(
    f"{title:{align}{width}}"
    for title, align, width in [
        ("method", "<", 16),
        ("scan s", ">", 8),
        ("spearman", ">", 10),
        ("top10", ">", 7),
        ("fallback", ">", 10),
        ("KL", ">", 10),
        ("met", ">", 5),
        ("search s", ">", 10),
    ]
)


def print_format(record: dict[str, Any], fmt: dict[str, Any]) -> None:
    print(
        f"\n{fmt['format']} ({fmt['recipe']} scan): {fmt['layers']} layers, {fmt['tokens']} tokens, "
        f"reference forward {fmt['probe_seconds']:.1f} s, budget {record['kl_budget']} nats, "
        f"at most {fmt['max_fallback_layers']} layers kept; KL all quantized {fmt['kl_all_quantized']:.4f}",
        flush=True,
    )
    print(HEADER)
    for row in fmt["rows"]:
        print(
            f"{row['method']:<16}{row['scan_seconds']:>8.1f}{row['spearman']:>10.3f}"
            f"{row['top10_overlap']:>5}/{TOP}{len(row['fallback']):>10}{row['fallback_kl']:>10.4f}"
            f"{'yes' if row['budget_met'] else 'no':>5}{row['search_seconds']:>10.1f}",
            flush=True,
        )


def print_report(record: dict[str, Any]) -> None:
    load = load_line(record["load_before"], record["load_after"])
    print(f"\n{load}; {record['threads']} torch threads")
    for fmt in record["formats"]:
        print_format(record, fmt)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__file__, __doc__)
    parser.add_argument("--formats", nargs="+", choices=list(RECIPES), default=["int4"])
    parser.add_argument("--samples", nargs="+", type=int, default=[4, 16], help="fisher labels per token")
    parser.add_argument(
        "--kl-budget", type=float, default=0.01, help="quant.kl_budget of the fallback search"
    )
    parser.add_argument(
        "--max-fallback-layers", type=int, help="default: the recipe's quant.max_fallback_layers"
    )
    parser.add_argument("--model", type=Path, default=SOURCE, help="HF checkpoint folder")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument(
        "--override", nargs="*", default=[], help="recipe overrides, e.g. quant.sensitivity.num_samples=4"
    )
    parser.add_argument("--json", type=Path, help="also write every number here")
    args = parser.parse_args(argv)
    if min(args.samples) < 1 or args.threads < 1 or not args.kl_budget > 0:
        parser.error("--samples and --threads must be >= 1, --kl-budget > 0")
    if args.max_fallback_layers is not None and args.max_fallback_layers < 1:
        parser.error(f"--max-fallback-layers {args.max_fallback_layers}: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_and_report(parse_args(argv), run, print_report, interrupted="the formats printed are measured")


if __name__ == "__main__":
    sys.exit(main())
