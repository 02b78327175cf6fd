"""Torch eager fp32 vs our ``quant=none`` ONNX Runtime engine: TTFT and TPOT on the same prompt.

What is measured, in one process and one run, batch 1, greedy:

* **TTFT@L** (time to first token) for each prompt length L: prefill of the prompt plus picking
  the first token. Torch: wall time of ``model.generate(ids, max_new_tokens=1, min_new_tokens=1,
  do_sample=False)`` (so it includes ``generate``'s own set-up, as a user of transformers pays it).
  Engine: ``Engine.generate_ids(..., GenerationConfig(max_new_tokens=1, stop_at_eos=False))
  .prefill_seconds`` (one ORT forward plus the argmax).
* **TPOT** (time per output token) over ``--decode-tokens`` N tokens after a prompt of
  ``--decode-prompt-length`` tokens. Torch: ``generate`` with its KV cache (``max_new_tokens=N,
  min_new_tokens=N``, ``eos_token_id=None`` so an end-of-sequence token does not stop it nor get
  masked), timed by a streamer that timestamps every emitted token: the mean gap between
  consecutive tokens after the first, i.e. (t_N - t_1) / (N - 1). Engine: mean of
  ``GenerationResult.step_seconds`` with ``stop_at_eos=False``. Both include one forward of one
  token plus the greedy pick.

Prompts are seeded random token ids in [100, vocab) (``numpy.random.default_rng(--seed)``, drawn in
the same order as ``pipeline.bench``), identical for both runtimes. Torch (``torch.set_num_threads``)
and ONNX Runtime (intra-op threads) get the same ``--threads``. Each figure is the median over
``--repeats`` runs after ``--warmup`` runs; torch and engine runs are interleaved (torch, engine,
torch, engine, ...) so that load drift on a shared machine hits both alike. The ratio is
torch / engine: above 1 means the engine is faster. The script also checks that both pick the same
greedy tokens for 16 tokens after a short English prompt, and records the load average
before and after, the CPU model and core count.

Run from the repository root::

    python -m benchmarks.torch_vs_engine --prompt-lengths 128 512 --decode-tokens 64 --repeats 3

The command and the recorded results: ``benchmarks/README.md`` (torch_vs_engine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    GREEDY_CHECK_TEXT,
    GREEDY_CHECK_TOKENS,
    REPO,
    UsageError,
    cpu_line,
    load_average,
    load_line,
    make_parser,
    make_prompt,
    ort_model,
    print_lines,
    run_and_report,
)
from pipeline.bench import host_info, summarize
from pipeline.core.errors import EngineError
from pipeline.runtime.generate import common_prefix_length

NOT_FOUND_HINT = "run `python -m pipeline model=llama quant=none` first, or pass --engine and --model"


# --------------------------------------------------------------------------- locating artifacts


def _runs_dirs() -> list[Path]:
    dirs = []
    for root in (Path.cwd(), REPO):
        runs = (root / "artifacts" / "runs").resolve()
        if runs.is_dir() and runs not in dirs:
            dirs.append(runs)
    return dirs


def newest_engine() -> Path:
    """The newest ``artifacts/runs/*/engine`` whose run has a ``manifest.json``."""
    candidates = [
        engine
        for runs in _runs_dirs()
        for engine in runs.glob("*/engine")
        if engine.is_dir() and (engine.parent / "manifest.json").is_file()
    ]
    if not candidates:
        raise UsageError(f"no engine found under artifacts/runs/*/engine: {NOT_FOUND_HINT}")
    return max(candidates, key=lambda e: ((e.parent / "manifest.json").stat().st_mtime, e.parent.name))


def read_manifest(engine_dir: Path) -> dict[str, Any] | None:
    path = engine_dir.resolve().parent / "manifest.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path} is unreadable ({exc}): pass --model explicitly") from None


def model_from_manifest(engine_dir: Path, manifest: dict[str, Any] | None) -> Path:
    """``source.path`` of the engine's run, resolved against the cwd or the repository root."""
    source = (manifest or {}).get("source") or {}
    raw = source.get("path")
    if not raw:
        where = engine_dir.parent / "manifest.json"
        raise UsageError(f"no model: {where} records no source.path; {NOT_FOUND_HINT}")
    path = Path(raw).expanduser()
    for candidate in (path, Path.cwd() / path, REPO / path):
        if (candidate / "config.json").is_file():
            return candidate.resolve()
    run_name = engine_dir.parent.name
    raise UsageError(f"model folder {raw} (source.path of run {run_name}) not found: {NOT_FOUND_HINT}")


# --------------------------------------------------------------------------- measuring


class _TokenClock:
    """A transformers streamer that timestamps every ``put``: the prompt first, then each new token."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())
        if self._prompt_seen:
            self.tokens.extend(int(t) for t in value.reshape(-1).tolist())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def torch_generate(
    model: Any, prompt: list[list[int]], new_tokens: int, pad_id: int
) -> tuple[float, _TokenClock]:
    """One greedy ``generate`` of exactly ``new_tokens`` tokens; return its wall time and the clock."""
    import torch

    ids = torch.tensor(prompt, dtype=torch.long)
    clock = _TokenClock()
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),  # explicit: never inferred from pad ids
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,  # ignore EOS like the engine's stop_at_eos=False (neither stop nor mask it)
        pad_token_id=pad_id,
        streamer=clock,
    )
    wall = time.perf_counter() - start
    produced = out.shape[1] - ids.shape[1]
    if produced != new_tokens or len(clock.tokens) != new_tokens:
        raise EngineError(f"torch generate produced {produced} tokens, expected exactly {new_tokens}")
    return wall, clock


def ratio(torch_s: dict[str, Any], engine_s: dict[str, Any]) -> float:
    return round(torch_s["median_ms"] / engine_s["median_ms"], 3) if engine_s["median_ms"] else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from tqdm.auto import tqdm

    from pipeline.core.cache import installed_versions
    from pipeline.core.torch_model import load_causal_lm
    from pipeline.runtime import Engine, GenerationConfig

    engine_dir: Path = args.engine.resolve() if args.engine else newest_engine()
    if not (engine_dir / "engine.json").is_file():
        raise UsageError(f"{engine_dir} is not an engine folder (no engine.json): {NOT_FOUND_HINT}")
    manifest = read_manifest(engine_dir)
    model_dir: Path = args.model.resolve() if args.model else model_from_manifest(engine_dir, manifest)
    if not (model_dir / "config.json").is_file():
        raise UsageError(f"{model_dir} is not a Hugging Face model folder (no config.json)")

    torch.set_num_threads(args.threads)
    with contextlib.suppress(RuntimeError):  # fails if torch already started its inter-op pool
        torch.set_num_interop_threads(1)  # like ORT's inter_op_num_threads=1
    engine = Engine(engine_dir, threads=args.threads)
    model = load_causal_lm(model_dir)
    vocab = engine.io.vocab_size
    if model.config.vocab_size != vocab:
        raise UsageError(
            f"vocabularies differ (torch {model.config.vocab_size}, engine {vocab}): "
            f"{model_dir} is not the model {engine_dir} was built from"
        )
    max_length = min(
        int(engine.spec.get("max_length", 2048)),
        int(getattr(model.config, "max_position_embeddings", 2048)),
    )
    if args.decode_tokens < 2:
        raise UsageError("--decode-tokens must be at least 2 (TPOT needs decode steps after the first token)")
    too_long = [n for n in args.prompt_lengths if n < 1 or n + 1 > max_length]
    if too_long or args.decode_prompt_length + args.decode_tokens > max_length:
        bad = too_long or [args.decode_prompt_length + args.decode_tokens]
        raise UsageError(f"prompt lengths {bad} do not fit the models' max_length {max_length}")

    rng = np.random.default_rng(args.seed)
    ttft_prompts = {n: make_prompt(rng, vocab, n) for n in args.prompt_lengths}
    decode_prompt = make_prompt(rng, vocab, args.decode_prompt_length)
    pad_id = engine.pad_token_id
    one = GenerationConfig(max_new_tokens=1, stop_at_eos=False)
    many = GenerationConfig(max_new_tokens=args.decode_tokens, stop_at_eos=False)

    samples: dict[str, list[float]] = {}
    runs = args.warmup + args.repeats
    load_before = load_average()
    started = time.perf_counter()
    bar = tqdm(total=runs * (len(ttft_prompts) + 1), desc="torch vs engine", unit="pair", file=sys.stderr)
    with torch.inference_mode():
        for index in range(runs):
            keep = index >= args.warmup
            for length, prompt in ttft_prompts.items():
                wall, clock = torch_generate(model, prompt, 1, pad_id)  # A
                result = engine.generate_ids(prompt, one)  # B
                if keep:
                    samples.setdefault(f"torch_ttft_{length}", []).append(wall)
                    samples.setdefault(f"torch_prefill_{length}", []).append(clock.times[1] - clock.times[0])
                    samples.setdefault(f"engine_ttft_{length}", []).append(result.prefill_seconds)
                bar.update()
            wall, clock = torch_generate(model, decode_prompt, args.decode_tokens, pad_id)  # A
            result = engine.generate_ids(decode_prompt, many)  # B
            if len(result.tokens[0]) != args.decode_tokens:
                got = len(result.tokens[0])
                raise EngineError(f"engine produced {got} tokens, expected {args.decode_tokens}")
            if keep:
                gaps = np.diff(clock.times[1:])  # token i -> token i+1, i >= 1: N-1 decode steps
                samples.setdefault("torch_tpot", []).append(float(gaps.mean()))
                samples.setdefault("engine_tpot", []).append(statistics.mean(result.step_seconds))
            bar.update()
        # Token agreement on real text (random-id prompts make the model repeat itself, which
        # says little about whether the two runtimes compute the same thing).
        text_prompt = [engine.tokenizer(GREEDY_CHECK_TEXT)["input_ids"]]
        _, clock = torch_generate(model, text_prompt, GREEDY_CHECK_TOKENS, pad_id)
        torch_tokens = clock.tokens
        engine_tokens = engine.generate_ids(
            text_prompt, GenerationConfig(max_new_tokens=GREEDY_CHECK_TOKENS, stop_at_eos=False)
        ).tokens[0]
    bar.close()
    load_after = load_average()

    ttft = {}
    for length in ttft_prompts:
        t, e = summarize(samples[f"torch_ttft_{length}"]), summarize(samples[f"engine_ttft_{length}"])
        ttft[str(length)] = {
            "torch": t,
            "engine": e,
            "ratio": ratio(t, e),
            "torch_prefill_inside_generate": summarize(samples[f"torch_prefill_{length}"]),
        }
    t, e = summarize(samples["torch_tpot"]), summarize(samples["engine_tpot"])
    checked = GREEDY_CHECK_TOKENS
    agree = common_prefix_length(torch_tokens[:checked], engine_tokens[:checked])
    return {
        "engine": str(engine_dir),
        "engine_overrides": (manifest or {}).get("overrides"),
        "model": str(model_dir),
        "config": {
            "prompt_lengths": args.prompt_lengths,
            "decode_prompt_length": args.decode_prompt_length,
            "decode_tokens": args.decode_tokens,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "seed": args.seed,
            "batch_size": 1,
        },
        "threads": {
            "torch_intra_op": torch.get_num_threads(),
            "torch_inter_op": torch.get_num_interop_threads(),
            "ort_intra_op": ort_model(engine).session.get_session_options().intra_op_num_threads,
        },
        "ttft": ttft,
        "tpot": {"torch": t, "engine": e, "ratio": ratio(t, e)},
        "greedy": {
            "checked": checked,
            "agreeing_prefix": agree,
            "agree": agree == checked,
            "torch_tokens": torch_tokens[:checked],
            "engine_tokens": engine_tokens[:checked],
        },
        "load_average": {"before": load_before, "after": load_after},
        "host": host_info(),
        "versions": installed_versions(("torch", "transformers", "onnxruntime")),
        "measure_seconds": round(time.perf_counter() - started, 1),
    }


# --------------------------------------------------------------------------- reporting


def print_report(record: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    config = record["config"]
    table = Table(title="torch eager fp32 vs ORT engine (batch 1, greedy; medians)")
    table.add_column("metric")
    table.add_column("torch ms", justify="right")
    table.add_column("engine ms", justify="right")
    table.add_column("ratio (torch/engine)", justify="right")
    for length, row in record["ttft"].items():
        table.add_row(
            f"TTFT@{length}",
            f"{row['torch']['median_ms']:.1f}",
            f"{row['engine']['median_ms']:.1f}",
            f"{row['ratio']:.2f}x",
        )
    tpot = record["tpot"]
    table.add_row(
        f"TPOT (prompt {config['decode_prompt_length']}, {config['decode_tokens']} tokens)",
        f"{tpot['torch']['median_ms']:.2f}",
        f"{tpot['engine']['median_ms']:.2f}",
        f"{tpot['ratio']:.2f}x",
    )
    console = Console()
    console.print(table)
    greedy = record["greedy"]
    host, load, threads = record["host"], record["load_average"], record["threads"]
    overhead = ", ".join(
        f"@{n}: {row['torch']['median_ms'] - row['torch_prefill_inside_generate']['median_ms']:.1f} ms"
        for n, row in record["ttft"].items()
    )
    overrides = " ".join(record["engine_overrides"] or []) or "unknown"

    lines = [
        f"greedy tokens agree: {'yes' if greedy['agree'] else 'no'} "
        f"({greedy['agreeing_prefix']}/{greedy['checked']})",
        f"engine: {record['engine']}  (run overrides: {overrides})",
        f"model:  {record['model']}",
        f"threads: torch {threads['torch_intra_op']} (inter-op {threads['torch_inter_op']}), "
        f"ORT {threads['ort_intra_op']}; {config['repeats']} repeats after {config['warmup']} warm-up, "
        "interleaved torch/engine",
        f"torch generate() overhead outside prefill (in TTFT): {overhead}",
        load_line(load["before"], load["after"]),
        cpu_line(host),
    ]
    print_lines(console, lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__file__, __doc__)
    parser.add_argument("--engine", type=Path, help="engine folder (default: newest run's)")
    parser.add_argument("--model", type=Path, help="HF folder (default: the run's source.path)")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 512], help="TTFT prompts")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens generated for TPOT")
    parser.add_argument("--decode-prompt-length", type=int, default=128, help="prompt length for TPOT")
    parser.add_argument("--repeats", type=int, default=5, help="measured runs (median)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs first")
    parser.add_argument("--threads", type=int, default=2, help="torch and ONNX Runtime intra-op threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    parser.add_argument("--json", type=Path, help="also write every number here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_and_report(parse_args(argv), run, print_report, interrupted="nothing was recorded")


if __name__ == "__main__":
    sys.exit(main())
