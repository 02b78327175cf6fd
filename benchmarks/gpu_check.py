"""Device check for a machine with an NVIDIA GPU: TensorRT engines of the default model, judged by
the eval gate and timed against ONNX Runtime CUDA, in one bounded command, one JSON, one table:

    python -m benchmarks.gpu_check [--recipes fp8 int4] [--deadline 450] [--json out.json]

It builds, with the real CLI (cached like any run, so a rerun is quick; calibration runs on the
GPU, ``pipeline.device=auto``):

- ``fp32 ort-cpu``: ``quant=none``, the reference of the gate (what README command 1 builds);
- for each recipe, ``target=tensorrt``: the strongly typed TensorRT 11 engine of the recipe's
  Q/DQ graph (``fusion=tensorrt``: standard-op RMSNorm and RoPE), and ``target=ort-cpu`` of the
  same graph (same cache entries up to the build), for a logit parity check;
- ``fp16 ort-cuda``: ``quant=fp16 target=ort-cuda``, the timing peer (needs onnxruntime-gpu in
  place of onnxruntime; without it that row says so and the rest runs).

then, per TensorRT engine: the gate's quick suites and token drift against the fp32 reference
(``python -m pipeline.gate --eval quick``: PASS / FAIL / INCONCLUSIVE, per suite the difference,
its CI and McNemar p), the logit agreement with ORT CPU on the same graph
(``evals.agreement.compare``: KL, top-1), and TTFT at 512 prompt tokens and TPOT over 64 new
tokens (medians, engines interleaved run by run) with ratios against the fp16 ORT CUDA engine.

Recipes (TensorRT takes precision from the graph only):

- ``fp8``: ``quant=fp8`` (E4M3 Q/DQ, per-channel weights, static per-tensor activations);
- ``int4``: ``quant=int4_awq quant.lowering=qdq quant.group_size=128 quant.symmetric=true`` (AWQ,
  INT4 weight blocks of 128 along the input axis: TensorRT's block sizes are 64 and 128);
- also ``fp16`` (``quant=fp16``) and ``int8`` (SmoothQuant W8A8 Q/DQ) with ``--recipes``.

Bounded: calibration uses 32 windows with the sensitivity scans off, and ``--deadline``
(seconds, default 450) skips every stage that would start after it, saying so in its row; each
build has ``--build-timeout`` and each gate ``--gate-timeout``. Sized for 8 minutes on an
H100/H200-class GPU, estimated, not measured: it has not run on a GPU yet.

From a fresh copy of the working tree it needs, besides the code: the converted default model
``artifacts/models/llama-b179c9523d0e`` (517 MB; README command 1 makes it, and with it no
download happens), and installed there: TensorRT 11 (``pip install -e ".[gpu]"
--extra-index-url https://pypi.nvidia.com``) and onnxruntime-gpu for the peer. Nothing else is
read. On a machine without GPU or TensorRT it stops at once with one line saying what is
missing (exit 2).

The command and the recorded results: ``benchmarks/README.md`` (gpu_check).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from benchmarks.common import (
    DECODE_TOKENS,
    REPO,
    TTFT_LENGTH,
    Contestant,
    add_run_arguments,
    build_recipe,
    make_parser,
    measure_speed,
    median_ms,
    pipeline_command,
    run_and_report,
    run_logged,
)
from pipeline.config import QualityConfig

FAST = ("quant.sensitivity.enabled=false", "quant.calibration.num_samples=32")
RECIPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "fp16": ("fp16", ()),
    "fp8": ("fp8", FAST),
    "int8": ("int8", FAST),
    "int4": (
        "int4_awq",
        (*FAST, "quant.lowering=qdq", "quant.group_size=128", "quant.symmetric=true"),
    ),
}
DEFAULT_RECIPES = ["fp8", "int4"]
BUILD_ONLY = ("eval=none", "registry=none", "quality.enabled=false")
COMMON = ("fusion=tensorrt", *BUILD_ONLY)
REFERENCE = ("none", BUILD_ONLY)  # quant=none target=ort-cpu: README command 1's engine
PEER = ("fp16", (*BUILD_ONLY, "target=ort-cuda"))
# TensorRT vs ONNX Runtime CPU on the same graph: kernels and accumulation order differ, the
# model does not. Beyond these the engines disagree on the model, not on rounding.
MAX_KL = 0.01
MIN_TOP1 = 0.98


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__file__, __doc__)
    parser.add_argument("--recipes", nargs="*", choices=list(RECIPES), default=DEFAULT_RECIPES)
    add_run_arguments(parser, REPO / "artifacts" / "benchmarks" / "gpu_check", 300, repeats=5, threads=False)
    parser.add_argument("--deadline", type=float, default=450, help="seconds: start no stage after it")
    parser.add_argument("--gate-timeout", type=int, default=240, help="seconds per gate")
    parser.add_argument("--tokens", type=int, default=2048, help="held-out tokens for the logit check")
    return parser.parse_args(argv)


class Clock:
    """Seconds since the start, against ``--deadline``."""

    def __init__(self, deadline: float) -> None:
        self.started, self.deadline = time.perf_counter(), deadline

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def past(self) -> bool:
        return self.elapsed() >= self.deadline

    def late(self) -> str:
        return f"past the --deadline ({self.deadline:.0f} s) at {self.elapsed():.0f} s"


def _skipped(label: str, clock: Clock) -> Contestant:
    return Contestant(label, "recipe", status="skipped", note=clock.late())


def gate(baseline: Contestant, candidate: Contestant, args: argparse.Namespace) -> dict[str, Any]:
    """``python -m pipeline.gate --eval quick`` of ``candidate`` against ``baseline``."""
    record_path = args.out / f"gate-{candidate.name}.json"
    record_path.unlink(missing_ok=True)
    command = pipeline_command(
        "pipeline.gate", "--baseline", str(baseline.folder), "--candidate", str(candidate.folder),
        "--eval", "quick", "--json", str(record_path),
    )  # fmt: skip
    started = time.perf_counter()
    result = run_logged(command, args.out / f"gate-{candidate.name}.log", args.gate_timeout)
    if result is None:
        return {"verdict": "not run", "note": f"the gate took over {args.gate_timeout} s (--gate-timeout)"}
    if result.returncode not in (0, 3, 4) or not record_path.is_file():  # PASS, FAIL, INCONCLUSIVE
        lines = result.stderr.strip().splitlines() or ["no output"]
        return {"verdict": "not run", "note": f"the gate failed (exit {result.returncode}): {lines[-1]}"}
    record = json.loads(record_path.read_text())
    suites = {
        name: {key: suite.get(key) for key in ("verdict", "difference", "ci_low", "ci_high", "p_value")}
        for name, suite in record.get("suites", {}).items()
    }
    drift = record.get("drift") or {}
    return {
        "verdict": record.get("verdict"),
        "suites": suites,
        "drift": {
            "family": drift.get("family"),
            "verdict": drift.get("verdict"),
            **(drift.get("measured") or {}),
        },
        "seconds": round(time.perf_counter() - started, 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from evals.agreement import compare
    from pipeline.core.gpu import require_tensorrt
    from pipeline.runtime import Engine

    trt_version, gpu = require_tensorrt()  # a ConfigError (one line, exit 2) without GPU/TensorRT
    clock = Clock(args.deadline)
    args.out.mkdir(parents=True, exist_ok=True)

    def build(label: str, recipe: str, overrides: tuple[str, ...]) -> Contestant:
        if clock.past():
            return _skipped(label, clock)
        row = build_recipe(recipe, args.out, args.build_timeout, label=label, overrides=overrides)
        if row.ok and row.folder is not None:
            row.engine = Engine(row.folder)
        return row

    reference = build("fp32-ort-cpu", *REFERENCE)
    rows: list[dict[str, Any]] = []
    engines: list[Contestant] = []
    for label in args.recipes:
        recipe, overrides = RECIPES[label]
        trt = build(f"{label}-tensorrt", recipe, (*overrides, *COMMON, "target=tensorrt"))
        cpu = build(f"{label}-ort-cpu", recipe, (*overrides, *COMMON, "target=ort-cpu"))
        record: dict[str, Any] = {
            "recipe": label,
            "target": "tensorrt",
            "status": trt.status,
            "note": trt.note,
        }
        record["build_s"] = trt.build.get("seconds")
        if trt.ok and trt.engine is not None:
            record["plan_bytes"] = trt.size_bytes
            if cpu.ok and cpu.engine is not None and not clock.past():
                agreement = compare(trt.engine, cpu.engine, QualityConfig(window=512, max_tokens=args.tokens))
                keys = ("kl_mean", "top1_agreement", "perplexity", "reference_perplexity")
                record["vs_ort_cpu"] = {key: agreement[key] for key in keys}
                record["match"] = agreement["kl_mean"] <= MAX_KL and agreement["top1_agreement"] >= MIN_TOP1
            if not reference.ok:
                record["gate"] = {"verdict": "not run", "note": f"no reference: {reference.note}"}
            elif clock.past():
                record["gate"] = {"verdict": "not run", "note": clock.late()}
            else:
                record["gate"] = gate(reference, trt, args)
            engines.append(trt)
        rows.append(record)
    peer = build("fp16-ort-cuda", *PEER)
    rows.append({"recipe": "fp16", "target": "ort-cuda", "status": peer.status, "note": peer.note})
    timed = [*engines, *([peer] if peer.ok else [])]
    timing: dict[str, Any] = {}
    if timed and not clock.past():
        timing = measure_speed(timed, args)
        peer_ms = {key: median_ms(peer.samples[key]) for key in ("ttft", "tpot")} if peer.ok else {}
        for row in timed:
            record = next(r for r in rows if f"{r['recipe']}-{r['target']}" == row.name)
            record["ttft_ms"] = round(median_ms(row.samples["ttft"]), 2)
            record["tpot_ms"] = round(median_ms(row.samples["tpot"]), 3)
            for key, value in peer_ms.items():
                record[f"{key}_vs_ort_cuda_fp16"] = round(median_ms(row.samples[key]) / value, 3)
    elif timed:
        timing = {"note": clock.late()}
    return {
        "tensorrt": trt_version,
        "gpu": gpu.to_dict(),
        "reference": {"status": reference.status, "note": reference.note, "engine": str(reference.folder)},
        "ttft_prompt_tokens": TTFT_LENGTH,
        "decode_tokens": DECODE_TOKENS,
        "rows": rows,
        "timing": timing,
        "seconds": round(clock.elapsed(), 1),
        "deadline_s": args.deadline,
    }


def _gate_cell(gate_record: dict[str, Any] | None) -> str:
    if not gate_record:
        return ""
    if gate_record["verdict"] == "not run":
        return f"not run: {gate_record['note']}"
    lines = [str(gate_record["verdict"])]
    for suite, result in gate_record["suites"].items():
        lines.append(f"{suite}: {result['difference']:+.1%} {result['verdict']}")
    drift = gate_record["drift"]
    if "kl" in drift:
        lines.append(
            f"drift: KL {drift['kl']:.4f}, top-1 {drift['top1']:.1%} ({drift['family']}) {drift['verdict']}"
        )
    return "\n".join(lines)


def cells(row: dict[str, Any]) -> list[str]:
    """One row of the table: recipe, target, gate, parity vs ORT CPU, TTFT, TPOT, ratios."""
    if row["status"] != "ok":
        return [row["recipe"], row["target"], f"{row['status']}: {row['note']}", "", "", "", ""]
    vs = row.get("vs_ort_cpu")
    parity = ""
    if vs:
        parity = f"{vs['kl_mean']:.5f} / {vs['top1_agreement']:.2%} {'ok' if row['match'] else 'NO'}"
    ratios = [row.get(f"{key}_vs_ort_cuda_fp16") for key in ("ttft", "tpot")]
    return [
        row["recipe"],
        row["target"],
        _gate_cell(row.get("gate")),
        parity,
        str(row.get("ttft_ms", "")),
        str(row.get("tpot_ms", "")),
        ", ".join(f"x{r}" for r in ratios if r is not None),
    ]


def print_report(record: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    gpu = record["gpu"]
    where = f"{gpu['name']} (sm {gpu['compute_capability']}, CUDA {gpu['cuda']})"
    table = Table(title=f"TensorRT {record['tensorrt']} on {where}, {record['seconds']} s")
    columns = ("recipe", "target", "gate (quick) vs fp32", "KL / top-1 vs ORT CPU", "TTFT ms", "TPOT ms")
    for column in (*columns, "TTFT, TPOT vs ort-cuda fp16"):
        table.add_column(column)
    for row in record["rows"]:
        table.add_row(*cells(row))
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    return run_and_report(parse_args(argv), run, print_report)


if __name__ == "__main__":
    sys.exit(main())
