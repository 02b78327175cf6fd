"""Quantization recipes side by side: size, TTFT, TPOT and quality of each ``quant=`` engine and of
ONNX Runtime GenAI's model-builder int4 model of the same checkpoint.

What one run does:

1. **Build** our engine for each recipe in ``--recipes`` with the real CLI, one subprocess each:
   ``python -m pipeline model=llama quant=<recipe> bench=none hydra.run.dir=<out>/<recipe>``
   (the pipeline cache makes a rerun cheap; the log goes to ``<out>/<recipe>.log``). A recipe
   without a config (Hydra: ``Could not find 'quant/<recipe>'``) is reported as *not available*
   and a recipe whose build fails as *failed*, with its last error line; neither stops the
   script. ``none`` is always built: it is the fp32 reference of every comparison. Each
   ``--variant LABEL RECIPE OVERRIDE...`` adds a row built with those overrides (default: the naive
   static INT8 baseline, ``int8`` without smoothing and every layer W8A8, and ``fp8`` with
   ``quant.fallback=auto``).
2. **Build** the model builder's int4 model (``python -m onnxruntime_genai.models.builder -i <hf
   folder> -o <out> -p int4 -e cpu``; round-to-nearest blocks of 32, fused graph with
   GroupQueryAttention and MatMulNBits) from the HF folder the ``none`` run used (its manifest's
   ``source.path``). The output is kept in the pipeline cache (``artifacts/cache/<key>``, key =
   source digest + builder options + onnxruntime-genai version + the pipeline's key libraries),
   so a rerun skips the build.
3. **Measure** every engine in this one process, batch 1, greedy, ``--threads`` intra-op threads:
   * size: bytes of every file of the engine folder (MiB), tokenizer included;
   * TTFT@512: ``Engine.generate_ids(prompt, max_new_tokens=1).prefill_seconds`` (one forward of
     a 512-token prompt plus the argmax);
   * TPOT: mean of ``GenerationResult.step_seconds`` over 64 tokens decoded after a 128-token
     prompt (``stop_at_eos=False``);
   each the median over ``--repeats`` runs after ``--warmup`` runs, interleaved across engines
   (run 1: A B C ..., run 2: A B C ...) so that load drift on a shared machine hits all alike.
   Prompts are seeded random token ids in [100, vocab) drawn as ``pipeline.bench`` draws them
   (``numpy.random.default_rng(--seed)``), the same for every engine.
   * quality vs our fp32 ``none`` engine on the held-out text (``evals/data/gpl-3.0.txt``, the
     same windows and settings as the runs' ``quality`` record): perplexity, mean
     KL(reference || candidate) per token and top-1 agreement, from ``evals.agreement.compare``.
     For our recipes it is the run manifest's ``quality`` when its reference is the ``none``
     engine, else measured here; the builder model is always scored here (result cached).

The builder's ``model.onnx`` follows the GenAI IO convention (``input_ids``, ``attention_mask``,
``past_key_values.{i}.key/value`` -> ``logits``, ``present.{i}.key/value``; no ``position_ids``:
GroupQueryAttention derives positions from the mask), so it runs through our ``OrtModel`` like
our engines, with shapes read from its ``genai_config.json``; the script checks the session's
inputs and outputs against that convention, and checks that greedy decoding through ``OrtModel``
gives the same 16 tokens as onnxruntime_genai's own ``og.Generator`` on an English prompt.

The table prints the TPOT ratio as none / recipe: above 1 means the recipe decodes faster. The
load average (1/5/15 min) before and after the measurement, the CPU and the thread count are
printed too, since this machine is shared and noisy. ``--json`` writes every number.

Run from the repository root::

    python -m benchmarks.quantization --recipes none fp8 int8 int4_awq int4_gptq --repeats 3

The command and the recorded results: ``benchmarks/README.md`` (quantization).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    DECODE_PROMPT_LENGTH,
    DECODE_TOKENS,
    GREEDY_CHECK_TEXT,
    GREEDY_CHECK_TOKENS,
    REFERENCE,
    REPO,
    TTFT_LENGTH,
    Contestant,
    GenAIModelEngine,
    UsageError,
    add_run_arguments,
    build_builder_model,
    build_recipe,
    cpu_line,
    format_load,
    load_average,
    load_line,
    make_parser,
    measure_speed,
    ort_model,
    print_lines,
    quality_config,
    run_and_report,
    score,
)
from pipeline.bench import host_info, summarize
from pipeline.core.errors import PipelineError
from pipeline.runtime import Engine, GenerationConfig

DEFAULT_RECIPES = ["none", "fp8", "int8", "int4_awq", "int4_gptq"]
DEFAULT_OUT = Path("artifacts/benchmarks/quantization")
# Rows beside the plain recipes: the naive static INT8 baseline the int8 recipe must beat (no
# smoothing, every layer W8A8), and fp8 keeping its most sensitive layers in fp32.
DEFAULT_VARIANTS = [
    ["int8-naive", "int8", "quant.smooth=false", "quant.weight_only=[]", "quant.sensitivity.enabled=false"],
    ["fp8-fallback", "fp8", "quant.fallback=auto", "quant.kl_budget=0.01", "quant.max_fallback_layers=32"],
]
_RECIPE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def genai_greedy_check(engine: GenAIModelEngine) -> dict[str, Any]:
    """Greedy tokens from onnxruntime_genai's own generator vs ours through ``OrtModel``."""
    import onnxruntime_genai as og

    prompt = engine.tokenizer(GREEDY_CHECK_TEXT)["input_ids"]
    ours = engine.generate_ids(
        [prompt], GenerationConfig(max_new_tokens=GREEDY_CHECK_TOKENS, stop_at_eos=False)
    ).tokens[0]
    model = og.Model(str(engine.folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + GREEDY_CHECK_TOKENS, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([prompt], dtype=np.int32))
    theirs: list[int] = []
    while not generator.is_done() and len(theirs) < GREEDY_CHECK_TOKENS:
        generator.generate_next_token()
        theirs.append(int(generator.get_next_tokens()[0]))
    del generator, model
    return {
        "tokens": GREEDY_CHECK_TOKENS,
        "ort_model": ours,
        "onnxruntime_genai": theirs,
        "agree": ours == theirs,
    }


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = (REPO / args.out).resolve() if not args.out.is_absolute() else args.out
    out.mkdir(parents=True, exist_ok=True)
    load_at_start = load_average()
    started = time.perf_counter()
    recipes = list(dict.fromkeys([REFERENCE, *args.recipes]))  # none first, always: the reference
    rows = [build_recipe(recipe, out, args.build_timeout) for recipe in recipes]
    for label, recipe, *overrides in DEFAULT_VARIANTS if args.variant is None else args.variant:
        rows.append(build_recipe(recipe, out, args.build_timeout, label, tuple(overrides)))
    reference = rows[0]
    if not reference.ok or reference.manifest is None:
        raise UsageError(f"the reference recipe quant={REFERENCE} did not build: {reference.note}")
    source = reference.manifest["source"]
    source_dir = Path(source["path"])
    source_dir = source_dir if source_dir.is_absolute() else REPO / source_dir
    if not (source_dir / "config.json").is_file():
        raise UsageError(f"source.path {source['path']} of the {REFERENCE} run is not an HF model folder")
    builder = build_builder_model(source_dir, source["digest"], out, args.build_timeout)
    rows.append(builder)

    for row in rows:
        if not row.ok or row.folder is None:
            continue
        try:
            if row.kind == "builder":
                row.engine = GenAIModelEngine(row.folder, threads=args.threads)
                row.build["io"] = row.engine.io_names
            else:
                row.engine = Engine(row.folder, threads=args.threads)
        except PipelineError as exc:
            if row is reference:
                raise
            row.status, row.note = "failed", f"cannot load: {exc}"
    timing = measure_speed(rows, args)

    greedy = None
    if builder.ok and isinstance(builder.engine, GenAIModelEngine):
        greedy = genai_greedy_check(builder.engine)
        if not greedy["agree"]:
            builder.note = "greedy tokens differ from onnxruntime_genai's generator"
    config = quality_config(reference)
    for row in rows:
        if row.ok:
            row.quality = score(row, reference, config)

    ref_tpot = statistics.median(reference.samples["tpot"])
    assert reference.engine is not None
    threads = ort_model(reference.engine).session.get_session_options().intra_op_num_threads
    return {
        "config": {
            "recipes": recipes,
            "ttft_prompt_length": TTFT_LENGTH,
            "decode_prompt_length": DECODE_PROMPT_LENGTH,
            "decode_tokens": DECODE_TOKENS,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "seed": args.seed,
            "threads": args.threads,
            "batch_size": 1,
            "quality": asdict(config),
        },
        "rows": [_row_record(row, ref_tpot) for row in rows],
        "builder": {
            "run_through": "pipeline.runtime.OrtModel (has_position_ids=False)",
            "io": builder.build.get("io"),
            "greedy_check": greedy,
        },
        "source": {"path": str(source_dir), "digest": source["digest"]},
        "threads": {"ort_intra_op": threads},
        "load_average": {"at_start": load_at_start, **timing["load_average"]},
        "measure_seconds": timing["seconds"],
        "total_seconds": round(time.perf_counter() - started, 1),
        "host": host_info(),
        "versions": _versions(),
    }


def _row_record(row: Contestant, ref_tpot: float) -> dict[str, Any]:
    record: dict[str, Any] = {
        "name": row.name,
        "kind": row.kind,
        "status": row.status,
        "note": row.note,
        "engine": str(row.folder) if row.folder else None,
        "build": row.build,
        "size_mib": round(row.size_bytes / 2**20, 1) if row.size_bytes is not None else None,
        "model_files_mib": round(row.weight_bytes / 2**20, 1) if row.weight_bytes is not None else None,
    }
    if row.samples:
        tpot = summarize(row.samples["tpot"])
        record.update(
            ttft={**summarize(row.samples["ttft"]), "prompt_length": TTFT_LENGTH},
            tpot={**tpot, "prompt_length": DECODE_PROMPT_LENGTH, "tokens": DECODE_TOKENS},
            tpot_ratio_none_over_this=round(ref_tpot * 1e3 / tpot["median_ms"], 3),
        )
    if row.quality is not None:
        record["quality"] = row.quality
    return record


def _versions() -> dict[str, str]:
    from pipeline.core.cache import installed_versions

    return installed_versions(("onnxruntime", "onnxruntime-genai", "onnx", "transformers", "torch"))


# --------------------------------------------------------------------------- reporting


def print_report(record: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    config = record["config"]
    table = Table(title="Quantization recipes vs fp32 quant=none (ORT CPU, batch 1, greedy; medians)")
    for name, justify in [
        ("recipe", "left"),
        ("size MiB", "right"),
        (f"TTFT@{config['ttft_prompt_length']} ms", "right"),
        ("TPOT ms", "right"),
        ("TPOT ratio (none/x)", "right"),
        ("perplexity", "right"),
        ("KL", "right"),
        ("top-1 agree", "right"),
        ("notes", "left"),
    ]:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    notes: list[str] = []
    for row in record["rows"]:
        quality = row.get("quality") or {}
        cells = [
            f"{row['size_mib']:.1f}" if row["size_mib"] is not None else "-",
            f"{row['ttft']['median_ms']:.1f}" if "ttft" in row else "-",
            f"{row['tpot']['median_ms']:.2f}" if "tpot" in row else "-",
            f"{row['tpot_ratio_none_over_this']:.2f}x" if "tpot" in row else "-",
            f"{quality['perplexity']:.2f}" if quality else "-",
            f"{quality['kl_mean']:.4f}" if quality else "-",
            f"{quality['top1_agreement']:.1%}" if quality else "-",
        ]
        marker = f" [{len(notes) + 1}]" if row["note"] else ""
        if row["note"]:
            notes.append(f"[{len(notes) + 1}] {row['name']}: {row['note']}")
        table.add_row(row["name"], *cells, ("" if row["status"] == "ok" else row["status"]) + marker)
    console = Console()
    if not console.is_terminal:  # piped or logged: do not squeeze the table into 80 columns
        console.width = 150
    console.print(table)
    print_lines(console, notes)
    host, load, quality = record["host"], record["load_average"], config["quality"]
    builder = record["builder"]

    lines = [
        f"TTFT: prefill of a {config['ttft_prompt_length']}-token prompt + first token; TPOT: mean per token "
        f"over {config['decode_tokens']} tokens after a {config['decode_prompt_length']}-token prompt; "
        f"{config['repeats']} repeats after {config['warmup']} warm-up, interleaved across engines; "
        f"seeded random-token prompts (seed {config['seed']})",
        f"quality vs quant=none on {quality['text']} ({quality['max_tokens']} tokens, "
        f"{quality['window']}-token windows): perplexity, mean KL(none || x) per token, top-1 agreement",
    ]
    if builder["io"]:
        check = builder["greedy_check"] or {}
        agree = "agree" if check.get("agree") else "DIFFER"
        lines.append(
            f"builder model run through our OrtModel (inputs input_ids, attention_mask, "
            f"past_key_values.*; no position_ids); greedy {check.get('tokens')} tokens vs "
            f"onnxruntime_genai's generator: {agree}"
        )
    lines += [
        f"threads: ORT intra-op {record['threads']['ort_intra_op']} (inter-op 1)",
        f"{load_line(load['before'], load['after'])} while measuring "
        f"(at start, before builds: {format_load(load['at_start'])})",
        cpu_line(host),
    ]
    print_lines(console, lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__file__, __doc__)
    parser.add_argument(
        "--recipes", nargs="+", default=DEFAULT_RECIPES, help="quant= options (none is always built)"
    )
    parser.add_argument(
        "--variant",
        nargs="+",
        action="append",
        metavar="LABEL RECIPE OVERRIDE",
        help="a recipe with overrides as its own row, e.g. --variant int8-naive int8 quant.smooth=false "
        "'quant.weight_only=[]' (repeatable; default: "
        + "; ".join(" ".join(v) for v in DEFAULT_VARIANTS)
        + "; --variant none: no variants)",
    )
    add_run_arguments(parser, DEFAULT_OUT, build_timeout=3600)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1 or args.build_timeout < 1:
        parser.error("--repeats, --threads and --build-timeout must be >= 1, --warmup >= 0")
    if args.variant and any(v == ["none"] for v in args.variant):
        args.variant = [] if args.variant == [["none"]] else parser.error("--variant none stands alone")
    for variant in args.variant or []:
        named = len(variant) >= 2 and all(_RECIPE_NAME.match(v) for v in variant[:2])
        if not named or variant[0] in args.recipes:
            parser.error(f"--variant {' '.join(variant)}: give a new LABEL, a RECIPE, then overrides")
    bad = [r for r in args.recipes if not _RECIPE_NAME.match(r)]
    if bad:
        parser.error(f"--recipes takes quant option names such as int8, not {' '.join(bad)}")
    if args.json and not args.json.resolve().parent.is_dir():
        parser.error(f"--json {args.json}: folder {args.json.resolve().parent} does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_and_report(parse_args(argv), run, print_report)


if __name__ == "__main__":
    sys.exit(main())
