"""Scaling: time, CPU time, peak memory and disk of every pass against the parameter count, on
random-initialized Llama checkpoints of real shapes built through the real CLI.

What one run does:

1. **Checkpoints.** For each ``--shapes`` entry (SmolLM2-135M, SmolLM2-360M, TinyLlama-1.1B and
   Llama-3.2-3B shapes by default; ``8b``, Llama-3.1-8B's, on request; every one with the default
   model's tokenizer, so vocab 49152) it writes a seeded random-initialized Llama in bf16
   safetensors under ``--work``/models: the model is built on the meta device (no memory), then
   each tensor is drawn on its own (fp32, then bf16), written shard by shard and freed, so a 3B
   checkpoint (6 GiB) never holds more than one shard (``--shard-gib``). HF's init: normal(0, 0.02)
   for linear and embedding weights, ones for the RMSNorm weights. A checkpoint is reused when its
   ``scaling.json`` names the same shape and seed and every file matches the sha256 stored there;
   a shape whose checkpoint does not fit in the free disk space is skipped.
2. **Builds.** Each shape with each ``--recipes`` option (``quant=none int8 int4_awq fp8``), one
   ``python -m pipeline`` subprocess per build (``model.path=<checkpoint> quant=<recipe> eval=none
   bench=none quality.enabled=false registry=none``: no gate, speed benchmark, quality scoring or
   publication, so the numbers are the passes'; quant recipes with
   ``quant.sensitivity.enabled=true``, so the scan is measured though only fallback=auto runs it by
   default), each with its own pipeline cache
   (``--work``/cache/<shape>/<recipe>) so no build takes a pass from another's. Without ``--keep``
   the build's cache and run folder are cleared before it (every pass runs) and its cache and
   engine after it is measured (the manifest and log stay). A build the pipeline's memory
   preflight refuses (exit 2, one line about memory) is recorded as "refused by preflight: <the
   line>", and a build for which the free disk is under ``--disk-factor`` x the fp32 weights as
   skipped; the benchmark goes on.
3. **Measures** per build and per pass: wall seconds (``passes[i].seconds`` of the run's
   ``manifest.json``), CPU seconds, peak RSS and the preflight's estimate (``passes[i].resources``,
   when the manifest has them: the table's "by" column says "pass"); per build the whole process's
   wall time, CPU time and peak RSS (``os.wait4`` on the subprocess: its own rusage, children it
   waited for included; "process"; the pipeline's per-pass meter resets the kernel's high-water
   mark, so the build's peak is the largest of wait4's and the passes'); the disk bytes the build
   added under its cache and run folders, each inode counted once and inodes that existed before
   the build not counted (hard links into the cache are not new bytes), and that as a ratio of the
   fp32 weight bytes.
4. **Fits** per recipe and per pass the exponent b of time ~ a * params^b and of peak RSS ~
   params^b by least squares on log-log over the shapes built (``--fit-from 360m``: only shapes
   at least that large) and flags time exponents above 1.15 (the issue's target: linear in
   parameters, allowing for fixed costs).

Load average before and after every build, CPU model and cores are in the output and in the JSON
(``--out``). On a shared machine the timings are noisy: compare ratios from one run.

Run from the repository root::

    python -m benchmarks.scaling --shapes 135m 360m --recipes none int4_awq [--keep]
    python -m benchmarks.scaling --report artifacts/scaling/scaling.json --fit-from 360m  # refit, no builds
    python -m benchmarks.scaling --report a.json b.json  # the builds of several runs in one table

The command and the recorded results: ``benchmarks/README.md`` (scaling).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import DEFAULT_MODEL, REPO, UsageError, error_line, load_average, make_parser

DEFAULT_WORK = Path("artifacts/scaling")
DEFAULT_TOKENIZER = DEFAULT_MODEL
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
SPEC_FILE = "scaling.json"  # the shape, seed and sha256 of every file of a written checkpoint
WRITER_VERSION = 2  # bump when the checkpoint writer changes what it writes
DEFAULT_RECIPES = ("none", "int8", "int4_awq", "fp8")
TIME_EXPONENT_LIMIT = 1.15
GIB = 2**30
TOTAL = "total"


@dataclass(frozen=True)
class Shape:
    """A Llama architecture: what a checkpoint's config.json says about its size."""

    name: str
    like: str  # the public model of this shape
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool
    vocab: int = 49152  # the default tokenizer's
    max_positions: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        """Parameter count: embeddings, per layer q/k/v/o, gate/up/down and two RMSNorms, the
        final norm, and the LM head unless it is tied to the embeddings."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attention = 2 * h * self.heads * self.head_dim + 2 * h * kv
        layer = attention + 3 * h * self.intermediate + 2 * h
        head = 0 if self.tied else self.vocab * h
        return self.vocab * h + self.layers * layer + h + head

    def fp32_bytes(self) -> int:
        return 4 * self.parameters()

    def config(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate,
            "tie_word_embeddings": self.tied,
            "max_position_embeddings": self.max_positions,
        }


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("135m", "SmolLM2-135M", 576, 30, 9, 3, 1536, tied=True),
        Shape("360m", "SmolLM2-360M", 960, 32, 15, 5, 2560, tied=True),
        Shape("1.1b", "TinyLlama-1.1B", 2048, 22, 32, 4, 5632, tied=False),
        Shape("3b", "Llama-3.2-3B", 3072, 28, 24, 8, 8192, tied=True),
        Shape("8b", "Llama-3.1-8B", 4096, 32, 32, 8, 14336, tied=False),
    )
}
DEFAULT_SHAPES = ("135m", "360m", "1.1b", "3b")
SIZE_KEYS = tuple(SHAPES["135m"].config())  # the config.json keys a Shape sets


def say(message: str) -> None:
    print(f"[scaling {time.strftime('%H:%M:%S')}] {message}", flush=True)


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


# --------------------------------------------------------------------------- checkpoints


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _spec(shape: Shape, seed: int, shard_bytes: int) -> dict[str, Any]:
    return {
        "writer": WRITER_VERSION,
        "shape": dataclasses.asdict(shape),
        "seed": seed,
        "shard_bytes": shard_bytes,
    }


def _base_config(tokenizer_dir: Path) -> dict[str, Any]:
    """The tokenizer folder's config.json minus everything about size: token ids, norm epsilon,
    rope settings stay those of the model the tokenizer belongs to."""
    path = tokenizer_dir / "config.json"
    base = json.loads(path.read_text()) if path.is_file() else {}
    drop = {"_model_name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version"}
    drop |= {"model_type", "use_cache", *SIZE_KEYS}
    return {k: v for k, v in base.items() if k not in drop}


def _init_tensor(name: str, shape: tuple[int, ...], seed: int) -> Any:
    """HF Llama's init for one tensor, seeded by its name (independent of writing order)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(
        int(hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()[:15], 16)
    )
    values = torch.randn(shape, generator=generator, dtype=torch.float32).mul_(0.02)
    return values.to(torch.bfloat16)


def checkpoint_ok(folder: Path, spec: dict[str, Any]) -> bool:
    """The folder holds the checkpoint ``spec`` asks for, every file as written (sha256)."""
    path = folder / SPEC_FILE
    if not path.is_file():
        return False
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if stored.get("spec") != spec:
        return False
    files = stored.get("files", {})
    present = {p.name for p in folder.iterdir() if p.is_file() and p.name != SPEC_FILE}
    if present != set(files):
        return False
    return all(sha256_file(folder / name) == digest for name, digest in files.items())


def write_checkpoint(
    shape: Shape, folder: Path, tokenizer_dir: Path, seed: int = 0, shard_bytes: int = 2 * GIB
) -> bool:
    """Write (or keep, when it checks out) the random bf16 checkpoint of ``shape`` in ``folder``.
    Returns whether it was written. Written into a lock-owned staging folder, then renamed."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.core.staging import owned_folder, unique_name

    spec = _spec(shape, seed, shard_bytes)
    if checkpoint_ok(folder, spec):
        return False
    config = LlamaConfig(**{**_base_config(tokenizer_dir), **shape.config()})
    config.dtype = torch.bfloat16
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):  # names and shapes only: no memory
        model = LlamaForCausalLM(config)
    tensors = [
        (name, tuple(p.shape))
        for name, p in model.named_parameters(remove_duplicate=False)
        if not (shape.tied and name == "lm_head.weight")
    ]
    del model
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensors:  # plan the shards from the shapes (2 bytes an element)
        nbytes = 2 * math.prod(dims)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    count = len(shards)
    names = (
        ["model.safetensors"]
        if count == 1
        else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    )
    with owned_folder(folder.parent / unique_name(f".{folder.name}")) as staging:
        weight_map: dict[str, str] = {}
        total = 0
        for file_name, shard in zip(names, shards, strict=True):
            data = {name: _init_tensor(name, dims, seed) for name, dims in shard}
            total += sum(t.numel() * t.element_size() for t in data.values())
            save_file(data, str(staging / file_name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(data, file_name))
            del data
        if count > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config.save_pretrained(staging)
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, staging / name)
        files = {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file()}
        (staging / SPEC_FILE).write_text(json.dumps({"spec": spec, "files": files}, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(staging, folder)
    return True


# --------------------------------------------------------------------------- disk accounting


def _files(roots: Iterable[Path]) -> Iterable[tuple[str, os.stat_result]]:
    """(path, lstat) of every regular file under ``roots`` (symbolic links left out)."""
    for root in roots:
        if not root.exists():
            continue
        for parent, _, names in os.walk(root):
            for name in names:
                path = os.path.join(parent, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield path, st


def inodes(roots: Iterable[Path]) -> set[tuple[int, int]]:
    """Every regular file's inode under ``roots``."""
    return {(st.st_dev, st.st_ino) for _, st in _files(roots)}


def new_files(roots: Iterable[Path], before: set[tuple[int, int]] | None = None) -> list[dict[str, Any]]:
    """The files under ``roots`` not in ``before``, one per inode (hard links are one file; the
    first path found names it), largest first: path, bytes, link count."""
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for path, st in _files(roots):
        key = (st.st_dev, st.st_ino)
        if (before is None or key not in before) and key not in seen:
            seen[key] = {"path": path, "bytes": st.st_size, "links": st.st_nlink}
    return sorted(seen.values(), key=lambda f: -f["bytes"])


def new_bytes(roots: Iterable[Path], before: set[tuple[int, int]] | None = None) -> int:
    """Bytes of the files under ``roots``, each inode once (hard links are one file), leaving out
    inodes in ``before`` (files that existed already: links to them add no bytes)."""
    return sum(f["bytes"] for f in new_files(roots, before))


# --------------------------------------------------------------------------- fits


def fit_exponent(params: Sequence[float], values: Sequence[float]) -> tuple[float, float] | None:
    """(a, b) of values ~ a * params^b, least squares on log-log; None with fewer than two
    distinct parameter counts or a value that is not positive."""
    import numpy as np

    points = [(p, v) for p, v in zip(params, values, strict=True) if v is not None]
    if len({p for p, _ in points}) < 2 or any(p <= 0 or v <= 0 for p, v in points):
        return None
    x = np.log([p for p, _ in points])
    y = np.log([v for _, v in points])
    b, log_a = np.polyfit(x, y, 1)
    return float(math.exp(log_a)), float(b)


def fits(builds: list[dict[str, Any]], min_params: int = 0) -> list[dict[str, Any]]:
    """Per recipe and per pass (and the build's total): exponents of wall time, CPU time (less
    sensitive to other jobs on a shared machine) and peak RSS; wall-time exponents above
    ``TIME_EXPONENT_LIMIT`` are flagged."""
    measures = {"time": "seconds", "cpu": "cpu_seconds", "rss": "peak_rss_bytes"}
    series: dict[tuple[str, str], dict[str, list[tuple[int, float]]]] = {}
    for build in builds:
        if build["status"] != "ok" or build["params"] < min_params:
            continue
        for row in [*build["passes"], {"name": TOTAL, **build["total"]}]:
            if row.get("cache_hit"):
                continue  # no time of this build: the pass came from the cache
            entry = series.setdefault((build["recipe"], row["name"]), {m: [] for m in measures})
            for measure, key in measures.items():
                if row.get(key):
                    entry[measure].append((build["params"], row[key]))
    out = []
    for (recipe, name), entry in series.items():
        found = {
            m: fit_exponent(*zip(*points, strict=True)) if points else None for m, points in entry.items()
        }
        if all(f is None for f in found.values()):
            continue
        b = {m: round(f[1], 3) if f else None for m, f in found.items()}
        out.append(
            {
                "recipe": recipe,
                "pass": name,
                "shapes": len({p for p, _ in entry["time"]}),
                "time_exponent": b["time"],
                "cpu_exponent": b["cpu"],
                "rss_exponent": b["rss"],
                "time_flag": b["time"] is not None and b["time"] > TIME_EXPONENT_LIMIT,
            }
        )
    return out


# --------------------------------------------------------------------------- builds


def host() -> dict[str, Any]:
    from pipeline.bench import host_info

    info = host_info()
    info["usable_cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return info


def is_preflight_refusal(returncode: int, line: str) -> bool:
    """The pipeline's memory preflight refuses with one ``error:`` line about memory, exit 2."""
    lowered = line.lower()
    return returncode == 2 and line.startswith("error:") and ("memory" in lowered or "gib" in lowered)


def _stop(pid: int) -> tuple[int, Any]:
    """SIGTERM the build's process group (the pipeline cleans up), SIGKILL after 60 s; reap it."""
    for sig, grace in ((signal.SIGTERM, 60.0), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + (grace or 3600)
        while time.monotonic() < deadline:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                return status, usage
            time.sleep(0.2)
    _, status, usage = os.wait4(pid, 0)
    return status, usage


def run_build(command: list[str], log_path: Path, timeout_s: int) -> dict[str, Any]:
    """Run one build; its wall seconds and its own rusage (``wait4``: CPU and peak RSS of the
    process and the children it waited for)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(
            command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = False
        try:
            while True:
                done, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if done:
                    break
                if time.perf_counter() - start > timeout_s:
                    timed_out = True
                    status, usage = _stop(proc.pid)
                    break
                time.sleep(0.5)
        except BaseException:  # Ctrl-C: stop the build (it removes its staging), then go
            status, usage = _stop(proc.pid)
            proc.returncode = os.waitstatus_to_exitcode(status)
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "wall_s": round(time.perf_counter() - start, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux: KiB
    }


def pass_rows(manifest: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """Per pass: seconds and, when the manifest has them, the resources; and whether it had them."""
    rows, measured = [], True
    for record in manifest.get("passes", []):
        resources = record.get("resources") or record.get("metrics", {}).get("resources") or {}
        measured = measured and bool(resources)
        rows.append(
            {
                "name": record["name"],
                "seconds": record.get("seconds"),
                "cache_hit": bool(record.get("cache_hit")),
                "cpu_seconds": resources.get("cpu_seconds"),
                "peak_rss_bytes": resources.get("peak_rss_bytes"),
                "gpu_peak_bytes": resources.get("gpu_peak_bytes"),
                "estimate_bytes": resources.get("estimate_bytes"),
                "measured_by": "pass" if resources else "wall only",
            }
        )
    return rows, measured and bool(rows)


def build(shape: Shape, checkpoint: Path, recipe: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build ``checkpoint`` with ``quant=recipe`` through the CLI and measure it; never raises
    for a failing, refused or skipped build."""
    work: Path = args.work
    cache_dir = work / "cache" / shape.name / recipe
    run_dir = work / "runs" / shape.name / recipe
    record: dict[str, Any] = {
        "shape": shape.name,
        "like": shape.like,
        "params": shape.parameters(),
        "fp32_bytes": shape.fp32_bytes(),
        "recipe": recipe,
        "status": "ok",
        "note": "",
        "passes": [],
        "total": {},
    }
    if not args.keep:
        for folder in (cache_dir, run_dir):
            shutil.rmtree(folder, ignore_errors=True)
    free = shutil.disk_usage(work).free
    needed = args.disk_factor * shape.fp32_bytes()
    if free < needed:
        record["status"] = "skipped"
        record["note"] = (
            f"skipped: {gib(free)} GiB free on {work}, under {args.disk_factor} x the fp32 weights "
            f"({gib(needed)} GiB; --disk-factor)"
        )
        say(f"{shape.name} quant={recipe}: {record['note']}")
        return record
    run_dir.mkdir(parents=True, exist_ok=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    before = inodes([cache_dir, run_dir, checkpoint])
    manifest_path = run_dir / "manifest.json"
    manifest_path.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "pipeline",
        f"model.path={checkpoint.resolve()}",
        f"quant={recipe}",
        "eval=none",
        "bench=none",
        "quality.enabled=false",
        "registry=none",
        f"pipeline.cache_dir={cache_dir.resolve()}",
        f"hydra.run.dir={run_dir.resolve()}",
        # the sensitivity scan is measured too: by default it runs only for quant.fallback=auto
        *(["quant.sensitivity.enabled=true"] if recipe != "none" else []),
        *([f"pipeline.max_memory_gib={args.max_memory_gib}"] if args.max_memory_gib else []),
        *args.set,
    ]
    log_path = run_dir.parent / f"{recipe}.log"
    record["command"] = command
    record["log"] = str(log_path)
    record["load_before"] = load_average()
    size = f"{shape.parameters() / 1e6:.0f}M"
    say(f"{shape.name} ({size}) quant={recipe}: build starts (load {record['load_before']})")
    process = run_build(command, log_path, args.build_timeout)
    record["load_after"] = load_average()
    record["process"] = process
    added = new_files([cache_dir, run_dir], before)
    record["disk_added_bytes"] = sum(f["bytes"] for f in added)
    record["disk_largest_files"] = [  # where the bytes went (paths relative to --work)
        {**f, "path": os.path.relpath(f["path"], work)} for f in added[:12]
    ]
    record["disk_ratio_fp32"] = round(record["disk_added_bytes"] / shape.fp32_bytes(), 3)
    line = error_line(log_path.read_text(errors="replace"))
    if process["timed_out"]:
        record["status"], record["note"] = (
            "failed",
            f"build took over {args.build_timeout} s (--build-timeout)",
        )
    elif is_preflight_refusal(process["returncode"], line):
        record["status"], record["note"] = "refused", f"refused by preflight: {line}"
    elif process["returncode"] != 0:
        record["status"], record["note"] = "failed", f"exit {process['returncode']}: {line}"
    elif not manifest_path.is_file():
        record["status"], record["note"] = "failed", f"the run wrote no {manifest_path}"
    else:
        manifest = json.loads(manifest_path.read_text())
        record["passes"], per_pass = pass_rows(manifest)
        record["engine_bytes"] = sum(f["bytes"] for f in manifest["engine"]["files"])
        record["manifest"] = str(manifest_path)
        record["measured_by"] = "pass" if per_pass else "process (no resources in the manifest)"
    # The pipeline's per-pass meter resets the kernel's high-water mark (clear_refs) at each
    # pass, and the ru_maxrss wait4 reports is then the peak since the last reset only: the
    # build's peak is the largest of it and the passes' peaks.
    pass_peaks = [p["peak_rss_bytes"] for p in record["passes"] if p.get("peak_rss_bytes")]
    record["total"] = {
        "seconds": process["wall_s"],
        "cpu_seconds": process["cpu_s"],
        "peak_rss_bytes": max([process["peak_rss_bytes"], *pass_peaks]),
        "measured_by": "process and passes" if pass_peaks else "process",
    }
    if not args.keep:  # measured: give the disk back (the manifest and the log stay)
        shutil.rmtree(cache_dir, ignore_errors=True)
        shutil.rmtree(run_dir / "engine", ignore_errors=True)
    say(
        f"{shape.name} quant={recipe}: {record['status']} in {process['wall_s']:.0f} s, CPU "
        f"{process['cpu_s']:.0f} s, peak RSS {gib(record['total']['peak_rss_bytes'])} GiB, disk "
        f"+{gib(record['disk_added_bytes'])} GiB (load {record['load_after']})"
        + (f": {record['note']}" if record["note"] else "")
    )
    return record


def prepare_checkpoint(shape: Shape, args: argparse.Namespace) -> tuple[Path | None, str]:
    folder = args.work / "models" / f"llama-{shape.name}-seed{args.seed}"
    spec = _spec(shape, args.seed, int(args.shard_gib * GIB))
    if folder.is_dir():
        say(f"{shape.name}: checking the checkpoint in {folder} (sha256)")
        if checkpoint_ok(folder, spec):
            return folder, "reused (sha256 verified)"
    needed = 2 * shape.parameters() + 256 * 2**20
    free = shutil.disk_usage(args.work).free
    if free < needed:
        where = f"{gib(free)} GiB free on {args.work}"
        return None, f"skipped: its checkpoint needs {gib(needed)} GiB, {where}"
    size = f"{shape.parameters() / 1e6:.0f}M"
    say(f"{shape.name}: writing a {size}-parameter bf16 checkpoint ({shape.like} shape)")
    start = time.perf_counter()
    write_checkpoint(shape, folder, args.tokenizer, args.seed, int(args.shard_gib * GIB))
    return folder, f"written in {time.perf_counter() - start:.0f} s"


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.work = args.work if args.work.is_absolute() else REPO / args.work
    args.work.mkdir(parents=True, exist_ok=True)
    if not (args.tokenizer / "tokenizer.json").is_file():
        raise UsageError(
            f"--tokenizer {args.tokenizer} has no tokenizer.json: run `python -m pipeline model=llama` once "
            "(it converts the default model) or name a Hugging Face Llama folder"
        )
    record: dict[str, Any] = {
        "host": host(),
        "load_at_start": load_average(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "work": str(args.work),
        "keep": args.keep,
        "overrides": args.set,
        "shapes": {},
        "builds": [],
        "interrupted": False,
    }
    try:
        for name in args.shapes:
            shape = SHAPES[name]
            folder, note = prepare_checkpoint(shape, args)
            record["shapes"][name] = {
                **dataclasses.asdict(shape),
                "params": shape.parameters(),
                "checkpoint": str(folder) if folder else None,
                "note": note,
            }
            say(f"{name}: checkpoint {note}")
            for recipe in args.recipes:
                if folder is None:
                    record["builds"].append(
                        {"shape": name, "like": shape.like, "params": shape.parameters(), "recipe": recipe}
                        | {"fp32_bytes": shape.fp32_bytes(), "status": "skipped", "note": note}
                        | {"passes": [], "total": {}}
                    )
                    continue
                record["builds"].append(build(shape, folder, recipe, args))
    except KeyboardInterrupt:
        record["interrupted"] = True
        say("interrupted: reporting the builds that finished")
    min_params = SHAPES[args.fit_from].parameters() if args.fit_from else 0
    record["fit_from"] = args.fit_from
    record["fits"] = fits(record["builds"], min_params)
    record["load_at_end"] = load_average()
    return record


# --------------------------------------------------------------------------- report


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(record: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    builds = Table(
        title="Builds (whole process: wall, CPU from wait4; peak RSS: the largest of wait4's and the passes')"
    )
    for column in ("shape", "params", "recipe", "status", "wall s", "CPU s", "peak RSS GiB", "RSS/fp32"):
        builds.add_column(column)
    for column in ("disk + GiB", "disk/fp32", "load before", "load after"):
        builds.add_column(column)
    for b in record["builds"]:
        total = b["total"]
        rss = total.get("peak_rss_bytes")
        builds.add_row(
            b["shape"],
            f"{b['params'] / 1e6:.0f}M",
            b["recipe"],
            b["status"],
            _f(total.get("seconds")),
            _f(total.get("cpu_seconds")),
            gib(rss),
            _f(rss / b["fp32_bytes"], 2) if rss else "-",
            gib(b.get("disk_added_bytes")),
            _f(b.get("disk_ratio_fp32"), 2),
            " ".join(map(str, b.get("load_before", []))) or "-",
            " ".join(map(str, b.get("load_after", []))) or "-",
        )
    console.print(builds)
    for b in record["builds"]:
        if b["note"]:
            console.print(f"{b['shape']} quant={b['recipe']}: {b['note']}", highlight=False, soft_wrap=True)
    passes = Table(title='Passes ("by": pass = the manifest\'s per-pass resources; wall only = not recorded)')
    for column in ("shape", "recipe", "pass", "wall s", "CPU s", "peak RSS GiB", "RSS/fp32", "estimate GiB"):
        passes.add_column(column)
    passes.add_column("by")
    for b in record["builds"]:
        for p in b["passes"]:
            rss = p.get("peak_rss_bytes")
            passes.add_row(
                b["shape"],
                b["recipe"],
                p["name"] + (" (cache hit)" if p["cache_hit"] else ""),
                _f(p.get("seconds")),
                _f(p.get("cpu_seconds")),
                gib(rss),
                _f(rss / b["fp32_bytes"], 2) if rss else "-",
                gib(p.get("estimate_bytes")),
                p["measured_by"],
            )
    console.print(passes)
    fitted = Table(
        title="Exponents b of y ~ a * params^b (log-log least squares; * : wall-time b > "
        f"{TIME_EXPONENT_LIMIT})"
        + (f", shapes from {record['fit_from']} up" if record.get("fit_from") else "")
    )
    for column in ("recipe", "pass", "shapes", "wall-time b", "CPU-time b", "peak RSS b"):
        fitted.add_column(column)
    for f in record["fits"]:
        mark = " *" if f["time_flag"] else ""
        fitted.add_row(
            f["recipe"],
            f["pass"],
            str(f["shapes"]),
            _f(f["time_exponent"], 2) + mark,
            _f(f.get("cpu_exponent"), 2),
            _f(f["rss_exponent"], 2),
        )
    if record["fits"]:
        console.print(fitted)
    else:
        console.print("no exponents: they need builds of at least two shapes")
    h = record["host"]
    console.print(
        f"CPU: {h['cpu']}; {h['logical_cores']} logical / {h['physical_cores']} physical cores "
        f"({h.get('usable_cores')} usable); {h['memory_gib']} GiB memory. Load (1/5/15 min) at start "
        f"{record['load_at_start']}, at end {record['load_at_end']}: on a shared machine the timings "
        "are noisy.",
        highlight=False,
        soft_wrap=True,
    )


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__file__, __doc__)
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=list(SHAPES))
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES), help="quant= options")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="checkpoints, caches, runs, logs")
    parser.add_argument(
        "--out", type=Path, help="also write every number as JSON here (default --work/scaling.json)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep each build's cache and engine (reruns hit the cache)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--shard-gib", type=float, default=2.0, help="largest safetensors shard")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER, help="tokenizer folder to copy")
    parser.add_argument("--max-memory-gib", type=float, help="pipeline.max_memory_gib for every build")
    parser.add_argument(
        "--disk-factor",
        type=float,
        default=3.0,
        help="skip a build with less free disk than this x its fp32 weights",
    )
    parser.add_argument("--build-timeout", type=int, default=6 * 3600, help="seconds per build")
    parser.add_argument(
        "--fit-from", choices=list(SHAPES), help="fit exponents on shapes at least this large"
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="OVERRIDE",
        help="more overrides for every build (pipeline.device=cuda)",
    )
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        help="print these saved --out JSONs again, their builds merged (no builds)",
    )
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.report or [] if not path.is_file()]
    if missing:
        parser.error(f"--report {' '.join(missing)}: no such file")
    if args.shard_gib <= 0 or args.build_timeout < 1 or args.disk_factor < 0:
        parser.error("--shard-gib and --build-timeout must be positive, --disk-factor at least 0")
    args.shapes = sorted(dict.fromkeys(args.shapes), key=lambda s: SHAPES[s].parameters())
    args.recipes = list(dict.fromkeys(args.recipes))
    bad = [r for r in args.recipes if not (REPO / "configs/quant" / f"{r}.yaml").is_file()]
    if bad:
        parser.error(
            f"--recipes {' '.join(bad)}: no configs/quant/<name>.yaml (take {' '.join(DEFAULT_RECIPES)})"
        )
    if args.out and not args.out.resolve().parent.is_dir():
        parser.error(f"--out {args.out}: folder {args.out.resolve().parent} does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:  # print saved runs again, merged, the exponents refitted (--fit-from)
        saved = [json.loads(path.read_text()) for path in args.report]
        record = saved[0]
        record["builds"] = [build for run in saved for build in run["builds"]]
        record["load_at_end"] = saved[-1].get("load_at_end")
        record["fit_from"] = args.fit_from
        record["fits"] = fits(record["builds"], SHAPES[args.fit_from].parameters() if args.fit_from else 0)
        report(record)
        return 0
    try:
        record = run(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report(record)
    out = args.out or args.work / "scaling.json"
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 130 if record["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
