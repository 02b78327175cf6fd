"""Registry reliability and speed on a real engine folder, in one run, in a scratch registry:

- publish and pull of the engine (median seconds and MB/s over ``--repeats``; a re-publish of
  the same bytes stores nothing new, a pull hashes every byte);
- ``--kills`` publishers killed with SIGKILL at random moments (one in each of ``--kills`` equal
  slices of 1.5 measured publish times, CLI start-up included): after each, ``verify`` must pass
  and the version must be complete or absent; ``gc`` then removes what was left;
- 4 concurrent publishers of one recipe and 4 of different recipes: all must finish, versions
  distinct, ``verify`` clean.

    python -m benchmarks.registry artifacts/runs/<time> [--kills 10] [--repeats 3] [--keep DIR]

The run folder must hold ``manifest.json`` and its engine (any run; a gate verdict other than
PASS is published with ``--force``, recorded as such).

The command and the recorded results: ``benchmarks/README.md`` (registry).
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.common import REPO, load_average, load_line, make_parser, pipeline_command, write_record
from pipeline.core.artifacts import file_digests
from pipeline.core.subprocesses import child_environment
from pipeline.registry import LocalRegistry, Ref

# Publishers run from the repository root (``python -m pipeline.registry`` finds ``pipeline``
# there) with a clean environment, as every child of ours.
CHILD: dict[str, Any] = {"cwd": REPO, "env": child_environment()}


def publish_command(root: Path, run: Path, recipe: str, force: bool) -> list[str]:
    """``python -m pipeline.registry publish`` of ``run`` as ``bench/<recipe>`` into ``root``."""
    force_it = ["--force", "benchmark"] if force else []
    return pipeline_command(
        "pipeline.registry", "--root", str(root), "publish", str(run), "--model", "bench", "--recipe", recipe,
        *force_it,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__file__, __doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="scratch folder to keep (default: a temporary one)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.run_dir = args.run_dir.resolve()  # the publishers run from the repository root
    manifest = json.loads((args.run_dir / "manifest.json").read_text())
    force = (manifest.get("gate") or {}).get("verdict") != "PASS"
    size = sum(int(f["bytes"]) for f in manifest["engine"]["files"])
    scratch = args.keep or Path(tempfile.mkdtemp(prefix="registry-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    result: dict[str, Any] = {"engine_bytes": size, "files": len(manifest["engine"]["files"])}
    try:
        # publish / pull speed, each repeat into a fresh registry (cold: every blob copied)
        publish_s, pull_s, republish_s = [], [], []
        for repeat in range(args.repeats):
            root = scratch / f"speed{repeat}"
            started = time.perf_counter()
            subprocess.run(
                publish_command(root, args.run_dir, "r", force), **CHILD, check=True, capture_output=True
            )
            publish_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            subprocess.run(
                publish_command(root, args.run_dir, "r", force), **CHILD, check=True, capture_output=True
            )
            republish_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            pulled = LocalRegistry(root).pull(Ref.parse("bench/r@1"), scratch / f"pulled{repeat}")
            pull_s.append(time.perf_counter() - started)
            assert file_digests(pulled / "engine") == {
                f["path"]: f["sha256"] for f in manifest["engine"]["files"]
            }
            shutil.rmtree(pulled)
            shutil.rmtree(root)
        result["publish_s"] = statistics.median(publish_s)
        result["republish_s"] = statistics.median(republish_s)
        result["pull_s"] = statistics.median(pull_s)

        # kill -9 at random moments
        outcomes = {"complete": 0, "absent": 0, "inconsistent": 0}
        garbage = []
        for kill in range(args.kills):
            root = scratch / f"kill{kill}"
            process = subprocess.Popen(publish_command(root, args.run_dir, "r", force), **CHILD)
            # stratified over 1.5 publish times (some land after the commit), jittered in the stratum
            time.sleep((kill + rng.random()) / args.kills * 1.5 * result["publish_s"])
            process.send_signal(signal.SIGKILL)
            process.wait()
            store = LocalRegistry(root)
            problems = store.verify() if root.exists() else []
            versions = store.index()["versions"] if root.exists() else []
            if problems:
                outcomes["inconsistent"] += 1
            elif versions:
                outcomes["complete"] += 1
            else:
                outcomes["absent"] += 1
            garbage.append(store.gc()["orphan_blobs"] if root.exists() else 0)
            shutil.rmtree(root, ignore_errors=True)
        result["kills"] = {**outcomes, "runs_leaving_orphan_blobs": sum(1 for g in garbage if g)}

        # 4 publishers of one recipe + 4 of different recipes, at once
        root = scratch / "concurrent"
        recipes = ["same"] * 4 + ["a", "b", "c", "d"]
        started = time.perf_counter()
        processes = [
            subprocess.Popen(
                publish_command(root, args.run_dir, r, force), **CHILD, stdout=subprocess.DEVNULL
            )
            for r in recipes
        ]
        codes = [p.wait() for p in processes]
        store = LocalRegistry(root)
        same = sorted(v["version"] for v in store.index()["versions"] if v["recipe"] == "same")
        result["concurrent"] = {
            "seconds": time.perf_counter() - started,
            "exit_codes": codes,
            "same_recipe_versions": same,
            "versions": len(store.index()["versions"]),
            "verify_problems": len(store.verify()),
        }
    finally:
        if args.keep is None:
            shutil.rmtree(scratch, ignore_errors=True)

    mb = size / 1e6
    table = Table(title=f"Local registry on {args.run_dir} ({mb:.0f} MB, {result['files']} files)")
    table.add_column("check")
    table.add_column("result")
    table.add_row("publish (cold)", f"{result['publish_s']:.2f} s ({mb / result['publish_s']:.0f} MB/s)")
    table.add_row("publish again (blobs stored)", f"{result['republish_s']:.2f} s")
    table.add_row("pull (every byte hashed)", f"{result['pull_s']:.2f} s ({mb / result['pull_s']:.0f} MB/s)")
    kills = result["kills"]
    table.add_row(
        f"kill -9 x{args.kills} at random moments",
        f"complete {kills['complete']}, absent {kills['absent']}, inconsistent {kills['inconsistent']}; "
        f"gc found orphans after {kills['runs_leaving_orphan_blobs']}",
    )
    c = result["concurrent"]
    table.add_row(
        "4 same + 4 different recipes at once",
        f"exit codes {c['exit_codes']}, versions of 'same' {c['same_recipe_versions']}, "
        f"{c['versions']} versions, verify problems {c['verify_problems']}, {c['seconds']:.1f} s",
    )
    Console().print(table)
    print(f"{load_line(load_average())}; medians over {args.repeats} repeats")
    if args.json:
        write_record(args.json, result)
    ok = (
        kills["inconsistent"] == 0
        and set(c["exit_codes"]) == {0}
        and c["same_recipe_versions"] == [1, 2, 3, 4]
    )
    return 0 if ok and c["verify_problems"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
