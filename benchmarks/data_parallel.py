"""Data parallelism on this machine, on the default model.

Distillation (``--part distill``): the distill pass inline vs 2 processes under ``accelerate
launch`` (DDP and FSDP), same global batch and seed, on the model pruned by ``prune=width25``: the
loss curve of each, seconds in all, and the largest weight difference from the inline student.
Calibration (``--part calibration``): quant=int8's SmoothQuant and quant=int4_gptq's GPTQ pass with
``calibration.num_processes`` 1 and 2 (their default 64 windows x 256 tokens): rank 0's windows,
its wall and CPU seconds in calibration forwards (what data parallelism divides), and the pass's
seconds in all.

    python -m benchmarks.data_parallel --part distill calibration --steps 20 [--model ...] [--json out.json]

The pruned student comes from the pipeline cache (``artifacts/cache``; computed once). The distill
runs are not cached (they run the pass directly, without checkpoints), one after another, so each
has the 2 cores to itself; the load average is printed before and after.

The command and the recorded results: ``benchmarks/README.md`` (data_parallel).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, load_average, load_line, make_parser, write_record

# One micro-batch a step in every process (8 sequences inline, 4 in each of 2 ranks).
CONTESTANTS = {
    "inline": {},
    "ddp x2": {"launcher": "accelerate", "num_processes": 2, "strategy": "ddp", "micro_batch_size": 4},
    "fsdp x2": {"launcher": "accelerate", "num_processes": 2, "strategy": "fsdp", "micro_batch_size": 4},
}


def pruned_student(model: Path) -> Any:
    """The default model after ``prune=width25``, through the pass manager and its cache."""
    from passes.prune import PrunePass
    from pipeline.core.artifacts import Artifact, Kind
    from pipeline.core.cache import Cache
    from pipeline.core.manager import PassManager, validate

    step = PrunePass(mlp_ratio=0.25)
    step.config_group = "prune"
    validate([step], Kind.TORCH, final_kind=None)  # the recipe stops at the torch student
    source = Artifact.from_dir(Kind.TORCH, model)
    result, _ = PassManager([step], Cache(REPO / "artifacts" / "cache"))._run_one(1, step, source)
    return result


def distill(student: Any, settings: dict[str, Any], steps: int) -> tuple[dict[str, Any], float, Path]:
    from passes.distill import DistillPass
    from pipeline.core.artifacts import Artifact, Kind

    step = DistillPass(steps=steps, checkpoint_every=10**6, **settings)
    step.config_group = "distill"
    step.preflight()
    step.requires(student)
    out = Path(tempfile.mkdtemp(prefix="data-parallel-"))
    started = time.perf_counter()
    metrics = step.run(student, out)
    seconds = time.perf_counter() - started
    return metrics, seconds, Artifact.from_dir(Kind.TORCH, out).path


def calibrate(model: Path, recipe: str, processes: int) -> dict[str, Any]:
    """One calibration pass on the default model in ``processes`` ranks (not cached)."""
    import shutil

    from passes.gptq import GptqPass
    from passes.smoothquant import SmoothQuantPass
    from pipeline.core.artifacts import Artifact, Kind
    from pipeline.core.manager import validate

    calibration = {"num_processes": processes}
    step = (
        SmoothQuantPass(calibration=calibration)
        if recipe == "smoothquant"
        else GptqPass(calibration=calibration)
    )
    step.config_group = "quant"
    validate([step], Kind.TORCH, final_kind=None)
    source = Artifact.from_dir(Kind.TORCH, model)
    step.requires(source)
    out = Path(tempfile.mkdtemp(prefix="data-parallel-"))
    try:
        started = time.perf_counter()
        metrics = step.run(source, out)
        return {"seconds": round(time.perf_counter() - started, 1), **metrics["calibration"]}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def calibration_part(model: Path) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for recipe in ("smoothquant", "gptq"):
        for processes in (1, 2):
            rows[f"{recipe} x{processes}"] = row = calibrate(model, recipe, processes)
            print(f"{recipe} x{processes}: {row}", flush=True)
    header = ["pass", "processes", "windows on rank 0", "rank 0 forward s", "rank 0 forward CPU s"]
    print("\n| " + " | ".join([*header, "CPU vs x1", "pass s"]) + " |")
    print("|---|---|---|---|---|---|---|")
    for label, row in rows.items():
        one = rows[label.replace("x2", "x1")]
        ratio = row["forward_cpu_seconds"] / max(one["forward_cpu_seconds"], 1e-9)
        name, ranks = label.split(" x")
        print(
            f"| {name} | {ranks} | {row['windows']} | {row['forward_seconds']} | "
            f"{row['forward_cpu_seconds']} | {ratio:.2f} | {row['seconds']} |"
        )
    return rows


def largest_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return max(float((first[name] - second[name]).abs().max()) for name in first)


def distill_part(model: Path, steps: int, only: list[str]) -> dict[str, Any]:
    import shutil

    student = pruned_student(model)
    rows: dict[str, dict[str, Any]] = {}
    outputs: dict[str, Path] = {}
    try:
        for label in only:
            metrics, seconds, outputs[label] = distill(student, CONTESTANTS[label], steps)
            rows[label] = {"seconds": round(seconds, 1), "curve": metrics["loss_curve"]}
            rows[label]["holdout_kl_after"] = metrics["holdout_after"]["kl_vs_teacher"]
            print(f"{label}: {seconds:.0f} s, curve {metrics['loss_curve']}", flush=True)
        first = only[0]
        for label in only[1:]:
            rows[label][f"max |w - w_{first}|"] = largest_difference(outputs[label], outputs[first])
    finally:
        for folder in outputs.values():
            shutil.rmtree(folder, ignore_errors=True)
    points = [step for step, _ in rows[only[0]]["curve"]]
    print(
        "\n| contestant | s total | "
        + " | ".join(f"loss @{p}" for p in points)
        + " | held-out KL | max |Δw| |"
    )
    print("|---" * (len(points) + 4) + "|")
    for label, row in rows.items():
        losses = " | ".join(f"{loss:.5f}" for _, loss in row["curve"])
        diff = next((f"{v:.2e}" for k, v in row.items() if k.startswith("max")), "-")
        print(f"| {label} | {row['seconds']} | {losses} | {row['holdout_kl_after']:.5f} | {diff} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__file__, __doc__)
    parser.add_argument("--model", type=Path, default=None, help="default: newest artifacts/models/llama-*")
    parser.add_argument(
        "--part", nargs="+", default=["distill", "calibration"], choices=["distill", "calibration"]
    )
    parser.add_argument("--steps", type=int, default=20, help="distill steps")
    parser.add_argument("--only", nargs="*", default=list(CONTESTANTS), choices=list(CONTESTANTS))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    model = args.model or max(
        (REPO / "artifacts" / "models").glob("llama-*"), key=lambda p: p.stat().st_mtime
    )
    record: dict[str, Any] = {"model": str(model), "steps": args.steps, "load_before": load_average()}
    if "distill" in args.part:
        record["distill"] = distill_part(model, args.steps, args.only)
    if "calibration" in args.part:
        record["calibration"] = calibration_part(model)
    record["load_after"] = load_average()
    print(f"\n{load_line(record['load_before'], record['load_after'])}")
    if args.json:
        write_record(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
