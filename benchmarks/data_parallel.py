"""Data parallelism on this machine: the distill pass inline vs 2 processes under ``accelerate
launch`` (DDP and FSDP), same global batch and seed, on the default model pruned by
``prune=width25``: the loss curve of each, seconds a step, and the largest weight difference from
the inline student.

    python benchmarks/data_parallel.py --steps 20 [--model artifacts/models/llama-...] [--json out.json]

The pruned student comes from the pipeline cache (``artifacts/cache``; computed once). The distill
runs are not cached (they run the pass directly, without checkpoints), one after another, so each
has the 2 cores to itself; the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONTESTANTS = {
    "inline": {},
    "ddp x2": {"launcher": "accelerate", "num_processes": 2, "strategy": "ddp"},
    "fsdp x2": {"launcher": "accelerate", "num_processes": 2, "strategy": "fsdp"},
}


def pruned_student(model: Path) -> Any:
    """The default model after ``prune=width25``, through the pass manager and its cache."""
    from passes.prune import PrunePass
    from pipeline.artifacts import Artifact, Kind
    from pipeline.cache import Cache
    from pipeline.manager import PassManager, validate

    step = PrunePass(mlp_ratio=0.25)
    step.config_group = "prune"
    validate([step], Kind.TORCH, final_kind=None)  # the recipe stops at the torch student
    source = Artifact.from_dir(Kind.TORCH, model)
    result, _ = PassManager([step], Cache(ROOT / "artifacts" / "cache"))._run_one(1, step, source)
    return result


def distill(student: Any, settings: dict[str, Any], steps: int) -> tuple[dict[str, Any], float, Path]:
    from passes.distill import DistillPass
    from pipeline.artifacts import Artifact, Kind

    step = DistillPass(steps=steps, checkpoint_every=10**6, **settings)
    step.config_group = "distill"
    step.preflight()
    step.requires(student)
    out = Path(tempfile.mkdtemp(prefix="data-parallel-"))
    started = time.perf_counter()
    metrics = step.run(student, out)
    seconds = time.perf_counter() - started
    return metrics, seconds, Artifact.from_dir(Kind.TORCH, out).path


def largest_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return max(float((first[name] - second[name]).abs().max()) for name in first)


def main(argv: list[str] | None = None) -> int:
    import shutil

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: newest artifacts/models/llama-*")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", nargs="*", default=list(CONTESTANTS), choices=list(CONTESTANTS))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    model = args.model or max(
        (ROOT / "artifacts" / "models").glob("llama-*"), key=lambda p: p.stat().st_mtime
    )
    load_before = os.getloadavg()
    student = pruned_student(model)
    rows: dict[str, dict[str, Any]] = {}
    outputs: dict[str, Path] = {}
    try:
        for label in args.only:
            metrics, seconds, outputs[label] = distill(student, CONTESTANTS[label], args.steps)
            rows[label] = {"seconds": round(seconds, 1), "curve": metrics["loss_curve"]}
            rows[label]["holdout_kl_after"] = metrics["holdout_after"]["kl_vs_teacher"]
            print(f"{label}: {seconds:.0f} s, curve {metrics['loss_curve']}", flush=True)
        first = args.only[0]
        for label in args.only[1:]:
            rows[label][f"max |w - w_{first}|"] = largest_difference(outputs[label], outputs[first])
    finally:
        for folder in outputs.values():
            shutil.rmtree(folder, ignore_errors=True)
    record = {
        "model": str(model),
        "steps": args.steps,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    record["rows"] = rows
    points = [step for step, _ in rows[args.only[0]]["curve"]]
    print(f"\nload average before {load_before[0]:.2f}, after {record['load_after'][0]:.2f}")
    print(
        "| contestant | s total | " + " | ".join(f"loss @{p}" for p in points) + " | held-out KL | max |Δw| |"
    )
    print("|---" * (len(points) + 4) + "|")
    for label, row in rows.items():
        losses = " | ".join(f"{loss:.5f}" for _, loss in row["curve"])
        diff = next((f"{v:.2e}" for k, v in row.items() if k.startswith("max")), "-")
        print(f"| {label} | {row['seconds']} | {losses} | {row['holdout_kl_after']:.5f} | {diff} |")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
