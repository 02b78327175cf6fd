"""Device check for a machine with an NVIDIA GPU: TensorRT engines of the default model in every
precision, checked against ONNX Runtime on CPU and timed. One command, one table:

    python benchmarks/gpu_check.py [--recipes fp16 fp8 int8 int4] [--ort-cuda] [--json out.json]

For each recipe it builds, with the real CLI (cached like any run, so a rerun is quick):

- ``target=tensorrt``: the strongly typed TensorRT 11 engine of the recipe's graph
  (``fusion=tensorrt``: standard-op RMSNorm and RoPE), and
- ``target=ort-cpu``: the ONNX Runtime CPU engine of the same graph (same cache entries up to the
  build), the numerics the gate measured,

then compares their logits on held-out text (``evals.agreement.compare``: KL(ORT CPU || TensorRT),
top-1 agreement, perplexity of each) and times TTFT at 512 prompt tokens and TPOT over 64 new
tokens (medians, engines interleaved run by run), with ratios against the fp16 TensorRT engine.
``--ort-cuda`` adds ``target=ort-cuda`` engines (needs onnxruntime-gpu in place of onnxruntime).

Recipes (graph precisions; TensorRT takes precision from the graph only):

- ``fp16``: ``quant=fp16`` (ONNX Runtime's float16 converter, RMSNorm reductions and Softmax fp32);
- ``fp8``: ``quant=fp8`` (E4M3 Q/DQ, per-channel weights, static per-tensor activations);
- ``int8``: ``quant=int8`` (SmoothQuant W8A8 Q/DQ);
- ``int4``: ``quant=int4_awq quant.lowering=qdq quant.group_size=128 quant.symmetric=true`` (AWQ,
  INT4 weight blocks of 128 along the input axis: TensorRT's block sizes are 64 and 128).

To fit a few minutes, calibration uses 32 windows and the per-layer sensitivity scans are off.
On a machine without GPU or TensorRT it stops at once with one line saying what is missing.
Not run on our CPU-only machines: this script is written for the device check and has not been
run on a GPU yet.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quantization import (
    DECODE_TOKENS,
    REPO,
    TTFT_LENGTH,
    Contestant,
    build_recipe,
    measure_speed,
    run_and_report,
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
COMMON = ("fusion=tensorrt", "eval=none", "registry=none", "quality.enabled=false")
PEER = "fp16"
# TensorRT vs ONNX Runtime CPU on the same graph: kernels and accumulation order differ, the
# model does not. Beyond these the engines disagree on the model, not on rounding.
MAX_KL = 0.01
MIN_TOP1 = 0.98


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu_check.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--recipes", nargs="*", choices=list(RECIPES), default=list(RECIPES))
    parser.add_argument("--ort-cuda", action="store_true", help="also build and time target=ort-cuda")
    parser.add_argument("--out", type=Path, default=REPO / "artifacts" / "benchmarks" / "gpu_check")
    parser.add_argument("--build-timeout", type=int, default=1200, help="seconds per build")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=2048, help="held-out tokens for the logit check")
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from evals.agreement import compare
    from pipeline.gpu import require_tensorrt
    from pipeline.runtime import Engine

    trt_version, gpu = require_tensorrt()  # a ConfigError (one line, exit 2) without GPU/TensorRT
    args.out.mkdir(parents=True, exist_ok=True)
    check = QualityConfig(window=512, max_tokens=args.tokens)
    rows: list[dict[str, Any]] = []
    timed: list[Contestant] = []
    for label in args.recipes:
        recipe, overrides = RECIPES[label]
        targets = ["tensorrt", "ort-cpu", *(["ort-cuda"] if args.ort_cuda else [])]
        built = {
            target: build_recipe(
                recipe,
                args.out,
                args.build_timeout,
                label=f"{label}-{target}",
                overrides=(*overrides, *COMMON, f"target={target}"),
            )
            for target in targets
        }
        for row in built.values():
            if row.ok and row.folder is not None:
                row.engine = Engine(row.folder)
        cpu = built["ort-cpu"]
        for target in ("tensorrt", "ort-cuda"):
            row = built.get(target)
            if row is None:
                continue
            record: dict[str, Any] = {"recipe": label, "target": target, "status": row.status}
            record["note"] = row.note
            if row.ok and cpu.ok and row.engine is not None and cpu.engine is not None:
                agreement = compare(row.engine, cpu.engine, check)
                keys = ("kl_mean", "top1_agreement", "perplexity", "reference_perplexity")
                record["vs_ort_cpu"] = {key: agreement[key] for key in keys}
                record["match"] = agreement["kl_mean"] <= MAX_KL and agreement["top1_agreement"] >= MIN_TOP1
                record["plan_bytes"] = row.size_bytes
                timed.append(row)
            rows.append(record)
    timing = measure_speed(timed, args) if timed else {}
    peer = next((r for r in timed if r.name == f"{PEER}-tensorrt"), None)
    peer_tpot = _median(peer.samples["tpot"]) if peer else None
    for row in timed:
        record = next(r for r in rows if f"{r['recipe']}-{r['target']}" == row.name)
        record["ttft_ms"] = round(_median(row.samples["ttft"]) * 1000, 2)
        record["tpot_ms"] = round(_median(row.samples["tpot"]) * 1000, 3)
        if peer_tpot:
            record["tpot_vs_fp16"] = round(_median(row.samples["tpot"]) / peer_tpot, 3)
    return {
        "tensorrt": trt_version,
        "gpu": gpu.to_dict(),
        "ttft_prompt_tokens": TTFT_LENGTH,
        "decode_tokens": DECODE_TOKENS,
        "rows": rows,
        "timing": timing,
    }


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def print_report(record: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    gpu = record["gpu"]
    where = f"{gpu['name']} (sm {gpu['compute_capability']}, CUDA {gpu['cuda']})"
    table = Table(title=f"TensorRT {record['tensorrt']} on {where}")
    columns = ("recipe", "target", "KL vs ORT CPU", "top-1", "ppl (ORT CPU)", "TTFT ms", "TPOT ms", "vs fp16")
    for column in (*columns, "ok"):
        table.add_column(column)
    for row in record["rows"]:
        if "vs_ort_cpu" not in row:
            table.add_row(row["recipe"], row["target"], row["status"], row["note"], "", "", "", "", "-")
            continue
        vs = row["vs_ort_cpu"]
        table.add_row(
            row["recipe"],
            row["target"],
            f"{vs['kl_mean']:.5f}",
            f"{vs['top1_agreement']:.2%}",
            f"{vs['perplexity']:.2f} ({vs['reference_perplexity']:.2f})",
            f"{row.get('ttft_ms', '')}",
            f"{row.get('tpot_ms', '')}",
            f"{row.get('tpot_vs_fp16', '')}",
            "yes" if row["match"] else "NO",
        )
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    return run_and_report(parse_args(argv), run, print_report)


if __name__ == "__main__":
    sys.exit(main())
