"""The run summary: the note on the KV-cache pass, tables at full width without a terminal, the
gate's verdict lines, a sweep's combined table."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from pipeline.summary import _kv_cache_note, gate_table, gate_verdict_lines, make_console, sweep_table


def test_the_kv_cache_note_names_layout_dtype_calibration_and_window() -> None:
    assert _kv_cache_note({"layout": "concat", "dtype": "fp32", "window": 0}) == "concat, fp32"
    kv = {
        "layout": "shared",
        "dtype": "int8",
        "window": 256,
        "capacity": 320,
        "calibration": {"tokens": 4096},
    }
    assert _kv_cache_note(kv) == "shared, int8 (calibrated on 4096 tokens), window 256 in 320 positions"
    per_layer = {**kv, "capacity": [320, 80, 320]}  # layers with shorter windows of their own
    assert _kv_cache_note(per_layer).endswith("window 256 in 80-320 positions")
    assert _kv_cache_note({**kv, "capacity": [320, 320]}).endswith("window 256 in 320 positions")
    own = {"layout": "shared", "dtype": "fp32", "window": 0, "capacity": [640, 640, 0]}  # Gemma 3's
    assert _kv_cache_note(own) == "shared, fp32, windowed layers in 640 positions"


# --------------------------------------------------------------------------------------------
# Tables without a terminal (a log file, a nightly job) at full width; the gate's verdict lines;
# a sweep's combined table


def suite_row(n: int, base: float, cand: float, low: float, high: float, verdict: str) -> dict:
    return {
        "n": n,
        "baseline_mean": base,
        "candidate_mean": cand,
        "difference": cand - base,
        "ci_low": low,
        "ci_high": high,
        "p_value": 0.0123,
        "recovery": cand / base,
        "resolution": {"minimum_detectable_drop": 0.081, "items_needed": 1234},
        "verdict": verdict,
    }


GATE = {
    "verdict": "FAIL",
    "reason": "long_context: a drop of -10.4% shown",
    "settings": {"size": "quick", "scoring": "rank"},
    "suites": {
        "reasoning": suite_row(50, 0.62, 0.60, -0.10351, 0.06123, "INCONCLUSIVE"),
        "tool_call": suite_row(50, 0.70, 0.70, -0.04, 0.04, "PASS"),
        "long_context": suite_row(48, 0.55, 0.4458, -0.18762, -0.02083, "FAIL"),
    },
    "drift": {
        "family": "bits8",
        "measured": {"kl": 0.01234, "top1": 0.9567, "ppl_ratio": 1.0123},
        "verdict": "PASS",
    },
}


def test_without_a_terminal_the_gate_table_is_printed_whole() -> None:
    out = io.StringIO()
    console = make_console(out)  # a file: no terminal
    assert not console.is_terminal
    console.print(gate_table(GATE))
    text = out.getvalue()
    assert "…" not in text
    for needle in ("reasoning", "long_context", "-10.4% [-18.8%, -2.1%]", "-2.0% [-10.4%, +6.1%]",
                   "token drift (bits8)", "KL 0.0123, top-1 95.7%, ppl x1.012", "8.1% / 1234"):  # fmt: skip
        assert needle in text, needle
    # rich's default for a file: 80 columns, the cells cut (what a nightly log showed)
    narrow = io.StringIO()
    Console(file=narrow).print(gate_table(GATE))
    assert "…" in narrow.getvalue()


def test_on_a_terminal_the_console_is_riches_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    monkeypatch.setenv("COLUMNS", "77")
    assert make_console(io.StringIO()).width == 77  # the terminal's width, as before


def test_the_verdict_lines_name_the_verdict_and_each_suites_numbers() -> None:
    lines = gate_verdict_lines(GATE)
    assert lines[0] == "gate FAIL: long_context: a drop of -10.4% shown"
    assert lines[3] == (
        "  long_context: 48 items, baseline 55.0%, candidate 44.6%, difference -10.4% [-18.8%, -2.1%]: FAIL"
    )
    assert lines[4] == "  token drift (bits8): KL 0.0123, top-1 95.7%, ppl x1.012: PASS"
    assert len(lines) == 5


def test_a_sweep_table_has_one_row_per_job_and_survives_a_missing_record() -> None:
    bench = {"tpot": {"median_ms": 3.456}, "ttft": {"128": {"median_ms": 12.34}}}
    jobs = [
        {"job": "0", "varied": "quant=int8", "exit_code": 3, "manifest": {"gate": GATE, "benchmark": bench}},
        {"job": "1", "varied": "quant=int4_awq", "exit_code": 1, "manifest": None},
        {"job": "2", "varied": "quant=fp8", "exit_code": 0, "manifest": {"gate": {"suites": {"x": {}}}}},
    ]
    out = io.StringIO()
    make_console(out).print(sweep_table(jobs))
    text = out.getvalue()
    assert text.startswith("Sweep: 3 job(s)") and "…" not in text
    row0 = next(line for line in text.splitlines() if "quant=int8" in line)
    for needle in ("FAIL", "60.0% (-2.0%)", "44.6% (-10.4%)", "KL 0.0123", "3.46", "@128 12.3"):
        assert needle in row0, needle
    assert any("quant=int4_awq" in line and " - " in line for line in text.splitlines())
    assert any("quant=fp8" in line for line in text.splitlines())  # a record it cannot read: dashes


def test_the_run_summary_in_a_log_file_cuts_no_number(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from pipeline.summary import print_summary

    manifest = {"passes": [], "gate": GATE, "engine": {"files": [], "path": "engine", "target": "ort-cpu"}}
    print_summary(manifest, tmp_path)  # stdout captured: no terminal, as in a nightly job's log
    text = capsys.readouterr().out
    assert "…" not in text and "-10.4% [-18.8%, -2.1%]" in text and "token drift (bits8)" in text


def test_a_sweep_job_writes_its_summary_whole_to_its_folder(tmp_path: Path) -> None:
    from pipeline.core.staging import unique_name
    from pipeline.run import RUN_STAGING
    from pipeline.summary import SUMMARY_FILE, write_summary

    manifest = {"passes": [], "gate": GATE, "engine": {"files": [], "path": "engine", "target": "ort-cpu"}}
    path = write_summary(manifest, tmp_path)
    assert path == tmp_path / SUMMARY_FILE and [p.name for p in tmp_path.iterdir()] == [SUMMARY_FILE]
    text = path.read_text()
    assert "-10.4% [-18.8%, -2.1%]" in text and "…" not in text and "\x1b[" not in text  # no colour codes
    assert RUN_STAGING.fullmatch(unique_name(f".{SUMMARY_FILE}"))  # a killed job's staging is removed


def test_a_rule_that_gives_reasons_shows_its_failures_per_engine() -> None:
    row = dict(GATE["suites"]["long_context"])
    row["failures"] = {"baseline": {"parse": 13, "schema": 12}, "candidate": {"parse": 30}}
    gate = {**GATE, "suites": {**GATE["suites"], "tool_call_valid": row}}
    out = io.StringIO()
    make_console(out).print(gate_table(gate))
    text = " ".join(out.getvalue().split())
    assert "tool_call_valid: baseline parse 13, schema 12; candidate parse 30" in text
    assert gate_verdict_lines(gate)[4].endswith("(failed: baseline parse 13, schema 12; candidate parse 30)")
    assert gate_table(GATE).caption is None  # rules without reasons add nothing
