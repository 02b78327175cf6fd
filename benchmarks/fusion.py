"""Fusion and KV-cache layout benchmark: our engine unfused vs fused, concat vs shared KV cache,
against ONNX Runtime GenAI's model builder (fp32 and int4) on the same checkpoint, in one run.

Rows (each built with the real CLI, ``bench=none``, so reruns come from the pipeline cache):
- ``fp32 unfused / concat``: ``quant=none`` (the export as is);
- ``fp32 fused / concat`` and ``fp32 fused / shared``: ``fusion=ort kv_cache=concat|shared``;
- ``... / int8 KV``: the shared layout with an int8 cache (``kv_cache.dtype=int8``);
- ``... / fp8 KV``: the concat layout with an fp8 cache (``kv_cache.dtype=fp8``, Q/DQ at the
  cache IO; a shared buffer cannot take it);
- ``int8 ...`` and ``<int4> ...``: the same for ``quant=int8`` (SmoothQuant W8A8) and
  ``quant=<int4 recipe>`` (int8 has no builder peer: its ratio column is against builder fp32);
- ``builder fp32`` and ``builder int4``: ``python -m onnxruntime_genai.models.builder -p fp32|int4``
  (cached by source digest), run through our ``OrtModel`` with the shared buffer its
  ``genai_config.json`` asks for;
- ``llama.cpp Q4_1`` and ``llama.cpp Q8_0``: the default model's own GGUF and llama.cpp's Q8_0 of
  it, in llama-cpp-python built with the machine's native instructions
  (``benchmarks.llamacpp_peer``; ``--no-llama-cpp`` leaves them out).

Measured per row, interleaved per repeat (A B C ..., A B C ...), medians over ``--repeats`` after
``--warmup``: TTFT (prefill + first token) at ``--ttft`` lengths; TPOT (mean time per decoded token
over ``--decode-tokens``) after a prompt of each ``--contexts`` length; the KV cache's bytes at
the longest context (a shared buffer holds ``max_length``), and the peak RSS of a fresh process
while it decodes after the longest context, measured after loading (``--no-memory`` skips it). Ratios
are against the builder of the same precision and against llama.cpp Q4_1 (<1: faster than it).

    python -m benchmarks.fusion [--contexts 256 1024 4096] [--ttft 512 2048] [--repeats 3]
        [--warmup 1] [--threads 2] [--int4 int4_awq] [--only 'fp32 fused'] [--json out.json]

The command and the recorded results: ``benchmarks/README.md`` (fusion).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import llamacpp_peer
from benchmarks.common import (
    REPO,
    Contestant,
    GenAIModelEngine,
    UsageError,
    add_run_arguments,
    build_builder_model,
    build_recipe,
    child_rss,
    load_average,
    load_line,
    make_parser,
    make_prompt,
    peak_rss_script,
    run_and_report,
    timing_record,
)
from pipeline.runtime.generate import GenerationConfig
from pipeline.runtime.ort import Engine

DEFAULT_OUT = Path("artifacts/benchmarks/fusion")


def rows_to_build(int4: str) -> list[tuple[str, str, tuple[str, ...], str]]:
    """(label, quant recipe, overrides, precision) of our engines."""
    return [
        ("fp32 unfused / concat", "none", (), "fp32"),
        ("fp32 fused / concat", "none", ("fusion=ort", "kv_cache=concat"), "fp32"),
        ("fp32 fused / shared", "none", ("fusion=ort", "kv_cache=shared"), "fp32"),
        ("int8 unfused / concat", "int8", (), "int8"),
        ("int8 fused / shared", "int8", ("fusion=ort", "kv_cache=shared"), "int8"),
        (f"{int4} unfused / concat", int4, (), "int4"),
        (f"{int4} fused / shared", int4, ("fusion=ort", "kv_cache=shared"), "int4"),
        (
            "fp32 fused / shared / int8 KV",
            "none",
            ("fusion=ort", "kv_cache=shared", "kv_cache.dtype=int8"),
            "fp32",
        ),
        (
            f"{int4} fused / shared / int8 KV",
            int4,
            ("fusion=ort", "kv_cache=shared", "kv_cache.dtype=int8"),
            "int4",
        ),
        (
            "fp32 fused / concat / fp8 KV",
            "none",
            ("fusion=ort", "kv_cache=concat", "kv_cache.dtype=fp8"),
            "fp32",
        ),
    ]


# Memory is measured in a fresh process per engine (``benchmarks.common.peak_rss_script``).
PEAK_RSS_CHILD = peak_rss_script(
    "from pipeline.runtime.ort import Engine\nengine = Engine(sys.argv[1], threads=int(sys.argv[3]))"
)


def peak_rss(folder: Path, tokens: int, threads: int) -> dict[str, int]:
    """Resident memory of a fresh process after loading the engine, and its peak while it
    decodes after ``tokens`` tokens (Linux only)."""
    return child_rss(PEAK_RSS_CHILD, [str(folder), str(tokens), str(threads)], REPO)


def kv_bytes(engine: Engine, tokens: int) -> int:
    """Bytes the cache holds at ``tokens`` tokens (a shared layout preallocates ``max_length``)."""
    io = engine.io
    itemsize = io.kv_itemsize()
    held = engine.max_length if io.kv_layout == "shared" else tokens
    return 2 * io.num_layers * io.num_kv_heads * io.head_dim * held * itemsize


def measure(rows: list[Contestant], args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    vocab = rows[0].engine.io.vocab_size  # type: ignore[union-attr]
    rng = np.random.default_rng(args.seed)
    ttft_prompts = {n: make_prompt(rng, vocab, n) for n in args.ttft}
    context_prompts = {n: make_prompt(rng, vocab, n) for n in args.contexts}
    one = GenerationConfig(max_new_tokens=1, stop_at_eos=False)
    decode = GenerationConfig(max_new_tokens=args.decode_tokens + 1, stop_at_eos=False)
    load_before = load_average()
    started = time.perf_counter()
    runs = args.warmup + args.repeats
    bar = tqdm(total=runs * len(rows), desc="measure", unit="engine-run", file=sys.stderr)
    for index in range(runs):
        for row in rows:
            engine = row.engine
            assert engine is not None
            samples: dict[str, float] = {}
            for n, prompt in ttft_prompts.items():
                samples[f"ttft@{n}"] = engine.generate_ids(prompt, one).prefill_seconds
            for n, prompt in context_prompts.items():
                result = engine.generate_ids(prompt, decode)
                samples[f"tpot@{n}"] = statistics.mean(result.step_seconds)
            if index >= args.warmup:
                for key, value in samples.items():
                    row.samples.setdefault(key, []).append(value)
            bar.update()
    bar.close()
    return timing_record(load_before, started)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Contestant] = []
    precision: dict[str, str] = {}
    for label, recipe, overrides, prec in rows_to_build(args.int4):
        if args.only and not any(part in label for part in args.only):
            continue
        slug = label.replace(" / ", "-").replace(" ", "-")
        row = build_recipe(recipe, out, args.build_timeout, label=slug, overrides=overrides)
        row.name = label
        if row.ok:
            assert row.folder is not None
            row.engine = Engine(row.folder, threads=args.threads)
        rows.append(row)
        precision[label] = prec
    reference = next((r for r in rows if r.ok and r.manifest), None)
    if reference is None:
        raise UsageError("no engine of ours built; see the logs under " + str(out))
    source = reference.manifest["source"]  # type: ignore[index]
    for prec in ("fp32", "int4"):
        row = build_builder_model(
            Path(source["path"]), source["digest"], out, args.build_timeout, precision=prec
        )
        if row.ok:
            assert row.folder is not None
            row.engine = GenAIModelEngine(row.folder, threads=args.threads, share_buffer=True)
        rows.append(row)
        precision[row.name] = prec
    longest = max([*args.contexts, *args.ttft]) + args.decode_tokens + 1
    if args.llama_cpp:
        rows += llama_cpp_rows(Path(source["path"]), out, longest, args.threads)
        precision.update({r.name: ("int4" if "Q4" in r.name else "int8") for r in rows[-2:]})
    live = [r for r in rows if r.ok and r.engine is not None]
    for row in live:
        if row.engine.max_length < longest:  # type: ignore[union-attr]
            raise UsageError(f"{row.name}: max_length {row.engine.max_length} < {longest} tokens")  # type: ignore[union-attr]
    timing = measure(live, args)
    builders = {precision[r.name]: r for r in live if r.kind == "builder"}
    q4_1 = next((r for r in live if r.kind == "llama.cpp" and "Q4_1" in r.name), None)
    table = []
    for row in rows:
        entry: dict[str, Any] = {"row": row.name, "status": row.status, "note": row.note}
        if row.ok and row.engine is not None:
            entry["median_ms"] = {k: round(1000 * statistics.median(v), 2) for k, v in row.samples.items()}
            entry["kv_layout"] = row.engine.io.kv_layout
            entry["kv_dtype"] = row.engine.io.kv_dtype
            if row.kind == "llama.cpp":
                entry["kv_cache_bytes_at_longest_context"] = row.engine.kv_cache_bytes()  # type: ignore[attr-defined]
                if args.memory:
                    entry["memory_bytes"] = llamacpp_peer.peak_rss(
                        row.folder,  # type: ignore[arg-type]
                        max(args.contexts),
                        args.threads,
                        REPO,
                    )
            else:
                entry["kv_cache_bytes_at_longest_context"] = kv_bytes(row.engine, max(args.contexts))
                if args.memory and row.kind != "builder":
                    entry["memory_bytes"] = peak_rss(row.folder, max(args.contexts), args.threads)  # type: ignore[arg-type]
            if row.manifest:
                fusion = next((p for p in row.manifest["passes"] if p["name"] == "fusion"), None)
                entry["fusion_rewrites"] = fusion["metrics"].get("rewrites") if fusion else None
            peer = builders.get(precision[row.name]) or builders.get("fp32")
            if peer is not None and peer is not row:
                entry["vs_builder"] = {
                    k: round(statistics.median(v) / statistics.median(peer.samples[k]), 3)
                    for k, v in row.samples.items()
                }
            if q4_1 is not None and q4_1 is not row:
                entry["vs_llama_cpp_q4_1"] = {
                    k: round(statistics.median(v) / statistics.median(q4_1.samples[k]), 3)
                    for k, v in row.samples.items()
                }
        table.append(entry)
    return {
        "benchmark": "fusion",
        "settings": vars(args) | {"out": str(args.out)},
        "cpu": os.cpu_count(),
        "llama_cpp": {"version": llamacpp_peer.available(), "system_info": llamacpp_peer.system_info()}
        if args.llama_cpp and llamacpp_peer.available()
        else None,
        "timing": timing,
        "rows": table,
    }


def llama_cpp_rows(source_dir: Path, out: Path, max_length: int, threads: int) -> list[Contestant]:
    """The llama.cpp Q4_1 and Q8_0 rows (``benchmarks/llamacpp_peer.py``), or rows saying why not."""
    version = llamacpp_peer.available()
    names = [f"llama.cpp Q4_1 ({version or '-'})", f"llama.cpp Q8_0 ({version or '-'})"]
    rows = [Contestant(name, "llama.cpp") for name in names]
    if version is None:
        for row in rows:
            row.status, row.note = (
                "not available",
                f"{llamacpp_peer.PACKAGE} is not installed: pip install -e '.[bench]'",
            )
        return rows
    try:
        q4_1 = llamacpp_peer.source_gguf(source_dir)
        q8_0 = llamacpp_peer.requantize_q8_0(q4_1, out / "gguf", threads)
    except (ValueError, OSError, RuntimeError) as exc:
        for row in rows:
            row.status, row.note = "failed", str(exc)
        return rows
    for row, gguf in zip(rows, (q4_1, q8_0), strict=True):
        row.folder = gguf
        row.size_bytes = gguf.stat().st_size
        row.engine = llamacpp_peer.LlamaCppEngine(gguf, max_length, threads)  # type: ignore[assignment]
    return rows


def print_report(record: dict[str, Any], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    keys = [f"ttft@{n}" for n in args.ttft] + [f"tpot@{n}" for n in args.contexts]
    table = Table(
        title="Fusion and KV layout vs the ONNX Runtime GenAI builder and llama.cpp "
        "(median ms; (ratio vs builder) [ratio vs llama.cpp Q4_1])"
    )
    table.add_column("engine")
    for key in keys:
        table.add_column(key.replace("@", " @"), justify="right")
    table.add_column(f"KV MiB @{max(args.contexts)}", justify="right")
    table.add_column(f"peak RSS MiB decoding @{max(args.contexts)}", justify="right")
    for entry in record["rows"]:
        if entry["status"] != "ok":
            table.add_row(entry["row"], *[entry["status"]] * len(keys), entry["note"], "")
            continue
        cells = []
        for key in keys:
            ms = entry["median_ms"][key]
            ratio = entry.get("vs_builder", {}).get(key)
            versus_llama = entry.get("vs_llama_cpp_q4_1", {}).get(key)
            cells.append(
                f"{ms:.1f}"
                + (f" ({ratio:.2f}x)" if ratio is not None else "")
                + (f" [{versus_llama:.2f}x]" if versus_llama is not None else "")
            )
        memory = entry.get("memory_bytes")
        table.add_row(
            entry["row"],
            *cells,
            f"{entry['kv_cache_bytes_at_longest_context'] / 2**20:.0f}",
            f"{memory['peak_decoding'] / 2**20:.0f}" if memory else "-",
        )
    console = Console(width=160)
    console.print(table)
    timing = record["timing"]
    if record.get("llama_cpp"):
        console.print(f"llama.cpp {record['llama_cpp']['version']}: {record['llama_cpp']['system_info']}")
    console.print(
        f"{load_line(timing['load_average']['before'], timing['load_average']['after'])}; "
        f"{args.repeats} repeats after {args.warmup} warm-up, interleaved; {args.threads} threads; "
        f"{timing['seconds']} s"
    )
    for entry in record["rows"]:
        if entry.get("fusion_rewrites"):
            console.print(f"{entry['row']}: rewrites {entry['fusion_rewrites']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__file__, __doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--ttft", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--decode-tokens", type=int, default=32)
    add_run_arguments(parser, DEFAULT_OUT, build_timeout=1800)
    parser.add_argument("--int4", default="int4_awq", help="the int4 recipe of our rows")
    parser.add_argument("--only", nargs="+", help="only our rows whose label contains one of these")
    parser.add_argument(
        "--memory", action=argparse.BooleanOptionalAction, default=True, help="peak RSS per engine"
    )
    parser.add_argument(
        "--llama-cpp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="llama.cpp Q4_1 and Q8_0 rows (llama-cpp-python)",
    )
    args = parser.parse_args(argv)
    if min(args.contexts + args.ttft) < 1 or args.repeats < 1 or args.warmup < 0 or args.decode_tokens < 2:
        parser.error("lengths and --repeats must be positive, --decode-tokens at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_and_report(args, run, lambda record: print_report(record, args))


if __name__ == "__main__":
    sys.exit(main())
