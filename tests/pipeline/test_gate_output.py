"""What ``python -m pipeline ... eval=quick`` prints while the gate runs (tiny Llama, output to a
pipe as in a nightly job's log): a line as each suite starts and ends, the verdict before the
benchmark starts, none of lm-eval's INFO lines or its ``--metadata`` advice unless asked for
(``hydra.verbose=lm_eval``), and the gate's table whole."""

from __future__ import annotations

from pathlib import Path

from tests.pipeline.test_main import QUICK_BENCH, run_pipeline

GATE = ["eval=quick", "eval.suites=[reasoning]", "eval.resamples=2000"]
ADVICE = "Custom kwargs can be passed to `--metadata`"


def test_the_gate_shows_its_progress_and_verdict_before_the_benchmark(
    tiny_llama: Path, tmp_path: Path
) -> None:
    result = run_pipeline(tiny_llama, tmp_path, "run", *QUICK_BENCH, *GATE, "eval.limit=12")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()

    def first(needle: str) -> int:
        return next(i for i, line in enumerate(lines) if needle in line)

    start = first("gate: suite 1/1 reasoning: scoring the engine")
    end = first("gate: suite 1/1 reasoning: done, 12 items in ")
    verdict = first("[pipeline.run][INFO] - gate PASS: ")
    suite = first("[pipeline.run][INFO] -   reasoning: 12 items, baseline ")
    benchmark = first("benchmark: running")
    assert start < end < verdict < suite < benchmark
    assert lines[end].endswith(": PASS") and " s: baseline " in lines[end]
    # lm-eval's own INFO lines (6 per suite and engine) and its advice stay out of the way
    output = result.stdout + result.stderr
    assert "[lm_eval." not in output and ADVICE not in output
    # the table, written to a pipe, is whole: no suite name or interval cut to 80 columns
    table = lines[first("Eval gate (quick suites, rank scoring): PASS") :]
    assert "…" not in result.stdout
    assert any("│ reasoning " in line and "[+0.0%, +0.0%]" in line for line in table)
    assert "gate    PASS (" in result.stdout  # the summary repeats the verdict

    # The user asks for lm-eval's logs (another limit: scored again, not read from the cache)
    verbose = run_pipeline(
        tiny_llama, tmp_path, "verbose", "bench=none", *GATE, "eval.limit=11", "hydra.verbose=lm_eval"
    )
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "[lm_eval.evaluator]" in verbose.stdout and ADVICE in verbose.stdout
