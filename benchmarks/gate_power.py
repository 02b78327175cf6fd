"""Gate power, measured: the eval gate must PASS builds that did not change the model's
behaviour, FAIL planted regressions, and say INCONCLUSIVE (exit 4) only where its suites cannot
tell and no token-level bound is broken.

One run builds, with the real CLI (``python -m pipeline ... bench=none``, cached like any run):

- ``none``: the fp32 engine of the default model, the baseline of every pair;
- ``int8-seed0`` / ``int8-seed1``: ``quant=int8`` with calibration seeds 0 and 1 (two builds of
  one recipe: the gate must PASS one against the other);
- ``resaved``: the default checkpoint loaded and saved again (same weights, new files): PASS;
- ``bf16``: the default checkpoint's weights rounded to bfloat16 and saved in float32 again (an
  fp32 -> bf16 -> fp32 round trip, a benign rebuild): PASS;
- ``int8-naive``: static W8A8 without SmoothQuant (its perplexity: ``benchmarks/README.md``): FAIL;
- ``swapped``: decoder layers ``--swap`` and ``--swap``+1 exchanged in the checkpoint: FAIL;
- ``window-<N>``: fp32, ``fusion=ort kv_cache=concat kv_cache.window=<N>`` (``--window``, default
  256): sliding-window attention shorter than the long-context items (1k-8k tokens): FAIL on
  long_context. The fusion itself is exact (``passes/fusion/``), so only the window differs;
- ``colder``: the final RMSNorm's weight scaled by ``--temperature`` (default 1.25): every
  logit multiplied by it, a softmax temperature of 1/1.25. The argmax never changes (top-1
  agreement 100%) and a ranking of one-token answers neither, so suite scores barely move; the
  KL and perplexity do: FAIL by the token-level bounds (fp32 family);
- ``quotes``: a JSON-syntax regression. The head is untied from the embedding, and the head
  rows of every token holding a double quote are swapped with its single-quote twin (where the
  vocabulary has one). The engine then writes ``'`` where ``"`` belongs and reads text as
  before: tool_call's syntax distractors see it, and tool_call_valid (its generated calls
  no longer parse) sees it more clearly (FAIL). The other suites and the drift on prose barely do;
- ``noisy``: Gaussian noise of ``--noise`` (default 2%) of each row's RMS added to every
  decoder linear weight: a diffuse change that moves the held-out statistics more than a
  50-item suite can see: FAIL by the token-level bounds;
- ``fused``: fp32, ``fusion=ort kv_cache=concat``, and ``int8-fused-seed0`` / ``-seed1``: the int8
  seed pair fused. The long-context suite at full size (1k-8k-token prompts) is measured on these
  (``window-fused`` and ``seeds-fused`` pairs): scored in 512-token prefill steps, the prefill's
  rate, not the graph's fusion, sets its time (``python -m benchmarks.prefill_chunks``; the
  minutes it takes are in ``benchmarks/README.md``).

then runs ``python -m pipeline.gate`` on each pair and prints one table: pair, expectation, the
verdict, per suite the difference with its 95% CI, McNemar p-value and outcome, the token-level
drift (KL, top-1, perplexity ratio) with its outcome, and the seconds the gate took; per rule also
the smallest drop it detects at its measured discordance (the detectable effect) and the
categories the suite-validity report keeps out. "right?"
is yes when the verdict is the expected one, "safe" when a planted regression came out
INCONCLUSIVE (not shipped, but not shown either), NO otherwise.

    python -m benchmarks.gate_power --eval quick [--limit N] [--pairs swapped ...] [--json out.json]

The command and the recorded results: ``benchmarks/README.md`` (gate_power).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    DEFAULT_MODEL,
    REPO,
    last_line,
    make_parser,
    pipeline_command,
    run_logged,
    write_record,
)

DEFAULT_OUT = REPO / "artifacts" / "benchmarks" / "gate_power"
SOURCE = DEFAULT_MODEL  # `python -m pipeline model=llama` makes it

BUILDS: dict[str, list[str]] = {
    "none": ["quant=none"],
    "int8-seed0": ["quant=int8", "quant.calibration.seed=0"],
    "int8-seed1": ["quant=int8", "quant.calibration.seed=1"],
    "int8-naive": [
        "quant=int8",
        "quant.smooth=false",
        "quant.weight_only=[]",
        "quant.sensitivity.enabled=false",
    ],
}
FUSED = ["fusion=ort", "kv_cache=concat"]
BUILDS.update(
    {
        "fused": ["quant=none", *FUSED],
        "int8-fused-seed0": ["quant=int8", "quant.calibration.seed=0", *FUSED],
        "int8-fused-seed1": ["quant=int8", "quant.calibration.seed=1", *FUSED],
    }
)
# id -> (label, baseline build, candidate build, expected verdict)
PAIRS: dict[str, tuple[str, str, str, str]] = {
    "seeds": ("calibration seed 0 vs 1", "int8-seed0", "int8-seed1", "PASS"),
    "resaved": ("re-saved checkpoint", "none", "resaved", "PASS"),
    "bf16": ("fp32 -> bf16 -> fp32 round trip", "none", "bf16", "PASS"),
    "int8-naive": ("naive static INT8 (no SmoothQuant)", "none", "int8-naive", "FAIL"),
    "swapped": ("two adjacent layers swapped", "none", "swapped", "FAIL"),
    "colder": ("logits x1.25 (final norm scaled): top-1 unchanged", "none", "colder", "FAIL"),
    "noisy": ("2% noise on every decoder weight", "none", "noisy", "FAIL"),
    "quotes": ("double quotes written as single quotes (head rows swapped)", "none", "quotes", "FAIL"),
    "window": ("sliding-window attention shorter than the items", "none", "window", "FAIL"),
    "window-fused": ("sliding window vs the fused fp32 engine", "fused", "window", "FAIL"),
    "seeds-fused": ("calibration seed 0 vs 1, fused", "int8-fused-seed0", "int8-fused-seed1", "PASS"),
}


def build(name: str, overrides: list[str], out: Path) -> Path | None:
    """The run folder of one CLI build (None if it failed; the log says why)."""
    run_dir = out / name
    # A rerun replaces its own earlier build: the CLI refuses a run folder that holds a record.
    (run_dir / "manifest.json").unlink(missing_ok=True)
    command = pipeline_command("pipeline", *overrides, "bench=none", "eval=none", f"hydra.run.dir={run_dir}")
    print(f"build  {name}: {' '.join(overrides)}", flush=True)
    result = run_logged(command, out / f"{name}.build.log")
    if result is None or result.returncode != 0:
        code = result.returncode if result else "timeout"
        print(f"build  {name}: failed (exit {code}; {out / f'{name}.build.log'})", flush=True)
        return None
    return run_dir


def modified_checkpoint(out: Path, name: str, args: argparse.Namespace) -> Path:
    """The default checkpoint re-saved by transformers, edited for the planted regression ``name``:
    ``swapped`` exchanges layers ``--swap`` and ``--swap`` + 1 (tensor by tensor, so every layer
    keeps its index), ``colder`` scales the final norm by ``--temperature``, ``noisy`` adds
    seeded noise of ``--noise`` x each output row's RMS to every decoder linear weight,
    ``quotes`` unties the head and swaps its rows of each double-quote token and its
    single-quote twin (:func:`quote_twins`), ``bf16`` rounds every weight to bfloat16 and back
    (saved in float32); ``resaved`` changes nothing."""
    import torch

    from pipeline.core.torch_model import load_causal_lm

    folder = out / "models" / name
    if (folder / "config.json").is_file():
        return folder
    model = load_causal_lm(SOURCE)
    with torch.no_grad():
        if name == "swapped":
            first, second = model.model.layers[args.swap], model.model.layers[args.swap + 1]
            for (_, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
                saved = a.detach().clone()
                a.copy_(b)
                b.copy_(saved)
        elif name == "colder":
            model.model.norm.weight.mul_(args.temperature)
        elif name == "noisy":
            generator = torch.Generator().manual_seed(0)
            for module in model.model.layers.modules():
                if isinstance(module, torch.nn.Linear):
                    weight = module.weight
                    rms = weight.pow(2).mean(dim=1, keepdim=True).sqrt()
                    weight.add_(torch.randn(weight.shape, generator=generator) * rms * args.noise)
        elif name == "bf16":
            for parameter in model.parameters():
                parameter.copy_(parameter.to(torch.bfloat16).to(parameter.dtype))
        elif name == "quotes":
            from tokenizers import Tokenizer

            head = model.get_output_embeddings()
            head.weight = torch.nn.Parameter(head.weight.detach().clone())  # untied: the input side stays
            model.config.tie_word_embeddings = False
            pairs = quote_twins(Tokenizer.from_file(str(SOURCE / "tokenizer.json")).get_vocab())
            if not pairs:
                raise ValueError(
                    f"{SOURCE}: its vocabulary has no double-quote token with a single-quote twin"
                )
            first, second = zip(*pairs, strict=True)
            rows = head.weight.data
            rows[list(first + second)] = rows[list(second + first)].clone()
    staging = folder.with_name(f".{name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    for extra in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (SOURCE / extra).is_file():
            shutil.copy2(SOURCE / extra, staging / extra)
    staging.rename(folder)
    return folder


def quote_twins(vocab: dict[str, int]) -> list[tuple[int, int]]:
    """(id, id) of each token holding a double quote (and no single one) and the token spelled
    with single quotes in their place, where the vocabulary has it: a one-to-one pairing, so
    swapping the pairs is a permutation."""
    return sorted(
        (index, vocab[token.replace('"', "'")])
        for token, index in vocab.items()
        if '"' in token and "'" not in token and token.replace('"', "'") in vocab
    )


def gate(label: str, baseline: Path, candidate: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    record_path = out / f"gate-{label.replace(' ', '_')}.json"
    sets = ["--set", *args.set] if args.set else []
    if args.limit:
        sets = ["--set", *args.set, f"limit={args.limit}"]
    command = pipeline_command(
        "pipeline.gate", "--baseline", str(baseline), "--candidate", str(candidate),
        "--eval", args.eval, "--json", str(record_path), *sets,
    )  # fmt: skip
    print(f"gate   {label} ...", flush=True)
    started = time.perf_counter()
    result = run_logged(command, out / f"gate-{label.replace(' ', '_')}.log")
    seconds = round(time.perf_counter() - started, 1)
    if (
        result is None or result.returncode not in (0, 3, 4) or not record_path.is_file()
    ):  # PASS, FAIL, INCONCLUSIVE
        return {"status": "failed", "note": last_line(result.stderr) if result else "timed out"}
    return {"status": "ok", "seconds": seconds, **json.loads(record_path.read_text())}


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__file__, __doc__)
    parser.add_argument("--eval", default="quick", help="configs/eval option (quick | full)")
    parser.add_argument("--limit", type=int, help="items a suite (default: all of the size)")
    parser.add_argument("--set", nargs="*", default=[], help="more gate overrides, e.g. 'suites=[reasoning]'")
    parser.add_argument(
        "--pairs",
        nargs="*",
        choices=list(PAIRS),
        help="only these pairs (default: all)",
    )
    parser.add_argument("--swap", type=int, default=10, help="swap decoder layers N and N+1")
    parser.add_argument("--window", type=int, default=256, help="sliding window of the window build")
    parser.add_argument("--temperature", type=float, default=1.25, help="logit scale of the colder build")
    parser.add_argument("--noise", type=float, default=0.02, help="noise / row RMS of the noisy build")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not (SOURCE / "config.json").is_file():
        print(
            f"error: {SOURCE} is missing: run `python -m pipeline model=llama quant=none` once",
            file=sys.stderr,
        )
        return 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    pairs = {key: pair for key, pair in PAIRS.items() if not args.pairs or key in args.pairs}
    needed = {name for _, base, cand, _ in pairs.values() for name in (base, cand)}
    runs: dict[str, Path | None] = {}
    for name in sorted(needed):  # only the builds the chosen pairs need (each is cached)
        if name in BUILDS:
            runs[name] = build(name, ["model=llama", *BUILDS[name]], out)
        elif name in ("resaved", "bf16", "swapped", "colder", "noisy", "quotes"):
            checkpoint = modified_checkpoint(out, name, args)
            runs[name] = build(name, [f"model.path={checkpoint}", "quant=none"], out)
        else:
            window = ["model=llama", "quant=none", *FUSED, f"kv_cache.window={args.window}"]
            runs[name] = build(f"window-{args.window}", window, out)
    rows = []
    for label, base, cand, expected in pairs.values():
        row: dict[str, Any] = {"pair": label, "baseline": base, "candidate": cand, "expected": expected}
        if runs.get(base) is None or runs.get(cand) is None:
            row.update(status="failed", note="a build failed: see its log")
        else:
            row.update(gate(label, runs[base], runs[cand], args, out))  # type: ignore[arg-type]
        rows.append(row)
    print_table(rows, args)
    if args.json:
        write_record(args.json, {"eval": args.eval, "limit": args.limit, "rows": rows})
    return 0


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Gate power (eval={args.eval}{f', {args.limit} items a suite' if args.limit else ''})"
    )
    columns = (
        "pair",
        "expected",
        "verdict",
        "suites: difference [95% CI] (McNemar p) outcome",
        "token drift: KL, top-1, ppl ratio (family) outcome",
        "gate s",
        "right?",
    )
    for column in columns:
        table.add_column(column)
    for row in rows:
        if row["status"] != "ok":
            table.add_row(row["pair"], row["expected"], row["status"], row.get("note", ""), "", "", "-")
            continue
        cells = [suite_cell(suite, r) for suite, r in row["suites"].items()]
        drift = row.get("drift") or {}
        measured = drift.get("measured")
        token = (
            f"{measured['kl']:.4f}, {measured['top1']:.1%}, x{measured['ppl_ratio']:.3f} "
            f"({drift['family']}) {drift['verdict']}"
            if measured
            else f"not measured {drift.get('verdict', '')}"
        )
        table.add_row(
            row["pair"],
            row["expected"],
            row["verdict"],
            "\n".join(cells),
            token,
            str(row["seconds"]),
            right(row),
        )
    Console().print(table)


def suite_cell(suite: str, row: dict[str, Any]) -> str:
    """One rule of a gate: its difference with CI and McNemar p, outcome, the smallest drop it
    detects at its measured discordance (80% power), and the categories kept out as invalid."""
    text = f"{suite}: {row['difference']:+.1%}"
    if row.get("p_value") is not None:
        text += f" [{row['ci_low']:+.1%}, {row['ci_high']:+.1%}] (p {row['p_value']:.2g})"
    text += f" {row['verdict']}"
    sized = row.get("resolution")
    if sized:
        text += f"; detects {sized['minimum_detectable_drop']:.1%}"
    kept_out = [entry["category"] for entry in row.get("kept_out") or []]
    if kept_out:
        text += f"; kept out: {', '.join(kept_out)}"
    return text


def right(row: dict[str, Any]) -> str:
    """yes: the expected verdict; safe: a planted regression INCONCLUSIVE (not shipped); else NO."""
    if row["verdict"] == row["expected"]:
        return "yes"
    return "safe" if row["expected"] == "FAIL" and row["verdict"] == "INCONCLUSIVE" else "NO"


if __name__ == "__main__":
    sys.exit(main())
