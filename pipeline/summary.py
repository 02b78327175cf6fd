"""The summary printed at the end of a run: passes, parity, benchmark, where things are; the
gate's verdict lines (logged as soon as the gate ends) and the combined table of a sweep.

Every rich table the run prints goes through :func:`make_console`: on a terminal rich's own
console (the terminal's width), elsewhere (a log file, a nightly job, CI) one so wide that no
table is squeezed: rich would otherwise fit it in 80 columns and cut its cells (``reaso…``)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pipeline.core.staging import owned_folder, unique_name

# The width of a console that is no terminal: wider than any table of ours, so rich never
# wraps or cuts a cell (tables stay as narrow as their content; text lines are not padded).
LOG_WIDTH = 1000
SUMMARY_FILE = "summary.txt"  # a sweep's job: its summary, in its own folder


def make_console(file: IO[str] | None = None) -> Console:
    """A console for our tables: rich's own on a terminal, a :data:`LOG_WIDTH`-column one
    without a terminal (a file, a pipe, a log), so no number is cut."""
    console = Console(file=file)
    if console.is_terminal:
        return console
    return Console(file=file, width=LOG_WIDTH)


def _short(digest: str) -> str:
    return digest[:12]


def write_summary(manifest: dict[str, Any], run_dir: Path) -> Path:
    """The summary of :func:`print_summary` as plain text in ``run_dir/summary.txt`` (a sweep's
    job writes it there instead of the shared stdout), by atomic rename from a lock-owned
    staging folder (what a SIGKILL leaves, the next run removes: ``pipeline.run.RUN_STAGING``)."""
    buffer = io.StringIO()
    print_summary(manifest, run_dir, Console(file=buffer, width=LOG_WIDTH, color_system=None))
    path = run_dir / SUMMARY_FILE
    with owned_folder(run_dir / unique_name(f".{SUMMARY_FILE}")) as staging:
        staged = staging / SUMMARY_FILE
        staged.write_text(buffer.getvalue(), encoding="utf-8")
        os.replace(staged, path)
    return path


def print_summary(manifest: dict[str, Any], run_dir: Path, console: Console | None = None) -> None:
    if console is None:
        console = make_console()
    passes = Table(title="Passes", title_justify="left")
    for column in ("#", "pass", "version", "cache", "seconds", "peak RSS", "estimate", "output", "notes"):
        passes.add_column(column)
    for index, record in enumerate(manifest["passes"], start=1):
        notes = ""
        parity = record["metrics"].get("parity")
        if parity:
            agreement, diff = parity["top1_agreement"], parity["max_abs_diff"]
            notes = f"ORT vs torch: top-1 {agreement:.0%}, max |Δlogit| {diff:.1e}"
        elif vs_input := record["metrics"].get("vs_input") or record["metrics"].get("parity_vs_input_graph"):
            agreement, diff = vs_input["top1_agreement"], vs_input["max_abs_diff"]
            notes = f"vs input graph: top-1 {agreement:.0%}, max |Δlogit| {diff:.1e}"
        if rewrites := record["metrics"].get("rewrites"):  # fusion: sites per rule family
            sites = ", ".join(f"{family} x{count}" for family, count in rewrites.items())
            notes = f"{sites}; {notes}" if notes else sites
            if as_built := record["metrics"].get("parity_as_built"):
                notes += f"; as built: top-1 {as_built['top1_agreement']:.0%}"
        if kv := record["metrics"].get("kv_cache"):  # the KV-cache layout
            notes = _kv_cache_note(kv)
        passes.add_row(
            str(index),
            record["name"],
            str(record["version"]),
            "hit" if record["cache_hit"] else "miss",
            f"{record['seconds']:.1f}",
            *_memory_cells(record.get("resources") or {}),
            _short(record["output_digest"]),
            notes,
        )
    console.print(passes)

    bench = manifest.get("benchmark")
    if bench:
        title = "Benchmark (median over repeats, ms)"
        if bench.get("cache_hit"):
            title += f" · same engine measured on this host at {bench['measured_at']} (cached)"
        table = Table(title=title, title_justify="left")
        table.add_column("metric")
        table.add_column("median", justify="right")
        table.add_column("min", justify="right")
        table.add_column("max", justify="right")
        for length, stats in bench["ttft"].items():
            table.add_row(
                f"TTFT @ {length} tokens", *(f"{stats[k]:.1f}" for k in ("median_ms", "min_ms", "max_ms"))
            )
        tpot = bench["tpot"]
        table.add_row(
            f"TPOT ({tpot['tokens']} tokens after {tpot['prompt_length']})",
            *(f"{tpot[k]:.2f}" for k in ("median_ms", "min_ms", "max_ms")),
        )
        if spec := bench.get("speculative"):
            table.add_row(
                f"TPOT speculative, k={spec['k']} ({spec['tokens']} tokens after {spec['prompts']} x "
                f"{spec['prompt_length']} of text)",
                *(f"{spec['tpot_speculative'][k]:.2f}" for k in ("median_ms", "min_ms", "max_ms")),
            )
            table.add_row(
                "TPOT target alone (same prompts)",
                *(f"{spec['tpot_target'][k]:.2f}" for k in ("median_ms", "min_ms", "max_ms")),
            )
        console.print(table)
        if versus := bench.get("vs_reference"):
            ttft = ", ".join(f"@{n} {row['ratio']:.2f}x" for n, row in versus["ttft"].items())
            console.print(
                f"vs the reference engine (no optimization passes), measured alternately: TPOT "
                f"{versus['tpot']['engine_ms']:.2f} vs {versus['tpot']['reference_ms']:.2f} ms = "
                f"{versus['tpot']['ratio']:.2f}x; TTFT {ttft}"
            )
        if spec:
            same = "identical to" if spec["identical_to_target"] else "DIFFERENT from"
            console.print(
                f"speculative: {spec['tpot_ratio']:.2f}x the target's TPOT (TTFT "
                f"{spec['ttft_speculative']['median_ms']:.0f} vs {spec['ttft_target']['median_ms']:.0f} ms "
                f"with the draft's prefill), {spec['acceptance_rate']:.0%} of "
                f"draft tokens accepted, {spec['tokens_per_round']:.2f} tokens per target forward; "
                f"output {same} the target's greedy output"
            )
        if serving := bench.get("serving"):
            if "skipped" in serving:
                console.print(f"serving benchmark skipped: {serving['skipped']}")
            else:
                console.print(serving_table(serving))
        load = bench["load_average"]
        console.print(
            f"peak RSS {bench['peak_rss_mib']:.0f} MiB · load average {load['before'][0]:.2f} → "
            f"{load['after'][0]:.2f} on {bench['host']['logical_cores']} cores ({bench['host']['cpu']})"
        )
    quality = manifest.get("quality")
    if quality:
        table = Table(
            title=f"Quality on held-out text ({quality['text']}, {quality['tokens_scored']} tokens)",
            title_justify="left",
        )
        for column in ("perplexity", "reference perplexity", "Δ perplexity", "KL (mean)", "top-1 agreement"):
            table.add_column(column, justify="right")
        delta = quality["perplexity"] / quality["reference_perplexity"] - 1
        table.add_row(
            f"{quality['perplexity']:.3f}",
            f"{quality['reference_perplexity']:.3f}",
            f"{delta:+.2%}",
            f"{quality['kl_mean']:.5f}",
            f"{quality['top1_agreement']:.2%}",
        )
        console.print(table)
    if manifest["gate"].get("suites"):
        console.print(gate_table(manifest["gate"]))
    engine = manifest["engine"]
    size = sum(f["bytes"] for f in engine["files"]) / 2**20
    console.print(f"engine  {run_dir / engine['path']}  ({engine['target']}, {size:.0f} MiB)")
    console.print(f"record  {run_dir / 'manifest.json'}")
    console.print(f"gate    {manifest['gate']['verdict']} ({manifest['gate']['reason']})")
    for warning in manifest["gate"].get("warnings") or []:
        console.print(f"        warning: {warning}")


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f} GiB"


def _memory_cells(resources: dict[str, Any]) -> tuple[str, str]:
    """The measured peak RSS of a pass (plus its GPU peak on CUDA) and the preflight's estimate
    (for a cache hit: both from the run that computed it)."""
    peak = _gib(resources.get("peak_rss_bytes"))
    if resources.get("gpu_peak_bytes") is not None:
        peak += f" (GPU {_gib(resources['gpu_peak_bytes'])})"
    return peak, _gib(resources.get("estimate_bytes"))


def serving_table(serving: dict[str, Any]) -> Table:
    """The serving benchmark: one row per mode and concurrency, plus the prefix-cache line."""
    trace = serving["trace"]
    table = Table(
        title=(
            f"Serving ({trace['requests']} requests, {trace['output_tokens']} output tokens, seeded; medians "
            f"of {serving['config']['repeats']} runs; TTFT from arrival)"
        ),
        title_justify="left",
    )
    for column in (
        "batching",
        "concurrent",
        "tokens/s",
        "TTFT p50 / p95 ms",
        "TPOT p50 / p95 ms",
        "vs 1-by-1",
    ):
        table.add_column(column, justify="right")
    ratios = serving["continuous_ratios"]
    for row in serving["rows"]:
        ratio = ratios.get(str(row["concurrency"]), {})
        versus = ""
        if row["mode"] == "continuous" and ratio.get("vs_one_by_one"):
            versus = f"{ratio['vs_one_by_one']:.2f}x" + (
                f" ({ratio['vs_static']:.2f}x static)" if ratio.get("vs_static") else ""
            )
        tpot = (
            f"{row['tpot_p50_ms']:.1f} / {row['tpot_p95_ms']:.1f}" if row["tpot_p50_ms"] is not None else "-"
        )
        table.add_row(
            row["mode"],
            str(row["concurrency"]),
            f"{row['tokens_per_s']:.1f}",
            f"{row['ttft_p50_ms']:.0f} / {row['ttft_p95_ms']:.0f}",
            tpot,
            versus,
        )
    same = serving.get("identical_to_one_by_one")
    notes = [] if same is None else [f"outputs {'identical to' if same else 'DIFFERENT from'} one by one"]
    if prefix := serving.get("prefix_cache"):
        notes.append(
            f"prefix cache: TTFT with a cached {prefix['cached_tokens']:.0f}-token prefix of "
            f"{prefix['prefix_tokens']} + {prefix['suffix_tokens']} new tokens "
            f"{prefix['ttft_cached_ms']:.0f} ms vs "
            f"{prefix['ttft_uncached_ms']:.0f} ms uncached ({prefix['ratio']:.2f}x)"
        )
    if serving.get("plot"):
        notes.append(f"plot {serving['plot']}")
    table.caption = " · ".join(notes) or None
    return table


def gate_table(gate: dict[str, Any]) -> Table:
    """One row per suite: scores, difference with its CI, McNemar p-value, recovery, the smallest
    drop the suite detects and the items that would settle max_drop, verdict; then the
    token-level drift row (KL, top-1, perplexity ratio against the recipe family's bounds)."""
    settings = gate.get("settings", {})
    size, scoring = settings.get("size", "?"), settings.get("scoring", "?")
    title = f"Eval gate ({size} suites, {scoring} scoring): {gate['verdict']}"
    table = Table(title=title, title_justify="left")
    columns = (
        "suite",
        "items",
        "baseline",
        "candidate",
        "difference [95% CI]",
        "p (McNemar)",
        "recovery",
        "detects / items to settle",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "suite" else "right")
    table.add_column("verdict")
    for suite, row in gate["suites"].items():
        p_value = "-" if row.get("p_value") is None else f"{row['p_value']:.3g}"
        sized = row.get("resolution")
        power = "-" if not sized else f"{sized['minimum_detectable_drop']:.1%} / {sized['items_needed']}"
        table.add_row(
            suite,
            str(row["n"]),
            f"{row['baseline_mean']:.1%}",
            f"{row['candidate_mean']:.1%}",
            f"{row['difference']:+.1%} [{row['ci_low']:+.1%}, {row['ci_high']:+.1%}]",
            p_value,
            f"{row['recovery']:.1%}",
            power,
            _verdict_text(row["verdict"]),
        )
    drift = gate.get("drift")
    if drift:
        numbers = _drift_numbers(drift)
        label = f"token drift ({drift['family']})"
        table.add_row(label, "", "", "", numbers, "", "", "", _verdict_text(drift["verdict"]))
    failures = [
        f"{suite}: {_failures_text(row)}" for suite, row in gate["suites"].items() if row.get("failures")
    ]
    kept_out = [
        f"{suite}: {_kept_out_text(row)}" for suite, row in gate["suites"].items() if row.get("kept_out")
    ]
    table.caption = " · ".join(failures + kept_out) or None
    return table


def _kept_out_text(row: dict[str, Any]) -> str:
    """A rule's categories kept out of its verdict as invalid: ``irrelevance kept out (12 items;
    reference 0.0% at full, chance 25.0%)``."""
    return "; ".join(
        f"{entry['category']} kept out ({entry['items']} items; reference {entry['accuracy']:.1%} at full, "
        f"chance {entry['chance']:.1%})"
        for entry in row["kept_out"]
    )


def _failures_text(row: dict[str, Any]) -> str:
    """A rule's failed items by reason, per engine: ``baseline parse 13, schema 12; candidate ...``."""
    return "; ".join(
        f"{engine} " + (", ".join(f"{reason} {count}" for reason, count in counts.items()) or "none")
        for engine, counts in row["failures"].items()
    )


def gate_verdict_lines(gate: dict[str, Any]) -> list[str]:
    """The gate's verdict as text lines, logged as soon as the gate ends (before the benchmark):
    ``gate PASS: <reason>``, then one line per suite (items, scores, difference with its CI,
    verdict) and one for the token-level drift."""
    lines = [f"gate {gate['verdict']}: {gate['reason']}"]
    for suite, row in (gate.get("suites") or {}).items():
        lines.append(
            f"  {suite}: {row['n']} items, baseline {row['baseline_mean']:.1%}, candidate "
            f"{row['candidate_mean']:.1%}, difference {row['difference']:+.1%} "
            f"[{row['ci_low']:+.1%}, {row['ci_high']:+.1%}]: {row['verdict']}"
            + (f" (failed: {_failures_text(row)})" if row.get("failures") else "")
            + (f" ({_kept_out_text(row)})" if row.get("kept_out") else "")
        )
    drift = gate.get("drift")
    if drift:
        lines.append(f"  token drift ({drift['family']}): {_drift_numbers(drift)}: {drift['verdict']}")
    return lines


def _drift_numbers(drift: dict[str, Any]) -> str:
    measured = drift.get("measured")
    if not measured:
        return "not measured"
    return f"KL {measured['kl']:.4f}, top-1 {measured['top1']:.1%}, ppl x{measured['ppl_ratio']:.3f}"


def sweep_table(jobs: list[dict[str, Any]]) -> Table:
    """One row per job of a sweep (``pipeline.nightly.SweepStatus``): the overrides the sweep
    varied, the exit code, the gate verdict, each suite's candidate score and difference, the
    token drift, the median TPOT and TTFT. ``jobs``: dicts of ``job``,
    ``varied``, ``exit_code`` and ``manifest`` (the run record, or None where the job wrote none)."""
    suites: list[str] = []
    for job in jobs:
        gate = (job.get("manifest") or {}).get("gate")
        found = gate.get("suites") if isinstance(gate, dict) else None
        for suite in found if isinstance(found, dict) else {}:
            if suite not in suites:
                suites.append(str(suite))
    table = Table(title=f"Sweep: {len(jobs)} job(s)", title_justify="left")
    table.add_column("job", justify="right")
    table.add_column("overrides")
    table.add_column("exit", justify="right")
    table.add_column("gate")
    for suite in suites:
        table.add_column(f"{suite} (Δ)", justify="right")
    for column in ("token drift", "TPOT ms", "TTFT ms"):
        table.add_column(column, justify="right")
    for job in jobs:
        manifest = job.get("manifest") or {}
        try:
            cells = _sweep_cells(manifest, suites)
        except (KeyError, TypeError, ValueError, AttributeError):  # a record we cannot read: no numbers
            cells = ["-"] * (len(suites) + 3)
        verdict = (manifest.get("gate") or {}).get("verdict") if isinstance(manifest, dict) else None
        table.add_row(
            str(job["job"]),
            job.get("varied") or "",
            str(job["exit_code"]),
            _verdict_text(str(verdict or "-")),
            *cells,
        )
    return table


def _sweep_cells(manifest: dict[str, Any], suites: list[str]) -> list[str]:
    """A job's numbers in :func:`sweep_table`: each suite, the token drift, TPOT, TTFT."""
    gate = manifest.get("gate") or {}
    rows = gate.get("suites") or {}
    scores = [
        f"{rows[s]['candidate_mean']:.1%} ({rows[s]['difference']:+.1%})" if s in rows else "-"
        for s in suites
    ]
    drift = gate.get("drift")
    bench = manifest.get("benchmark") or {}
    tpot = (bench.get("tpot") or {}).get("median_ms")
    ttft = [f"@{n} {row['median_ms']:.1f}" for n, row in (bench.get("ttft") or {}).items()]
    return [
        *scores,
        _drift_numbers(drift) if drift else "-",
        "-" if tpot is None else f"{tpot:.2f}",
        ", ".join(ttft) or "-",
    ]


VERDICT_STYLES = {"PASS": "green", "FAIL": "bold red", "INCONCLUSIVE": "yellow"}


def _verdict_text(verdict: str) -> Text:
    return Text(verdict, style=VERDICT_STYLES.get(verdict, ""))


def _kv_cache_note(kv: dict[str, Any]) -> str:
    """``shared, int8 (calibrated on 4096 tokens), window 256 in 320 positions``."""
    parts = [kv["layout"], kv["dtype"]]
    if "calibration" in kv:
        parts[-1] += f" (calibrated on {kv['calibration']['tokens']} tokens)"
    capacity = kv.get("capacity")
    sizes = sorted({size for size in (capacity if isinstance(capacity, list) else [capacity]) if size})
    held = "" if not sizes else f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    if kv.get("window"):
        parts.append(f"window {kv['window']}" + (f" in {held} positions" if held else ""))
    elif held:  # the model's own windows (Gemma 3's local layers)
        parts.append(f"windowed layers in {held} positions")
    return ", ".join(parts)
